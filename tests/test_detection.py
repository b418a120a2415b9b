"""The SSD fork's detection layers (Permute, Normalize, PriorBox, DetectionOutput) on both backends against the
bundled pycaffe (brocolli-caffe 9.0.2), and two SSD deploy nets end to end.

The schema and the shape rules need no pycaffe (the fast tier runs them); every comparison with pycaffe is
marked `caffe`. The two vendored nets (tests/data/ssd_*.prototxt) are tiny copies of the shapes of
chuanqi305/MobileNet-SSD's deploy net and of OpenCV's res10_300x300_ssd face detector; their weights are set
by pycaffe from a numpy RandomState (BatchNorm's statistics from the data, so that the features stay alive)
and saved as a .caffemodel that both backends load. PriorBox and DetectionOutput are compared bit for bit:
the TensorFlow backend repeats Caffe's float and double arithmetic, so fed the same inputs it gives the same
rows, NMS decisions included.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from conftest import ROOT
from deepspark import Net, export, graph
from deepspark.backends import create_model
from deepspark.backends.caffe import runtime
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from test_export import SERVE
from test_zoo_layers import L, check_backends, normal, seeded  # noqa: F401 (seeded: a fixture)

tf = pytest.importorskip("tensorflow")

DATA = os.path.join(ROOT, "tests", "data")
NETS = {"mobilenet": os.path.join(DATA, "ssd_mobilenet.prototxt"),
        "res10": os.path.join(DATA, "ssd_res10_face.prototxt")}


@pytest.fixture(scope="module")
def pycaffe():
    try:
        return runtime.caffe()
    except ImportError as error:
        pytest.skip(str(error))


# -- the schema: the fork's messages as its caffe.proto has them --------------------------------------------

FORK_MESSAGES = [
    "LayerParameter", "PermuteParameter", "NormalizeParameter", "PriorBoxParameter", "DetectionOutputParameter",
    "NonMaximumSuppressionParameter", "SaveOutputParameter", "MultiBoxLossParameter", "DetectionEvaluateParameter",
    "AnnotatedDataParameter", "BatchSampler", "Sampler", "SampleConstraint", "NormalizedBBox", "Annotation",
    "AnnotationGroup", "AnnotatedDatum", "LabelMapItem", "LabelMap", "BNParameter", "ReLU6Parameter",
    "HardSigmoidParameter", "UpsampleParameter", "PadParameter", "UnsqueezeParameter",
    "BilinearInterpolateParameter", "MaxUnPoolParameter", "PixelShuffleParameter", "ResizeParameter",
    "InceptionParameter", "InceptionColumnParameter", "ProposalParameter", "PSROIPoolingParameter",
    "VideoDataParameter", "OldResizeParameter", "NoiseParameter", "SaltPepperParameter", "EmitConstraint"]
LATER_BVLC = {"LayerParameter": {"clip_param", "swish_param"}}  # not in the fork: BVLC's later layers


def fields(message):
    """{field: (number, type, label, type name without package, default)} of a DescriptorProto."""
    return {f.name: (f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1],
                     float(np.float32(f.default_value)) if f.type == f.TYPE_FLOAT and f.default_value
                     else f.default_value) for f in message.field}


def test_the_forks_messages_match_its_caffe_proto(caffe_source, tmp_path):
    protoc = shutil.which("protoc")
    assert protoc, "protoc is missing: `make test` installs protobuf-compiler"
    folder = os.path.join(caffe_source, "src", "caffe", "proto")
    subprocess.run([protoc, f"-I{folder}", f"--descriptor_set_out={tmp_path}/caffe.desc",
                    os.path.join(folder, "caffe.proto")], check=True)
    theirs = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "caffe.desc").read_bytes()).file[0]
    ours = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(ours)
    theirs, ours = ({m.name: m for m in f.message_type} for f in (theirs, ours))
    for name in FORK_MESSAGES:
        want, got = fields(theirs[name]), fields(ours[name])
        for field in LATER_BVLC.get(name, ()):
            got.pop(field)
        assert got == want, name
        enums = [{e.name: [(v.name, v.number) for v in e.value] for e in m.enum_type}
                 for m in (theirs[name], ours[name])]
        assert enums[0] == enums[1], name


# -- shape rules (no pycaffe) -------------------------------------------------------------------------------

def shapes(text):
    """{top: shape} and {layer: its blob shapes} of a TEST net."""
    built = graph.Graph(parse_net(text)[0], pb.TEST)
    return ({top: shape for layer in built.layers for top, shape in zip(layer.tops, layer.top_shapes)},
            {layer.name: layer.param_shapes for layer in built.layers})


def inputs(**blobs):
    tops = " ".join(f'top: "{name}"' for name in blobs)
    dims = " ".join("shape { " + " ".join(f"dim: {d}" for d in shape) + " }" for shape in blobs.values())
    return f'layer {{ name: "in" type: "Input" {tops} input_param {{ {dims} }} }}\n'


def error_of(text):
    with pytest.raises(ConfigError) as caught:
        shapes(text)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_permute_puts_the_axes_in_order_the_rest_after():
    tops, _ = shapes(inputs(x=(2, 3, 4, 5)) + L("p", "Permute", ["x"], "permute_param { order: 0 order: 2 order: 3 "
                                                                   "order: 1 }") +
                     L("q", "Permute", ["x"], "permute_param { order: 3 order: 1 }") + L("r", "Permute", ["x"]))
    assert (tops["p"], tops["q"], tops["r"]) == ((2, 4, 5, 3), (5, 3, 2, 4), (2, 3, 4, 5))
    assert "order 1 is given twice" in error_of(inputs(x=(2, 3)) + L("p", "Permute", ["x"], "permute_param { order: 1 "
                                                                                           "order: 1 }"))
    assert "order 4 is not an axis" in error_of(inputs(x=(2, 3, 4, 5)) + L("p", "Permute", ["x"],
                                                                            "permute_param { order: 4 }"))


def test_normalize_has_one_scale_or_one_per_channel():
    _, blobs = shapes(inputs(x=(2, 3, 4, 5)) + L("a", "Normalize", ["x"]) +
                      L("b", "Normalize", ["x"], "norm_param { channel_shared: false }"))
    assert blobs["a"] == [()] and blobs["b"] == [(3,)]
    assert graph.spec("Normalize").fillers(parse_net(L("n", "Normalize", ["x"]))[0].layer[0])[0].value == 1.0
    assert "at least 2 axes" in error_of(inputs(x=(6,)) + L("n", "Normalize", ["x"]))


def test_prior_box_counts_its_priors_and_refuses_what_caffe_aborts_on():
    body = "prior_box_param { min_size: 8 max_size: 16 aspect_ratio: 2 aspect_ratio: 0.5 aspect_ratio: 3 }"
    tops, _ = shapes(inputs(f=(1, 4, 5, 6), data=(1, 3, 40, 48)) + L("p", "PriorBox", ["f", "data"], body))
    assert tops["p"] == (1, 2, 5 * 6 * (5 + 1) * 4)  # ratios 1, 2, 1/2, 3, 1/3 (0.5 is 2 flipped), and the max
    given = inputs(f=(1, 4, 5, 6)) + L("p", "PriorBox", ["f"], "prior_box_param { min_size: 8 img_size: 40 }")
    assert shapes(given)[0]["p"] == (1, 2, 120)
    for body, message in [("", "needs min_size"), ("min_size: 8 max_size: 4", "greater than its min_size"),
                          ("min_size: 8 variance: 0.1 variance: 0.2", "1 or 4 variances"),
                          ("min_size: 8 img_size: 9 img_h: 9 img_w: 9", "img_size or img_h/img_w"),
                          ("min_size: 8 step: 8 step_h: 8 step_w: 8", "step or step_h/step_w")]:
        text = inputs(f=(1, 4, 5, 6), data=(1, 3, 40, 48)) + L("p", "PriorBox", ["f", "data"],
                                                               f"prior_box_param {{ {body} }}")
        assert message in error_of(text), body
    assert "second bottom" in error_of(inputs(f=(1, 4, 5, 6)) + L("p", "PriorBox", ["f"],
                                                                  "prior_box_param { min_size: 8 }"))


def test_detection_output_checks_its_inputs_against_the_priors():
    blobs = inputs(loc=(2, 40), conf=(2, 30), priors=(1, 2, 40))
    body = "detection_output_param { num_classes: 3 }"
    tops, _ = shapes(blobs + L("d", "DetectionOutput", ["loc", "conf", "priors"], body))
    assert tops["d"] == (1, 1, 1, 7)  # Caffe's shape before its first forward: the rows are the data's
    assert "need 120 channels" in error_of(blobs + L("d", "DetectionOutput", ["loc", "conf", "priors"],
                                                     "detection_output_param { num_classes: 3 share_location: false }"))
    assert "need 20 channels" in error_of(blobs + L("d", "DetectionOutput", ["loc", "conf", "priors"],
                                                    "detection_output_param { num_classes: 2 }"))
    assert "needs num_classes" in error_of(blobs + L("d", "DetectionOutput", ["loc", "conf", "priors"]))
    assert "Caffe aborts" in error_of(blobs + L("d", "DetectionOutput", ["loc", "conf", "priors"],
                                                "detection_output_param { num_classes: 3 background_label_id: -1 }"))
    assert "eta" in error_of(blobs + L("d", "DetectionOutput", ["loc", "conf", "priors"],
                                       "detection_output_param { num_classes: 3 nms_param { eta: 1.5 } }"))


def test_a_net_that_needs_a_diff_through_detection_output_is_refused():
    text = ("force_backward: true\n" + inputs(loc=(2, 40), conf=(2, 30), priors=(1, 2, 40))
            + L("d", "DetectionOutput", ["loc", "conf", "priors"], "detection_output_param { num_classes: 3 }"))
    with pytest.raises(ConfigError) as caught:
        graph.Graph(parse_net(text)[0], pb.TRAIN).check_backward()
    assert "(DetectionOutput) takes no gradient" in str(caught.value) and "\n" not in str(caught.value)


# -- each layer against pycaffe ------------------------------------------------------------------------------

def outputs(backend, text, fed):
    """The outputs of one TEST forward pass of `text` on `backend`, fed `fed`."""
    model = create_model(backend, parse_net(text)[0], phase=pb.TEST, seed=5)
    try:
        return model.forward(fed)
    finally:
        model.close()


def same_on_both(text, fed):
    """The outputs of both backends, asserted equal bit for bit (and shape); Caffe's."""
    want, got = outputs("caffe", text, fed), outputs("tensorflow", text, fed)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    return want


# A pooling of one pixel: the identity, which hands the TensorFlow backend's next layer an NHWC blob.
NHWC = L("pool", "Pooling", ["x"], "pooling_param { pool: MAX kernel_size: 1 }")


@pytest.mark.caffe
@pytest.mark.parametrize("order, nhwc", [((0, 2, 3, 1), False), ((0, 2, 3, 1), True), ((0, 3, 1, 2), True),
                                         ((3, 1), False), ((2,), True)])
def test_permute(pycaffe, order, nhwc):
    x = normal(2, 3, 4, 5)
    body = "permute_param { " + " ".join(f"order: {o}" for o in order) + " }"
    layers = (NHWC if nhwc else "") + L("perm", "Permute", ["pool" if nhwc else "x"], body)
    values, _ = check_backends(layers, {"x": x}, ranks={"perm": 4})
    full = list(order) + [a for a in range(4) if a not in order]
    np.testing.assert_array_equal(values["perm"], np.transpose(x, full))


@pytest.mark.caffe
@pytest.mark.parametrize("body, shape, nhwc", [
    ("", (2, 3, 4, 5), False),
    ("norm_param { across_spatial: false }", (2, 3, 4, 5), False),
    ('norm_param { across_spatial: false channel_shared: false scale_filler { type: "constant" value: 20 } }',
     (2, 3, 4, 5), False),
    ('norm_param { channel_shared: false scale_filler { type: "constant" value: 2.5 } eps: 0.01 }', (2, 3, 4, 5),
     False),
    ('norm_param { across_spatial: false channel_shared: false scale_filler { type: "constant" value: 3 } }',
     (2, 3, 4, 5), True),
    ("norm_param { across_spatial: false }", (3, 6), False),
])
def test_normalize_forward_and_gradient(pycaffe, body, shape, nhwc):
    """The top, the input's diff and the scale's diff (both backends from the same constant scale)."""
    x = normal(*shape)
    layers = (NHWC if nhwc else "") + L("norm", "Normalize", ["pool" if nhwc else "x"], body)
    values, diffs = check_backends(layers, {"x": x}, ranks={"norm": len(shape)})
    assert np.any(diffs["norm"][0]) and np.any(diffs["x"][0])
    if "across_spatial: false" not in body:
        scale = float(body.split("value: ")[1].split()[0]) if "value" in body else 1.0
        eps = 0.01 if "eps" in body else 1e-10
        norm = np.sqrt((x.astype(np.float64) ** 2).sum(axis=tuple(range(1, len(shape))), keepdims=True) + eps)
        np.testing.assert_allclose(values["norm"], scale * x / norm, rtol=1e-5)


PRIOR_BOXES = [
    ("plain", ["f", "data"], "min_size: 8 max_size: 16 aspect_ratio: 2 aspect_ratio: 3 clip: false "
     "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2"),
    ("truncated", ["f", "data"], "min_size: 7.5 aspect_ratio: 2 flip: false variance: 0.1"),
    ("sized", ["f"], "img_size: 50 step: 9 offset: 0.3 min_size: 10 min_size: 20 max_size: 14 max_size: 30 "
     "aspect_ratio: 1.5"),
    ("rectangular", ["f"], "img_h: 40 img_w: 60 step_h: 7 step_w: 11 aspect_ratio: 0.5 aspect_ratio: 2 "
     "min_size: 12 clip: true"),
    ("odd_image", ["g", "odd"], "min_size: 8 clip: true"),
]


@pytest.mark.caffe
def test_prior_box_is_caffes_bit_for_bit(pycaffe):
    """Every variant of PriorBox's parameters: flip, duplicate ratios, clip, one or four variances, the image
    from a bottom or img_size / img_h and img_w, step or step_h and step_w, offset, min_size truncated."""
    fed = {"f": normal(1, 4, 5, 6), "data": normal(1, 3, 40, 48), "g": normal(2, 2, 7, 3), "odd": normal(2, 3, 37, 53)}
    text = inputs(**{name: value.shape for name, value in fed.items()}) + "".join(
        L(name, "PriorBox", bottoms, f"prior_box_param {{ {body} }}") for name, bottoms, body in PRIOR_BOXES)
    text += L("quiet", "Silence", ["f", "data", "g", "odd"], tops=[])
    want = same_on_both(text, fed)
    assert want["plain"].shape == (1, 2, 5 * 6 * 6 * 4)
    assert np.all(want["odd_image"][0, 0] >= 0) and np.all(want["odd_image"][0, 0] <= 1)
    assert want["truncated"][0, 0, 2] - want["truncated"][0, 0, 0] == pytest.approx(7 / 48, rel=1e-6)  # int(7.5)


@pytest.mark.caffe
def test_prior_box_gives_its_bottoms_no_diff(pycaffe):
    """Caffe's PriorBox Backward does nothing: the feature map's diff is the ReLU's beside it alone."""
    f, image = normal(2, 3, 4, 5), normal(2, 3, 16, 20)
    layers = L("p", "PriorBox", ["f", "image"], "prior_box_param { min_size: 4 aspect_ratio: 2 }") + L("r", "ReLU",
                                                                                                     ["f"])
    _, diffs = check_backends(layers, {"f": f, "image": image}, ranks={"p": 3, "r": 4})
    assert not np.any(diffs["image"][0])
    np.testing.assert_array_equal(diffs["f"][0] == 0, f <= 0)


def detection_inputs(items=2, priors=60, classes=4):
    """Locations (shared, and per class), softmax confidences and priors with 4 variances, random but fixed."""
    rng = np.random.default_rng(43)
    centre, size = rng.uniform(0.1, 0.9, (priors, 2)), rng.uniform(0.05, 0.5, (priors, 2))
    boxes = np.concatenate([centre - size / 2, centre + size / 2], axis=1).reshape(-1)
    variances = np.tile([0.1, 0.1, 0.2, 0.2], priors)
    logits = rng.normal(0, 2, (items, priors, classes))
    scores = np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)
    f32 = np.float32
    return {"loc": rng.normal(0, 0.5, (items, priors * 4)).astype(f32),
            "loc_c": rng.normal(0, 0.5, (items, priors * classes * 4)).astype(f32),
            "conf": scores.reshape(items, -1).astype(f32),
            "priors": np.stack([boxes, variances])[None].astype(f32),
            "image": rng.normal(0, 1, (items, 3, 8, 8)).astype(f32)}


NMS = "nms_param { nms_threshold: 0.45 top_k: 20 }"
DETECTIONS = [
    ("base", "", f"{NMS} code_type: CENTER_SIZE keep_top_k: 25 confidence_threshold: 0.3"),
    ("every_kept", "", "nms_param { nms_threshold: 0.3 } code_type: CENTER_SIZE confidence_threshold: 0.2"),
    ("per_class", "_c", f"share_location: false {NMS} code_type: CENTER_SIZE confidence_threshold: 0.25"),
    ("corner", "", f"{NMS} keep_top_k: 10 confidence_threshold: 0.3"),
    ("corner_size", "", f"{NMS} code_type: CORNER_SIZE variance_encoded_in_target: true confidence_threshold: 0.3"),
    ("encoded", "", f"{NMS} code_type: CENTER_SIZE variance_encoded_in_target: true confidence_threshold: 0.3"),
    ("without_nms", "", "code_type: CENTER_SIZE keep_top_k: 30 confidence_threshold: 0.9"),
    ("without_nms_all", "", "code_type: CENTER_SIZE"),
    ("adaptive", "", "nms_param { nms_threshold: 0.7 eta: 0.8 } code_type: CENTER_SIZE confidence_threshold: 0.2"),
    ("no_background", "_c", f"share_location: false background_label_id: -1 {NMS} code_type: CORNER_SIZE "
     "confidence_threshold: 0.3"),
    ("middle_background", "", f"background_label_id: 2 {NMS} code_type: CENTER_SIZE confidence_threshold: 0.3"),
    ("none_found", "", f"{NMS} code_type: CENTER_SIZE confidence_threshold: 0.9999"),
    ("none_kept", "", f"{NMS} code_type: CENTER_SIZE keep_top_k: 0 confidence_threshold: 0.3"),
    ("with_image", "", f"{NMS} code_type: CENTER_SIZE keep_top_k: 25 confidence_threshold: 0.3"),
]


@pytest.mark.caffe
@pytest.mark.parametrize("pairwise", [True, False])
def test_detection_output_is_caffes_bit_for_bit(pycaffe, monkeypatch, pairwise):
    """Fed the same locations, confidences and priors, both backends give the same rows: decoding (CORNER,
    CENTER_SIZE, CORNER_SIZE, variance in the target or not), the confidence threshold, top_k, NMS (adaptive
    eta too), keep_top_k, shared or per-class locations, the background label anywhere or none, no NMS at
    all, and Caffe's rows when nothing is detected. NMS both ways: every pair at once, and one by one."""
    from deepspark.backends.tensorflow.layers import detection  # deferred: it imports TensorFlow

    if not pairwise:
        monkeypatch.setattr(detection, "PAIRWISE", 0)
    fed = detection_inputs()
    text = inputs(**{name: value.shape for name, value in fed.items()})
    for name, loc, body in DETECTIONS:
        bottoms = ["loc" + loc, "conf", "priors"] + (["image"] if name == "with_image" else [])
        text += L(name, "DetectionOutput", bottoms, f"detection_output_param {{ num_classes: 4 {body} }}")
    text += L("quiet", "Silence", ["loc", "loc_c", "conf", "priors", "image"], tops=[])
    want = same_on_both(text, fed)
    rows = {name: want[name][0, 0] for name, _, _ in DETECTIONS}
    assert len(rows["base"]) == 50 and len(rows["corner"]) == 20  # keep_top_k 25 and 10 for each of 2 items
    assert len(rows["every_kept"]) > len(rows["base"]) and len(rows["without_nms_all"]) == 2 * 60 * 3
    np.testing.assert_array_equal(rows["none_found"], [[0] + [-1] * 6, [1] + [-1] * 6])
    np.testing.assert_array_equal(rows["none_kept"], rows["none_found"])
    assert set(rows["no_background"][:, 1]) == {0, 1, 2, 3} and 2 not in rows["middle_background"][:, 1]
    np.testing.assert_array_equal(rows["with_image"], rows["base"])
    for name, detections in rows.items():  # by item, then label, then best first within a label
        if name in ("none_found", "none_kept"):
            continue
        key = [tuple(row[:2]) for row in detections]
        assert key == sorted(key), name
        if name != "without_nms_all":
            for item, label in set(key):
                scores = detections[(detections[:, 0] == item) & (detections[:, 1] == label), 2]
                assert np.all(np.diff(scores) <= 0), name


# -- two SSD deploy nets end to end -------------------------------------------------------------------------

def make_weights(caffe, prototxt, path):
    """Weights for `prototxt`, set by pycaffe from a RandomState and saved to `path`: He-normal convolutions
    (the heads' scaled so that some confidences pass the threshold), BatchNorm's statistics those of its input
    on the fixed images (so the features neither die nor blow up), Scale and Normalize random; and the images."""
    net = caffe.Net(prototxt, caffe.TEST)
    rs = np.random.RandomState(7)
    images = (rs.uniform(0, 255, net.blobs["data"].data.shape) - 128).astype(np.float32)
    net.blobs["data"].data[...] = images
    names = list(net._layer_names)
    for position, (name, layer) in enumerate(zip(names, net.layers)):
        if name not in net.params:
            continue
        blobs = [blob.data for blob in net.params[name]]
        if layer.type == "BatchNorm":
            net.forward(end=names[position - 1])
            features = net.blobs[net.bottom_names[name][0]].data
            blobs[0][...], blobs[1][...], blobs[2][...] = features.mean((0, 2, 3)), features.var((0, 2, 3)), 1
        elif layer.type == "Scale":
            blobs[0][...], blobs[1][...] = rs.uniform(0.5, 1.5, blobs[0].shape), rs.normal(0.2, 0.3, blobs[1].shape)
        elif layer.type == "Normalize":
            blobs[0][...] = rs.uniform(2, 6, blobs[0].shape)
        else:
            gain = 1.5 if "conf" in name else 0.5 if "loc" in name else 1.0
            blobs[0][...] = rs.normal(0, gain * (2.0 / np.prod(blobs[0].shape[1:])) ** 0.5, blobs[0].shape)
            if len(blobs) > 1:
                blobs[1][...] = rs.normal(0, 0.1, blobs[1].shape)
    net.save(path)
    return images


@pytest.fixture(scope="module")
def ssd_nets(pycaffe, tmp_path_factory):
    """{net: (prototxt, caffemodel, images, pycaffe's detections)}."""
    folder = tmp_path_factory.mktemp("ssd")
    made = {}
    for name, prototxt in NETS.items():
        weights = str(folder / f"{name}.caffemodel")
        images = make_weights(pycaffe, prototxt, weights)
        reference = pycaffe.Net(prototxt, pycaffe.TEST, weights=weights)
        reference.blobs["data"].data[...] = images
        made[name] = (prototxt, weights, images, reference.forward()["detection_out"].copy())
    return made


def close_detections(got, want):
    """The same detections, item and label exactly, scores and boxes within 2e-5: the convolutions before
    them differ in the last bits, so two scores of a label within 1e-6 may come in either order."""
    assert got.shape == want.shape
    got, want = (rows[np.lexsort((-rows[:, 2], rows[:, 1], rows[:, 0]))] for rows in (got[0, 0], want[0, 0]))
    np.testing.assert_array_equal(got[:, :2], want[:, :2])
    np.testing.assert_allclose(got[:, 2:], want[:, 2:], rtol=0, atol=2e-5)


@pytest.mark.caffe
@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_an_ssd_deploy_net_gives_pycaffes_detections(ssd_nets, name, backend):
    prototxt, weights, images, want = ssd_nets[name]
    rows = want[0, 0]
    assert rows.shape[0] > 20 and np.all(rows[:, 1] >= 1)  # real detections, above the threshold
    assert set(rows[:, 0]) == set(range(len(images)))
    net = Net(prototxt, weights, backend=backend)
    try:
        got = net.forward(data=images)["detection_out"]
    finally:
        net.close()
    if backend == "caffe":
        np.testing.assert_array_equal(got, want)
    else:
        close_detections(got, want)


@pytest.mark.caffe
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_save_output_param_is_left_alone(pycaffe, tmp_path, backend):
    """This fork's DetectionOutput saves nothing (that code is commented out), yet its Caffe would empty
    output_directory and abort on a missing label map: both backends run the net, and the folder keeps its
    files."""
    kept = tmp_path / "results" / "keep.txt"
    kept.parent.mkdir()
    kept.write_text("mine")
    fed = detection_inputs()
    save = (f'save_output_param {{ output_directory: "{kept.parent}" output_name_prefix: "comp4_" '
            f'output_format: "VOC" label_map_file: "{tmp_path}/missing_labelmap.prototxt" '
            f'name_size_file: "{tmp_path}/missing_sizes.txt" }}')
    text = (inputs(loc=fed["loc"].shape, conf=fed["conf"].shape, priors=fed["priors"].shape)
            + L("d", "DetectionOutput", ["loc", "conf", "priors"], f"detection_output_param {{ num_classes: 4 {NMS} "
                f"code_type: CENTER_SIZE confidence_threshold: 0.3 visualize: true {save} }}"))
    (tmp_path / "net.prototxt").write_text(text)
    net = Net(str(tmp_path / "net.prototxt"), backend=backend)
    try:
        rows = net.forward(loc=fed["loc"], conf=fed["conf"], priors=fed["priors"])["d"]
    finally:
        net.close()
    assert rows.shape[2] > 2 and kept.read_text() == "mine"


@pytest.mark.caffe
def test_the_saved_model_of_an_ssd_net_gives_pycaffes_detections_in_plain_tensorflow(ssd_nets, tmp_path):
    """DetectionOutput is TensorFlow ops alone: the SavedModel runs in a process without DeepSpark."""
    arguments = []
    for name, (prototxt, weights, images, _) in sorted(ssd_nets.items()):
        export.export(prototxt, weights, str(tmp_path / name))
        np.savez(tmp_path / f"{name}_in.npz", data=images)
        arguments += [str(tmp_path / name), str(tmp_path / f"{name}_in.npz"), str(tmp_path / f"{name}_out.npz")]
    done = subprocess.run([sys.executable, "-c", SERVE, *arguments], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"  # no DeepSpark module in that process
    for name, (_, _, _, want) in ssd_nets.items():
        close_detections(np.load(tmp_path / f"{name}_out.npz")["detection_out"], want)
