"""A deploy net and its .caffemodel as a TensorFlow SavedModel, with the TensorFlow backend's Caffe numerics: `deepspark export`.

The SavedModel's `serving_default` signature takes the net's inputs by name, as
Caffe does (N x C x H x W float32, any N) and returns the blobs that nothing in
the net consumes, by name (a deploy net's `prob`, say). A fully convolutional
net takes any height and width and gives Caffe's outputs at each (Caffe's
reshape); a net with a layer that fixes the size (InnerProduct, Reshape, ...)
refuses any other with an error naming the shape it takes. It holds no DeepSpark
code: `tf.saved_model.load` serves it wherever TensorFlow runs. The input is
what the deploy net's Input layer takes: the training's transform_param (its
scale, mean and crop) is the caller's to apply, as with pycaffe's Net.
"""

import logging
import os

from deepspark import checkpoint, nets
from deepspark.backends import create_model
from deepspark.config import set_fields
from deepspark.data import lmdb_io
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

log = logging.getLogger(__name__)

SIGNATURE = "serving_default"


def export(model_path, weights, output, overwrite=False, **options):
    """Write the SavedModel of the deploy net at `model_path` (a file or a model folder) with the parameters
    of the .caffemodel `weights` to the folder `output` (under a temporary name, renamed when complete);
    returns ({input: shape, its batch None and "any" where any size goes}, [output names]).

    options: ExportParameter fields by name. A layer with parameters that the weights do not name would serve
    its fillers' values (zeros, mostly): refused, unless allow_uncovered, which logs the same line as a warning
    instead."""
    allow_uncovered = set_fields(pb.ExportParameter(), options).allow_uncovered
    net, source = nets.deploy_net(model_path, "export")
    python = [i for i, layer in enumerate(net.layer) if layer.type == "Python"]
    if python:
        raise ConfigError(f"layer '{net.layer[python[0]].name}' is a Python layer: a SavedModel carries no Python "
                          "code, so export cannot hold it", *source.where(python[0]))
    made = missing_parent(output)  # TF Serving's name/version layout: made here, and removed if export fails
    if made:
        os.makedirs(os.path.dirname(os.path.abspath(output)))
    try:
        lmdb_io.refuse_existing(output, overwrite)
        model = create_model("tensorflow", net, phase=pb.TEST, source=source)
        refuse_no_outputs(model.graph)
    except BaseException:
        if made:
            lmdb_io.remove_path(made)
        raise
    from deepspark.backends.tensorflow.runtime import tf  # deferred: TensorFlow loads only for this verb

    tmp = lmdb_io.temp_path(output)
    lmdb_io.remove_path(tmp)
    try:
        layers = checkpoint.read_caffemodel(weights)
        uncovered = uncovered_layers(model.graph, layers, weights)
        if uncovered and not allow_uncovered:
            raise ConfigError(uncovered + " (--allow-uncovered exports them with those values, and says so)",
                              weights)
        if uncovered:
            log.warning(f"{weights}: {uncovered}")
        model.set_params(checkpoint.weights_for(model.graph, layers, model.get_params(), weights))
        module = model.serving_module()
        tf.saved_model.save(module, tmp, signatures={SIGNATURE: module.serve.get_concrete_function()})
        lmdb_io.rename_into(tmp, output)
    except BaseException:
        lmdb_io.remove_path(tmp)
        if made:
            lmdb_io.remove_path(made)
        raise
    finally:
        model.close()
    inputs = {name: tuple("any" if i and d is None else d for i, d in enumerate(shape))  # N x C x any x any
              for name, shape in module.input_shapes.items()}
    return inputs, list(model.graph.outputs)


def uncovered_layers(graph, layers, path):
    """What the weights `layers` (read_caffemodel's) leave uncovered in `graph`: "" if they fill every
    parameter, else a sentence naming the layers with a parameter they do not fill (by Caffe's copy by name)."""
    filled = checkpoint.weights_for(graph, layers, [None] * len(graph.params), path)
    lacking = [layer.name for layer in graph.layers if any(filled[i] is None for i in layer.blob_params)]
    if not lacking:
        return ""
    named = [layer.name for layer in graph.layers if layer.blob_params]
    given = {name for name, _ in (layers.items() if hasattr(layers, "items") else layers)}
    which = "share no layer name with the net: they lack" if given.isdisjoint(named) else "lack"
    shown = ", ".join(f"'{name}'" for name in lacking[:8]) + (f" and {len(lacking) - 8} more" * (len(lacking) > 8))
    return (f"the weights {which} {len(lacking)} of the net's {len(named)} layers with parameters ({shown}), "
            "which would serve their fillers' values, not trained ones")


def refuse_no_outputs(graph):
    """A ConfigError where `graph` has no outputs (every blob is read by a later layer: a Silence layer, say):
    its SavedModel would answer nothing."""
    if graph.outputs:
        return
    silent = [layer for layer in graph.layers if layer.type == "Silence"]
    why, fix = ((f"layer '{silent[-1].name}' (Silence) takes {', '.join(silent[-1].bottoms)}",
                 "remove the Silence layer") if silent else
                ("every blob is read by a later layer, or is a loss layer's automatic top",
                 "let a named blob be the net's output"))
    raise ConfigError(f"the net has no outputs ({why}), so its SavedModel would give nothing; {fix}",
                      *graph.source.where(silent[-1].index if silent else 0))


def missing_parent(path):
    """The outermost folder above `path` that does not exist (what making its parents creates), or None."""
    missing, folder = None, os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        missing, folder = folder, os.path.dirname(folder)
    return missing
