"""One rule for the folder a run writes to (config.output_folder): the snapshot_prefix's folder, else the working
directory as Caffe; --output and the Estimator's output Param over it; the single and the Spark run agree."""

import os

from deepspark import config, nets
from deepspark.ml import DeepSparkEstimator
from deepspark.ml.fit import Fit
from deepspark.spark.job import JobPlan
from synthetic import make_job


def tiny(folder, prefix=None, **knobs):
    """The synthetic tiny solver under `folder` (made there once), its snapshot_prefix `prefix` where given, knobs
    over it."""
    path = folder / "solver.prototxt"
    solver = config.load_solver(str(path) if path.exists() else make_job(folder, max_iter=2, test_interval=2,
                                                                          snapshot=2))
    if prefix is not None:
        solver.param.snapshot_prefix = prefix
    return config.override(solver, **knobs)


def test_a_prefix_with_a_folder_writes_there(tmp_path):
    solver = tiny(tmp_path)
    assert config.output_folder(solver) == str(tmp_path / "out")
    assert config.output_folder(solver) == os.path.dirname(solver.param.snapshot_prefix)


def test_a_prefix_without_a_folder_writes_in_the_working_directory(tmp_path):
    assert config.output_folder(tiny(tmp_path, "tiny")) == "."
    assert config.output_folder(tiny(tmp_path, "")) == "."


def test_output_given_wins_and_keeps_the_prefix_name(tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    solver = tiny(tmp_path, output=elsewhere)
    assert config.output_folder(solver) == elsewhere
    assert solver.param.snapshot_prefix == os.path.join(elsewhere, "tiny")
    assert config.output_folder(tiny(tmp_path, "tiny"), given=elsewhere) == elsewhere


def test_the_estimators_output_param_and_its_default(tmp_path, monkeypatch):
    solver_path = make_job(tmp_path)
    (tmp_path / "deploy.prototxt").write_text('layer { name: "data" type: "Input" top: "data" '
                                              'input_param { shape { dim: 1 dim: 1 dim: 8 dim: 8 } } }\n')
    given = tmp_path / "fits"
    fit = Fit(DeepSparkEstimator(solver=solver_path, output=str(given)), None)
    fit.load_solver()
    assert os.path.dirname(fit.output) == str(given) and os.path.isdir(fit.output)
    fit = Fit(DeepSparkEstimator(solver=solver_path), None)
    fit.load_solver()
    assert os.path.dirname(fit.output) == str(tmp_path / "out")  # the solver's prefix is out/tiny
    prefixless = tmp_path / "prefixless.prototxt"
    prefixless.write_text(open(solver_path).read().replace(str(tmp_path / "out" / "tiny"), "tiny"))
    monkeypatch.chdir(tmp_path / "out")
    fit = Fit(DeepSparkEstimator(solver=str(prefixless)), None)
    fit.load_solver()
    assert os.path.dirname(fit.output) == "."  # Caffe's working directory, as a single run's


def test_single_and_spark_write_to_the_same_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = tiny(tmp_path, "tiny", algorithm="single", backend="tensorflow")
    nets.train(solver)
    assert (tmp_path / "train.log").exists() and (tmp_path / "tiny_iter_2.caffemodel").exists()
    plan = JobPlan.of(tiny(tmp_path, "tiny", algorithm="easgd"))  # a plan starts nothing
    assert plan.output == config.output_folder(solver) == "."
    plan = JobPlan.of(tiny(tmp_path))
    assert plan.output == str(tmp_path / "out")
