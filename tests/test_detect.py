"""deepspark.detections, Detector and `deepspark detect`: an SSD deploy net's DetectionOutput rows as boxes in
pixels, scores and classes per image, against pycaffe's own preprocessing and forward pass; DetectionEvaluate on
both backends and mean_average_precision against pycaffe's layer and its solver's mAP.

The net is the vendored MobileNet-SSD-shaped one (tests/data/ssd_mobilenet.prototxt, batch 2, 64 x 64 input)
with the weights test_detection's make_weights sets by pycaffe from a RandomState; the images are three PNGs of
seeded noise of three sizes (so that the last batch is padded). The rows-to-boxes helper needs no pycaffe.
"""

import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, run_cli
from deepspark import Detector, detections, graph
from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.detect import AP_VERSIONS, mean_average_precision, read_image
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from test_detection import NETS, make_weights, pycaffe  # noqa: F401 (pycaffe: a fixture)

MEAN, SCALE = [127.5, 127.5, 127.5], 0.007843  # MobileNet-SSD's preprocessing


def test_detections_scales_each_images_rows_and_drops_caffes_empty_row():
    rows = np.array([[0, 1, 0.9, 0.1, 0.2, 0.5, 0.6], [0, 3, 0.4, -0.1, 0.0, 0.3, 1.2],
                     [2, 2, 0.7, 0.5, 0.5, 1.0, 1.0]], np.float32).reshape(1, 1, 3, 7)
    first, second, third = detections(rows, [100, 50, 10], [200, 40, 20])
    np.testing.assert_allclose(first.boxes, [[10, 40, 50, 120], [-10, 0, 30, 240]], rtol=1e-6)
    np.testing.assert_allclose(first.scores, [0.9, 0.4])
    assert first.classes.tolist() == [1, 3] and first.classes.dtype.kind == "i"
    assert len(second.boxes) == 0 and second.boxes.shape == (0, 4)
    np.testing.assert_allclose(third.boxes, [[5, 10, 10, 20]])
    assert len(detections(rows, 100, 100, images=4)) == 4
    none = np.array([[0, -1, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1]], np.float32)  # Caffe's "none"
    assert [len(found.scores) for found in detections(none, 64, 64, images=2)] == [0, 0]


@pytest.fixture(scope="module")
def ssd(pycaffe, tmp_path_factory):
    """(prototxt, caffemodel, image paths, pycaffe's Detections per image)."""
    caffe = pycaffe
    folder = tmp_path_factory.mktemp("detect")
    prototxt, weights = NETS["mobilenet"], str(folder / "mobilenet.caffemodel")
    make_weights(caffe, prototxt, weights)
    rs = np.random.RandomState(5)
    paths = []
    for i, (height, width) in enumerate([(80, 120), (96, 64), (64, 64)]):
        paths.append(str(folder / f"image{i}.png"))
        Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8)).save(paths[-1])
    net = caffe.Net(prototxt, caffe.TEST, weights=weights)
    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_mean("data", np.array(MEAN))
    transformer.set_input_scale("data", SCALE)
    transformer.set_raw_scale("data", 255)
    transformer.set_channel_swap("data", (2, 1, 0))
    want = []
    for start in (0, 2):
        images = [caffe.io.load_image(path) for path in paths[start:start + 2]]
        net.blobs["data"].data[:len(images)] = [transformer.preprocess("data", image) for image in images]
        net.blobs["data"].data[len(images):] = 0
        rows = net.forward()["detection_out"].copy()
        want += detections(rows, [image.shape[1] for image in images], [image.shape[0] for image in images],
                           images=len(images))
    assert all(len(found.scores) > 3 for found in want)  # real detections in every image
    return prototxt, weights, paths, want


def same(got, want, exact):
    """The same detections per image: bit for bit (exact), or each one of ours paired with pycaffe's of its class
    nearest in box and score (two scores within 1e-6 may come in either order), within 2e-5 of the score and
    2e-5 of the image size."""
    assert len(got) == len(want)
    for mine, theirs, size in zip(got, want, [120, 96, 64]):
        if exact:
            for a, b in zip(mine, theirs):
                np.testing.assert_array_equal(a, b)
            continue
        assert sorted(mine.classes.tolist()) == sorted(theirs.classes.tolist())
        for box, score, label in zip(*mine):
            gap = np.max(np.abs(theirs.boxes - box), axis=1) / size + np.abs(theirs.scores - score)
            gap[theirs.classes != label] = np.inf
            nearest = int(np.argmin(gap))
            np.testing.assert_allclose(score, theirs.scores[nearest], atol=2e-5)
            np.testing.assert_allclose(box, theirs.boxes[nearest], atol=2e-5 * size)


@pytest.mark.caffe
@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_detector_gives_pycaffes_boxes_in_pixels(ssd, backend):
    prototxt, weights, paths, want = ssd
    detector = Detector(prototxt, weights, mean=MEAN, input_scale=SCALE, raw_scale=255, channel_swap=(2, 1, 0),
                        backend=backend)
    try:
        got = detector.detect([read_image(path) for path in paths])
    finally:
        detector.close()
    same(got, want, exact=backend == "caffe")


@pytest.mark.caffe
def test_the_detect_verb_prints_a_line_per_box(ssd):
    prototxt, weights, paths, want = ssd
    status, out, err = run_cli("detect", "--model", prototxt, "--weights", weights, "--mean-value",
                               "127.5,127.5,127.5", "--input-scale", str(SCALE), "--threshold", "0.3", "--backend",
                               "caffe", *paths)
    assert status == 0, err
    lines = [line.split("\t") for line in out.splitlines()]
    assert all(len(line) == 7 for line in lines)
    for path, found in zip(paths, want):
        mine = [line for line in lines if line[0] == path]
        kept = found.scores >= 0.3
        assert [int(line[1]) for line in mine] == found.classes[kept].tolist()
        np.testing.assert_allclose([float(line[2]) for line in mine], found.scores[kept], atol=1e-6)
        np.testing.assert_allclose([[float(v) for v in line[3:]] for line in mine], found.boxes[kept], atol=0.006)


def test_the_detect_verb_refuses_in_one_line(tmp_path):
    missing = str(tmp_path / "missing.png")
    status, _, err = run_cli("detect", "--model", NETS["mobilenet"], "--weights", missing, missing)
    assert status == 1 and len(err.strip().splitlines()) == 1 and "missing.png" in err
    status, _, err = run_cli("detect", "--model", NETS["mobilenet"], "--weights", missing, "--mean-value", "1,x",
                             missing)
    assert status == 2 and "comma-separated numbers" in err


# -- DetectionEvaluate and the solver's mAP ---------------------------------------------------------------------

# Ground truth of 3 images (one difficult box; rows after the first item -1 row are not read, as Caffe's) and
# detections near them or anywhere, with DetectionOutput's "none" row for a fourth image and an item -1 row.
TRUTH = np.array([[0, 1, 0, 0.1, 0.1, 0.4, 0.5, 0], [0, 1, 1, 0.5, 0.5, 0.9, 0.9, 1], [0, 2, 0, 0.2, 0.6, 0.5, 0.9, 0],
                  [1, 2, 0, 0.3, 0.3, 0.7, 0.7, 0], [2, 3, 0, 0.1, 0.1, 0.3, 0.3, 0], [-1] * 8,
                  [1, 1, 0, 0, 0, 1, 1, 0]], np.float32)


def evaluated_detections():
    rs = np.random.RandomState(1)
    rows = []
    for item in range(3):
        for label in (1, 2, 3):
            for k in range(3):
                boxes = TRUTH[(TRUTH[:, 0] == item) & (TRUTH[:, 1] == label)]
                box = (boxes[0, 3:7] + rs.uniform(-0.1, 0.1, 4) if len(boxes) and k < 2
                       else rs.uniform(0, 0.5, 4) + [0, 0, 0.4, 0.4])
                rows.append([item, label, rs.uniform(), *box])
    rows += [[3, -1, -1, -1, -1, -1, -1], [-1, 0, 0, 0, 0, 0, 0]]
    return np.array(rows, np.float32).reshape(1, 1, -1, 7)


def evaluate(backend, body):
    fed = {"det": evaluated_detections(), "gt": TRUTH.reshape(1, 1, -1, 8)}
    text = (L_INPUT.format(dims=" ".join("shape { " + " ".join(f"dim: {d}" for d in v.shape) + " }"
                                         for v in fed.values()))
            + f'layer {{ name: "ev" type: "DetectionEvaluate" bottom: "det" bottom: "gt" top: "ev" '
              f'detection_evaluate_param {{ num_classes: 4 {body} }} }}\n')
    model = create_model(backend, parse_net(text)[0], phase=pb.TEST)
    try:
        return model.forward(fed)["ev"]
    finally:
        model.close()


L_INPUT = 'layer {{ name: "in" type: "Input" top: "det" top: "gt" input_param {{ {dims} }} }}\n'


@pytest.mark.caffe
@pytest.mark.parametrize("body", ["", "evaluate_difficult_gt: false overlap_threshold: 0.3",
                                  "overlap_threshold: 0.05"])
def test_detection_evaluate_is_pycaffes_bit_for_bit(pycaffe, body):
    want = evaluate("caffe", body)
    np.testing.assert_array_equal(evaluate("tensorflow", body), want)
    rows = want[0, 0]
    assert rows.shape == (3 + 29, 5) and set(rows[3:30, 3]) == {0, 1}  # true and false positives both


@pytest.mark.caffe
def test_mean_average_precision_is_the_fork_solvers(pycaffe, tmp_path):
    """pycaffe's solver with eval_type "detection" (2 test iterations over an HDF5 of the same rows) logs the
    mAP of each ap_version; mean_average_precision of the TensorFlow backend's rows gives the same."""
    rows = evaluate("tensorflow", "")
    with h5py.File(tmp_path / "ev.h5", "w") as stream:
        stream["det"], stream["gt"] = evaluated_detections(), TRUTH.reshape(1, 1, -1, 8)
    (tmp_path / "list.txt").write_text(f"{tmp_path}/ev.h5\n")
    (tmp_path / "net.prototxt").write_text(
        f'layer {{ name: "in" type: "HDF5Data" top: "det" top: "gt" hdf5_data_param {{ source: "{tmp_path}/list.txt" '
        'batch_size: 1 } }\nlayer { name: "ev" type: "DetectionEvaluate" bottom: "det" bottom: "gt" top: "ev" '
        'include { phase: TEST } detection_evaluate_param { num_classes: 4 } }\n')
    script = ("import sys\nfrom deepspark.backends.caffe import runtime\n"
              "runtime.caffe().get_solver(sys.argv[1]).step(1)\n")
    for version in AP_VERSIONS:
        solver = tmp_path / f"{version}.prototxt"
        solver.write_text(f'net: "{tmp_path}/net.prototxt"\ntest_iter: 2\ntest_interval: 100\n'
                          f'test_initialization: true\nbase_lr: 0.1\nlr_policy: "fixed"\neval_type: "detection"\n'
                          f'ap_version: "{version}"\nmax_iter: 1\n')
        done = subprocess.run([sys.executable, "-c", script, str(solver)], capture_output=True, text=True,
                              env={**os.environ, "GLOG_logtostderr": "1", "GLOG_minloglevel": "0",
                                   "PYTHONPATH": ROOT}, timeout=300)
        logged = re.search(r"Test net output #0: ev = ([0-9.e+-]+)", done.stderr)
        assert logged, done.stderr[-2000:]
        got, per_class = mean_average_precision([rows, rows], version)
        assert got == pytest.approx(float(logged.group(1)), abs=1e-6), version
        assert 0 < got < 1 and len(per_class) == 3


def test_detection_evaluate_refuses_what_it_cannot_run():
    text = (L_INPUT.format(dims="shape { dim: 1 dim: 1 dim: 4 dim: 7 } shape { dim: 1 dim: 1 dim: 2 dim: 8 }")
            + 'layer { name: "ev" type: "DetectionEvaluate" bottom: "det" bottom: "gt" top: "ev" '
              'detection_evaluate_param { num_classes: 4 %s } }\n')
    assert graph.Graph(parse_net(text % "")[0], pb.TEST).layers[-1].top_shapes == [(1, 1, 7, 5)]
    for body, message in [('name_size_file: "sizes.txt"', "name_size_file"),
                          ("overlap_threshold: 0", "overlap_threshold above 0"),
                          ("background_label_id: 4", "background_label_id one of them")]:
        with pytest.raises(ConfigError) as caught:
            graph.Graph(parse_net(text % body)[0], pb.TEST)
        assert message in str(caught.value) and "\n" not in str(caught.value)
