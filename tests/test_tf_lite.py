"""The TensorFlow backend's small inference passes on TensorFlow Lite's interpreter (backends/tensorflow/lite.py):
which passes move there, how few operators MTCNN's P-Net takes there, and that the answers stay pycaffe's, with
the parameters written after the move too."""

import os
import threading

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import deepspark  # noqa: E402
from deepspark.backends.tensorflow import lite  # noqa: E402
from deepspark.backends.tensorflow.model import tf, traced  # noqa: E402

ZOO = os.path.join(os.path.dirname(__file__), "data", "zoo")
PNET, ONET = os.path.join(ZOO, "mtcnn_det1.prototxt"), os.path.join(ZOO, "mtcnn_det3.prototxt")
# Operators of P-Net's 12 x 12 pass in the interpreter: 5 convolutions with their bias adds, 3 PReLUs of 4 ops,
# the pooling, the softmax, and the transposes and reshapes of Caffe's layout (blobs and kernels). TensorFlow's
# executor ran ~55 kernels for the same pass (75 nodes of its optimised graph less arguments and constants).
PNET_OPERATORS = 37


def pass_of(net):
    """The call that serves `net`'s forward pass at its present shape."""
    model = net._model
    return model._forward_calls.calls[model._forward_fn]


def test_which_passes_may_move_small_test_passes_of_the_known_layers():
    pnet = deepspark.Net(PNET, seed=1, backend="tensorflow")
    assert lite.worth_it(pnet._model.graph, False)
    assert not lite.worth_it(pnet._model.graph, True)  # TRAIN: dropout's randomness, running statistics
    pnet.blobs["data"].reshape(1, 3, 288, 384)  # the first scale of a 640 x 480 image's pyramid: too big
    pnet.reshape()
    assert not lite.worth_it(pnet._model.graph, False)
    assert not lite.worth_it(deepspark.Net(ONET, seed=1, backend="tensorflow")._model.graph, False)


@pytest.mark.caffe
def test_pnet_moves_after_its_first_calls_in_few_operators_and_answers_as_pycaffe(tmp_path):
    pytest.importorskip("caffe")
    weights = str(tmp_path / "pnet.caffemodel")
    deepspark.Net(PNET, seed=1, backend="caffe").save(weights)
    ours = deepspark.Net(PNET, weights, backend="tensorflow")
    theirs = deepspark.Net(PNET, weights, backend="caffe")
    data = np.random.default_rng(0).uniform(-1, 1, ours.blobs["data"].shape).astype(np.float32)
    executor = {name: value.copy() for name, value in ours.forward(data=data).items()}
    assert not hasattr(pass_of(ours), "interpreter")
    for _ in range(lite.CALLS_BEFORE):
        moved = ours.forward(data=data)
    call = pass_of(ours)
    operators = [op["op_name"] for op in call.interpreter._get_ops_details() if op["op_name"] != "DELEGATE"]
    assert "CONV_2D" in operators and len(operators) <= PNET_OPERATORS
    want = theirs.forward(data=data)
    for name, value in want.items():
        np.testing.assert_allclose(moved[name], executor[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(moved[name], value, rtol=1e-4, atol=1e-5)

    for net in (ours, theirs):  # a write after the move: the interpreter is fed it at the next call
        net.params["conv1"][0].data[...] *= -0.5
        net.params["PReLU2"][0].data[...] = 0.75
    got, want = ours.forward(data=data), theirs.forward(data=data)
    assert pass_of(ours) is call
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)
    assert not np.allclose(got["conv4-2"], executor["conv4-2"])  # the write took


def test_a_pass_the_converter_refuses_is_none():
    def needs_flex(*tensors):  # no built-in of TensorFlow Lite computes it
        return [tf.math.cumprod(tensors[0], axis=1) + tensors[1]]

    specs = [tf.TensorSpec((2, 3), tf.float32, name="input0"), tf.TensorSpec((3,), tf.float32, name="param0")]
    concrete = traced(needs_flex, input_signature=specs).get_concrete_function()
    param = tf.Variable(np.zeros(3, np.float32))
    assert lite.interpreted(concrete, ["data"], ["out"], [param], lambda: 0) is None

    def adds(*tensors):
        return [tensors[0] + tensors[1]]

    concrete = traced(adds, input_signature=specs).get_concrete_function()
    call = lite.interpreted(concrete, ["data"], ["out"], [param], lambda: 0)
    assert np.array_equal(call({"data": np.ones((2, 3), np.float32)})["out"], np.ones((2, 3), np.float32))


def test_two_threads_calling_one_interpreted_pass_each_get_their_own_answer():
    def adds(*tensors):
        return [tensors[0] + tensors[1]]

    specs = [tf.TensorSpec((64, 64), tf.float32, name="input0"), tf.TensorSpec((64,), tf.float32, name="param0")]
    concrete = traced(adds, input_signature=specs).get_concrete_function()
    call = lite.interpreted(concrete, ["data"], ["out"], [tf.Variable(np.zeros(64, np.float32))], lambda: 0)
    wrong = []

    def caller(value):
        data = np.full((64, 64), value, np.float32)
        for _ in range(300):
            if not np.array_equal(call({"data": data})["out"], data):  # another thread's input between set and get
                wrong.append(value)

    threads = [threading.Thread(target=caller, args=(value,)) for value in (1.0, 2.0, 3.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
