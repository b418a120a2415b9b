"""Small inference passes run by TensorFlow Lite's interpreter, where TensorFlow's executor costs most of a call.

A call of a traced pass through TensorFlow's executor (model.direct_call) costs
about 100 us before any arithmetic on this machine, and TensorFlow's CPU
kernels (oneDNN) each cost 6 to 10 us at the smallest sizes whatever their
work (a 1 x 1 convolution of 32 values as a 12 x 12 one, a transpose of 1000
values): measured, MTCNN's P-Net at 12 x 12 spends ~95 us of CPU in its ~50
kernels, on the executor's thread, against pycaffe's whole forward of ~25 us.
TensorFlow Lite's interpreter (part of the tensorflow package) runs the same
traced pass, converted once, in ~40 us a call with the parameters fed as
inputs: set again only after the model's parameters were written. Its kernels
sum in another order than TensorFlow's: the answers differ from the executor's
in the last bits (measured on MTCNN: at most 1e-6), well inside what the
tests hold both to against pycaffe.
"""

import contextlib
import math
import os
import sys
import threading
import warnings

from deepspark.backends.tensorflow.runtime import tf

# The layer types a pass may hold to run here: their TensorFlow ops are TensorFlow Lite built-ins (in the TEST
# phase: no randomness, no state). Any other layer, or a converter that refuses, leaves the pass to the executor.
LITE_LAYERS = frozenset({
    "Input", "Convolution", "Pooling", "InnerProduct", "ReLU", "PReLU", "Sigmoid", "TanH", "Softmax", "Concat",
    "Eltwise", "Split", "Dropout", "Flatten", "Reshape",
})
# The most blob values (every top's, summed) a pass may make to run here. Measured on MTCNN at batch 1, one
# thread (bench/tf_speed.py's nets, 2 busy cores): the interpreter answers P-Net at 12 x 12 (3 k values) ~4x
# faster than the executor and R-Net at 24 x 24 (42 k) ~1.8x, O-Net at 48 x 48 (234 k) about as fast, and P-Net
# at 288 x 384 (~2 M) 2x slower: past a few hundred thousand values the executor's kernels win.
MAX_VALUES = 1 << 17
# Forwards of one pass (one input shape) by the executor before it is converted: a conversion costs ~0.25 s, what
# the interpreter saves in some thousands of calls, so only a pass called again and again (a detector's net, a
# benchmark) pays it; a net run a few times answers at once.
CALLS_BEFORE = 16


def worth_it(graph, train):
    """Whether a forward pass of `graph` may run here: the TEST phase's, of LITE_LAYERS alone, small enough."""
    if train or any(layer.type not in LITE_LAYERS for layer in graph.layers):
        return False
    return sum(math.prod(shape) for layer in graph.layers for shape in layer.top_shapes) <= MAX_VALUES


@contextlib.contextmanager
def _native_silenced():
    """fd 2 to /dev/null meanwhile: the converter logs each pass it converts there (absl's I and W lines, MLIR's
    locations of what it refuses) and the interpreter its delegate, whatever TF_CPP_MIN_LOG_LEVEL says. What a
    refusal says is in its exception, and a refusal only leaves the pass to the executor."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def interpreted(concrete, inputs, outputs, params, written, threads=None):
    """`concrete`, a traced pass of (the tensors of `inputs`, then of `params`, TensorSpecs named input<i> and
    param<i>) -> [the tensors of the blobs `outputs`], as a function of {input: float32 array} -> {blob: array}
    run by TensorFlow Lite's interpreter on `threads` threads; None where the converter or the interpreter
    refuses it. `params`: the variables the pass reads, set into the interpreter at the first call and again
    whenever written() has changed since."""
    try:
        with warnings.catch_warnings(), _native_silenced():  # the Interpreter warns of its move to LiteRT
            warnings.simplefilter("ignore")
            flat = tf.lite.TFLiteConverter.from_concrete_functions([concrete], concrete).convert()
            interpreter = tf.lite.Interpreter(model_content=flat, num_threads=threads)
            interpreter.allocate_tensors()  # where it applies its default delegate (XNNPACK), and says so
    except Exception:  # noqa: BLE001  (any refusal, ConverterError or other: the executor runs every pass)
        return None
    fed = {d["name"]: d["index"] for d in interpreter.get_input_details()}
    answered = {d["name"]: d["index"] for d in interpreter.get_output_details()}
    names = [f"input{i}" for i in range(len(inputs))] + [f"param{i}" for i in range(len(params))]
    returned = [tensor.name.split(":")[0] for tensor in concrete.outputs]
    if sorted(fed) != sorted(names) or sorted(answered) != sorted(returned) or len(returned) != len(outputs):
        return None  # an input or output the converter dropped or merged: not this pass
    input_indices = [fed[f"input{i}"] for i in range(len(inputs))]
    param_indices = [fed[f"param{i}"] for i in range(len(params))]
    output_indices = [answered[name] for name in returned]
    loaded = [None]  # written() when the parameters were last set
    # One interpreter holds its tensors between set_tensor and get_tensor: two threads calling one Net (which the
    # executor's pass allows) take turns.
    lock = threading.Lock()

    def call(arrays):
        with lock:
            if loaded[0] != written():
                for index, variable in zip(param_indices, params):
                    interpreter.set_tensor(index, variable.numpy())
                loaded[0] = written()
            for index, top in zip(input_indices, inputs):
                interpreter.set_tensor(index, arrays[top])
            interpreter.invoke()
            return {blob: interpreter.get_tensor(index) for blob, index in zip(outputs, output_indices)}

    call.interpreter = interpreter
    return call
