"""deepspark.ml without a JVM: the stages' Params as pyspark.ml's conventions have them (keyword-only constructors,
getters and setters for every Param, the solver's values as defaults, seed), the images of Arrow columns as
pyspark.ml makes them (vectors dense and sparse, flat and nested arrays, Datum bytes), the scale rule, and the
workers' progress bars."""

import inspect
import io
import os
import time

import numpy as np
import pyarrow as pa
import pytest

from deepspark.data import encode_datum
from deepspark.errors import ConfigError
from deepspark.ml import DeepSparkEstimator, DeepSparkModel, images
from deepspark.progress import WorkerBars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVER = os.path.join(ROOT, "models", "lenet", "solver.prototxt")
VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                    ("values", pa.list_(pa.float64()))])


def test_the_estimator_shows_and_uses_what_the_solvers_files_say_for_a_param_left_unset():
    estimator = DeepSparkEstimator(solver=SOLVER)
    # models/lenet/deepspark.prototxt says moving_rate 0.45 (the schema's default is 0.2); the solver max_iter 10000
    # and random_seed 1: those are the defaults a fit uses, and what explainParams shows.
    assert "movingRate: " in estimator.explainParams()
    assert "(default: 0.45)" in estimator.explainParam("movingRate")
    assert estimator.getMovingRate() == 0.45 and estimator.getMaxIter() == 10000 and estimator.getSeed() == 1
    assert not estimator.isSet("movingRate")  # still the solver's to say at fit time
    estimator.setMaxIter(200).setSeed(7).setSolver(SOLVER).setValidationFraction(0.1)
    assert (estimator.getMaxIter(), estimator.getSeed(), estimator.getValidationFraction()) == (200, 7, 0.1)
    assert estimator.getSolver() == SOLVER and estimator.getOutput is not None
    copy = estimator.copy({estimator.movingRate: 0.3})
    assert copy.getMovingRate() == 0.3 and copy.uid == estimator.uid and estimator.getMovingRate() == 0.45


def test_constructors_take_keywords_only_each_param_named_in_their_signature():
    with pytest.raises(TypeError, match="forces keyword arguments"):
        DeepSparkEstimator(SOLVER)
    with pytest.raises(ConfigError, match=r"^DeepSparkEstimator has no Param 'learningRate'; its Params are "
                                          r"adaptivePeriod, algorithm, "):
        DeepSparkEstimator(solver=SOLVER, learningRate=0.1)
    signature = inspect.signature(DeepSparkEstimator.__init__)
    assert {"solver", "inputCol", "labelCol", "validationFraction", "inputScale", "seed", "executorEnv"} <= set(
        signature.parameters)
    assert all(p.kind is p.KEYWORD_ONLY for name, p in signature.parameters.items() if name != "self")
    assert "handleInvalid" in inspect.signature(DeepSparkModel().setParams).parameters
    for stage in (DeepSparkEstimator(), DeepSparkModel()):
        for param in stage.params:
            title = param.name[0].upper() + param.name[1:]
            assert callable(getattr(stage, f"get{title}")) and callable(getattr(stage, f"set{title}")), param.name
    with pytest.raises(TypeError, match="Could not convert"):
        DeepSparkEstimator(maxIter="many")


def vectors(rows):
    return pa.array([None if r is None else ({"type": 1, "size": None, "indices": None, "values": r}
                                             if isinstance(r, list) else {"type": 0, **r}) for r in rows], VECTOR)


def test_images_of_vectors_dense_and_sparse_flat_and_nested_arrays_and_datums():
    found, ok = images.column_images(vectors([[0.1, 0.2, 0.3, 0.4], {"size": 4, "indices": [2], "values": [0.5]},
                                              None, [0.1]]), images.VECTOR, (1, 2, 2))
    assert ok.tolist() == [True, True, False, False]
    np.testing.assert_array_equal(found.reshape(2, 4), [[0.1, 0.2, 0.3, 0.4], [0, 0, 0.5, 0]])
    nested = pa.array([[[1, 2], [3, 4]], None, [[5, 6], [7]], [[9, 10], [11, 12]]], pa.list_(pa.list_(pa.int32())))
    found, ok = images.column_images(nested, images.ARRAY, (1, 2, 2))
    assert ok.tolist() == [True, False, False, True] and found.dtype == np.int32
    np.testing.assert_array_equal(found.reshape(2, 4), [[1, 2, 3, 4], [9, 10, 11, 12]])
    found, ok = images.column_images(nested.slice(3), images.ARRAY, (1, 2, 2))  # an Arrow slice: its own rows
    np.testing.assert_array_equal(found.ravel(), [9, 10, 11, 12])
    flat = pa.array([[0.0] * 784, [1.0] * 784], pa.list_(pa.float64()))
    assert images.column_images(flat, images.ARRAY, (1, 28, 28))[0].shape == (2, 1, 28, 28)
    datums = pa.array([encode_datum(np.full((1, 2, 2), 7, np.uint8), 3), b"not a datum", None], pa.binary())
    found, ok = images.column_images(datums, images.DATUM, None)
    assert ok.tolist() == [True, False, False] and found.dtype == np.uint8 and found.shape == (1, 1, 2, 2)


def test_a_bad_row_is_one_line_naming_the_column_and_the_row():
    column = vectors([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3]])
    _, ok = images.column_images(column, images.VECTOR, (1, 2, 2))
    assert str(images.bad_row(column, images.VECTOR, (1, 2, 2), ok, "inputCol 'features'")) == (
        "inputCol 'features': row 1 holds 3 numbers; the net takes 1x2x2 = 4 (set inputShape for another layout)")
    column = vectors([None])
    assert str(images.bad_row(column, images.VECTOR, (1, 2, 2), np.array([False]), "inputCol 'features'")) == (
        "inputCol 'features': row 0 is null (handleInvalid='skip' leaves such rows out)")


def test_pixels_already_in_0_1_get_the_inverse_of_a_pixel_nets_scale_and_nothing_else_does():
    lenet = 0.00390625
    assert images.input_scale(np.array([0.0, 0.5, 1.0]), lenet) == 255.0  # x / 255 made pixels again
    assert images.input_scale(np.array([0.0, 0.5, 1.0]), 1 / 255) == 255.0
    assert images.input_scale(np.array([0.0, 3.0, 255.0]), lenet) == 1.0  # pixels: the net's scale is theirs
    assert images.input_scale(np.array([-1.0, 0.5]), lenet) == 1.0  # centred data: not pixels in [0, 1]
    assert images.input_scale(np.array([0.0, 0.5]), 1.0) == 1.0  # a net that scales nothing takes them as they are
    assert images.input_scale(np.zeros(4), lenet) == 1.0  # all black says nothing
    param, mean = images.scaled_transform(images.pb.TransformationParameter(scale=lenet, mean_value=[128]), 256.0,
                                          np.full((1, 2, 2), 128, np.float32))
    assert param.scale == 1.0 and list(param.mean_value) == [0.5] and mean.max() == 0.5
    x = np.float32(0.25)  # (x * 256 - 128) * lenet == (x - 0.5) * 1
    assert (x * 256 - 128) * np.float32(lenet) == (x - 0.5) * param.scale


def test_the_workers_bars_show_iteration_loss_images_per_second_and_eta():
    stream = io.StringIO()
    bars = WorkerBars(2, 100, 64, file=stream)
    bars.draw({0: {"iteration": 0, "loss": 2.3}, 1: {"iteration": 0}})
    time.sleep(0.05)
    bars.draw({0: {"iteration": 40, "loss": 1.25}, 1: {"iteration": 30, "loss": 1.5}}, lost={1})
    bars.close()
    text = stream.getvalue()
    assert "w0:  40%" in text and "40/100 [" in text and "loss 1.2500" in text and " img/s" in text
    assert "w1:  30%" in text and "lost, to rejoin" in text
    assert "<00:0" in text  # the ETA, as tqdm gives it
