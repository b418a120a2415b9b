"""pycaffe's own Net and solver on the net the Caffe backend compiles for a model, with the model's weights: the baselines of bench/caffe_backend.py and bench/time_layers.py, built from the backend's public parts (its compiler, base.Model's graph, get_params and feed), never from its insides."""

import os
import tempfile

from deepspark.backends.caffe import compiler, runtime
from deepspark.backends.caffe.model import param_blobs


def _built(message, build):
    """build(path) of `message` written as a prototxt in a scratch folder (a solver's snapshot_prefix in it too):
    Caffe reads its nets and solvers whole as it builds them, so the folder goes at once."""
    with tempfile.TemporaryDirectory(prefix="deepspark-bench-pycaffe-") as scratch:
        if hasattr(message, "snapshot_prefix"):
            message.snapshot_prefix = os.path.join(scratch, "state")  # never written: no snapshots
        path = os.path.join(scratch, "built.prototxt")
        with open(path, "w") as stream:
            stream.write(compiler.to_text(message))
        return build(path)


def with_weights(net, model):
    """`net` holding `model`'s parameters (Caffe's blob order: the graph's)."""
    for blob, array in zip(param_blobs(model.graph, net), model.get_params()):
        blob.data[...] = array
    return net


def net(model):
    """A caffe.Net of the net the backend compiles for `model` (its fed layers as Input), with its weights."""
    caffe = runtime.caffe()
    message = compiler.to_caffe(compiler.net_param(model.graph), caffe.proto.caffe_pb2.NetParameter)
    phase = caffe.TRAIN if model.train else caffe.TEST
    return with_weights(_built(message, lambda path: caffe.Net(path, phase)), model)


def solver(model):
    """A pycaffe solver of `model`'s net and solver as the backend compiles them, with its weights."""
    caffe = runtime.caffe()
    message = compiler.to_caffe(compiler.solver_param(model.solver_param, model.iter_size),
                                caffe.proto.caffe_pb2.SolverParameter)
    message.net_param.CopyFrom(compiler.to_caffe(compiler.net_param(model.graph), caffe.proto.caffe_pb2.NetParameter))
    built = _built(message, caffe.get_solver)
    with_weights(built.net, model)
    return built


def load(net, model, batch):
    """Copy `batch` (the model's fed tops) into `net`'s Input blobs."""
    for top, array in model.feed(batch).items():
        net.blobs[top].data[...] = array
