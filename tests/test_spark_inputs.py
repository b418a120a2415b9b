"""Nets that read their own data on 2 Spark workers: HDF5Data and ImageData lists (each worker its share) and
a Python layer whose module travels with the job (BVLC's linreg.prototxt with pyloss)."""

import json
import os
import re
import shutil

import h5py
import pytest

from conftest import ROOT
from sparkjobs import start_runs, workers_done
from test_data_layers import HDF5_EXAMPLE, IMAGE_NET, SOLVER, hdf5_example, png_folder

pytestmark = pytest.mark.spark

PYCAFFE = os.path.join(ROOT, "tests", "data", "bvlc", "examples", "pycaffe")
FASHION = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.exists(f"{FASHION}/t10k-images-idx3-ubyte.gz"), reason="dataset-fashion-mnist")
def test_hdf5_images_and_a_python_layer_train_on_two_workers(tmp_path):
    # The HDF5 classification example, its list and paths relative to BVLC's root (the driver's cwd is the
    # repository's: the job makes them absolute for the executors through the list's folder).
    hdf5 = tmp_path / "hdf5"
    hdf5.mkdir()
    data = hdf5_example(hdf5, rows=(200, 40))
    shutil.copy(os.path.join(HDF5_EXAMPLE, "train_val.prototxt"), hdf5)
    net = (hdf5 / "train_val.prototxt").read_text().replace("examples/hdf5_classification/data", str(data))
    (hdf5 / "train_val.prototxt").write_text(net)
    (hdf5 / "solver.prototxt").write_text(SOLVER.format(nets=f'net: "{hdf5}/train_val.prototxt"', iterations=80,
                                                        prefix=hdf5 / "out" / "logreg"))
    images = tmp_path / "images"
    images.mkdir()
    png_folder(images)
    (images / "net.prototxt").write_text(IMAGE_NET.format(root=images, transform="", extra="is_color: false"))
    (images / "solver.prototxt").write_text(SOLVER.format(nets=f'net: "{images}/net.prototxt"', iterations=10,
                                                          prefix=images / "out" / "images"))
    # linreg.prototxt with a copy of its module beside it, and its solver in a folder of its own: the executors
    # find the module only because the job ships it (sc.addPyFile), not on the driver's paths
    linreg = tmp_path / "linreg"
    (linreg / "net").mkdir(parents=True)
    shutil.copy(os.path.join(PYCAFFE, "linreg.prototxt"), linreg / "net")
    shutil.copy(os.path.join(PYCAFFE, "layers", "pyloss.py"), linreg / "net")
    (linreg / "solver.prototxt").write_text(SOLVER.format(nets='net: "net/linreg.prototxt"', iterations=20,
                                                          prefix=linreg / "out" / "linreg").replace("test_iter: 5\n",
                                                                                                      "")
                                        + "snapshot_format: HDF5\n")
    for folder in (hdf5, images, linreg):
        (folder / "out").mkdir()
    runs = start_runs([str(hdf5 / "solver.prototxt"), str(images / "solver.prototxt"), str(linreg / "solver.prototxt")],
                      workers=2, period=5)
    out, err = runs.communicate(timeout=900)
    assert runs.returncode == 0, err[-4000:]
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(summaries) == 3
    logs = {name: (folder / "out" / "train.log").read_text() for name, folder in
            (("hdf5", hdf5), ("images", images), ("linreg", linreg))}
    for name, log in logs.items():
        assert workers_done(log) == [0, 1], (name, log[-3000:])
        assert "Sharded the train net's own data sources into 2 shards" in log, name
    accuracy = [float(a) for a in re.findall(r"Test net output #0: accuracy = ([\d.]+)", logs["hdf5"])]
    assert len(accuracy) == 2 and accuracy[-1] > 0.8 and accuracy[-1] > accuracy[0], accuracy
    assert "Test net output #0: accuracy = " in logs["images"]
    # snapshot_format: HDF5 on Spark too: the center in Caffe's layout, the workers' histories beside Caffe's
    assert summaries[2]["iterations"] == 20 and summaries[2]["weights"].endswith("linreg_iter_20.caffemodel.h5")
    with h5py.File(linreg / "out" / "linreg_iter_20.caffemodel.h5") as h5:
        assert h5["data/ipx/0"].shape == (10, 6) and h5["data/ipy/1"].shape == (10,)
    with h5py.File(linreg / "out" / "linreg_iter_20.solverstate.h5") as h5:
        assert int(h5["iter"][()]) == 20 and sorted(h5["deepspark_worker_state"]) == ["0", "1"]
