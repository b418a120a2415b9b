"""AnnotatedData's OpenCV-only transform_param (noise_param, old_resize_param FIT_SMALL_SIZE and FIT_LARGE_SIZE_AND_PAD) against the bundled pycaffe, built without OpenCV: where it runs them our batches equal its, where it aborts (in a subprocess) we refuse in one line saying so (#43)."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT
from deepspark.data.annotated import PYCAFFE_ABORTS, convert_annoset
from deepspark.data.datum import DataError
from deepspark.errors import ConfigError
from test_annotated import LABEL_MAP, annotated_layer, annoset, converted, feeder, voc_xml  # noqa: F401 (fixtures)
from test_detection import pycaffe  # noqa: F401 (a fixture)

NOISE = ("noise_param { prob: 1 hist_eq: true inverse: true decolorize: true gauss_blur: true jpeg: 50 "
         "posterize: true erode: true saltpepper: true saltpepper_param { fraction: 0.5 } clahe: true "
         "convert_to_hsv: true convert_to_lab: true }")
# The annoset's images are 16x20: a resize to that size is none in every build of the fork.
OWN_SIZE = ["old_resize_param { resize_mode: FIT_SMALL_SIZE height: 16 width: 20 }",
            "old_resize_param { resize_mode: FIT_LARGE_SIZE_AND_PAD height: 16 width: 20 pad_value: 9 }",
            "old_resize_param { height: 16 width: 20 interp_mode: CUBIC interp_mode: AREA }"]
# Caffe's TEST-phase net whose forward the subprocess runs.
FORWARD = ("import sys\nfrom deepspark.backends.caffe import runtime\ncaffe = runtime.caffe()\n"
           "caffe.Net(sys.argv[1], caffe.TEST).forward()\n")


@pytest.fixture(scope="module")
def encoded(annoset, tmp_path_factory):
    """The annoset's LMDB of PNG records."""
    root, listfile, label_map, _ = annoset
    out = str(tmp_path_factory.mktemp("encoded") / "lmdb")
    convert_annoset(root, listfile, out, label_map_file=label_map, encode_type="png")
    return out


def pycaffe_forward(text, tmp_path):
    """(exit status, stderr) of a fresh Python that runs pycaffe's forward of the one-layer net `text`."""
    (tmp_path / "net.prototxt").write_text(text)
    done = subprocess.run([sys.executable, "-c", FORWARD, str(tmp_path / "net.prototxt")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GLOG_minloglevel": "0", "PYTHONPATH": ROOT})
    return done.returncode, done.stderr


@pytest.mark.caffe
@pytest.mark.parametrize("transform", [NOISE] + OWN_SIZE)
def test_what_pycaffe_runs_gives_its_batches(pycaffe, annoset, converted, tmp_path, transform, caplog):
    """Noise on raw records (which the fork's Transform of a raw Datum never noises) and a resize of any mode to
    the records' own size: pycaffe's batches are the plain layer's, and ours equal them."""
    caffe, label_map = pycaffe, annoset[2]
    text = annotated_layer(converted, label_map, 2, f"crop_size: 12 scale: 0.5 {transform}")
    (tmp_path / "net.prototxt").write_text(text)
    net = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST)
    with caplog.at_level(logging.WARNING, logger="deepspark.data.annotated"):
        ours = feeder(text)
    assert ("noise_param hist_eq, inverse, decolorize" in caplog.text) == (transform == NOISE)
    plain = feeder(annotated_layer(converted, label_map, 2, "crop_size: 12 scale: 0.5"))
    for _ in range(3):
        net.forward()
        batch, expect = ours.next_batch(), plain.next_batch()
        np.testing.assert_array_equal(batch["data"], net.blobs["data"].data)
        np.testing.assert_array_equal(batch["data"], expect["data"])
        np.testing.assert_array_equal(batch["label"], expect["label"])


@pytest.mark.caffe
@pytest.mark.parametrize("source, transform", [
    ("encoded", "noise_param { decolorize: true }"),
    ("encoded", "old_resize_param { resize_mode: FIT_SMALL_SIZE height: 10 width: 10 }"),
    ("converted", "old_resize_param { resize_mode: FIT_SMALL_SIZE height: 10 width: 10 }"),
    ("converted", "old_resize_param { resize_mode: FIT_LARGE_SIZE_AND_PAD height: 24 width: 24 }")])
def test_what_pycaffe_aborts_on_is_refused_saying_so(pycaffe, annoset, request, tmp_path, source, transform):
    """The claim in each refusal holds for the bundled pycaffe: it aborts where the fork needs OpenCV (an encoded
    record, noised or not) or a raw record is not the resize's size. If a rebuild with OpenCV runs these, this
    fails, and the refusals are to become implementations."""
    text = annotated_layer(request.getfixturevalue(source), annoset[2], 2, transform)
    with pytest.raises(ConfigError) as caught:
        feeder(text)
    refusal = str(caught.value)
    assert "\n" not in refusal and "the bundled pycaffe, built without it, aborts" in refusal
    is_encoded = source == "encoded"
    assert PYCAFFE_ABORTS[is_encoded] in refusal
    status, err = pycaffe_forward(text, tmp_path)
    assert status != 0, err[-2000:]
    if is_encoded:
        assert "Encoded datum requires OpenCV; compile with USE_OPENCV" in err, err[-2000:]
    else:
        assert "data_transformer.cpp" in err and "Check failed" in err and "datum_height" in err, err[-2000:]


def test_noise_on_an_encoded_record_is_refused(annoset, encoded):
    with pytest.raises(ConfigError, match="noise_param jpeg: the fork noises encoded records through OpenCV") as c:
        feeder(annotated_layer(encoded, annoset[2], 2, "noise_param { jpeg: 80 }"))
    assert "\n" not in str(c.value)


def test_a_later_record_of_another_size_is_refused_where_pycaffe_aborts(tmp_path):
    """The first record (16x20) fits FIT_SMALL_SIZE 16x20 as it is; the second (16x24) would be resized."""
    for name, width in (("a.png", 20), ("b.png", 24)):
        Image.fromarray(np.full((16, width, 3), 9, np.uint8)).save(tmp_path / name)
        (tmp_path / f"{name}.xml").write_text(voc_xml(width, 16, [("cat", 1, 1, 8, 8, 0)]))
    (tmp_path / "list.txt").write_text("a.png a.png.xml\nb.png b.png.xml\n")
    (tmp_path / "labelmap.prototxt").write_text(LABEL_MAP)
    convert_annoset(str(tmp_path), str(tmp_path / "list.txt"), str(tmp_path / "lmdb"),
                    label_map_file=str(tmp_path / "labelmap.prototxt"))
    ours = feeder(annotated_layer(tmp_path / "lmdb", tmp_path / "labelmap.prototxt", 1,
                                  "old_resize_param { resize_mode: FIT_SMALL_SIZE height: 16 width: 20 }"))
    assert ours.next_batch()["data"].shape == (1, 3, 16, 20)
    with pytest.raises(DataError, match="FIT_SMALL_SIZE of a 16x24 raw record to 16x20 is not done here") as caught:
        ours.next_batch()
    assert "\n" not in str(caught.value)
