"""A Caffe net as a DAG for one phase, with the layer registry that shapes it.

Which module holds what:
- registry: the registry (LayerSpec, REGISTRY, layer_type, check_table) and the helpers shape rules share;
- neuron, vision, common, loss, recurrent, detection, data: the shape rules of each family of layer types, one
  `@layer_type` row per type (backends/tensorflow/layers/ keeps each type's compute under the same family name);
- phase: Caffe's include/exclude filter; dag: Layer, Param, BuildContext and Graph;
- backward: which diffs Caffe's backward computes; rewrites: batch size, input shapes, taps and a span of a net.

To add a compute type: its shape rule under `@layer_type("Name", ...)` in its family's module here, and its
compute in backends/tensorflow/layers/<family>.py (Caffe runs its own layer of that name; check_table names a
type a backend's table lacks). To add a data layer the backends feed (`fed=True`): its shape rule in data.py
here, and its feeder in deepspark/data/, registered there with data.table.feeds beside the feeder
(deepspark.data's import-time check_feeders names a fed type with no row); both backends feed every fed type.
"""

# The families register their rows as they are imported, so the flag sets below are computed after them.
from deepspark.graph import common, data, detection, loss, neuron, recurrent, vision  # noqa: F401
from deepspark.graph.backward import backward_needs
from deepspark.graph.data import crop_of, crop_shape
from deepspark.graph.dag import BuildContext, Graph, Layer, Param
from deepspark.graph.detection import aspect_ratios, permute_order, prior_image_size, prior_step, proposal_anchors
from deepspark.graph.phase import layer_included, make_state, state_meets_rule
from deepspark.graph.recurrent import RECURRENT_STATES, recurrent_inputs
from deepspark.graph.registry import (AUTOMATIC, REGISTRY, LayerSpec, ShapeError, canonical_axis, check_table, count,
                                      fmt, layer_type, legacy, spec, supported_types, types)
from deepspark.graph.rewrites import TAP, layers_between, tap_name, with_batch_size, with_input_shapes, with_taps
from deepspark.graph.vision import conv_geometry, crop_offsets, pool_geometry, pooled_size, spp_levels

# The kinds of layer other modules ask about, from the registered rows.
LOSS_TYPES = types("loss")
DATA_TYPES = types("data")
FED_TYPES = types("fed")
LABELLED_TYPES = types("labelled")
