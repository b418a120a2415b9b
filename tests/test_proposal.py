"""The fork's Proposal (brocolli-caffe 9.0.2's proposal_layer.cpp, Faster R-CNN's) on the TensorFlow backend
against the bundled pycaffe: the same rois [item, x1, y1, x2, y2] and scores on fixed-seed inputs (anchors,
deltas, clipping, min_size, pre- and post-NMS top N, the NMS threshold, tied scores), and in a SavedModel."""

import os
import subprocess
import sys

import numpy as np
import pytest

from deepspark import checkpoint, export
from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph, proposal_anchors
from deepspark.proto import deepspark_pb2 as pb
from test_export import SERVE
from test_zoo_layers import caffe  # noqa: F401 (a fixture: pycaffe, or the tests skip)

pytestmark = pytest.mark.caffe

tf = pytest.importorskip("tensorflow")


def net(items, anchors, height, width, body, tops=("rois", "scores")):
    shapes = [(items, 2 * anchors, height, width), (items, 4 * anchors, height, width), (items, 3)]
    dims = " ".join("shape { " + " ".join(f"dim: {d}" for d in shape) + " }" for shape in shapes)
    return (f'layer {{ name: "in" type: "Input" top: "cls" top: "deltas" top: "info" input_param {{ {dims} }} }}\n'
            f'layer {{ name: "proposal" type: "Proposal" bottom: "cls" bottom: "deltas" bottom: "info" '
            + " ".join(f'top: "{t}"' for t in tops) + f" proposal_param {{ {body} }} }}\n")


def inputs(items, anchors, height, width, image, seed, levels=None):
    """Fixed-seed bottoms; with `levels`, the scores take that many values only, so that many tie."""
    rng = np.random.default_rng(seed)
    cls = rng.uniform(0.01, 1.0, (items, 2 * anchors, height, width)).astype(np.float32)
    if levels:
        cls = np.ceil(cls * levels).astype(np.float32) / levels
    deltas = (rng.standard_normal((items, 4 * anchors, height, width)) * 0.4).astype(np.float32)
    info = np.tile(np.array([image[0], image[1], 1.0], np.float32), (items, 1))
    info[1:] = 999  # the fork reads the first item's image size for every item
    return {"cls": cls, "deltas": deltas, "info": info}


def forward(backend, text, fed, tops):
    model = create_model(backend, parse_net(text)[0], phase=pb.TEST)
    try:
        outputs = model.forward(fed)
        return [np.asarray(outputs[top]) for top in tops]
    finally:
        model.close()


CASES = [  # (items, ratios, scales, H, W, image (h, w), proposal_param, boxes under min_size (tied at 0) reach the NMS)
    (2, [0.5, 1, 2], [8, 16, 32], 6, 7, (90, 100), "feat_stride: 16 min_size: 4 pre_nms_topn: 60 post_nms_topn: 20 "
     "nms_thresh: 0.5", False),
    (1, [1], [16, 32], 5, 5, (37, 41), "feat_stride: 8 min_size: 10 pre_nms_topn: 6000 post_nms_topn: 300 "
     "nms_thresh: 0.7", True),
    (3, [0.5, 2], [32], 4, 6, (64, 96), "feat_stride: 16 base_size: 8 min_size: 2 pre_nms_topn: 30 "
     "post_nms_topn: 8 nms_thresh: 0.3", False),
]


@pytest.mark.parametrize("items, ratios, scales, height, width, image, body, ties", CASES)
def test_proposal_as_pycaffe(items, ratios, scales, height, width, image, body, ties):
    anchors = len(ratios) * len(scales)
    body += "".join(f" ratio: {r}" for r in ratios) + "".join(f" scale: {s}" for s in scales)
    text = net(items, anchors, height, width, body)
    fed = inputs(items, anchors, height, width, image, seed=len(body))
    want_rois, want_scores = forward("caffe", text, fed, ["rois", "scores"])
    got_rois, got_scores = forward("tensorflow", text, fed, ["rois", "scores"])
    assert (np.sum(want_scores == 0) > 1) == ties  # tied boxes in the fork's quicksort's order
    assert got_rois.shape == want_rois.shape and len(want_rois) > items
    np.testing.assert_array_equal(got_rois, want_rois)
    np.testing.assert_array_equal(got_scores, want_scores)
    assert set(want_rois[:, 0]) == set(range(items))
    assert np.all(want_rois[:, 3] <= image[1] - 1) and np.all(want_rois[:, 4] <= image[0] - 1)


@pytest.mark.parametrize("levels, body", [
    (3, "feat_stride: 16 min_size: 4 pre_nms_topn: 50 post_nms_topn: 40 nms_thresh: 0.6"),
    (5, "feat_stride: 8 min_size: 12 pre_nms_topn: 6000 post_nms_topn: 300 nms_thresh: 0.7"),
    (2, "feat_stride: 16 min_size: 1 pre_nms_topn: 7 post_nms_topn: 5 nms_thresh: 0.9")])
def test_tied_scores_go_in_the_forks_quicksort_order(levels, body):
    """Scores of a few values only (and 0 under min_size): the order of equal scores decides which boxes
    suppress which and in what order the rows come, and both are pycaffe's."""
    items, anchors, height, width = 2, 4, 5, 6
    text = net(items, anchors, height, width, body + " ratio: 0.5 ratio: 2 scale: 8 scale: 16")
    fed = inputs(items, anchors, height, width, (80, 96), seed=levels, levels=levels)
    want_rois, want_scores = forward("caffe", text, fed, ["rois", "scores"])
    got_rois, got_scores = forward("tensorflow", text, fed, ["rois", "scores"])
    assert len(np.unique(want_scores)) < len(want_scores) - items  # ties among the kept
    np.testing.assert_array_equal(got_rois, want_rois)
    np.testing.assert_array_equal(got_scores, want_scores)


def test_proposal_anchors_are_the_forks():
    """generate_anchors's half sizes 0.5 * round(w * scale / base_size - 1) about the base box's centre 7.5:
    ratio 2 gives w = sqrt(256 / 2) = 11.31, h = 22.63, so at scale 8 halves 0.5 * round(4.66) and
    0.5 * round(10.31)."""
    param = pb.ProposalParameter(base_size=16, ratio=[1, 2], scale=[8, 32])
    np.testing.assert_array_equal(proposal_anchors(param), [[4, 4, 11, 11], [-8, -8, 23, 23],
                                                            [5, 2.5, 10, 12.5], [-3.5, -14.5, 18.5, 29.5]])


@pytest.mark.parametrize("body, message", [
    ("scale: 8", "at least one ratio"),
    ("ratio: 1 scale: 8 scale: 16", "needs scores N x 4"),
])
def test_proposal_refuses_what_the_fork_misreads(body, message):
    with pytest.raises(ConfigError, match=message) as error:
        Graph(parse_net(net(1, 1, 3, 3, body))[0], pb.TEST)
    assert "\n" not in str(error.value)


def test_the_saved_model_of_a_proposal_net_gives_pycaffes_rois_in_plain_tensorflow(tmp_path):
    """Proposal is TensorFlow ops alone: the SavedModel runs in a process without DeepSpark."""
    items, ratios, scales, height, width, image, body, _ = CASES[0]
    anchors = len(ratios) * len(scales)
    body += "".join(f" ratio: {r}" for r in ratios) + "".join(f" scale: {s}" for s in scales)
    prototxt, weights = tmp_path / "deploy.prototxt", str(tmp_path / "none.caffemodel")
    prototxt.write_text(net(items, anchors, height, width, body))
    model = create_model("tensorflow", parse_net(prototxt.read_text())[0], phase=pb.TEST)
    checkpoint.save_caffemodel(weights, model.graph, [])
    model.close()
    export.export(str(prototxt), weights, str(tmp_path / "saved"))
    fed = inputs(items, anchors, height, width, image, seed=3, levels=4)  # ties: the fork's quicksort served
    np.savez(tmp_path / "in.npz", **fed)
    done = subprocess.run([sys.executable, "-c", SERVE, str(tmp_path / "saved"), str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"  # no DeepSpark module in that process
    served = np.load(tmp_path / "out.npz")
    want = forward("caffe", prototxt.read_text(), fed, ["rois", "scores"])
    np.testing.assert_array_equal(served["rois"], want[0])
    np.testing.assert_array_equal(served["scores"], want[1])
