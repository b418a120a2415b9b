"""The TensorFlow backend's speed where #43 found it slow: depthwise compile time, and batch-1 calls against pycaffe.

1. `tf_speed_depthwise_compile`: an Xception-sized stack (Xception's middle flow: 728 channels at 19x19, each
   block three ReLU -> 3x3 depthwise Convolution (group 728) -> 1x1 Convolution -> Scale, a residual
   Eltwise per block) built by `deepspark.Net` and run forward once, on each backend: the seconds from
   construction to the first forward's answer (the TensorFlow backend builds and traces its pass there), and
   their ratio. Before depthwise ran as one op, 728 convolutions a layer took minutes.
2. `tf_speed_mtcnn_batch1`: MTCNN's three nets (tests/data/zoo/mtcnn_det{1,2,3}.prototxt, P-Net at 12x12, R-Net
   at 24x24, O-Net at 48x48; P-Net also at 288x384, the first scale of its image pyramid for a 640x480 image,
   as a detector runs it) at batch 1: `deepspark.Net.forward` on the TensorFlow backend (and on the Caffe
   backend) against pycaffe's own `net.forward` (the input copied into its blob first), all three loading the
   same weights from a .caffemodel as a detector does; rounds interleaved so machine noise hits all alike;
   images/s, microseconds per call, and the median of the per-round ratios ours / pycaffe's. The rule (#43):
   at batch 1 the TensorFlow backend is within 2x of pycaffe, a ratio of at least 0.5, on all four. A small
   pass (P-Net at 12x12, R-Net) moves to TensorFlow Lite's interpreter after its first calls
   (deepspark/backends/tensorflow/lite.py): `tf_path` says which path the timed calls took, and the answers
   compared with pycaffe's are that path's, taken after the rounds. Every contender gets the same thread
   count (--threads).
3. `tf_speed_call_floor`: what one call costs TensorFlow's executor itself at batch 1, with no work in it: an
   empty tf.function (no input, a constant out) called as a tf.function and as its concrete function, and
   `direct_call` (the TensorFlow backend's executor path: an array in, an array out) on a function that only
   passes a 1x3x12x12 input on: the median and the best round. No forward on the executor at batch 1 is faster
   than this last figure (what moved P-Net at 12x12 to the interpreter); on a loaded machine its best round is
   the one to read.

Prints one JSON line per figure and appends them to --out.

    PYTHONPATH=. .venv/bin/python bench/tf_speed.py [--quick] [--threads 1] [--out FILE]
"""

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import _results  # noqa: E402  (bench/_results.py)
import deepspark  # noqa: E402
from deepspark.backends.caffe import runtime  # noqa: E402
from deepspark.backends.tensorflow.model import direct_call, tf, traced  # noqa: E402
from deepspark.config import parse_net  # noqa: E402

MTCNN = {name: os.path.join(ROOT, "tests", "data", "zoo", f"mtcnn_{name}.prototxt")
         for name in ("det1", "det2", "det3")}
# P-Net at its prototxt's 12x12 and at the first scale of MTCNN's pyramid for a 640x480 image (min face 20: 0.6)
CASES = [("det1", None), ("det1", (1, 3, 288, 384)), ("det2", None), ("det3", None)]
CHANNELS, SIZE = 728, 19  # Xception's middle flow


def separable(name, bottom):
    """ReLU -> depthwise 3x3 -> pointwise 1x1 -> Scale, as Xception's Caffe ports write it less their BatchNorm
    (whose unset statistics, zeros, would scale each layer by 1/sqrt(eps) into infinities)."""
    conv = 'weight_filler { type: "msra" } bias_term: false'
    return (f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{bottom}" top: "{name}_relu" }}\n'
            f'layer {{ name: "{name}_dw" type: "Convolution" bottom: "{name}_relu" top: "{name}_dw" '
            f'convolution_param {{ num_output: {CHANNELS} group: {CHANNELS} kernel_size: 3 pad: 1 {conv} }} }}\n'
            f'layer {{ name: "{name}_pw" type: "Convolution" bottom: "{name}_dw" top: "{name}_pw" '
            f'convolution_param {{ num_output: {CHANNELS} kernel_size: 1 {conv} }} }}\n'
            f'layer {{ name: "{name}_scale" type: "Scale" bottom: "{name}_pw" top: "{name}_pw" '
            f'scale_param {{ bias_term: true }} }}\n')


def xception_middle(blocks):
    """A NetParameter of `blocks` Xception middle-flow blocks (3 depthwise convolutions each)."""
    text = (f'name: "xception_middle" layer {{ name: "data" type: "Input" top: "data" '
            f'input_param {{ shape {{ dim: 1 dim: {CHANNELS} dim: {SIZE} dim: {SIZE} }} }} }}\n')
    bottom = "data"
    for b in range(blocks):
        inner = bottom
        for i in range(3):
            text += separable(f"block{b}_sep{i}", inner)
            inner = f"block{b}_sep{i}_pw"
        text += (f'layer {{ name: "block{b}_add" type: "Eltwise" bottom: "{inner}" bottom: "{bottom}" '
                 f'top: "block{b}_add" }}\n')
        bottom = f"block{b}_add"
    return parse_net(text, "xception_middle")[0]


def first_forward(net_param, backend, threads):
    """Seconds from building `deepspark.Net` to its first forward's answer, and that answer."""
    data = np.random.default_rng(0).standard_normal((1, CHANNELS, SIZE, SIZE)).astype(np.float32)
    started = time.perf_counter()
    net = deepspark.Net(net_param, backend=backend, seed=1, threads=threads)
    outputs = net.forward(data=data)
    seconds = time.perf_counter() - started
    net.close()
    return seconds, outputs


def bench_depthwise(blocks, threads, emit):
    net_param = xception_middle(blocks)
    seconds, answers = {}, {}
    for backend in ("caffe", "tensorflow"):
        seconds[backend], answers[backend] = first_forward(net_param, backend, threads)
        emit({"bench": "tf_speed_depthwise_compile", "backend": backend, "depthwise_layers": 3 * blocks,
              "channels": CHANNELS, "size": SIZE, "first_forward_s": round(seconds[backend], 2)})
    agree = all(np.allclose(answers["tensorflow"][name], want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
                for name, want in answers["caffe"].items())
    emit({"bench": "tf_speed_depthwise_compile", "depthwise_layers": 3 * blocks, "outputs_agree": bool(agree),
          "ratio_tf_vs_caffe": round(seconds["tensorflow"] / seconds["caffe"], 2)})


class PyCaffe:
    """The baseline: pycaffe's Net on the prototxt and weights, its input copied into the blob before each
    net.forward()."""

    def __init__(self, path, weights, threads, shape):
        caffe = runtime.caffe(threads)
        self.net = caffe.Net(path, weights, caffe.TEST)
        self.net.blobs["data"].reshape(*shape)
        self.net.reshape()

    def forward(self, data):
        self.net.blobs["data"].data[...] = data
        return self.net.forward()


def rate(forward, data, seconds):
    """Images/s of `forward(data)` at batch 1, calling it for about `seconds`."""
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        forward(data)
        calls += 1
    return calls / (time.perf_counter() - started)


def interleaved(contenders, data, rounds, seconds):
    """{name: [images/s per round]} of each of `contenders` ({name: forward}), in rounds whose order flips
    each time, so that machine noise hits all alike."""
    rates = {impl: [] for impl in contenders}
    order = list(contenders)
    for round_index in range(rounds):
        for impl in order if round_index % 2 == 0 else order[::-1]:
            rates[impl].append(rate(contenders[impl], data, seconds))
    return rates


class PathLines(logging.Handler):
    """The TensorFlow backend's lines saying what runs a forward pass (its executor, or TensorFlow Lite's
    interpreter for a small pass called again and again), collected while the block runs."""

    LOGGER = "deepspark.backends.tensorflow.model"

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger(self.LOGGER)
        self.level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self.level)


def bench_mtcnn(name, shape, rounds, seconds, threads, emit):
    """The contenders on MTCNN net `name` at input `shape` (None: the prototxt's), with the same weights."""
    with tempfile.TemporaryDirectory(prefix="tf_speed-") as scratch:
        weights = os.path.join(scratch, f"mtcnn_{name}.caffemodel")
        maker = deepspark.Net(MTCNN[name], seed=1, threads=threads)
        maker.save(weights)
        maker.close()
        ours = deepspark.Net(MTCNN[name], weights, backend="tensorflow", threads=threads)
        theirs = deepspark.Net(MTCNN[name], weights, backend="caffe", threads=threads)
        shape = shape or ours.blobs["data"].shape
        baseline = PyCaffe(MTCNN[name], weights, threads, shape)
    contenders = {"deepspark_tf": lambda x: ours.forward(data=x), "deepspark_caffe": lambda x: theirs.forward(data=x),
                  "pycaffe": baseline.forward}
    data = np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float32)
    for forward in contenders.values():  # out of the rounds: the reshape to `shape` and TensorFlow's trace
        forward(data)
    with PathLines() as paths:  # the TF backend's DEBUG line: which runs the pass once chosen
        rates = interleaved(contenders, data, rounds, seconds)
    # After the rounds: the answers of the pass that was timed (a small one moves to TensorFlow Lite's interpreter)
    answers = {impl: {k: np.array(v) for k, v in forward(data).items()} for impl, forward in contenders.items()}
    agree = all(np.allclose(answers["deepspark_tf"][k], v, rtol=1e-4, atol=1e-5) for k, v in answers["pycaffe"].items())
    case = {"bench": "tf_speed_mtcnn_batch1", "net": name, "input": "x".join(map(str, shape)),
            "tf_path": "interpreter" if any("Lite" in line for line in paths.lines) else "executor"}
    for impl, values in rates.items():
        median = statistics.median(values)
        emit({**case, "impl": impl, "threads": threads, "images_per_s": round(median, 1),
              "us_per_call": round(1e6 / median, 1)})
    for impl in ("deepspark_tf", "deepspark_caffe"):
        ratios = [mine / base for mine, base in zip(rates[impl], rates["pycaffe"])]
        emit({**case, "impl": impl, "outputs_agree": bool(agree),
              "ratio_vs_pycaffe": round(statistics.median(ratios), 3), "target": 0.5})
    ours.close()
    theirs.close()


def bench_floor(rounds, seconds, threads, emit):
    """TensorFlow's own cost of one call with no work in it (3. above), microseconds per call."""
    shape = (1, 3, 12, 12)
    empty = traced(lambda: tf.constant(0.0), input_signature=[])
    concrete = empty.get_concrete_function()
    passing = traced(lambda inputs: {"data": tf.identity(inputs["data"])},
                     input_signature=[{"data": tf.TensorSpec(shape, tf.float32)}])
    passed = direct_call(passing.get_concrete_function(), {"data": shape})
    contenders = {"tf.function": lambda x: empty(), "concrete_function": lambda x: concrete(),
                  "direct_call": lambda x: passed({"data": x})}
    data = np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float32)
    for impl, values in interleaved(contenders, data, rounds, seconds).items():
        emit({"bench": "tf_speed_call_floor", "impl": impl, "threads": threads,
              "us_per_call": round(1e6 / statistics.median(values), 1),
              "best_us_per_call": round(1e6 / max(values), 1)})  # the round least disturbed by the machine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 Xception block, 3 short rounds per MTCNN net")
    parser.add_argument("--blocks", type=int, default=None, help="Xception middle-flow blocks (default 8, quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per MTCNN net (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="threads for TensorFlow and pycaffe's OpenBLAS")
    parser.add_argument("--out", default=_results.results_path("tf_speed"), help="JSON lines are also appended here")
    args = parser.parse_args()
    blocks = args.blocks or (1 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 7)
    seconds = 0.5 if args.quick else 2.0

    def emit(record):
        _results.emit({**record, "quick": args.quick} if args.quick else record, args.out)

    for name, shape in CASES:
        bench_mtcnn(name, shape, rounds, seconds, args.threads, emit)
    bench_floor(rounds, seconds, args.threads, emit)
    bench_depthwise(blocks, args.threads, emit)


if __name__ == "__main__":
    main()
