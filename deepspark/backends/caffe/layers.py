"""The layer table: how each graph layer type reaches Caffe, as the LayerParameter Caffe builds from it.

A layer function takes (layer, graph, keep_data): the graph.Layer, its
Graph and the model's data_layers choice (keep_data: Caffe reads the Data
layers' LMDB itself), and returns the LayerParameter for Caffe. Most types
are Caffe's own layer, passed through; a layer whose tops come from a batch
becomes an Input layer of the same name, tops and shapes (FED_TYPES, from
the registry). A type Caffe runs as its own layer needs no entry here: every
registered type the table does not name is passed through; only a type that
reaches Caffe otherwise has its function here (docs/layers.md). The table is
checked against graph.REGISTRY as this module is imported.
"""

from deepspark.backends.base import infogain_matrix
from deepspark.errors import ConfigError
from deepspark.graph import FED_TYPES, check_table, supported_types
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


@layer(*sorted(FED_TYPES))
def fed(layer, graph, keep_data):
    """Fed as an Input layer; with keep_data, a Data layer stays Caffe's own, reading its LMDB at the graph's
    batch size."""
    if not (keep_data and layer.type == "Data"):
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


def passed_through(layer, graph, keep_data):
    """Caffe's own layer of the same type, as the prototxt defines it: the entry of every type the table does
    not name."""
    out = pb.LayerParameter()
    out.CopyFrom(layer.param)
    for field in RESOLVED_FIELDS:
        out.ClearField(field)
    return out


@layer("InfogainLoss")
def infogain_loss(layer, graph, keep_data):
    """Caffe's own, once its matrix file is known to read as Caffe reads it (Caffe aborts on a bad one)."""
    if len(layer.bottoms) < 3:
        infogain_matrix(layer, graph.source)
    return passed_through(layer, graph, keep_data)


@layer("DetectionOutput")
def detection_output(layer, graph, keep_data):
    """Caffe's own, without what makes it act outside the net: this fork's Forward writes no file
    (its saving is commented out), yet its LayerSetUp empties save_output_param's output_directory and aborts
    on a missing label map or name-size file; `visualize` needs OpenCV, which this pycaffe lacks, and reads
    transform_param's mean file. Its detections are the same without them."""
    out = passed_through(layer, graph, keep_data)
    out.detection_output_param.ClearField("save_output_param")
    out.detection_output_param.ClearField("visualize")
    out.ClearField("transform_param")
    return out


def lacking(graph, net, caffe_types):
    """A ConfigError for the first layer of `net` (net_param's of `graph`) whose type this pycaffe lacks
    (Clip and Swish came to BVLC Caffe after the one it was built from); Caffe would abort on it."""
    for layer, out in zip(graph.layers, net.layer):
        if out.type not in caffe_types:
            return ConfigError(f"layer '{layer.name}': this pycaffe has no {out.type} layer (a later BVLC Caffe "
                               f"has it); the TensorFlow backend runs it", *graph.source.where(layer.index))
    return None


# Every other registered type is Caffe's own layer, passed through (a type this pycaffe lacks: `lacking`).
LAYERS.update({kind: passed_through for kind in supported_types() if kind not in LAYERS})
check_table(LAYERS, "Caffe")
