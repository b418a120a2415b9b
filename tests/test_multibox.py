"""MultiBoxLoss, the SSD fork's training loss, on both backends against the bundled pycaffe (brocolli-caffe 9.0.2).

The layer alone: its locations and confidences are Parameter blobs passed through a Power layer (Caffe's
MultiBoxLoss hands its bottom the diff of an inner blob by ShareDiff, which a Parameter layer's own blob would
not see), its priors a PriorBox over fed shapes, its ground truth fed rows over 2 images (one difficult, one
item -1 row); the loss and the locations' and confidences' diffs must agree with pycaffe's within 1e-4 of the
largest, for each matching, encoding, mining, loss and normalization option. Then a tiny SSD train net
(tests/data/ssd_tiny_train.prototxt: two feature maps with their heads, Permute, Flatten, PriorBox, Concat) with
weights pycaffe sets from a RandomState: every weight's diff, 3 SGD steps and `compare --solver` against
pycaffe's, and its test phase (DetectionOutput, then DetectionEvaluate). The shape rule's refusals need no
pycaffe.
"""

import io
import os

import h5py
import numpy as np
import pytest

from conftest import ROOT
from deepspark import compare, graph
from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from test_detection import pycaffe  # noqa: F401 (a fixture)
from test_zoo_layers import L, close, net_text, run

tf = pytest.importorskip("tensorflow")

TINY = os.path.join(ROOT, "tests", "data", "ssd_tiny_train.prototxt")
PRIORS = ("prior_box_param { min_size: 30 max_size: 60 aspect_ratio: 2 flip: true variance: 0.1 variance: 0.1 "
          "variance: 0.2 variance: 0.2 }")
FEATURE = (4, 4)  # 4 x 4 positions, 4 priors each, over a 100 x 100 image
NUM_PRIORS = FEATURE[0] * FEATURE[1] * 4
# [item, label, instance, xmin, ymin, xmax, ymax, difficult]: two boxes on each image, one difficult, and a row
# Caffe skips (item -1)
TRUTH = np.array([[0, 1, 0, 0.1, 0.1, 0.45, 0.5, 0], [0, 2, 0, 0.5, 0.4, 0.9, 0.95, 0],
                  [-1, -1, -1, -1, -1, -1, -1, -1], [1, 1, 0, 0.2, 0.3, 0.7, 0.8, 0],
                  [1, 2, 0, 0.05, 0.6, 0.3, 0.9, 1]], np.float32)


# -- the shape rule (no pycaffe) ------------------------------------------------------------------------------

def loss_net(body="num_classes: 3", extra="", loc=2 * NUM_PRIORS * 4, truth=(1, 1, 5, 8)):
    fed = {"loc": (2, loc), "conf": (2, NUM_PRIORS * 3), "feat": (1, 1) + FEATURE, "data": (1, 3, 100, 100),
           "label": truth}
    tops = " ".join(f'top: "{name}"' for name in fed)
    shapes = " ".join("shape { " + " ".join(f"dim: {d}" for d in shape) + " }" for shape in fed.values())
    return (f'layer {{ name: "in" type: "Input" {tops} input_param {{ {shapes} }} }}\n'
            + L("priors", "PriorBox", ["feat", "data"], PRIORS)
            + L("loss", "MultiBoxLoss", ["loc", "conf", "priors", "label"],
                f"multibox_loss_param {{ {body} }} {extra}"))


def refusal(text):
    with pytest.raises(ConfigError) as caught:
        graph.Graph(parse_net(text)[0], pb.TRAIN).check_backward()
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_its_shape_rule_refuses_what_caffe_aborts_on():
    assert graph.Graph(parse_net(loss_net(loc=NUM_PRIORS * 4))[0], pb.TRAIN).layers[-1].top_shapes == [()]
    assert "needs num_classes" in refusal(loss_net("code_type: CENTER_SIZE"))
    assert "the locations need 256 channels" in refusal(loss_net())
    assert "only with share_location: true" in refusal(loss_net("num_classes: 3 share_location: false",
                                                                loc=NUM_PRIORS * 3 * 4))
    assert "rows of 8 values" in refusal(loss_net(loc=NUM_PRIORS * 4, truth=(1, 1, 5, 7)))
    assert "is not one of its 3 classes" in refusal(loss_net("num_classes: 3 background_label_id: 3",
                                                             loc=NUM_PRIORS * 4))
    assert "contradicts" in refusal(loss_net("num_classes: 3 do_neg_mining: false", loc=NUM_PRIORS * 4))
    forced = "force_backward: true\n" + loss_net(loc=NUM_PRIORS * 4)
    assert "(MultiBoxLoss) takes no gradient to its bottom 'priors'" in refusal(forced)


# -- the layer against pycaffe --------------------------------------------------------------------------------

CASES = [
    ("", ""),  # Caffe's defaults: CORNER codes, PER_PREDICTION, MAX_NEGATIVE, SMOOTH_L1, SOFTMAX, VALID
    ("code_type: CENTER_SIZE match_type: BIPARTITE", ""),
    ("code_type: CENTER_SIZE mining_type: NONE", ""),
    ("code_type: CENTER_SIZE conf_loss_type: LOGISTIC", ""),
    ("code_type: CENTER_SIZE mining_type: NONE conf_loss_type: LOGISTIC share_location: false", ""),
    ("code_type: CENTER_SIZE loc_loss_type: L2 loc_weight: 2 neg_pos_ratio: 1.5 neg_overlap: 0.3 "
     "use_difficult_gt: false overlap_threshold: 0.3", ""),
    ("code_type: CENTER_SIZE mining_type: HARD_EXAMPLE sample_size: 10 nms_param { nms_threshold: 0.5 top_k: 20 }",
     ""),
    ("code_type: CENTER_SIZE nms_param { nms_threshold: 0.3 top_k: 30 } use_prior_for_nms: true", ""),
    ("code_type: CENTER_SIZE nms_param { nms_threshold: 0.3 }", ""),  # top_k unset: 0, no negative mined
    ("code_type: CENTER_SIZE use_prior_for_matching: false share_location: false mining_type: NONE", ""),
    ("code_type: CENTER_SIZE use_prior_for_matching: false", ""),
    ("code_type: CENTER_SIZE encode_variance_in_target: true ignore_cross_boundary_bbox: true", ""),
    ("code_type: CORNER_SIZE bp_inside: true use_prior_for_matching: false", ""),
    ("bp_inside: true", ""),
    ("code_type: CENTER_SIZE map_object_to_agnostic: true", ""),
    ("code_type: CENTER_SIZE", "loss_param { normalization: FULL }"),
    ("code_type: CENTER_SIZE mining_type: NONE", "loss_param { normalization: BATCH_SIZE }"),
    ("code_type: CENTER_SIZE", "loss_param { normalization: NONE }"),
    ("code_type: CENTER_SIZE", "loss_param { normalize: false }"),
    ("code_type: CENTER_SIZE", "propagate_down: false propagate_down: true propagate_down: false "
                               "propagate_down: false"),
]


def layer_case(body, extra, truth=TRUTH):
    """(net text, sources, fed) of MultiBoxLoss over random locations and confidences (a fixed RandomState)."""
    classes = 2 if "agnostic" in body else 3
    loc_classes = 1 if "share_location: false" not in body else classes
    rs = np.random.RandomState(3)
    sources = {"loc0": (rs.randn(2, NUM_PRIORS * loc_classes * 4) * 0.5).astype(np.float32),
               "conf0": rs.randn(2, NUM_PRIORS * classes).astype(np.float32)}
    truth = truth.copy()
    if classes == 2:
        truth[truth[:, 0] >= 0, 1] = 1
    fed = {"feat": np.zeros((1, 1) + FEATURE, np.float32), "data": np.zeros((1, 3, 100, 100), np.float32),
           "label": truth.reshape(1, 1, -1, 8)}
    layers = (L("loc", "Power", ["loc0"]) + L("conf", "Power", ["conf0"]) + L("priors", "PriorBox", ["feat", "data"],
                                                                             PRIORS)
              + L("loss", "MultiBoxLoss", ["loc", "conf", "priors", "label"],
                  f"multibox_loss_param {{ num_classes: {classes} {body} }} {extra}"))
    return net_text(layers, sources, fed, {}), sources, fed


def both(text, sources, fed):
    """{backend: (loss, {source: its diff})}."""
    found = {}
    for backend in ("caffe", "tensorflow"):
        values, loss, diffs, owners = run(backend, text, sources, fed, ["loss"])
        assert values["loss"].item() == pytest.approx(loss, rel=1e-6)
        found[backend] = loss, dict(zip(owners, diffs))
    return found


@pytest.mark.caffe
@pytest.mark.parametrize("body, extra", CASES)
def test_the_loss_and_its_diffs_are_pycaffes(pycaffe, body, extra):
    found = both(*layer_case(body, extra))
    (want, caffe), (got, ours) = found["caffe"], found["tensorflow"]
    close(got, want, "loss")
    for name in ("loc0", "conf0"):
        close(ours[name], caffe[name], f"the diff of {name}")
    assert want > 0 and np.any(caffe["conf0"] != 0)
    assert np.any(caffe["loc0"] != 0) != ("propagate_down: false propagate_down: true" in extra)


@pytest.mark.caffe
@pytest.mark.parametrize("body", ["code_type: CENTER_SIZE", "code_type: CENTER_SIZE mining_type: NONE"])
@pytest.mark.parametrize("items", [[1], []])
def test_images_without_boxes(pycaffe, body, items):
    """An image with no box has no positive, and under mining no negative either (Caffe mines per matched
    image); with no box at all the location loss is 0 and the normalizer 1."""
    truth = TRUTH[np.isin(TRUTH[:, 0], items)] if items else np.full((1, 8), -1, np.float32)
    found = both(*layer_case(body, "", truth))
    (want, caffe), (got, ours) = found["caffe"], found["tensorflow"]
    close(got, want, "loss")
    for name in ("loc0", "conf0"):
        close(ours[name], caffe[name], f"the diff of {name}")
    assert not np.any(caffe["conf0"][0]) == ("mining_type: NONE" not in body)


# -- a tiny SSD train net -------------------------------------------------------------------------------------

SOLVER = pb.SolverParameter(type="SGD", base_lr=0.05, momentum=0.9, weight_decay=0.0005, lr_policy="fixed")


def tiny_net(loss_param=None):
    """The tiny train net, its multibox_loss_param replaced by `loss_param` where given."""
    net = parse_net(open(TINY).read())[0]
    if loss_param:
        net.layer[-1].multibox_loss_param.Clear()
        net.layer[-1].multibox_loss_param.MergeFrom(parse_net(
            f'layer {{ name: "l" type: "MultiBoxLoss" multibox_loss_param {{ {loss_param} }} }}')[0]
            .layer[0].multibox_loss_param)
    return net


@pytest.fixture(scope="module")
def tiny(pycaffe, tmp_path_factory):
    """(pycaffe's weights {layer: arrays}, the batch): He-normal convolutions, the heads' confidences scaled up,
    set by pycaffe from a RandomState; 24 x 24 images and the ground-truth rows over both images."""
    net = pycaffe.Net(TINY, pycaffe.TRAIN)
    rs = np.random.RandomState(11)
    for name, blobs in net.params.items():
        gain = 3.0 if "conf" in name else 1.0
        blobs[0].data[...] = rs.normal(0, gain * (2.0 / np.prod(blobs[0].data.shape[1:])) ** 0.5, blobs[0].data.shape)
        blobs[1].data[...] = rs.normal(0, 0.1, blobs[1].data.shape)
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.caffemodel")
    net.save(path)
    weights = {name: [blob.data.copy() for blob in blobs] for name, blobs in pycaffe.Net(
        TINY, pycaffe.TRAIN, weights=path).params.items()}
    label = np.vstack([TRUTH, [[1, 1, 1, 0.55, 0.05, 0.95, 0.35, 0]]]).reshape(1, 1, 6, 8)
    return weights, {"data": rs.uniform(-1, 1, (2, 3, 24, 24)).astype(np.float32), "label": label}


def tiny_model(backend, weights, loss_param=None):
    model = create_model(backend, tiny_net(loss_param), SOLVER, seed=5)
    for name, arrays in weights.items():
        model.set_blobs(name, arrays)
    return model


@pytest.mark.caffe
@pytest.mark.parametrize("loss_param", [None, "num_classes: 3 code_type: CENTER_SIZE mining_type: NONE "
                                              "conf_loss_type: LOGISTIC loc_loss_type: L2"])
def test_a_tiny_ssd_nets_weight_diffs_are_pycaffes(tiny, loss_param):
    weights, batch = tiny
    found = {}
    for backend in ("caffe", "tensorflow"):
        model = tiny_model(backend, weights, loss_param)
        try:
            found[backend] = model.gradients(batch), [p.layer for p in model.graph.params]
        finally:
            model.close()
    ((want, caffe), owners), ((got, ours), _) = found["caffe"], found["tensorflow"]
    close(got, want, "loss")
    for owner, a, b in zip(owners, ours, caffe):
        close(a, b, f"the diff of a blob of '{owner}'")
    assert all(np.any(diff != 0) for diff in caffe)


@pytest.mark.caffe
def test_three_sgd_steps_of_a_tiny_ssd_net_are_pycaffes(tiny):
    weights, batch = tiny
    found = {}
    for backend in ("caffe", "tensorflow"):
        model = tiny_model(backend, weights)
        try:
            found[backend] = [model.step(batch) for _ in range(3)], model.get_params()
        finally:
            model.close()
    (want, caffe), (got, ours) = found["caffe"], found["tensorflow"]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert want[2] < want[0]  # it learns
    for a, b in zip(ours, caffe):
        close(a, b, "weights after 3 steps")


@pytest.mark.caffe
def test_compare_solver_on_a_tiny_ssd_net_agrees_with_pycaffe(pycaffe, tmp_path):
    """`deepspark compare --solver` on the tiny net fed by an HDF5Data layer (Caffe reads the first G rows of
    its N x 1 x G x 8 label: item 0's holds the batch's boxes, item 1's none): 3 steps within its tolerances."""
    text = open(TINY).read()
    start = text.index('layer { name: "data" type: "Input"')
    end = text.index("\n", text.index("input_param", start)) + 1
    text = (text[:start] + f'layer {{ name: "data" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ '
            f'source: "{tmp_path}/list.txt" batch_size: 2 }} }}\n' + text[end:])
    (tmp_path / "net.prototxt").write_text(text)
    label = np.full((2, 1, len(TRUTH), 8), -1, np.float32)
    label[0, 0] = TRUTH
    with h5py.File(tmp_path / "ssd.h5", "w") as stream:
        stream["data"] = np.random.RandomState(11).uniform(-1, 1, (2, 3, 24, 24)).astype(np.float32)
        stream["label"] = label
    (tmp_path / "list.txt").write_text(f"{tmp_path}/ssd.h5\n")
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path}/net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\n'
                                              'weight_decay: 0.0005\nlr_policy: "fixed"\nmax_iter: 3\n')
    out = io.StringIO()
    result = compare.run(str(tmp_path / "net.prototxt"), solver_path=str(tmp_path / "solver.prototxt"), out=out,
                         iterations=3)
    assert result["ok"], out.getvalue()
    losses = result["training"]["losses"]
    assert losses["caffe"][2] < losses["caffe"][0] and result["training"]["worst_absolute"] < 1e-4


# SSD's test phase on the tiny net: softmax confidences, DetectionOutput, then DetectionEvaluate's rows
TEST_PHASE = '''
layer { name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf" top: "mbox_conf_reshape"
  include { phase: TEST } reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape" top: "mbox_conf_softmax"
  include { phase: TEST } softmax_param { axis: 2 } }
layer { name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax" top: "mbox_conf_flatten"
  include { phase: TEST } flatten_param { axis: 1 } }
layer { name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc" bottom: "mbox_conf_flatten"
  bottom: "mbox_priorbox" top: "detection_out" include { phase: TEST }
  detection_output_param { num_classes: 3 share_location: true background_label_id: 0 code_type: CENTER_SIZE
    nms_param { nms_threshold: 0.45 top_k: 100 } keep_top_k: 50 confidence_threshold: 0.2 } }
layer { name: "detection_eval" type: "DetectionEvaluate" bottom: "detection_out" bottom: "label"
  top: "detection_eval" include { phase: TEST }
  detection_evaluate_param { num_classes: 3 background_label_id: 0 overlap_threshold: 0.3
    evaluate_difficult_gt: false } }
'''


@pytest.mark.caffe
def test_a_tiny_ssd_test_nets_detection_evaluate_rows_are_pycaffes(tiny):
    weights, batch = tiny
    net = parse_net(open(TINY).read() + TEST_PHASE)[0]
    found = {}
    for backend in ("caffe", "tensorflow"):
        model = create_model(backend, net, phase=pb.TEST)
        try:
            for name, arrays in weights.items():
                model.set_blobs(name, arrays)
            found[backend] = model.forward(batch)["detection_eval"]
        finally:
            model.close()
    want = found["caffe"]
    assert want.shape[2] > 20 and set(want[0, 0, 2:, 3]) == {0, 1}  # detections, true and false positives
    np.testing.assert_array_equal(found["tensorflow"][..., [0, 1, 3, 4]], want[..., [0, 1, 3, 4]])
    np.testing.assert_allclose(found["tensorflow"], want, atol=1e-5)
