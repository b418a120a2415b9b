"""Grouped and depthwise convolutions on the TensorFlow backend: each one op, and equal to real pycaffe's forward
and backward.

Each case is a small net: a Parameter layer holds the convolution's bottom (so its diff is a parameter diff), the
convolution under test, and an InnerProduct with fixed random weights and loss_weight 1 over its top (so its
backward starts from random diffs). Both backends get the same blobs; the top, the loss and every diff must
agree within 1e-4 of the largest magnitude in each array.
"""

import collections

import numpy as np
import pytest

from deepspark import fillers
from deepspark.backends import create_model
from deepspark.config import parse_net
from deepspark.graph import Graph, tap_name, with_taps
from deepspark.proto import deepspark_pb2 as pb

pytestmark = pytest.mark.caffe

tf = pytest.importorskip("tensorflow")
pytest.importorskip("caffe")  # pycaffe, the reference

from deepspark.backends.tensorflow import compiler  # noqa: E402

SOLVER = pb.SolverParameter(type="SGD", base_lr=0.01)
FILLERS = 'weight_filler { type: "gaussian" std: 0.4 } bias_filler { type: "gaussian" std: 0.3 }'


def net_text(shape, conv):
    dims = " ".join(f"dim: {d}" for d in shape)
    return (f'layer {{ name: "x" type: "Parameter" top: "x" parameter_param {{ shape {{ {dims} }} }} }}\n'
            f'layer {{ name: "conv" type: "Convolution" bottom: "x" top: "conv" convolution_param {{ {conv} '
            f'{FILLERS} }} }}\n'
            'layer { name: "probe" type: "InnerProduct" bottom: "conv" top: "probe" param { lr_mult: 0 } '
            'inner_product_param { num_output: 1 bias_term: false weight_filler { type: "gaussian" std: 1 } } '
            'loss_weight: 1 }\n')


def run(backend, text, params):
    """(the conv top of one forward pass, the loss and every diff of the next forward-backward pass)."""
    net = parse_net(text)[0]
    graph = Graph(net, pb.TRAIN)
    model = create_model(backend, with_taps(net, graph, ["conv"]), SOLVER, seed=5)
    try:
        model.set_params(params)
        top = model.forward({})[tap_name(graph, "conv")]
        loss, diffs = model.gradients({})
        return top, loss, diffs
    finally:
        model.close()


def close(got, want, what):
    scale = max(float(np.max(np.abs(want))), 1e-6)
    assert got.shape == want.shape, what
    assert np.max(np.abs(got - want)) <= 1e-4 * scale, f"{what}: {np.max(np.abs(got - want))} (scale {scale})"


CASES = {
    "depthwise": ((2, 6, 7, 7), "num_output: 6 group: 6 kernel_size: 3 pad: 1"),
    "depthwise_multiplier_strided_dilated": ((2, 4, 9, 8), "num_output: 8 group: 4 kernel_size: 3 pad: 2 "
                                             "stride: 2 dilation: 2"),
    "depthwise_rectangular_no_bias": ((1, 5, 8, 9), "num_output: 15 group: 5 kernel_h: 3 kernel_w: 2 pad_h: 1 "
                                      "stride_h: 1 stride_w: 2 bias_term: false"),
    "grouped": ((2, 6, 7, 7), "num_output: 9 group: 3 kernel_size: 3 pad: 1 stride: 2"),
    "grouped_dilated_no_bias": ((2, 8, 9, 9), "num_output: 4 group: 2 kernel_size: 3 pad: 2 dilation: 2 "
                                "bias_term: false"),
}


@pytest.mark.parametrize("shape, conv", CASES.values(), ids=CASES)
def test_grouped_convolution_equals_pycaffe(shape, conv):
    text = net_text(shape, conv)
    graph = Graph(parse_net(text)[0], pb.TRAIN)
    params = fillers.init_params(graph, seed=3)
    params[0] = np.random.default_rng(11).standard_normal(shape).astype(np.float32)  # the bottom, x
    want_top, want_loss, want_diffs = run("caffe", text, params)
    got_top, got_loss, got_diffs = run("tensorflow", text, params)
    close(got_top, want_top, "top")
    assert abs(got_loss - want_loss) <= 1e-4 * max(abs(want_loss), 1.0)
    for blob, (got, want) in zip(graph.params, zip(got_diffs, want_diffs)):
        close(got, want, f"diff of {blob.layer}")


def op_types(channels, conv):
    """The op types of the traced forward pass of a convolution over a 1 x channels x 19 x 19 input."""
    shape = (1, channels, 19, 19)
    text = (f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ '
            f'{" ".join(f"dim: {d}" for d in shape)} }} }} }}\n'
            f'layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param {{ {conv} }} }}\n')
    graph = Graph(parse_net(text)[0], pb.TEST)
    params = [tf.constant(value) for value in fillers.init_params(graph, seed=1)]

    def forward(x):
        _, blobs = compiler.run(graph, params, compiler.Context(graph, {"data": x}, False))
        return blobs["conv"].tensor

    traced = tf.function(forward, autograph=False).get_concrete_function(tf.TensorSpec(shape, tf.float32))
    return collections.Counter(op.type for op in traced.graph.get_operations())


def test_xception_sized_depthwise_convolution_is_one_op():
    """728 groups of one channel: one depthwise op, not 728 convolutions and a concat."""
    types = op_types(728, "num_output: 728 group: 728 kernel_size: 3 pad: 1")
    assert types["DepthwiseConv2dNative"] == 1
    assert types["Conv2D"] == 0 and types["ConcatV2"] == 0 and types["Split"] == 0


def test_grouped_convolution_is_one_op():
    types = op_types(64, "num_output: 64 group: 32 kernel_size: 3 pad: 1")
    assert types["Conv2D"] == 1
    assert types["ConcatV2"] == 0 and types["Split"] == 0
