"""The layer table: how each graph layer type reaches Caffe, as the LayerParameter Caffe builds from it.

A layer function takes (layer, graph, keep_data): the graph.Layer, its
Graph and the model's data_layers choice (keep_data: Caffe reads the Data
layers' LMDB itself), and returns the LayerParameter for Caffe. Most types
are Caffe's own layer, passed through; a layer whose tops come from a batch
becomes an Input layer of the same name, tops and shapes. Adding a layer
type means its registration here.
"""

from deepspark.graph import FED_TYPES
from deepspark.proto import deepspark_pb2 as pb

LAYERS = {}  # graph layer type -> its function

# What our Graph has already resolved for this phase, which Caffe must not see again.
RESOLVED_FIELDS = ("include", "exclude", "blobs", "phase")


def layer(*types):
    def register(function):
        for kind in types:
            LAYERS[kind] = function
        return function
    return register


def input_layer(layer):
    """An Input layer standing for a fed data layer: same name, tops and shapes."""
    out = pb.LayerParameter(name=layer.name, type="Input", top=layer.tops)
    for shape in layer.top_shapes:
        out.input_param.shape.add().dim.extend(shape)
    return out


@layer(*sorted(FED_TYPES - {"Data"}))
def fed(layer, graph, keep_data):
    return input_layer(layer)


@layer("Data")
def data(layer, graph, keep_data):
    """Fed as an Input layer; with keep_data, Caffe's Data layer reading its LMDB at the graph's batch size."""
    if not keep_data:
        return input_layer(layer)
    out = passed_through(layer, graph, keep_data)
    if graph.context.batch_size:
        out.data_param.batch_size = graph.context.batch_size
    return out


@layer("HDF5Output")
def hdf5_output(layer, graph, keep_data):
    """DeepSpark's HDF5Output writer as a pycaffe Python layer (Caffe's own aborts on its second forward: it
    makes the file's datasets again); the same file as the TensorFlow backend writes."""
    out = pb.LayerParameter(name=layer.name, type="Python", bottom=layer.bottoms)
    out.python_param.module = "deepspark.backends.caffe.hdf5_output"
    out.python_param.layer = "HDF5OutputLayer"
    out.python_param.param_str = layer.param.hdf5_output_param.file_name
    return out


@layer("DummyData",
       "Convolution", "Deconvolution", "Pooling", "LRN",
       "InnerProduct", "Dropout", "BatchNorm", "Scale", "Bias", "Eltwise", "Concat", "Slice", "Split", "Silence",
       "Flatten", "Reshape", "Softmax", "ArgMax",
       "ReLU", "Sigmoid", "TanH", "AbsVal", "BNLL", "ELU", "Power", "Exp", "Log", "PReLU",
       "SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "Accuracy",
       "Python")
def passed_through(layer, graph, keep_data):
    """Caffe's own layer of the same type, as the prototxt defines it."""
    out = pb.LayerParameter()
    out.CopyFrom(layer.param)
    for field in RESOLVED_FIELDS:
        out.ClearField(field)
    return out
