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

import os

from deepspark import checkpoint, nets
from deepspark.backends import create_model
from deepspark.data import lmdb_io
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

SIGNATURE = "serving_default"


def export(model_path, weights, output, overwrite=False):
    """Write the SavedModel of the deploy net at `model_path` (a file or a model folder) with the parameters
    of the .caffemodel `weights` to the folder `output` (under a temporary name, renamed when complete);
    returns ({input: shape, its batch None and "any" where any size goes}, [output names])."""
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
    except BaseException:
        if made:
            lmdb_io.remove_path(made)
        raise
    from deepspark.backends.tensorflow.runtime import tf  # deferred: TensorFlow loads only for this verb

    tmp = lmdb_io.temp_path(output)
    lmdb_io.remove_path(tmp)
    try:
        params = checkpoint.weights_for(model.graph, checkpoint.read_caffemodel(weights), model.get_params(),
                                        weights)
        model.set_params(params)
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


def missing_parent(path):
    """The outermost folder above `path` that does not exist (what making its parents creates), or None."""
    missing, folder = None, os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        missing, folder = folder, os.path.dirname(folder)
    return missing
