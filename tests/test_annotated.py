"""convert-annoset's AnnotatedDatum LMDB and the AnnotatedData layer, against the bundled pycaffe's: records, batches, compare --solver, a 2-worker Spark job (#43)."""

import io
import os
import re

import lmdb
import numpy as np
import pytest
from PIL import Image

from conftest import run_cli
from deepspark.data.annotated import convert_annoset
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb
from test_detection import pycaffe  # noqa: F401 (a fixture)

LABEL_MAP = """item { name: "none_of_the_above" label: 0 display_name: "background" }
item { name: "cat" label: 1 display_name: "cat" }
item { name: "dog" label: 2 display_name: "dog" }
"""
# (image name, width, height, [(name, xmin, ymin, xmax, ymax, difficult)])
IMAGES = [("a.png", 20, 16, [("cat", 2, 3, 10, 12, 0), ("dog", 5, 1, 19, 15, 1), ("cat", 0, 0, 4, 4, 0)]),
          ("b.jpg", 20, 16, [("dog", 1, 2, 7, 9, 0)]),
          ("c.png", 20, 16, [])]


def voc_xml(width, height, objects):
    """A VOC annotation file's text."""
    body = "".join(f"<object><name>{name}</name><pose>Left</pose><truncated>0</truncated>"
                   f"<difficult>{difficult}</difficult><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin>"
                   f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
                   for name, x0, y0, x1, y1, difficult in objects)
    return (f"<annotation><folder>VOC</folder><size><width>{width}</width><height>{height}</height>"
            f"<depth>3</depth></size>{body}</annotation>")


@pytest.fixture(scope="module")
def annoset(tmp_path_factory):
    """(root folder, list file, label map file, {image: RGB pixels}) of three images and their XML files."""
    root = tmp_path_factory.mktemp("annoset")
    (root / "Images").mkdir()
    (root / "Annotations").mkdir()
    rng = np.random.default_rng(7)
    pixels, lines = {}, []
    for name, width, height, objects in IMAGES:
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(image).save(root / "Images" / name)
        with Image.open(root / "Images" / name) as stored:  # a JPEG's pixels are what it decodes to
            pixels[name] = np.asarray(stored.convert("RGB"))
        stem = os.path.splitext(name)[0]
        (root / "Annotations" / f"{stem}.xml").write_text(voc_xml(width, height, objects))
        lines.append(f"Images/{name} Annotations/{stem}.xml")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    (root / "labelmap.prototxt").write_text(LABEL_MAP)
    return str(root), str(root / "list.txt"), str(root / "labelmap.prototxt"), pixels


@pytest.fixture(scope="module")
def converted(annoset, tmp_path_factory):
    """The annoset's LMDB as convert-annoset writes it by default (raw BGR pixels, XML boxes)."""
    root, listfile, label_map, _ = annoset
    out = str(tmp_path_factory.mktemp("converted") / "lmdb")
    convert_annoset(root, listfile, out, label_map_file=label_map)
    return out


def read_lmdb(path):
    """[(key, AnnotatedDatum)] of an LMDB, in key order."""
    with lmdb.open(path, readonly=True, lock=False) as env, env.begin() as txn:
        return [(bytes(k), pb.AnnotatedDatum.FromString(bytes(v))) for k, v in txn.cursor()]


def expected_labels(records):
    """The fork's AnnotatedData label rows [item, group, instance, xmin, ymin, xmax, ymax, difficult]."""
    rows = [[item, group.group_label, anno.instance_id, anno.bbox.xmin, anno.bbox.ymin, anno.bbox.xmax,
             anno.bbox.ymax, anno.bbox.difficult]
            for item, (_, record) in enumerate(records)
            for group in record.annotation_group for anno in group.annotation]
    return np.array(rows or [[-1] * 8], dtype=np.float32)


def test_records_hold_the_fork_layout(annoset, tmp_path):
    root, listfile, label_map, pixels = annoset
    out = str(tmp_path / "lmdb")
    assert convert_annoset(root, listfile, out, label_map_file=label_map) == 3
    records = read_lmdb(out)
    assert [k for k, _ in records] == [b"00000000_Images/a.png", b"00000001_Images/b.jpg", b"00000002_Images/c.png"]
    first = records[0][1]
    assert first.type == pb.AnnotatedDatum.BBOX and first.datum.label == -1
    assert first.datum.HasField("encoded") and not first.datum.encoded
    data = np.frombuffer(first.datum.data, np.uint8).reshape(3, 16, 20)
    np.testing.assert_array_equal(data, pixels["a.png"][:, :, ::-1].transpose(2, 0, 1))
    # Groups in first-seen order; instance ids count within a group; boxes are float32 quotients.
    assert [(g.group_label, [a.instance_id for a in g.annotation]) for g in first.annotation_group] == \
        [(1, [0, 1]), (2, [0])]
    dog = first.annotation_group[1].annotation[0].bbox
    assert (dog.xmin, dog.ymin, dog.xmax, dog.ymax, dog.difficult) == \
        (np.float32(5) / np.float32(20), np.float32(1) / np.float32(16), np.float32(19) / np.float32(20),
         np.float32(15) / np.float32(16), True)
    assert not records[2][1].annotation_group and records[2][1].type == pb.AnnotatedDatum.BBOX


@pytest.mark.caffe
def test_pycaffe_reads_the_lmdb(pycaffe, annoset, converted, tmp_path):
    caffe, label_map, out = pycaffe, annoset[2], converted
    records = read_lmdb(out)
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(f'layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" '
                        f'include {{ phase: TEST }} data_param {{ source: "{out}" batch_size: 3 backend: LMDB }} '
                        f'annotated_data_param {{ label_map_file: "{label_map}" }} }}')
    net = caffe.Net(str(prototxt), caffe.TEST)
    net.forward()
    images = np.stack([np.frombuffer(r.datum.data, np.uint8).reshape(3, 16, 20) for _, r in records])
    np.testing.assert_array_equal(net.blobs["data"].data, images.astype(np.float32))
    np.testing.assert_array_equal(net.blobs["label"].data[0, 0], expected_labels(records))


def test_txt_annotations_resize_and_encoding(annoset, tmp_path):
    root, _, _, pixels = annoset
    (tmp_path / "a.txt").write_text("1 2.5 3 10 12\n2 5 1 19 15\n")
    listfile = tmp_path / "list.txt"
    listfile.write_text(f"Images/a.png {tmp_path / 'a.txt'}\nImages/b.jpg {tmp_path / 'missing.txt'}\n")
    out = str(tmp_path / "lmdb")
    convert_annoset(root, str(listfile), out, label_type="txt", resize_width=10, resize_height=8,
                    encode_type="png")
    (_, a), (_, b) = read_lmdb(out)
    assert a.datum.encoded and (a.datum.channels, a.datum.height, a.datum.width) == (3, 8, 10)
    with Image.open(io.BytesIO(a.datum.data)) as image:
        assert image.format == "PNG" and image.size == (10, 8)
    # Boxes are normalised by the original image's size, before any resize.
    assert a.annotation_group[0].annotation[0].bbox.xmin == np.float32(2.5) / np.float32(20)
    assert not b.annotation_group  # no annotation file: an image without boxes, as the fork writes it


def test_unknown_name_and_missing_label_map_are_refused(annoset, tmp_path):
    root, listfile, _, _ = annoset
    with pytest.raises(ConfigError, match="needs --label-map-file"):
        convert_annoset(root, listfile, str(tmp_path / "x"))
    (tmp_path / "map.prototxt").write_text('item { name: "cat" label: 1 }')
    with pytest.raises(ConfigError, match="unknown name: dog"):
        convert_annoset(root, listfile, str(tmp_path / "y"), label_map_file=str(tmp_path / "map.prototxt"))


def test_cli_convert_annoset(annoset, tmp_path):
    root, listfile, label_map, _ = annoset
    out = str(tmp_path / "cli")
    status, _, err = run_cli("convert-annoset", root, listfile, out, "--label-map-file", label_map,
                             "--encoded", "--encode-type", "jpg")
    assert status == 0, err
    assert "Processed 3 files." in err
    records = read_lmdb(out)
    assert all(r.datum.encoded for _, r in records)
    with open(os.path.join(root, "Images", "b.jpg"), "rb") as f:
        assert records[1][1].datum.data == f.read()  # a JPEG asked for as JPEG is stored as it is


def annotated_layer(source, label_map, batch, transform="", phase="TEST"):
    """An AnnotatedData layer's text (in one phase, or both where phase is None)."""
    include = f"include {{ phase: {phase} }} " if phase else ""
    return (f'layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" {include}'
            f'transform_param {{ {transform} }} data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} '
            f'annotated_data_param {{ label_map_file: "{label_map}" }} }}')


def feeder(text, phase=pb.TEST, seed=None):
    from google.protobuf import text_format
    from deepspark.data import feeder_for
    net = text_format.Parse(text, pb.NetParameter())
    return feeder_for(net.layer[0], phase=phase, seed=seed)


@pytest.mark.caffe
def test_feeder_gives_pycaffe_batches(pycaffe, annoset, converted, tmp_path):
    caffe, label_map, out = pycaffe, annoset[2], converted
    # crop_size 12 of 16x20 images, centred in TEST: the boxes are projected into the crop and clipped.
    text = annotated_layer(out, label_map, 2, "crop_size: 12 scale: 0.5 mean_value: 100 mean_value: 110 "
                                              "mean_value: 120")
    (tmp_path / "net.prototxt").write_text(text)
    net = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST)
    ours = feeder(text)
    assert ours.shapes == {"data": (2, 3, 12, 12), "label": (1, 1, 6, 8)}  # 2 x the 3 boxes of a
    for _ in range(4):  # past the end: the LMDB loops, a batch spanning the seam
        net.forward()
        batch = ours.next_batch()
        np.testing.assert_array_equal(batch["data"], net.blobs["data"].data)
        theirs = net.blobs["label"].data[0, 0]
        kept = batch["label"][0, 0]
        np.testing.assert_array_equal(kept[:len(theirs)] if theirs[0, 0] != -1 else kept[:1], theirs)
        assert (kept[len(theirs):] == -1).all()


def test_mirror_flips_boxes_with_the_image(annoset, converted):
    label_map, out = annoset[2], converted
    plain = feeder(annotated_layer(out, label_map, 3), pb.TRAIN).next_batch()
    mirrored = feeder(annotated_layer(out, label_map, 3, "mirror: true", "TRAIN"), pb.TRAIN, seed=3)
    flips = set()
    for _ in range(4):
        batch = mirrored.next_batch()
        for item in range(3):
            flipped = (batch["data"][item] != plain["data"][item]).any()
            assert flipped == (batch["data"][item] == plain["data"][item][:, :, ::-1]).all()
            flips.add(bool(flipped))
            rows, expect = (label[0, 0][label[0, 0, :, 0] == item] for label in (batch["label"], plain["label"]))
            if flipped:
                expect = expect.copy()
                expect[:, 3], expect[:, 5] = 1 - expect[:, 5], 1 - expect[:, 3]
            np.testing.assert_array_equal(rows, expect)
    assert flips == {True, False}


def test_batch_sampler_without_a_resize_is_refused_in_one_line(annoset, converted):
    text = annotated_layer(converted, annoset[2], 2).replace(
        "annotated_data_param {", "annotated_data_param { batch_sampler { max_sample: 1 }")
    with pytest.raises(ConfigError, match="batch_sampler's crops come in many sizes; add transform_param.old_resize"):
        feeder(text)


TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ssd_tiny_train.prototxt")
# Two 24x24 images' boxes (the tiny SSD net's input size): two on the first, one on the second.
SSD_IMAGES = [("p.png", 24, 24, [("cat", 2, 3, 12, 14, 0), ("dog", 10, 8, 23, 22, 0)]),
              ("q.png", 24, 24, [("dog", 4, 4, 16, 20, 0)])]


def tiny_ssd_net(folder, label_map):
    """The tiny SSD train net fed by AnnotatedData from an LMDB that convert-annoset makes of two images."""
    rng = np.random.default_rng(5)
    lines = []
    for name, width, height, objects in SSD_IMAGES:
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)
        (folder / f"{name}.xml").write_text(voc_xml(width, height, objects))
        lines.append(f"{name} {name}.xml")
    (folder / "list.txt").write_text("\n".join(lines) + "\n")
    convert_annoset(str(folder), str(folder / "list.txt"), str(folder / "lmdb"), label_map_file=label_map)
    text = open(TINY).read()
    start = text.index('layer { name: "data" type: "Input"')
    end = text.index("\n", text.index("input_param", start)) + 1
    layer = annotated_layer(folder / "lmdb", label_map, 2, "scale: 0.0078125 mean_value: 127.5", None)
    (folder / "net.prototxt").write_text(text[:start] + layer + "\n" + text[end:])
    return str(folder / "net.prototxt")


@pytest.mark.caffe
def test_compare_solver_on_the_tiny_ssd_net(pycaffe, annoset, tmp_path):
    from deepspark import compare
    net = tiny_ssd_net(tmp_path, annoset[2])
    (tmp_path / "solver.prototxt").write_text(f'net: "{net}"\nbase_lr: 0.05\nmomentum: 0.9\n'
                                              'weight_decay: 0.0005\nlr_policy: "fixed"\nmax_iter: 3\n')
    out = io.StringIO()
    result = compare.run(net, solver_path=str(tmp_path / "solver.prototxt"), out=out, iterations=3)
    assert result["ok"], out.getvalue()
    losses = result["training"]["losses"]
    assert losses["caffe"][2] < losses["caffe"][0]


@pytest.mark.spark
@pytest.mark.caffe
def test_a_two_worker_easgd_job_lowers_the_tiny_ssd_loss(pycaffe, annoset, tmp_path):
    """Each of 2 local Spark workers reads its half of convert-annoset's LMDB; pycaffe's own AnnotatedData layer
    then reads the LMDB for the loss of the untrained net (Caffe's constant fillers, as training starts) and of
    the job's snapshot."""
    caffe = pycaffe
    net = tiny_ssd_net(tmp_path, annoset[2])
    (tmp_path / "solver.prototxt").write_text(f'net: "{net}"\nbase_lr: 0.05\nmomentum: 0.9\nweight_decay: 0.0005\n'
                                              f'lr_policy: "fixed"\nmax_iter: 40\ndisplay: 10\nsnapshot: 0\n'
                                              f'snapshot_prefix: "{tmp_path}/out/ssd"\n')
    status, _, log = run_cli("train", "--solver", str(tmp_path / "solver.prototxt"), "--workers", "2",
                             "--algorithm", "easgd", "--output", str(tmp_path / "out"))
    assert status == 0, log[-3000:]
    assert "each executor reads its share of them itself" in log
    # each worker its own count, the two summing to 2 x max_iter (the exchanger's leases)
    assert sum(map(int, re.findall(r"Worker \d on \S+ \(in [^)]*\): (\d+) iterations", log))) == 80, log[-3000:]
    trained = caffe.Net(net, caffe.TRAIN)
    untrained = float(trained.forward()["mbox_loss"])
    trained.copy_from(str(tmp_path / "out" / "ssd_iter_40.caffemodel"))
    assert float(trained.forward()["mbox_loss"]) < 0.8 * untrained


def test_encoded_records_give_the_raw_records_batches(annoset, converted, tmp_path):
    """PNG records (which the bundled pycaffe, built without OpenCV, cannot decode) decode to the raw ones."""
    root, listfile, label_map, _ = annoset
    encoded = str(tmp_path / "png")
    convert_annoset(root, listfile, encoded, label_map_file=label_map, encode_type="png")
    batches = [feeder(annotated_layer(path, label_map, 3, "scale: 0.5")).next_batch() for path in (converted, encoded)]
    for top in ("data", "label"):
        np.testing.assert_array_equal(batches[0][top], batches[1][top])
