"""The TensorFlow backend's forward path, direct_call: a traced pass run by TensorFlow's executor directly, on its
single-threaded executor where asked, and on the default one where that refuses the pass's control flow."""

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from deepspark.backends.tensorflow.model import direct_call, tf, traced  # noqa: E402

SHAPE = (2, 3)


def compiled(function):
    """direct_call's input: `function` of {"data": tensor} traced for SHAPE, as a forward pass is."""
    return traced(function, input_signature=[{"data": tf.TensorSpec(SHAPE, tf.float32)}]).get_concrete_function()


@pytest.mark.parametrize("single_threaded", [True, False])
def test_the_pass_answers_as_its_concrete_function_and_leaves_the_input_alone(single_threaded):
    def layers(inputs):
        x = inputs["data"]
        return {"relu": tf.nn.relu(x), "sum": tf.reduce_sum(x * x, axis=1), "copy": tf.identity(x)}

    concrete = compiled(layers)
    data = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    kept = data.copy()
    call = direct_call(concrete, {"data": SHAPE}, single_threaded)
    got = call({"data": data})
    want = {name: value.numpy() for name, value in concrete({"data": tf.constant(data)}).items()}
    assert sorted(got) == sorted(want)
    assert all(got[name].tobytes() == want[name].tobytes() for name in want)
    got["copy"][...] = 7.0  # the answer is the caller's own array
    assert np.array_equal(data, kept) and np.array_equal(call({"data": data})["copy"], kept)


def test_control_flow_falls_back_to_the_default_executor_without_running_twice():
    counter = tf.Variable(0.0)

    def looped(inputs):
        doubled = tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2.0), (0, inputs["data"]))[1]
        counter.assign_add(1.0)  # stateful, as a recurrent layer's carried state
        return {"out": doubled}

    call = direct_call(compiled(looped), {"data": SHAPE}, single_threaded=True)
    for calls in (1, 2):
        assert np.array_equal(call({"data": np.ones(SHAPE, np.float32)})["out"], np.full(SHAPE, 8.0, np.float32))
        assert counter.numpy() == calls
