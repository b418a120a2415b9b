"""`deepspark describe` on models/ and on the BVLC nets shipped in Caffe's source."""

import glob
import os

import pytest

from conftest import ROOT, run_cli

MODELS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "models", "*")) if os.path.isdir(p))


def total(stdout):
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("total parameters: "), stdout
    return int(last.split(":")[1].split()[0])


@pytest.mark.parametrize("model,expected", [("lenet", 431080), ("cifar10_quick", 145578),
                                            ("cifar10_full", 89578), ("caffenet", 60965224),
                                            ("googlenet", 6998552), ("resnet18", 11699132)])
def test_describe_model_folder_totals(model, expected):
    status, out, err = run_cli("describe", f"models/{model}")
    assert status == 0, err
    assert total(out) == expected


def test_describe_rows_name_type_tops_params():
    status, out, _ = run_cli("describe", "models/lenet/deploy.prototxt")
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert "Convolution" in rows["conv1"] and "conv1 64x20x24x24" in rows["conv1"] and "20x1x5x5, 20" in rows["conv1"]
    assert "ip1 64x500" in rows["ip1"] and "500x800, 500" in rows["ip1"]


@pytest.mark.parametrize("model", MODELS)
def test_every_zoo_net_describes_in_both_phases(model):
    for phase in ("TRAIN", "TEST"):
        status, out, err = run_cli("describe", f"models/{model}/train_val.prototxt", "--phase", phase,
                                   "--data-shape", "3,256,256" if model not in ("lenet",) else "1,28,28")
        assert status == 0, err
        assert total(out) > 0


def test_describe_without_data_warns_and_exits_zero(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(open(os.path.join(ROOT, "models/lenet/train_val.prototxt")).read()
                   .replace("data/fashion_mnist_train_lmdb", str(tmp_path / "absent_lmdb")))
    status, out, err = run_cli("describe", str(net))
    assert status == 0
    assert "warning:" in err and "absent_lmdb" in err
    assert "conv1 ?" in out
    assert out.strip().splitlines()[-1] == "total parameters: unknown (8 parameter blobs of unknown shape)"
    status, out, _ = run_cli("describe", str(net), "--data-shape", "1,28,28")
    assert total(out) == 431080


def test_describe_bad_data_shape_is_a_usage_error():
    status, _, err = run_cli("describe", "models/lenet/train_val.prototxt", "--data-shape", "1,x,28")
    assert status == 2 and err.count("\n") == 1 and "--data-shape: must be C,H,W" in err


def test_describe_missing_file():
    status, _, err = run_cli("describe", "models/nope.prototxt")
    assert status == 1 and err.strip() == "deepspark describe: error: models/nope.prototxt: net file not found"


BVLC_TOTALS = {"bvlc_googlenet/deploy.prototxt": 6998552, "bvlc_alexnet/deploy.prototxt": 60965224,
               "bvlc_reference_caffenet/deploy.prototxt": 60965224}


def test_bvlc_nets_from_caffe_source(caffe_source):
    nets = sorted(p for p in glob.glob(os.path.join(caffe_source, "models", "*", "*.prototxt"))
                  if "solver" not in os.path.basename(p))
    assert len(nets) >= 9
    seen = {}
    for path in nets:
        relative = os.path.relpath(path, os.path.join(caffe_source, "models"))
        status, out, err = run_cli("describe", path, "--phase", "TEST")
        assert status == 0, (relative, err)
        if out.strip().endswith("of unknown shape)"):  # a train_val net: its LMDB or list is not in the source
            assert "warning: layer 'data': source" in err and relative.endswith("train_val.prototxt"), relative
            continue
        seen[relative] = total(out)
    for relative, expected in BVLC_TOTALS.items():
        assert seen[relative] == expected, relative
