"""Each layer of the TensorFlow backend against a NumPy reference written from Caffe's definitions.

One net holds most layers side by side, all reading the Input blobs, so one
compiled forward pass (a module-scoped fixture) serves most tests.
"""

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from deepspark import fillers  # noqa: E402
from deepspark.backends import create_model  # noqa: E402
from deepspark.backends.tensorflow import compiler  # noqa: E402
from deepspark.config import parse_net  # noqa: E402
from deepspark.graph import Graph  # noqa: E402
from deepspark.proto import deepspark_pb2 as pb  # noqa: E402

RNG = np.random.default_rng(0)
SHAPES = {"x": (2, 6, 7, 9), "a": (2, 3, 4, 5), "b": (2, 3, 4, 5), "c": (2, 3, 4, 5), "pos": (2, 3, 4, 5),
          "scores": (6, 5), "labels": (6,), "seg": (2, 4, 3, 3), "seglabels": (2, 1, 3, 3),
          "ties": (6, 5), "chan": (6,), "target": (2, 3, 4, 5)}


def inputs():
    data = {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    data["pos"] = RNG.uniform(0.5, 2.0, SHAPES["pos"]).astype(np.float32)
    data["labels"] = np.array([0, 4, 2, 255, 1, 3], np.float32)
    data["seglabels"] = RNG.integers(0, 4, SHAPES["seglabels"]).astype(np.float32)
    data["seglabels"][0, 0, 0, :2] = -1
    data["ties"] = RNG.integers(0, 3, SHAPES["ties"]).astype(np.float32)
    data["target"] = RNG.uniform(0, 1, SHAPES["target"]).astype(np.float32)
    return data


def input_layer():
    names = list(SHAPES)
    shapes = " ".join("shape { " + " ".join(f"dim: {d}" for d in SHAPES[n]) + " }" for n in names)
    return (f'layer {{ name: "in" type: "Input" {" ".join(f"top: {chr(34)}{n}{chr(34)}" for n in names)} '
            f"input_param {{ {shapes} }} }}\n")


def L(name, kind, bottoms, body="", tops=None):
    tops = [name] if tops is None else tops
    return (f'layer {{ name: "{name}" type: "{kind}" '
            + " ".join(f'bottom: "{b}"' for b in bottoms) + " "
            + " ".join(f'top: "{t}"' for t in tops) + f" {body} }}\n")


GAUSS = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 }'
LAYERS = [
    L("conv_gd", "Convolution", ["x"], "convolution_param { num_output: 4 kernel_size: 3 pad: 2 stride: 2 "
      f"dilation: 2 group: 2 {GAUSS} }}"),
    L("conv_hw", "Convolution", ["x"], "convolution_param { num_output: 3 kernel_h: 2 kernel_w: 3 pad_h: 1 "
      f"pad_w: 0 stride_h: 1 stride_w: 2 bias_term: false {GAUSS} }}"),
    L("deconv", "Deconvolution", ["x"], f"convolution_param {{ num_output: 4 kernel_size: 3 stride: 2 pad: 1 "
      f"group: 2 {GAUSS} }}"),
    L("deconv_dil", "Deconvolution", ["a"], f"convolution_param {{ num_output: 2 kernel_size: 2 dilation: 2 "
      f"{GAUSS} }}"),
    L("pool_max", "Pooling", ["x"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }"),
    L("pool_max_pad", "Pooling", ["x"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }"),
    L("pool_ave_pad", "Pooling", ["x"], "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }"),
    L("pool_ave_ceil", "Pooling", ["x"], "pooling_param { pool: AVE kernel_size: 2 stride: 2 }"),
    L("pool_ave_hw", "Pooling", ["x"], "pooling_param { pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 3 "
      "stride_w: 1 pad_h: 1 pad_w: 1 }"),
    L("pool_gmax", "Pooling", ["x"], "pooling_param { pool: MAX global_pooling: true }"),
    L("pool_gave", "Pooling", ["x"], "pooling_param { pool: AVE global_pooling: true }"),
    L("lrn_across", "LRN", ["x"], "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 }"),
    L("lrn_within", "LRN", ["x"], "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }"),
    L("sum", "Eltwise", ["a", "b", "c"], "eltwise_param { operation: SUM coeff: 1 coeff: -2 coeff: 0.5 }"),
    L("prod", "Eltwise", ["a", "b", "c"], "eltwise_param { operation: PROD }"),
    L("max", "Eltwise", ["a", "b", "c"], "eltwise_param { operation: MAX }"),
    L("conv_sum", "Eltwise", ["conv_gd", "conv_gd"]),
    L("concat1", "Concat", ["a", "b"]),
    L("concat2", "Concat", ["a", "c"], "concat_param { axis: 2 }"),
    L("concat_mixed", "Concat", ["pool_max", "pool_max"], "concat_param { axis: 1 }"),
    L("slice", "Slice", ["x"], "slice_param { axis: 1 slice_point: 2 slice_point: 5 }", ["s0", "s1", "s2"]),
    L("slice_w", "Slice", ["lrn_across"], "slice_param { axis: 3 }", ["w0", "w1", "w2"]),
    L("softmax", "Softmax", ["x"]),
    L("softmax_nhwc", "Softmax", ["pool_max"]),
    L("loss_valid", "SoftmaxWithLoss", ["scores", "labels"], "loss_param { ignore_label: 255 }"),
    L("loss_full", "SoftmaxWithLoss", ["scores", "labels"], "loss_param { ignore_label: 255 normalization: FULL }"),
    L("loss_batch", "SoftmaxWithLoss", ["scores", "labels"],
      "loss_param { ignore_label: 255 normalization: BATCH_SIZE }"),
    L("loss_none", "SoftmaxWithLoss", ["scores", "labels"], "loss_param { ignore_label: 255 normalization: NONE }"),
    L("loss_legacy", "SoftmaxWithLoss", ["scores", "labels"], "loss_param { ignore_label: 255 normalize: false }"),
    L("loss_seg", "SoftmaxWithLoss", ["seg", "seglabels"], "loss_weight: 2 loss_weight: 0 "
      "loss_param { ignore_label: -1 }", ["loss_seg", "prob_seg"]),
    L("acc1", "Accuracy", ["ties", "labels"], "accuracy_param { ignore_label: 255 }"),
    L("acc2", "Accuracy", ["ties", "labels"], "accuracy_param { top_k: 2 ignore_label: 255 }",
      ["acc2", "acc2_class"]),
    L("acc_seg", "Accuracy", ["seg", "seglabels"], "accuracy_param { top_k: 2 ignore_label: -1 }"),
    L("argmax", "ArgMax", ["ties"], "argmax_param { top_k: 2 out_max_val: true }"),
    L("argmax_axis", "ArgMax", ["x"], "argmax_param { top_k: 2 axis: 1 }"),
    L("relu", "ReLU", ["x"], "relu_param { negative_slope: 0.1 }"),
    L("elu", "ELU", ["x"], "elu_param { alpha: 0.5 }"),
    L("sigmoid", "Sigmoid", ["x"]),
    L("tanh", "TanH", ["x"]),
    L("absval", "AbsVal", ["x"]),
    L("bnll", "BNLL", ["x"]),
    L("exp", "Exp", ["x"], "exp_param { base: 2 scale: 0.5 shift: 1 }"),
    L("exp_e", "Exp", ["x"]),
    L("log", "Log", ["pos"], "log_param { base: 10 scale: 2 shift: 3 }"),
    L("power", "Power", ["x"], "power_param { power: 2 scale: 0.5 shift: 1 }"),
    L("sqrt", "Power", ["pos"], "power_param { power: 0.5 }"),
    L("prelu", "PReLU", ["x"]),
    L("prelu_shared", "PReLU", ["conv_gd"], "prelu_param { channel_shared: true }"),
    L("scale", "Scale", ["x"], 'scale_param { bias_term: true filler { type: "gaussian" } '
      'bias_filler { type: "gaussian" } }'),
    L("scale2", "Scale", ["x", "chan"]),
    L("scale_nhwc", "Scale", ["pool_max"], 'scale_param { filler { type: "gaussian" } }'),
    L("bias", "Bias", ["a"], 'bias_param { num_axes: 2 filler { type: "gaussian" } }'),
    L("flatten", "Flatten", ["pool_max"]),
    L("reshape", "Reshape", ["x"], "reshape_param { shape { dim: 0 dim: -1 dim: 9 } }"),
    L("split", "Split", ["a"], "", ["split0", "split1"]),
    L("silence", "Silence", ["b"], "", []),
    L("ip", "InnerProduct", ["a"], f"inner_product_param {{ num_output: 4 transpose: true {GAUSS} }}"),
    L("ip_axis", "InnerProduct", ["a"], f"inner_product_param {{ num_output: 2 axis: 2 {GAUSS} }}"),
    L("euclid", "EuclideanLoss", ["a", "b"]),
    L("sigce", "SigmoidCrossEntropyLoss", ["c", "target"]),
    L("pool_max_out", "Split", ["pool_max"]),  # pool_max and lrn_across feed other layers: expose them
    L("lrn_across_out", "Split", ["lrn_across"]),
    L("dummy", "DummyData", [], 'dummy_data_param { shape { dim: 2 dim: 3 } data_filler { type: "constant" '
      "value: 1.5 } }"),
]
NET = 'name: "layers"\n' + input_layer() + "".join(LAYERS)


@pytest.fixture(scope="module")
def run():
    net, source = parse_net(NET)
    model = create_model("tensorflow", net, phase=pb.TEST, source=source, seed=11)
    data = inputs()
    params = {layer.name: model.get_blobs(layer.name) for layer in model.graph.layers}
    return model, data, model.forward(data), params


def close(got, want, tol=1e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# -- references ---------------------------------------------------------------------

def conv_ref(x, w, b, pad, stride, dilation, group):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2)).astype(np.float64)
    oh = (h + 2 * pad[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    ow = (wd + 2 * pad[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    y = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg,
                           i * dilation[0]: i * dilation[0] + stride[0] * (oh - 1) + 1: stride[0],
                           j * dilation[1]: j * dilation[1] + stride[1] * (ow - 1) + 1: stride[1]]
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, i, j])
    return y + (0 if b is None else b[None, :, None, None])


def deconv_ref(x, w, b, pad, stride, dilation, group):
    """Caffe's deconvolution: each input pixel scatters its kernel (col2im of W^T x)."""
    n, c, h, wd = x.shape
    _, og, kh, kw = w.shape
    cg = c // group
    full = [s * (size - 1) + d * (k - 1) + 1 for size, s, d, k in zip((h, wd), stride, dilation, (kh, kw))]
    y = np.zeros((n, og * group, *full))
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                contrib = np.einsum("nchw,co->nohw", x[:, g * cg:(g + 1) * cg], w[g * cg:(g + 1) * cg, :, i, j])
                y[:, g * og:(g + 1) * og, i * dilation[0]: i * dilation[0] + stride[0] * (h - 1) + 1: stride[0],
                  j * dilation[1]: j * dilation[1] + stride[1] * (wd - 1) + 1: stride[1]] += contrib
    y = y[:, :, pad[0]:full[0] - pad[0], pad[1]:full[1] - pad[1]]
    return y + (0 if b is None else b[None, :, None, None])


def pooled(size, k, s, p):
    out = math.ceil((size + 2 * p - k) / s) + 1
    return out - 1 if p and (out - 1) * s >= size + p else out


def pool_ref(x, k, s, p, method):
    """Caffe's PoolingLayer::Forward_cpu loops, MAX and AVE."""
    n, c, h, w = x.shape
    oh, ow = pooled(h, k[0], s[0], p[0]), pooled(w, k[1], s[1], p[1])
    y = np.zeros((n, c, oh, ow))
    for ph in range(oh):
        for pw in range(ow):
            hs, ws = ph * s[0] - p[0], pw * s[1] - p[1]
            he, we = min(hs + k[0], h + p[0]), min(ws + k[1], w + p[1])
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            window = x[:, :, hs:he, ws:we]
            y[:, :, ph, pw] = window.max(axis=(2, 3)) if method == "max" else window.sum(axis=(2, 3)) / size
    return y


def lrn_across_ref(x, size, alpha, beta, k):
    half = (size - 1) // 2
    sq = np.pad(x.astype(np.float64) ** 2, ((0, 0), (half, half), (0, 0), (0, 0)))
    scale = k + alpha / size * sum(sq[:, i:i + x.shape[1]] for i in range(size))
    return x * scale ** -beta


def lrn_within_ref(x, size, alpha, beta):
    half = (size - 1) // 2
    sq = np.pad(x.astype(np.float64) ** 2, ((0, 0), (0, 0), (half, half), (half, half)))
    h, w = x.shape[2:]
    total = sum(sq[:, :, i:i + h, j:j + w] for i in range(size) for j in range(size))
    return x * (1 + alpha * total / size ** 2) ** -beta


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_loss_ref(scores, labels, ignore, mode):
    """scores (outer, C, inner), labels (outer, inner)."""
    p = softmax_ref(scores.astype(np.float64), 1)
    outer, _, inner = scores.shape
    loss, count = 0.0, 0
    for i in range(outer):
        for j in range(inner):
            label = int(labels[i, j])
            if label == ignore:
                continue
            loss -= math.log(p[i, label, j])
            count += 1
    normalizer = {"FULL": outer * inner, "VALID": count, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return loss / max(normalizer, 1)


def caffe_rank(values):
    """Class indices in Caffe's descending (value, index) order."""
    return sorted(range(len(values)), key=lambda k: (values[k], k), reverse=True)


def accuracy_ref(scores, labels, top_k, ignore):
    """scores (outer, C, inner)."""
    hits = count = 0
    for i in range(scores.shape[0]):
        for j in range(scores.shape[2]):
            label = int(labels[i, j])
            if label == ignore:
                continue
            hits += label in caffe_rank(list(scores[i, :, j]))[:top_k]
            count += 1
    return hits / count


# -- vision --------------------------------------------------------------------------

def test_grouped_dilated_strided_convolution(run):
    _, data, out, params = run
    w, b = params["conv_gd"]
    assert out["conv_sum"].shape == (2, 4, 4, 5)
    close(out["conv_sum"], 2 * conv_ref(data["x"], w, b, (2, 2), (2, 2), (2, 2), 2), 1e-4)


def test_convolution_kernel_hw_without_bias(run):
    _, data, out, params = run
    (w,) = params["conv_hw"]
    close(out["conv_hw"], conv_ref(data["x"], w, None, (1, 0), (1, 2), (1, 1), 1), 1e-4)


def test_deconvolution(run):
    _, data, out, params = run
    w, b = params["deconv"]
    assert w.shape == (6, 2, 3, 3) and out["deconv"].shape == (2, 4, 13, 17)
    close(out["deconv"], deconv_ref(data["x"], w, b, (1, 1), (2, 2), (1, 1), 2), 1e-4)
    w, b = params["deconv_dil"]
    close(out["deconv_dil"], deconv_ref(data["a"], w, b, (0, 0), (1, 1), (2, 2), 1), 1e-4)


@pytest.mark.parametrize("name, k, s, p, method", [
    ("pool_max", (3, 3), (2, 2), (0, 0), "max"),
    ("pool_max_pad", (3, 3), (2, 2), (1, 1), "max"),
    ("pool_ave_pad", (3, 3), (2, 2), (1, 1), "ave"),
    ("pool_ave_ceil", (2, 2), (2, 2), (0, 0), "ave"),
    ("pool_ave_hw", (3, 2), (3, 1), (1, 1), "ave"),
    ("pool_gmax", (7, 9), (1, 1), (0, 0), "max"),
    ("pool_gave", (7, 9), (1, 1), (0, 0), "ave"),
])
def test_pooling_ceil_size_and_border_divisor(run, name, k, s, p, method):
    _, data, out, _ = run
    want = pool_ref(data["x"], k, s, p, method)
    got = out[name] if name in out else out[name + "_out"]
    assert got.shape == want.shape
    close(got, want)


def test_pooling_shapes_are_caffes_ceil():
    assert pooled(8, 3, 2, 0) == 4 and pooled(9, 2, 2, 0) == 5  # ceil, not floor
    assert pooled(7, 3, 2, 1) == 4  # the last window would start in the padding: clipped


def test_lrn_across_channels(run):
    _, data, out, _ = run
    close(out["lrn_across_out"], lrn_across_ref(data["x"], 3, 0.5, 0.75, 2.0))
    close(np.concatenate([out["w0"], out["w1"], out["w2"]], axis=3), out["lrn_across_out"])


def test_lrn_within_channel(run):
    _, data, out, _ = run
    close(out["lrn_within"], lrn_within_ref(data["x"], 3, 0.5, 0.75))


# -- common and utility ---------------------------------------------------------------

def test_eltwise(run):
    _, data, out, _ = run
    a, b, c = data["a"], data["b"], data["c"]
    close(out["sum"], a - 2 * b + 0.5 * c)
    close(out["prod"], a * b * c)
    close(out["max"], np.maximum(np.maximum(a, b), c))


def test_concat_slice_split_flatten_reshape(run):
    _, data, out, _ = run
    close(out["concat1"], np.concatenate([data["a"], data["b"]], axis=1))
    close(out["concat2"], np.concatenate([data["a"], data["c"]], axis=2))
    pool = pool_ref(data["x"], (3, 3), (2, 2), (0, 0), "max")
    close(out["concat_mixed"], np.concatenate([pool, pool], axis=1))
    close(out["s0"], data["x"][:, :2])
    close(out["s1"], data["x"][:, 2:5])
    close(out["s2"], data["x"][:, 5:])
    close(out["split0"], data["a"])
    close(out["split1"], data["a"])
    close(out["flatten"], pool.reshape(2, -1))  # NHWC inside, Caffe's C-major order outside
    close(out["reshape"], data["x"].reshape(2, -1, 9))
    assert "b" not in out and "silence" not in out


def test_inner_product_transpose_and_axis(run):
    _, data, out, params = run
    w, b = params["ip"]
    assert w.shape == (60, 4)  # transpose: (K, N)
    close(out["ip"], data["a"].reshape(2, -1) @ w + b, 1e-4)
    w, b = params["ip_axis"]
    close(out["ip_axis"], data["a"].reshape(2, 3, -1) @ w.T + b, 1e-4)


def test_softmax(run):
    _, data, out, _ = run
    close(out["softmax"], softmax_ref(data["x"], 1))
    close(out["softmax_nhwc"], softmax_ref(pool_ref(data["x"], (3, 3), (2, 2), (0, 0), "max"), 1))


@pytest.mark.parametrize("name, mode", [("loss_valid", "VALID"), ("loss_full", "FULL"),
                                        ("loss_batch", "BATCH_SIZE"), ("loss_none", "NONE"),
                                        ("loss_legacy", "BATCH_SIZE")])
def test_softmax_loss_normalization_and_ignore_label(run, name, mode):
    _, data, out, _ = run
    scores, labels = data["scores"][:, :, None], data["labels"][:, None]
    assert float(out[name]) == pytest.approx(softmax_loss_ref(scores, labels, 255, mode), rel=1e-5)


def test_spatial_softmax_loss_and_loss_weight(run):
    model, data, out, _ = run
    seg, labels = data["seg"].reshape(2, 4, 9), data["seglabels"].reshape(2, 9)
    assert float(out["loss_seg"]) == pytest.approx(softmax_loss_ref(seg, labels, -1, "VALID"), rel=1e-5)
    close(out["prob_seg"], softmax_ref(data["seg"], 1))
    assert model.graph.layer("loss_seg").loss_weights == [2.0, 0.0]


def test_accuracy_top_k_ties_and_ignore(run):
    _, data, out, _ = run
    scores, labels = data["ties"][:, :, None], data["labels"][:, None]
    assert float(out["acc1"]) == pytest.approx(accuracy_ref(scores, labels, 1, 255))
    assert float(out["acc2"]) == pytest.approx(accuracy_ref(scores, labels, 2, 255))
    seg, seglabels = data["seg"].reshape(2, 4, 9), data["seglabels"].reshape(2, 9)
    assert float(out["acc_seg"]) == pytest.approx(accuracy_ref(seg, seglabels, 2, -1))
    per_class = np.zeros(5)
    for c in range(5):
        rows = [i for i in range(6) if data["labels"][i] == c]
        if rows:
            per_class[c] = np.mean([c in caffe_rank(list(data["ties"][i]))[:2] for i in rows])
    close(out["acc2_class"], per_class)


def test_accuracy_tie_rule_by_hand():
    # Scores tie between classes 1 and 3; Caffe's sort puts the higher index first.
    net, _ = parse_net('layer { name: "in" type: "Input" top: "s" top: "l" input_param { shape { dim: 2 dim: 4 } '
                       'shape { dim: 2 } } }' + L("acc", "Accuracy", ["s", "l"]))
    model = create_model("tensorflow", net, phase=pb.TEST)
    scores = np.array([[0, 1, 0, 1], [0, 1, 0, 1]], np.float32)
    assert float(model.forward({"s": scores, "l": np.array([3, 1], np.float32)})["acc"]) == 0.5


def test_argmax(run):
    _, data, out, _ = run
    want = np.zeros((6, 2, 2))
    for i, row in enumerate(data["ties"]):
        order = caffe_rank(list(row))[:2]
        want[i, 0], want[i, 1] = order, row[order]
    close(out["argmax"].reshape(6, 2, 2), want)
    order = np.argsort(-data["x"], axis=1, kind="stable")[:, :2]
    close(out["argmax_axis"], order)


# -- neurons -------------------------------------------------------------------------

def test_neurons(run):
    _, data, out, _ = run
    x, pos = data["x"].astype(np.float64), data["pos"].astype(np.float64)
    close(out["relu"], np.where(x > 0, x, 0.1 * x))
    close(out["elu"], np.where(x > 0, x, 0.5 * (np.exp(x) - 1)))
    close(out["sigmoid"], 1 / (1 + np.exp(-x)))
    close(out["tanh"], np.tanh(x))
    close(out["absval"], np.abs(x))
    close(out["bnll"], np.where(x > 0, x + np.log1p(np.exp(-x)), np.log1p(np.exp(x))))
    close(out["exp"], 2 ** (1 + 0.5 * x))
    close(out["exp_e"], np.exp(x))
    close(out["log"], np.log10(3 + 2 * pos))
    close(out["power"], (1 + 0.5 * x) ** 2)
    close(out["sqrt"], np.sqrt(pos))


def test_prelu(run):
    _, data, out, params = run
    (slope,) = params["prelu"]
    assert slope.shape == (6,) and np.all(slope == 0.25)
    x = data["x"]
    close(out["prelu"], np.maximum(x, 0) + 0.25 * np.minimum(x, 0))
    (shared,) = params["prelu_shared"]
    assert shared.shape == ()
    conv = out["conv_sum"] / 2
    close(out["prelu_shared"], np.maximum(conv, 0) + 0.25 * np.minimum(conv, 0), 1e-4)


def test_scale_and_bias(run):
    _, data, out, params = run
    scale, shift = params["scale"]
    x = data["x"]
    close(out["scale"], x * scale[None, :, None, None] + shift[None, :, None, None])
    close(out["scale2"], x * data["chan"][None, :, None, None])
    (factor,) = params["scale_nhwc"]
    close(out["scale_nhwc"], pool_ref(x, (3, 3), (2, 2), (0, 0), "max") * factor[None, :, None, None])
    (term,) = params["bias"]
    assert term.shape == (3, 4)
    close(out["bias"], data["a"] + term[None, :, :, None])


def test_losses(run):
    _, data, out, _ = run
    a, b = data["a"].astype(np.float64), data["b"].astype(np.float64)
    assert float(out["euclid"]) == pytest.approx(((a - b) ** 2).sum() / 4, rel=1e-5)
    c, t = data["c"].astype(np.float64), data["target"].astype(np.float64)
    entropy = -(t * np.log(1 / (1 + np.exp(-c))) + (1 - t) * np.log(1 - 1 / (1 + np.exp(-c))))
    assert float(out["sigce"]) == pytest.approx(entropy.sum() / 2, rel=1e-5)


def test_dummy_data(run):
    _, _, out, _ = run
    assert np.all(out["dummy"] == 1.5) and out["dummy"].shape == (2, 3)


# -- phase-dependent layers: BatchNorm and Dropout -------------------------------------

BN_NET = """
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 2 dim: 5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" batch_norm_param { moving_average_fraction: 0.9 } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 2 kernel_size: 1
  weight_filler { type: "gaussian" } } }
layer { name: "bn_nhwc" type: "BatchNorm" bottom: "c" top: "c" }
layer { name: "drop" type: "Dropout" bottom: "x" top: "d" dropout_param { dropout_ratio: 0.25 } }
"""


def bn_model(phase):
    return create_model("tensorflow", parse_net(BN_NET)[0], phase=phase, seed=2)


def test_batch_norm_train_statistics_and_running_update():
    model = bn_model(pb.TRAIN)
    x = RNG.standard_normal((4, 3, 2, 5)).astype(np.float32) * 3 + 1
    model.set_blobs("bn", [np.full(3, 2.0), np.full(3, 4.0), np.array([2.0])])
    out = model.forward({"x": x})
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    close(out["y"], (x - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5), 1e-4)
    m = 4 * 2 * 5
    mean_blob, var_blob, factor = model.get_blobs("bn")
    close(factor, [2.0 * 0.9 + 1])
    close(mean_blob, 0.9 * 2.0 + mean)
    close(var_blob, 0.9 * 4.0 + m / (m - 1) * var, 1e-4)
    conv = conv_ref(x, model.get_blobs("conv")[0], None, (0, 0), (1, 1), (1, 1), 1)
    cm, cv = conv.mean(axis=(0, 2, 3)), conv.var(axis=(0, 2, 3))
    close(out["c"], (conv - cm[None, :, None, None]) / np.sqrt(cv[None, :, None, None] + 1e-5), 1e-3)
    # Dropout in TRAIN: kept values scaled by 1/(1-p), about p of them dropped.
    d = out["d"]
    kept = d != 0
    close(d[kept], x[kept] / 0.75)
    assert 0.05 < 1 - kept.mean() < 0.5


def test_batch_norm_global_stats_in_test():
    model = bn_model(pb.TEST)
    x = RNG.standard_normal((4, 3, 2, 5)).astype(np.float32)
    mean, var, factor = np.array([1.0, 2, 3]), np.array([4.0, 5, 6]), np.array([2.0])
    model.set_blobs("bn", [mean, var, factor])
    out = model.forward({"x": x})
    close(out["y"], (x - mean[None, :, None, None] / 2) / np.sqrt(var[None, :, None, None] / 2 + 1e-5))
    close(model.get_blobs("bn")[2], factor)  # TEST leaves the statistics alone
    close(out["d"], x)  # Dropout is the identity in TEST
    model.set_blobs("bn", [mean, var, np.zeros(1)])  # scale factor 0 means zero statistics
    close(model.forward({"x": x})["y"], x / np.sqrt(1e-5), 1e-4)


def test_batch_norm_params_are_outside_the_solver():
    model = bn_model(pb.TRAIN)
    bn = model.graph.layer("bn")
    assert [bn.param_spec(i)[:2] for i in range(3)] == [(0.0, 0.0)] * 3


# -- gradients by finite differences -----------------------------------------------------

GRAD_NET = """
layer { name: "in" type: "Input" top: "x" top: "l" input_param { shape { dim: 2 dim: 4 dim: 5 dim: 6 }
  shape { dim: 2 dim: 1 dim: 5 dim: 6 } } }
LAYER
"""


def finite_difference_check(layer_text, train=True, points=12, tol=3e-2, labels=None):
    graph = Graph(parse_net(GRAD_NET.replace("LAYER", layer_text))[0], pb.TRAIN if train else pb.TEST)
    params = [tf.constant(p) for p in fillers.init_params(graph, seed=4)]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 5, 6)).astype(np.float32)
    lab = labels if labels is not None else rng.integers(0, 4, (2, 1, 5, 6)).astype(np.float32)
    top = graph.layers[-1].tops[0]
    weights = None

    def objective(x_value, param_values):
        nonlocal weights
        ctx = compiler.Context(graph, {"x": x_value, "l": tf.constant(lab)}, train)
        _, blobs = compiler.run(graph, param_values, ctx)
        y = blobs[top].caffe
        if weights is None:
            weights = tf.constant(rng.standard_normal(y.shape.as_list()).astype(np.float32))
        return tf.reduce_sum(tf.cast(y, tf.float64) * tf.cast(weights, tf.float64))

    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch([xt] + params)
        value = objective(xt, params)
    grads = tape.gradient(value, [xt] + params)
    targets = [(x, grads[0], lambda v: objective(tf.constant(v), params))]
    for i, p in enumerate(params):
        if grads[i + 1] is not None:
            def with_param(v, i=i):
                return objective(xt, params[:i] + [tf.constant(v)] + params[i + 1:])
            targets.append((p.numpy(), grads[i + 1], with_param))
    eps = 1e-2
    for base, grad, f in targets:
        grad = grad.numpy().reshape(-1)
        for index in rng.choice(base.size, min(points, base.size), replace=False):
            plus, minus = base.copy().reshape(-1), base.copy().reshape(-1)
            plus[index] += eps
            minus[index] -= eps
            numeric = (float(f(plus.reshape(base.shape))) - float(f(minus.reshape(base.shape)))) / (2 * eps)
            assert grad[index] == pytest.approx(numeric, rel=tol, abs=tol * 0.1), (layer_text, index)


@pytest.mark.parametrize("layer_text", [
    L("conv", "Convolution", ["x"], "convolution_param { num_output: 4 kernel_size: 3 pad: 1 stride: 2 "
      f"dilation: 1 group: 2 {GAUSS} }}"),
    L("conv", "Convolution", ["x"], f"convolution_param {{ num_output: 3 kernel_size: 2 pad: 2 dilation: 2 {GAUSS} }}"),
    L("deconv", "Deconvolution", ["x"], f"convolution_param {{ num_output: 2 kernel_size: 3 stride: 2 pad: 1 {GAUSS} }}"),
    L("deconv", "Deconvolution", ["x"], f"convolution_param {{ num_output: 2 kernel_size: 2 dilation: 2 {GAUSS} }}"),
    L("pool", "Pooling", ["x"], "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }"),
    L("lrn", "LRN", ["x"], "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 1.5 }"),
    L("lrn", "LRN", ["x"], "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }"),
    L("bn", "BatchNorm", ["x"]),
    L("prelu", "PReLU", ["x"], 'prelu_param { filler { type: "uniform" min: 0.1 max: 0.5 } }'),
    L("loss", "SoftmaxWithLoss", ["x", "l"], "loss_param { ignore_label: 2 }"),
])
def test_gradients_by_finite_differences(layer_text):
    finite_difference_check(layer_text)
