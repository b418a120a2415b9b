"""The algorithms' table: an algorithm is one module and one row, as docs/architecture.md says; a toy algorithm
registered from this file (the docs' own example) runs on 2 workers in local Spark. Real Spark, real LMDB."""

import importlib
import os
import re
import types

import numpy as np
import pytest

from conftest import ROOT
from synthetic import make_job

from deepspark import algorithms, plan, rules
from deepspark.algorithms import Projection
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

DOCS = os.path.join(ROOT, "docs", "architecture.md")


def section():
    """docs/architecture.md's "Add an algorithm" section."""
    text = open(DOCS, encoding="utf-8").read()
    return text.split("## Add an algorithm", 1)[1].split("\n## ", 1)[0]


def blocks():
    return re.findall(r"```python\n(.*?)```", section(), re.S)


def test_the_docs_name_one_module_and_one_row_and_so_does_the_code():
    text = section()
    module, row = blocks()
    assert re.findall(r"`(deepspark/algorithms/[^`]+\.py)`", text) == ["deepspark/algorithms/<name>.py",
                                                                       "deepspark/algorithms/__init__.py"]
    assert "An algorithm is one module and one row." in text
    assert len(re.findall(r"^ALGORITHMS = \{.*: \w+\(\)\}$", row, re.M)) == 1  # one row
    # the code: each row's Algorithm lives in the module of its name, and the package holds nothing else but
    # the table (__init__) and what the modules share (base)
    for value, algorithm in algorithms.ALGORITHMS.items():
        assert algorithm.name == pb.DeepSparkParameter.Algorithm.Name(value).lower()
        assert type(algorithm).__module__ == f"deepspark.algorithms.{algorithm.name}"
    folder = os.path.dirname(algorithms.__file__)
    modules = {name[:-3] for name in os.listdir(folder) if name.endswith(".py")}
    assert modules == {a.name for a in algorithms.ALGORITHMS.values()} | {"__init__", "base"}


def halfway():
    """The docs' example module, made a module here: its HalfWay algorithm."""
    module = types.ModuleType("halfway")
    exec(compile(blocks()[0], DOCS, "exec"), module.__dict__)
    return module.HalfWay


def test_train_plan_and_the_training_check_read_the_row(tmp_path, monkeypatch):
    pytest.importorskip("pyspark")
    spark = importlib.import_module("deepspark.spark")  # after the skip

    class Refusing(halfway()):
        def check(self, ds, path):
            raise ConfigError(f"halfway cannot run period {ds.period}", path)

        def cost(self, costs, network, ds, workers, shared=1.0):
            return Projection(workers, 1.0, 2.0, 0.0, 0.0, 3.0)

    monkeypatch.setitem(algorithms.ALGORITHMS, pb.DeepSparkParameter.AVERAGE, Refusing())
    ds = pb.DeepSparkParameter(algorithm=pb.DeepSparkParameter.AVERAGE, period=7)
    assert plan.project(None, None, ds, 4) == Projection(4, 1.0, 2.0, 0.0, 0.0, 3.0)
    assert plan.saturation(None, None, ds) is None
    solver = make_job(tmp_path)
    with pytest.raises(ConfigError, match="halfway cannot run period 7"):  # said before Spark starts
        spark.train(solver, algorithm="average", period=7)


@pytest.mark.spark
def test_a_toy_algorithm_registered_here_trains_on_two_workers_and_exchanges(tmp_path, monkeypatch):
    pytest.importorskip("pyspark")
    spark = importlib.import_module("deepspark.spark")  # after the skip

    class Recorded(halfway()):
        rounds = []

        def update_center(self, job, returned):
            before = job.center.copy()
            super().update_center(job, returned)
            Recorded.rounds.append((before, [r["params"] for r in returned], job.center.copy()))

    # A row added to the table at run time: the schema's Algorithm enum is closed, so the toy stands in for
    # average's value, and train, plan and the check read it from there.
    monkeypatch.setitem(algorithms.ALGORITHMS, pb.DeepSparkParameter.AVERAGE, Recorded())
    solver = make_job(tmp_path, max_iter=40, test_interval=40, snapshot=0)
    result = spark.train(solver, algorithm="average", workers=2, period=10)

    log = open(os.path.join(result.output, "train.log"), encoding="utf-8").read()
    assert "with 2 workers (tensorflow backend, half-way averaging every 10 iterations)" in log
    workers = result.summary["workers"]
    assert [(w["worker"], w["iterations"], w["exchanges"]) for w in workers] == [(0, 40, 4), (1, 40, 4)]
    assert len(Recorded.rounds) == 4
    for before, returned, after in Recorded.rounds:  # the toy's rule, round by round
        assert not np.array_equal(returned[0], returned[1])
        np.testing.assert_allclose(after, before + 0.5 * (rules.average_models(returned) - before), rtol=1e-6)
    assert result.history[-1]["iteration"] == 40
    assert result.final_test["test0/accuracy"] >= 0.7  # trained: the two-class problem is learned
    assert all(np.isfinite(e["loss"]) for e in result.history if "loss" in e and "test0/accuracy" not in e)
