"""The feeder table (deepspark/data/table.py) and the layer registry's fed types name the same types; a fed type
registered with no feeder is refused, naming it."""

import pytest

from deepspark import graph
from deepspark.data import FEEDERS, SOURCE_PARAMS, feeder_for
from deepspark.data.table import check_feeders, feeds
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb


def test_every_fed_type_has_a_row_in_the_feeder_table():
    assert set(FEEDERS) == set(graph.FED_TYPES)
    check_feeders(graph.FED_TYPES)


def test_a_fed_type_with_no_feeder_is_refused_naming_it():
    graph.layer_type("Wobble", data=True, fed=True)(graph.REGISTRY["Input"].shapes)
    try:
        with pytest.raises(RuntimeError) as error:
            check_feeders(graph.types("fed"))
    finally:
        del graph.REGISTRY["Wobble"]
    assert str(error.value) == ("the feeder table and graph.FED_TYPES differ: fed in deepspark/graph but with no "
                                "feeder in deepspark/data: Wobble (register one with data.table.feeds)")
    check_feeders(graph.types("fed"))


def test_a_feeder_for_a_type_that_is_not_fed_is_refused_naming_it():
    feeds("Wobble", make=FEEDERS["Data"].make, param="data_param")
    try:
        with pytest.raises(RuntimeError, match=r"in the feeder table but not a fed type in deepspark/graph: Wobble$"):
            check_feeders(graph.FED_TYPES)
    finally:
        del FEEDERS["Wobble"]
    check_feeders(graph.FED_TYPES)


def test_the_types_that_read_a_source_and_those_refused_come_from_the_table():
    assert SOURCE_PARAMS == {"Data": "data_param", "HDF5Data": "hdf5_data_param", "ImageData": "image_data_param",
                             "WindowData": "window_data_param", "AnnotatedData": "data_param"}
    window = pb.LayerParameter(name="w", type="WindowData")
    with pytest.raises(ConfigError, match=r"^layer 'w': WindowData \(R-CNN's window sampler"):
        feeder_for(window)
    caller = pb.LayerParameter(name="in", type="Input")
    with pytest.raises(ConfigError) as error:
        feeder_for(caller)
    assert str(error.value) == ("layer 'in': the data pipeline reads AnnotatedData, Data, HDF5Data and ImageData layers; Input is "
                                "handled by the backend")
