"""The layer registry (graph.REGISTRY) and each backend's layer table name the same types, and agree with Caffe.

Each backend's layers.py checks its table against the registry as it is imported (graph.check_table); these
tests hold the check itself to account and keep the derived sets and the blob counts true.
"""

import os

import pytest

from deepspark import graph
from deepspark.backends.caffe import layers as caffe_layers
from deepspark.backends.caffe import runtime
from deepspark.config import parse_net
from deepspark.proto import deepspark_pb2 as pb

REGISTERED = set(graph.REGISTRY)


def differences(table, name):
    """The failure message when a backend's table and the registry differ, or None."""
    lines = []
    if REGISTERED - set(table):
        lines.append(f"registered in deepspark/graph but not in the {name} table: {', '.join(sorted(REGISTERED - set(table)))}")
    if set(table) - REGISTERED:
        lines.append(f"in the {name} table but not registered in deepspark/graph: {', '.join(sorted(set(table) - REGISTERED))}")
    return "; ".join(lines) or None


def test_tensorflow_table_has_exactly_the_registered_types():
    pytest.importorskip("tensorflow")
    from deepspark.backends.tensorflow import layers as tf_layers  # deferred: it imports TensorFlow

    assert differences(tf_layers.LAYERS, "TensorFlow") is None, differences(tf_layers.LAYERS, "TensorFlow")


def test_caffe_table_has_exactly_the_registered_types():
    assert differences(caffe_layers.LAYERS, "Caffe") is None, differences(caffe_layers.LAYERS, "Caffe")


def test_a_table_that_differs_from_the_registry_fails_naming_the_types():
    table = {kind: None for kind in REGISTERED if kind != "Crop"}
    table["Wobble"] = None
    with pytest.raises(RuntimeError) as error:
        graph.check_table(table, "Test")
    assert str(error.value) == ("the Test layer table and graph.REGISTRY differ: registered in deepspark/graph but "
                                "missing from the Test table: Crop; in the Test table but not registered in "
                                "deepspark/graph: Wobble")
    graph.check_table(dict.fromkeys(REGISTERED), "Test")


def test_derived_sets_follow_the_rows():
    assert graph.FED_TYPES == {"Input", "Data", "MemoryData", "HDF5Data", "ImageData", "WindowData", "AnnotatedData"}
    assert graph.DATA_TYPES == graph.FED_TYPES | {"DummyData"}
    assert graph.LOSS_TYPES == {"SoftmaxWithLoss", "SigmoidCrossEntropyLoss", "EuclideanLoss", "ContrastiveLoss",
                                "InfogainLoss", "HingeLoss", "MultinomialLogisticLoss", "MultiBoxLoss", "SmoothL1Loss"}
    assert graph.LABELLED_TYPES == {"SoftmaxWithLoss", "Accuracy", "SigmoidCrossEntropyLoss", "InfogainLoss",
                                    "HingeLoss", "MultinomialLogisticLoss"}
    assert graph.supported_types() == sorted(REGISTERED)
    assert all(graph.spec(kind).type == kind for kind in REGISTERED)


# Every layer type with parameter blobs, in the variants that change how many it has.
BLOBS_NET = """
layer { name: "in" type: "Input" top: "x" top: "s" top: "v"
  input_param { shape { dim: 2 dim: 4 dim: 6 dim: 6 } shape { dim: 4 } shape { dim: 2 dim: 4 dim: 6 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "conv_nb" type: "Convolution" bottom: "x" top: "conv_nb"
  convolution_param { num_output: 4 kernel_size: 1 bias_term: false } }
layer { name: "deconv" type: "Deconvolution" bottom: "x" top: "deconv" convolution_param { num_output: 2 kernel_size: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "ip_nb" type: "InnerProduct" bottom: "x" top: "ip_nb" inner_product_param { num_output: 3 bias_term: false } }
layer { name: "prelu" type: "PReLU" bottom: "x" top: "prelu" }
layer { name: "prelu_shared" type: "PReLU" bottom: "x" top: "prelu_shared" prelu_param { channel_shared: true } }
layer { name: "bn" type: "BatchNorm" bottom: "x" top: "bn" }
layer { name: "scale" type: "Scale" bottom: "x" top: "scale" }
layer { name: "scale_b" type: "Scale" bottom: "x" top: "scale_b" scale_param { bias_term: true } }
layer { name: "scale_by" type: "Scale" bottom: "x" bottom: "s" top: "scale_by" }
layer { name: "scale_by_b" type: "Scale" bottom: "x" bottom: "s" top: "scale_by_b" scale_param { bias_term: true } }
layer { name: "bias" type: "Bias" bottom: "x" top: "bias" }
layer { name: "bias_by" type: "Bias" bottom: "x" bottom: "s" top: "bias_by" }
layer { name: "relu" type: "ReLU" bottom: "x" top: "relu" }
layer { name: "loss" type: "EuclideanLoss" bottom: "relu" bottom: "v" top: "loss" }
layer { name: "seq" type: "Input" top: "seq" top: "cont" top: "static" top: "h0" top: "c0"
  input_param { shape { dim: 3 dim: 2 dim: 4 } shape { dim: 3 dim: 2 } shape { dim: 2 dim: 5 }
                shape { dim: 1 dim: 2 dim: 3 } shape { dim: 1 dim: 2 dim: 3 } } }
layer { name: "lstm" type: "LSTM" bottom: "seq" bottom: "cont" top: "lstm" recurrent_param { num_output: 3 } }
layer { name: "lstm_static" type: "LSTM" bottom: "seq" bottom: "cont" bottom: "static" top: "lstm_static"
  recurrent_param { num_output: 3 } }
layer { name: "lstm_exposed" type: "LSTM" bottom: "seq" bottom: "cont" bottom: "h0" bottom: "c0" top: "lstm_exposed"
  top: "h1" top: "c1" recurrent_param { num_output: 3 expose_hidden: true } }
layer { name: "rnn" type: "RNN" bottom: "seq" bottom: "cont" bottom: "static" top: "rnn" recurrent_param { num_output: 3 } }
layer { name: "embed" type: "Embed" bottom: "cont" top: "embed" embed_param { num_output: 2 input_dim: 5 } }
layer { name: "embed_nb" type: "Embed" bottom: "cont" top: "embed_nb" embed_param { num_output: 2 input_dim: 5 bias_term: false } }
layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 3 } } }
"""


def test_each_rows_fillers_match_its_shape_functions_blobs():
    """A row's fillers say how many blobs a layer has before its shapes are known: as many as its shapes give."""
    net = graph.Graph(parse_net(BLOBS_NET)[0])
    counts = {layer.name: len(layer.param_shapes) for layer in net.layers}
    assert counts["conv"] == 2 and counts["conv_nb"] == 1 and counts["scale_by"] == 0 and counts["scale_by_b"] == 1
    assert (counts["lstm"], counts["lstm_static"], counts["lstm_exposed"], counts["rnn"]) == (3, 4, 3, 6)
    for layer in net.layers:
        assert graph.spec(layer.type).blob_count(layer.param) == len(layer.param_shapes), layer.name


def compiled(kind, keep_data):
    """The LayerParameter the Caffe table gives Caffe for a layer of type `kind`."""
    net = graph.Graph(parse_net('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 } } }')[0])
    bottoms = ["p", "label", "matrix"] if kind == "InfogainLoss" else []  # the matrix as a bottom: no file to read
    param = pb.LayerParameter(name="l", type=kind, bottom=bottoms, top=["l"])
    layer = graph.Layer("l", kind, bottoms, ["l"], param, 0, top_shapes=[(1,)])
    return caffe_layers.LAYERS[kind](layer, net, keep_data)


# What the Caffe table gives Caffe instead of the type itself, besides Input for the fed types.
REPLACED = {"HDF5Output": "Python"}  # DeepSpark's writer as a Python layer: Caffe's aborts on a second forward


def test_caffe_table_feeds_the_fed_types_through_input_layers():
    for kind in sorted(REGISTERED):
        expected = "Input" if kind in graph.FED_TYPES else REPLACED.get(kind, kind)
        assert compiled(kind, False).type == expected, kind
        assert compiled(kind, True).type == ("Data" if kind == "Data" else expected), kind


# BVLC added these after the commit brocolli-caffe 9.0.2 builds (9b89154): the Caffe backend refuses them in one line.
LATER_THAN_THIS_PYCAFFE = {"Clip", "Swish"}


@pytest.mark.caffe
def test_caffe_has_every_layer_type_the_table_gives_it():
    try:
        caffe = runtime.caffe()
    except ImportError as error:
        pytest.skip(str(error))
    theirs = set(caffe.layer_type_list())
    given = {(kind, compiled(kind, keep).type) for kind in REGISTERED for keep in (False, True)}
    lacking = {caffe_type for kind, caffe_type in given if caffe_type not in theirs}
    assert lacking == LATER_THAN_THIS_PYCAFFE, f"Caffe has no layer type for: {', '.join(sorted(lacking))}"


def test_docs_list_every_supported_type():
    """docs/layers.md's table of types is the registry's, row for row."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "layers.md"), encoding="utf-8") as stream:
        table = stream.read().split("## Supported types")[1]
    listed = [line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")]
    assert sorted(listed) == graph.supported_types()
