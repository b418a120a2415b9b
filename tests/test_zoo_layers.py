"""The layer types BVLC Caffe registers beyond the first 36, forward and backward, on both backends against real
pycaffe.

Each case is a small net: the layer under test reads Parameter layers (learned blobs set to random values, so
that the diffs of its bottoms are those blobs' diffs) and Input layers (labels, indices, sequence markers, which
take no diff); each of its tops feeds an InnerProduct with fixed random weights and loss_weight 1, so that its
backward starts from random diffs. Both backends run one forward pass and then one forward-backward pass
(`gradients`) on the same values; the tops, the loss and every parameter diff must agree within 1e-4 of the
largest magnitude in each array. Clip and Swish came to BVLC Caffe after the pycaffe built here (brocolli-caffe
9.0.2, BVLC 9b89154): their TensorFlow functions are checked against NumPy written from BVLC's clip_layer.cpp and
swish_layer.cpp, and the Caffe backend's one-line refusal is checked.
"""

import numpy as np
import pytest

from deepspark.backends import create_model
from deepspark.backends.caffe import runtime
from deepspark.checkpoint import array_to_blob
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph, tap_name, with_taps
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.caffe

tf = pytest.importorskip("tensorflow")

SOLVER = pb.SolverParameter(type="SGD", base_lr=0.01)
RNG = np.random.default_rng(24)


@pytest.fixture(autouse=True)
def seeded():
    """Each test's random inputs seeded afresh, so that none depends on which tests ran before it in its process."""
    RNG.bit_generator.state = np.random.default_rng(24).bit_generator.state
UNIFORM = 'weight_filler { type: "uniform" min: -0.6 max: 0.6 } bias_filler { type: "uniform" min: -0.4 max: 0.4 }'


@pytest.fixture(scope="module", autouse=True)
def caffe():
    try:
        return runtime.caffe()
    except ImportError as error:
        pytest.skip(str(error))


def dims(shape):
    return "shape { " + " ".join(f"dim: {d}" for d in shape) + " }"


def net_text(layers, sources, fed, probed):
    """A net: a Parameter layer per source, one Input layer for the fed blobs, `layers`, a probe per probed top."""
    text = "".join(f'layer {{ name: "{name}" type: "Parameter" top: "{name}" parameter_param {{ {dims(value.shape)} }} }}\n'
                   for name, value in sources.items())
    if fed:
        tops = " ".join(f'top: "{name}"' for name in fed)
        text += f'layer {{ name: "fed" type: "Input" {tops} input_param {{ {" ".join(dims(v.shape) for v in fed.values())} }} }}\n'
    text += layers
    for top, rank in probed.items():  # axis 1 where it can: the first axis of Filter's tops depends on the data
        text += (f'layer {{ name: "probe_{top}" type: "InnerProduct" bottom: "{top}" top: "probe_{top}" '
                 f'param {{ lr_mult: 0 }} inner_product_param {{ num_output: 1 axis: {1 if rank > 1 else 0} '
                 f'bias_term: false weight_filler {{ type: "gaussian" std: 1 }} }} loss_weight: 1 }}\n')
    return text


def run(backend, text, sources, fed, tops):
    """(the tops of one forward pass, the loss and every parameter diff of the next forward-backward pass)."""
    net = parse_net(text)[0]
    graph = Graph(net, pb.TRAIN)
    model = create_model(backend, with_taps(net, graph, tops), SOLVER, seed=5)
    try:
        for name, value in sources.items():
            model.set_blobs(name, [value])
        outputs = model.forward(fed)
        values = {top: outputs[tap_name(graph, top)] for top in tops}
        loss, diffs = model.gradients(fed)
        return values, loss, diffs, [p.layer for p in model.graph.params]
    finally:
        model.close()


def close(got, want, what):
    want = np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-6) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=what)


def check_backends(layers, sources=None, fed=None, tops=None, ranks=None):
    """Run the case on both backends and compare everything; the Caffe values, for a case's own checks."""
    sources, fed = sources or {}, fed or {}
    tops = list(tops or ranks)
    ranks = ranks or {}
    text = net_text(layers, sources, fed, ranks)
    caffe_values, caffe_loss, caffe_diffs, owners = run("caffe", text, sources, fed, tops)
    tf_values, tf_loss, tf_diffs, _ = run("tensorflow", text, sources, fed, tops)
    for top in tops:
        assert tf_values[top].shape == caffe_values[top].shape, top
        close(tf_values[top], caffe_values[top], f"top {top}")
    close(tf_loss, caffe_loss, "loss")
    for owner, got, want in zip(owners, tf_diffs, caffe_diffs):
        close(got, want, f"diff of a blob of '{owner}'")
    assert any(np.any(d != 0) for d, owner in zip(caffe_diffs, owners) if not owner.startswith("probe_"))
    blobs = {}
    for owner, diff in zip(owners, caffe_diffs):
        blobs.setdefault(owner, []).append(diff)
    return caffe_values, blobs  # {layer: the Caffe diffs of its blobs}


def normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def L(name, kind, bottoms, body="", tops=None):
    tops = [name] if tops is None else tops
    return (f'layer {{ name: "{name}" type: "{kind}" ' + " ".join(f'bottom: "{b}"' for b in bottoms) + " "
            + " ".join(f'top: "{t}"' for t in tops) + f" {body} }}\n")


# -- shapes and copies ----------------------------------------------------------------------

@pytest.mark.parametrize("body, expected", [
    ("crop_param { axis: 2 offset: 1 offset: 2 }", (2, 3, 4, 5)),
    ("crop_param { axis: 1 offset: 1 }", (2, 2, 4, 5)),
])
def test_crop(body, expected):
    x, reference = normal(2, 3, 7, 8), normal(2, 2, 4, 5)
    values, diffs = check_backends(L("crop", "Crop", ["x", "ref"], body), {"x": x, "ref": reference},
                                   ranks={"crop": 4})
    assert values["crop"].shape == expected
    offsets = [0, 1, 1, 1] if "axis: 1" in body else [0, 0, 1, 2]
    window = tuple(slice(o, o + n) for o, n in zip(offsets, expected))
    np.testing.assert_array_equal(values["crop"], x[window])
    assert not np.any(diffs["ref"][0])  # the reference gives only its shape


@pytest.mark.parametrize("body", ["tile_param { axis: 1 tiles: 3 }", "tile_param { axis: -1 tiles: 2 }"])
def test_tile(body):
    x = normal(2, 3, 4)
    values, _ = check_backends(L("tile", "Tile", ["x"], body), {"x": x}, ranks={"tile": 3})
    reps = [1, 3, 1] if "axis: 1" in body else [1, 1, 2]
    np.testing.assert_array_equal(values["tile"], np.tile(x, reps))


def test_filter_keeps_the_selected_items():
    x, y = normal(4, 3), normal(4, 2, 2)
    selector = np.array([[1], [0], [1], [1]], np.float32)
    values, diffs = check_backends(L("filter", "Filter", ["x", "y", "select"], "", ["fx", "fy"]), {"x": x, "y": y},
                                   {"select": selector}, ranks={"fx": 2, "fy": 3})
    np.testing.assert_array_equal(values["fx"], x[[0, 2, 3]])
    np.testing.assert_array_equal(values["fy"], y[[0, 2, 3]])
    assert not np.any(diffs["x"][0][1])  # a dropped item takes no diff


def test_losses_over_filtered_items_count_the_items_the_data_kept():
    """A Filter's tops are as long as the data says: each loss's normaliser is that count, not the batch's."""
    x, y = normal(5, 3), normal(5, 3)
    fed = {"label": np.array([0, 1, 2, 1, 0], np.float32), "select": np.array([[1], [0], [1], [1], [0]], np.float32)}
    keep_label = "propagate_down: true propagate_down: false"
    layers = (L("filter", "Filter", ["x", "y", "label", "select"], "", ["fx", "fy", "flabel"])
              + L("softmax", "SoftmaxWithLoss", ["fx", "flabel"], keep_label)
              + L("hinge", "HingeLoss", ["fy", "flabel"], keep_label)
              + L("euclid", "EuclideanLoss", ["fx", "fy"])
              + L("contrast", "ContrastiveLoss", ["fx", "fy", "flabel"], "propagate_down: true propagate_down: true "
                  "propagate_down: false"))
    values, _ = check_backends(layers, {"x": x, "y": y}, fed, tops=["softmax", "hinge", "euclid", "contrast"])
    kept = [0, 2, 3]
    assert values["euclid"] == pytest.approx(((x[kept] - y[kept]) ** 2).sum() / 6, rel=1e-5)


def test_batch_reindex_sums_the_diffs_of_repeated_picks():
    x = normal(4, 3)
    index = np.array([2, 0, 2, 3, 1], np.float32)
    values, _ = check_backends(L("reindex", "BatchReindex", ["x", "index"]), {"x": x}, {"index": index},
                               ranks={"reindex": 2})
    np.testing.assert_array_equal(values["reindex"], x[[2, 0, 2, 3, 1]])


@pytest.mark.parametrize("body", [
    "convolution_param { kernel_size: 3 pad: 1 stride: 2 }",
    "convolution_param { kernel_h: 2 kernel_w: 3 dilation: 2 pad_w: 1 pad_h: 0 }",
])
def test_im2col(body):
    x = normal(2, 3, 6, 7)
    values, _ = check_backends(L("cols", "Im2col", ["x"], body), {"x": x}, ranks={"cols": 4})
    if "kernel_size: 3" in body:  # channel c, kernel row i, column j at (c*3 + i)*3 + j: Caffe's im2col_cpu
        padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        np.testing.assert_array_equal(values["cols"][:, (1 * 3 + 2) * 3 + 0], padded[:, 1, 2:2 + 5:2, 0:0 + 7:2])


def test_parameter_is_its_blob():
    values, diffs = check_backends(L("double", "Power", ["p"], "power_param { scale: 2 }"), {"p": normal(2, 3)},
                                   tops=["p", "double"], ranks={"double": 2})
    assert values["p"].shape == (2, 3) and np.any(diffs["p"][0])


# -- neurons and normalisation ----------------------------------------------------------------

@pytest.mark.parametrize("body", [
    "reduction_param { operation: SUM axis: 1 coeff: 2 }",
    "reduction_param { operation: ASUM } loss_weight: 1.5",
    "reduction_param { operation: SUMSQ axis: -1 }",
    "reduction_param { operation: MEAN axis: 2 coeff: -0.5 }",
])
def test_reduction(body):
    x = normal(2, 3, 4)
    scalar = "loss_weight" in body
    values, _ = check_backends(L("reduce", "Reduction", ["x"], body), {"x": x}, tops=["reduce"],
                               ranks={} if scalar else {"reduce": 1})
    if scalar:
        assert values["reduce"].shape == () and values["reduce"] == pytest.approx(np.abs(x).sum(), rel=1e-5)


@pytest.mark.parametrize("body", ["", "mvn_param { across_channels: true }", "mvn_param { normalize_variance: false }",
                                  "mvn_param { eps: 0.5 }"])
def test_mvn(body):
    check_backends(L("mvn", "MVN", ["x"], body), {"x": normal(2, 3, 4, 5) * 2 + 1}, ranks={"mvn": 4})


@pytest.mark.parametrize("body", ["spp_param { pyramid_height: 3 pool: MAX }",
                                  "spp_param { pyramid_height: 2 pool: AVE }",
                                  "spp_param { pyramid_height: 1 }"])
def test_spp(body):
    values, _ = check_backends(L("spp", "SPP", ["x"], body), {"x": normal(2, 3, 7, 9)},
                               ranks={"spp": 4 if "height: 1" in body else 2})
    levels = int(body.split("pyramid_height: ")[1].split()[0])
    assert values["spp"].shape == ((2, 3, 1, 1) if levels == 1 else (2, 3 * sum(4 ** l for l in range(levels))))


def test_threshold_forward_and_no_backward():
    x = normal(3, 4)
    values, _ = check_backends(L("step", "Threshold", ["x"], "threshold_param { threshold: 0.2 }")
                               + L("scaled", "Scale", ["step"], 'scale_param { filler { type: "gaussian" } }'),
                               fed={"x": x}, tops=["step"], ranks={"scaled": 2})
    np.testing.assert_array_equal(values["step"], (x > 0.2).astype(np.float32))


# -- losses -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", ["contrastive_loss_param { margin: 3 }",
                                  "contrastive_loss_param { margin: 9 legacy_version: true } loss_weight: 1.5"])
def test_contrastive_loss(body):
    a = normal(6, 4)
    spread = np.array([0.2, 0.15, 1, 1.2, 0.2, 2], np.float32)[:, None]  # dissimilar pairs in and out of the margin
    b = (a + spread * normal(6, 4)).reshape(6, 4, 1, 1)
    similar = np.array([1, 0, 1, 0, 0, 0], np.float32)
    values, _ = check_backends(L("loss", "ContrastiveLoss", ["a", "b", "similar"], body), {"a": a, "b": b},
                               {"similar": similar}, tops=["loss"])
    distance = np.sqrt(((a - b.reshape(6, 4)) ** 2).sum(1))
    margin = 9.0 if "legacy" in body else 3.0
    apart = np.maximum(margin - distance ** 2, 0) if "legacy" in body else np.maximum(margin - distance, 0) ** 2
    assert 0 < np.count_nonzero(apart[similar == 0]) < 4  # pairs both inside and outside the margin
    assert values["loss"] == pytest.approx(np.where(similar == 1, distance ** 2, apart).sum() / 12, rel=1e-5)


def probabilities(n, classes):
    p = RNG.uniform(0.05, 1.0, (n, classes)).astype(np.float32)
    return p / p.sum(1, keepdims=True)


def test_multinomial_logistic_loss():
    p = probabilities(5, 4)
    labels = np.array([0, 3, 1, 1, 2], np.float32)
    values, _ = check_backends(L("loss", "MultinomialLogisticLoss", ["p", "labels"], "loss_weight: 2"), {"p": p},
                               {"labels": labels}, tops=["loss"])
    assert values["loss"] == pytest.approx(-np.log(p[range(5), labels.astype(int)]).mean(), rel=1e-5)


@pytest.mark.parametrize("from_file", [False, True])
def test_infogain_loss(tmp_path, from_file):
    p = probabilities(5, 4)
    p[1, 2] = 0.0  # clipped to 1e-20 in the log and in Caffe's diff
    labels = np.array([0, 3, 1, 2, 2], np.float32)
    matrix = RNG.uniform(0, 1, (1, 1, 4, 4)).astype(np.float32)
    if from_file:
        path = tmp_path / "infogain.binaryproto"
        path.write_bytes(array_to_blob(matrix).SerializeToString())
        layer = L("loss", "InfogainLoss", ["p", "labels"], f'infogain_loss_param {{ source: "{path}" }}')
        fed = {"labels": labels}
    else:
        layer, fed = L("loss", "InfogainLoss", ["p", "labels", "H"]), {"labels": labels, "H": matrix}
    values, _ = check_backends(layer, {"p": p}, fed, tops=["loss"])
    want = -(matrix[0, 0][labels.astype(int)] * np.log(np.maximum(p, 1e-20))).sum() / 5
    assert values["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss(norm):
    x = normal(5, 4)
    labels = np.array([0, 3, 1, 1, 2], np.float32)
    values, _ = check_backends(L("loss", "HingeLoss", ["x", "labels"], f"hinge_loss_param {{ norm: {norm} }}"),
                               {"x": x}, {"labels": labels}, tops=["loss"])
    sign = np.ones_like(x)
    sign[range(5), labels.astype(int)] = -1
    margins = np.maximum(0, 1 + sign * x)
    assert values["loss"] == pytest.approx((margins if norm == "L1" else margins ** 2).sum() / 5, rel=1e-5)


# -- learned layers -----------------------------------------------------------------------------

@pytest.mark.parametrize("bias", ["true", "false"])
def test_embed(bias):
    index = np.array([[0, 6, 3], [3, 1, 5]], np.float32)
    _, diffs = check_backends(L("embed", "Embed", ["index"], f"embed_param {{ num_output: 4 input_dim: 7 "
                                                             f"bias_term: {bias} {UNIFORM} }}"),
                              fed={"index": index}, ranks={"embed": 3})
    assert not np.any(diffs["embed"][0][[2, 4]]) and np.any(diffs["embed"][0][3])  # rows no index picked


CONT = np.array([[0, 0], [1, 1], [1, 0]], np.float32)  # stream 1 starts again at t = 2


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("variant", ["plain", "carried", "static_exposed"])
def test_recurrent(kind, variant):
    """Three steps of two streams; `carried`: cont_0 is 1, so the forward-backward pass starts from the state the
    first forward pass left (Caffe's carried h_T, c_T); `static_exposed`: a static input and expose_hidden."""
    states = 2 if kind == "LSTM" else 1
    sources = {"x": normal(3, 2, 4)}
    fed = {"cont": CONT if variant != "carried" else np.ones((3, 2), np.float32)}
    bottoms, tops = ["x", "cont"], [kind.lower()]
    param = f"recurrent_param {{ num_output: 3 {UNIFORM} }}"
    if variant == "static_exposed":
        sources["static"] = normal(2, 5)
        sources.update({f"state{i}": normal(1, 2, 3) for i in range(states)})
        bottoms += ["static"] + [f"state{i}" for i in range(states)]
        tops += [f"final{i}" for i in range(states)]
        param = f"recurrent_param {{ num_output: 3 expose_hidden: true {UNIFORM} }}"
    _, diffs = check_backends(L(kind.lower(), kind, bottoms, param, tops), sources, fed, tops=tops,
                              ranks={tops[0]: 3})
    if variant == "static_exposed":
        assert not any(np.any(diffs[f"state{i}"][0]) for i in range(states))  # Caffe passes no diff to h_0, c_0
        assert np.any(diffs["static"][0])


@pytest.mark.parametrize("cont", [[0, 1], [0.6, 1]])
def test_lstm_unit(cont):
    """A cont of 0.6: Caffe's forget-gate diff f (1 - f), with f = cont * sigmoid, is not the gradient there."""
    sources = {"c": normal(1, 2, 3), "gates": normal(1, 2, 12)}
    check_backends(L("unit", "LSTMUnit", ["c", "gates", "cont"], "", ["c_next", "h_next"]), sources,
                   {"cont": np.array([cont], np.float32)}, ranks={"c_next": 3, "h_next": 3})


def test_recurrent_blobs_are_caffes_order_and_shapes():
    """The parameter blobs in Caffe's unrolled-net order, so that .caffemodel weights move between the backends."""
    text = ('layer { name: "in" type: "Input" top: "x" top: "cont" top: "s" input_param { shape { dim: 3 dim: 2 '
            'dim: 4 } shape { dim: 3 dim: 2 } shape { dim: 2 dim: 5 } } }\n'
            + L("lstm", "LSTM", ["x", "cont", "s"], "recurrent_param { num_output: 3 }")
            + L("rnn", "RNN", ["x", "cont"], "recurrent_param { num_output: 3 }"))
    net = parse_net(text)[0]
    model = create_model("caffe", net, SOLVER)
    ours = [p.shape for p in Graph(net).params]
    caffes = [tuple(blob.data.shape) for name in ("lstm", "rnn") for blob in model._net.params[name]]
    assert ours == caffes == [(12, 4), (12,), (12, 5), (12, 3), (3, 4), (3,), (3, 3), (3, 3), (3,)]


# -- Clip and Swish: later than this pycaffe ------------------------------------------------------

def tf_values_and_diff(layer_text, x, tops):
    net = parse_net(net_text(layer_text, {"x": x}, {}, {top: x.ndim for top in tops}))[0]
    model = create_model("tensorflow", with_taps(net, Graph(net), tops), SOLVER, seed=5)
    model.set_blobs("x", [x])
    outputs = model.forward({})
    _, diffs = model.gradients({})
    probe = [np.broadcast_to(model.get_blobs(f"probe_{top}")[0].reshape(x.shape[1:]), x.shape) for top in tops]
    return [outputs[tap_name(model.graph, top)] for top in tops], diffs[0], probe


def test_clip_against_bvlc_formulas():
    x = normal(3, 5)
    x[0, :2] = [-0.5, 0.75]  # on the bounds: Caffe passes the diff there
    (y,), diff, (probe,) = tf_values_and_diff(L("clip", "Clip", ["x"], "clip_param { min: -0.5 max: 0.75 }"),
                                              x, ["clip"])
    close(y, np.maximum(-0.5, np.minimum(x, 0.75)), "Clip")
    close(diff, probe * ((x >= -0.5) & (x <= 0.75)), "Clip diff")


def test_swish_against_bvlc_formulas():
    x = normal(3, 5)
    (y,), diff, (probe,) = tf_values_and_diff(L("swish", "Swish", ["x"], "swish_param { beta: 1.5 }"), x, ["swish"])
    sigmoid = 1 / (1 + np.exp(-1.5 * x.astype(np.float64)))
    swish = x * sigmoid
    close(y, swish, "Swish")
    close(diff, probe * (1.5 * swish + sigmoid * (1 - 1.5 * swish)), "Swish diff")


@pytest.mark.parametrize("kind, body", [("Clip", "clip_param { min: 0 max: 1 }"), ("Swish", "")])
def test_caffe_backend_says_this_pycaffe_lacks_clip_and_swish(kind, body):
    net, source = parse_net(net_text(L("later", kind, ["x"], body), {"x": normal(2, 3)}, {}, {}), "net.prototxt")
    with pytest.raises(ConfigError) as error:
        create_model("caffe", net, SOLVER, source=source)
    message = str(error.value)
    assert message.startswith("net.prototxt:2:") and f"this pycaffe has no {kind} layer" in message
    assert "\n" not in message


# -- what Caffe cannot back-propagate, refused before pycaffe aborts --------------------------------

@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_a_gradient_through_a_bottom_caffe_refuses_is_one_line(backend):
    text = net_text(L("step", "Threshold", ["x"]), {"x": normal(2, 3)}, {}, {"step": 2})
    net, source = parse_net(text, "net.prototxt")
    with pytest.raises(ConfigError) as error:
        create_model(backend, net, SOLVER, source=source)
    assert str(error.value).startswith("net.prototxt:2:") and "takes no gradient to its bottom 'x'" in str(error.value)
    create_model(backend, net, phase=pb.TEST).close()  # a forward pass is fine
    net.layer[1].propagate_down.append(False)
    create_model(backend, net, SOLVER).close()  # and so is training without that diff


def test_lstm_trains_alike_on_both_backends_with_the_state_carried_between_steps():
    """Three SGD steps on sequences that go on from batch to batch (cont all 1): the same losses and weights."""
    text = ('layer { name: "in" type: "Input" top: "seq" top: "cont" top: "label" input_param { shape { dim: 3 '
            'dim: 2 dim: 4 } shape { dim: 3 dim: 2 } shape { dim: 3 dim: 2 } } }\n'
            + L("lstm", "LSTM", ["seq", "cont"], f"recurrent_param {{ num_output: 5 {UNIFORM} }}")
            + L("score", "InnerProduct", ["lstm"], f"inner_product_param {{ num_output: 3 axis: 2 {UNIFORM} }}")
            + L("loss", "SoftmaxWithLoss", ["score", "label"], "softmax_param { axis: 2 }"))
    net = parse_net(text)[0]
    solver = pb.SolverParameter(type="SGD", base_lr=0.5, momentum=0.9, lr_policy="fixed")
    batches = [{"seq": normal(3, 2, 4), "cont": np.ones((3, 2), np.float32),
                "label": RNG.integers(0, 3, (3, 2)).astype(np.float32)} for _ in range(3)]
    results = {}
    for backend in ("caffe", "tensorflow"):
        model = create_model(backend, net, solver, seed=9)
        try:
            results[backend] = [model.step(batch) for batch in batches], model.get_params()
        finally:
            model.close()
    close(results["tensorflow"][0], results["caffe"][0], "losses")
    for got, want in zip(results["tensorflow"][1], results["caffe"][1]):
        close(got, want, "weights after three steps")
