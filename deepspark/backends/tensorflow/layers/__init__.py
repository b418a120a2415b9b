"""The layer table: each Caffe layer type as one small TensorFlow function, in one module per layer family.

A layer function takes (layer, bottoms, params, ctx): the graph.Layer (its
LayerParameter and shapes), its bottom Blobs (deepspark.backends.tensorflow.layout),
its parameter blobs as tensors in Caffe's shapes (or in the axis order its
registration asks for), and the compiler's Context; it returns its top Blobs.
A type's function sits in layers/<family>.py, as its shape rule sits in
graph/<family>.py, and registers itself with @layer (layers.table); adding a
type means that function and its shape rule (docs/layers.md). Importing this
package imports every family and checks the full table against graph.REGISTRY.

Where Caffe's Backward is not the gradient of its Forward (a clipped log, a
1e-4 in a denominator, a variance), tf.custom_gradient gives Caffe's.
"""

# Each family module fills LAYERS as it is imported.
from deepspark.backends.tensorflow.layers import common, data, detection, loss, neuron, recurrent, vision  # noqa: F401
from deepspark.backends.tensorflow.layers.table import LAYERS, Entry, layer  # noqa: F401 (the package's names)
from deepspark.graph import check_table

check_table(LAYERS, "TensorFlow")
