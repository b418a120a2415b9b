"""bench/backends.py: its synthetic cifar10_quick set is learnable and loads as a job, the workers' lines parse, its page section tables and compares the backends."""

import os

import numpy as np

from deepspark.config import load_solver
from deepspark.data import decode_datum
from conftest import ROOT, load_script

bench = load_script("bench/backends.py", "bench_backends")


def test_a_synthetic_image_says_its_class_by_its_brighter_band():
    for key, value in bench.cifar_images(50, seed=3):
        image, label = decode_datum(value)
        assert image.shape == (3, 32, 32) and image.dtype == np.uint8
        rows = image[label % 3].mean(axis=1)
        assert np.argmax([rows[3 * c:3 * c + 3].mean() for c in range(10)]) == label, key


def test_the_cifar_job_is_a_solver_over_the_synthetic_lmdbs(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CIFAR_TRAIN", 300)
    monkeypatch.setattr(bench, "CIFAR_TEST", 200)
    solver, accuracy = bench.cifar_job(str(tmp_path))
    param = load_solver(solver).param
    assert list(param.test_iter) == [2] and accuracy.args == (str(tmp_path / "train_val.prototxt"), 2)
    text = (tmp_path / "train_val.prototxt").read_text()
    assert str(tmp_path / "train_lmdb") in text and str(tmp_path / "mean.binaryproto") in text


def test_worker_lines_give_images_per_s_and_the_blocked_share():
    log = ("I1202 01:03:52.681 5369 deepspark] Worker 0 on vm (in /w, deepspark from /w/deepspark): 60 iterations, "
           "7 exchanges, spilled 10000 records in 0.52s, trained 50.0s, blocked on exchange 5.00s, peak RSS 120 MB "
           "after the spill, 193 MB\n")
    assert bench.worker_figures(log, 100) == [(120.0, 0.1)]


def test_the_page_section_tables_each_run_and_gives_the_ratios():
    runs = [{"bench": "backends", "model": "lenet", "backend": backend, "data": "Fashion-MNIST (real)",
             "iterations_per_worker": 938, "images_per_s_per_worker": speed, "seconds_to_0.85": to_85,
             "seconds_to_0.88": None, "final_accuracy": 0.8712}
            for backend, speed, to_85 in (("caffe", 1500.0, 40.0), ("tensorflow", 3000.0, 20.0))]
    text = bench.page_section(runs + [{"bench": "backends", "model": "cifar10_quick", "backend": "caffe",
                                       "data": "synthetic", "images_per_s_per_worker": 300.0, "seconds_to_0.9": 30.0,
                                       "final_accuracy": 1.0}], os.path.join(ROOT, "docs", "data"))
    assert "| lenet | Fashion-MNIST (real) | caffe | 938 | 1,500 | 0.85: 40.0 s, 0.88: — | 0.8712 |" in text
    assert "- lenet: caffe / tensorflow images/s per worker 0.50; seconds to 0.85 2.00" in text
    assert "cifar10_quick: caffe" not in text  # one backend only: no ratio
    assert "`docs/data/backends.jsonl`" in text
    assert "_Not measured yet" in bench.page_section([], "docs/data")
