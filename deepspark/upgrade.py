"""Caffe's upgrades of old nets and solvers (src/caffe/util/upgrade_proto.cpp), rule for rule.

A net is upgraded as Caffe's UpgradeNetAsNeeded does it when it reads a
prototxt, in the same order: V0 layers (`layers { layer { type: "conv" } }`,
padding layers folded into the next convolution or pooling) to V1, the V1
data layers' transform fields into transform_param, V1 layers (`layers {
type: CONVOLUTION }`) to today's `layer { type: "Convolution" }`, the
`input:` fields to an Input layer, BatchNorm's three old ParamSpecs dropped.
A solver's `solver_type` enum becomes its `type` string.

What Caffe refuses with a fatal error is a ConfigError at the layer's
FILE:LINE:COL; what Caffe only logs ("upgrading anyway") is a problem string
the caller reports. Each upgraded layer remembers which block of the file it
came from (`origins`), so that later errors still point into the file.
"""

from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

V1 = pb.V1LayerParameter

# Caffe's UpgradeV0LayerType.
V0_TYPES = {
    "accuracy": V1.ACCURACY, "bnll": V1.BNLL, "concat": V1.CONCAT, "conv": V1.CONVOLUTION, "data": V1.DATA,
    "dropout": V1.DROPOUT, "euclidean_loss": V1.EUCLIDEAN_LOSS, "flatten": V1.FLATTEN, "hdf5_data": V1.HDF5_DATA,
    "hdf5_output": V1.HDF5_OUTPUT, "im2col": V1.IM2COL, "images": V1.IMAGE_DATA, "infogain_loss": V1.INFOGAIN_LOSS,
    "innerproduct": V1.INNER_PRODUCT, "lrn": V1.LRN, "multinomial_logistic_loss": V1.MULTINOMIAL_LOGISTIC_LOSS,
    "pool": V1.POOLING, "relu": V1.RELU, "sigmoid": V1.SIGMOID, "softmax": V1.SOFTMAX,
    "softmax_loss": V1.SOFTMAX_LOSS, "split": V1.SPLIT, "tanh": V1.TANH, "window_data": V1.WINDOW_DATA,
}

# Caffe's UpgradeV1LayerType.
V1_TYPES = {
    V1.NONE: "", V1.ABSVAL: "AbsVal", V1.ACCURACY: "Accuracy", V1.ARGMAX: "ArgMax", V1.BNLL: "BNLL",
    V1.CONCAT: "Concat", V1.CONTRASTIVE_LOSS: "ContrastiveLoss", V1.CONVOLUTION: "Convolution",
    V1.DECONVOLUTION: "Deconvolution", V1.DATA: "Data", V1.DROPOUT: "Dropout", V1.DUMMY_DATA: "DummyData",
    V1.EUCLIDEAN_LOSS: "EuclideanLoss", V1.ELTWISE: "Eltwise", V1.EXP: "Exp", V1.FLATTEN: "Flatten",
    V1.HDF5_DATA: "HDF5Data", V1.HDF5_OUTPUT: "HDF5Output", V1.HINGE_LOSS: "HingeLoss", V1.IM2COL: "Im2col",
    V1.IMAGE_DATA: "ImageData", V1.INFOGAIN_LOSS: "InfogainLoss", V1.INNER_PRODUCT: "InnerProduct",
    V1.LRN: "LRN", V1.MEMORY_DATA: "MemoryData", V1.MULTINOMIAL_LOGISTIC_LOSS: "MultinomialLogisticLoss",
    V1.MVN: "MVN", V1.POOLING: "Pooling", V1.POWER: "Power", V1.RELU: "ReLU", V1.SIGMOID: "Sigmoid",
    V1.SIGMOID_CROSS_ENTROPY_LOSS: "SigmoidCrossEntropyLoss", V1.SILENCE: "Silence", V1.SOFTMAX: "Softmax",
    V1.SOFTMAX_LOSS: "SoftmaxWithLoss", V1.SPLIT: "Split", V1.SLICE: "Slice", V1.TANH: "TanH",
    V1.WINDOW_DATA: "WindowData", V1.THRESHOLD: "Threshold",
}

# Caffe's UpgradeV0LayerParameter: V0 field -> {V0 layer type: (V1 parameter message, its field)};
# "*" serves every type. A repeated target field is appended to; a None field takes the whole message.
_DATA_SOURCES = {"data": ("data_param", "source"), "hdf5_data": ("hdf5_data_param", "source"),
                 "images": ("image_data_param", "source"), "window_data": ("window_data_param", "source"),
                 "infogain_loss": ("infogain_loss_param", "source")}
V0_FIELDS = {
    "num_output": {"conv": ("convolution_param", "num_output"), "innerproduct": ("inner_product_param", "num_output")},
    "biasterm": {"conv": ("convolution_param", "bias_term"), "innerproduct": ("inner_product_param", "bias_term")},
    "weight_filler": {"conv": ("convolution_param", "weight_filler"),
                      "innerproduct": ("inner_product_param", "weight_filler")},
    "bias_filler": {"conv": ("convolution_param", "bias_filler"),
                    "innerproduct": ("inner_product_param", "bias_filler")},
    "pad": {"conv": ("convolution_param", "pad"), "pool": ("pooling_param", "pad")},
    "kernelsize": {"conv": ("convolution_param", "kernel_size"), "pool": ("pooling_param", "kernel_size")},
    "group": {"conv": ("convolution_param", "group")},
    "stride": {"conv": ("convolution_param", "stride"), "pool": ("pooling_param", "stride")},
    "pool": {"pool": ("pooling_param", "pool")},
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio")},
    "local_size": {"lrn": ("lrn_param", "local_size")},
    "alpha": {"lrn": ("lrn_param", "alpha")},
    "beta": {"lrn": ("lrn_param", "beta")},
    "k": {"lrn": ("lrn_param", "k")},
    "source": _DATA_SOURCES,
    "scale": {"*": ("transform_param", "scale")},
    "meanfile": {"*": ("transform_param", "mean_file")},
    "batchsize": {"data": ("data_param", "batch_size"), "hdf5_data": ("hdf5_data_param", "batch_size"),
                  "images": ("image_data_param", "batch_size"), "window_data": ("window_data_param", "batch_size")},
    "cropsize": {"*": ("transform_param", "crop_size")},
    "mirror": {"*": ("transform_param", "mirror")},
    "rand_skip": {"data": ("data_param", "rand_skip"), "images": ("image_data_param", "rand_skip")},
    "shuffle_images": {"images": ("image_data_param", "shuffle")},
    "new_height": {"images": ("image_data_param", "new_height")},
    "new_width": {"images": ("image_data_param", "new_width")},
    "concat_dim": {"concat": ("concat_param", "concat_dim")},
    "det_fg_threshold": {"window_data": ("window_data_param", "fg_threshold")},
    "det_bg_threshold": {"window_data": ("window_data_param", "bg_threshold")},
    "det_fg_fraction": {"window_data": ("window_data_param", "fg_fraction")},
    "det_context_pad": {"window_data": ("window_data_param", "context_pad")},
    "det_crop_mode": {"window_data": ("window_data_param", "crop_mode")},
    "hdf5_output_param": {"hdf5_output": ("hdf5_output_param", None)},
}

# The V1 data layers whose own parameter message carried the transform fields (UpgradeNetDataTransformation).
_TRANSFORMED = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param", V1.WINDOW_DATA: "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

# Caffe's UpgradeSolverType: the deprecated enum's values in order.
SOLVER_TYPES = ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam")


def _nowhere(index=None):
    return None, None, None


# -- which upgrades a net needs (Caffe's NetNeeds*) -----------------------------------------


def needs_v0(net):
    return any(layer.HasField("layer") for layer in net.layers)


def needs_v1(net):
    return len(net.layers) > 0


def needs_data_upgrade(net):
    return any(layer.type in _TRANSFORMED and
               any(getattr(layer, _TRANSFORMED[layer.type]).HasField(f) for f in _TRANSFORM_FIELDS)
               for layer in net.layers)


def needs_input_upgrade(net):
    return len(net.input) > 0


def needs_batch_norm_upgrade(net):
    return any(layer.type == "BatchNorm" and len(layer.param) == 3 for layer in net.layer)


def needs_upgrade(net):
    return (needs_v0(net) or needs_v1(net) or needs_data_upgrade(net) or needs_input_upgrade(net)
            or needs_batch_norm_upgrade(net))


# -- V0 -> V1 ---------------------------------------------------------------------------------


def fold_padding_layers(net, where=_nowhere):
    """Caffe's UpgradeV0PaddingLayers: a copy of `net` without its V0 padding layers, each folded into the
    convolution or pooling that reads it; and the index in `net.layers` of each layer kept."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    out.ClearField("layers")
    kept = []
    last_top = {blob: -1 for blob in net.input}  # blob -> index of the layer that last wrote it
    for i, connection in enumerate(net.layers):
        layer = connection.layer
        if layer.type != "padding":
            out.layers.add().CopyFrom(connection)
            kept.append(i)
        for j, blob in enumerate(connection.bottom):
            if blob not in last_top:
                raise ConfigError(f"layer '{layer.name}': unknown blob input {blob} to layer {j}", *where(i))
            source_index = last_top[blob]
            if source_index == -1 or net.layers[source_index].layer.type != "padding":
                continue
            source = net.layers[source_index]
            if layer.type not in ("conv", "pool"):
                raise ConfigError(f"layer '{layer.name}': padding layer input to non-convolutional / "
                                  f"non-pooling layer type {layer.type}", *where(i))
            if len(connection.bottom) != 1 or len(source.bottom) != 1 or len(source.top) != 1:
                raise ConfigError(f"layer '{layer.name}': a padding layer and the layer it feeds take a single "
                                  "blob each, and the padding layer makes one", *where(i))
            out.layers[-1].layer.pad = source.layer.pad
            out.layers[-1].bottom[j] = source.bottom[0]
        for blob in connection.top:
            last_top[blob] = i
    return out, kept


def _set(message, field, value):
    """Set field of message as Caffe's setter or adder would: append to a repeated field, copy a message."""
    descriptor = message.DESCRIPTOR.fields_by_name[field]
    if descriptor.is_repeated:
        getattr(message, field).append(value)
    elif descriptor.message_type is not None:
        getattr(message, field).CopyFrom(value)
    else:
        setattr(message, field, value)


def upgrade_v0_layer(connection, where=_nowhere):
    """Caffe's UpgradeV0LayerParameter: (the V1LayerParameter of a V0 layer connection, problems)."""
    out, problems = V1(), []
    out.bottom.extend(connection.bottom)
    out.top.extend(connection.top)
    if not connection.HasField("layer"):
        return out, problems
    v0 = connection.layer
    if v0.HasField("name"):
        out.name = v0.name
    kind = v0.type
    if v0.HasField("type"):
        if kind not in V0_TYPES:
            raise ConfigError(f"layer '{v0.name}': unknown V0 layer type '{kind}'", *where())
        out.type = V0_TYPES[kind]
    out.blobs.extend(v0.blobs)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for field, targets in V0_FIELDS.items():
        if not v0.HasField(field):
            continue
        target = targets.get(kind) or targets.get("*")
        if target is None:
            problems.append(f"layer '{v0.name}': unknown parameter {field} for layer type {kind}")
            continue
        message, name = target
        value = getattr(v0, field)
        if name is None:
            getattr(out, message).CopyFrom(value)
        else:
            _set(getattr(out, message), name, value)
    return out, problems


def upgrade_v0_net(net, where=_nowhere):
    """Caffe's UpgradeV0Net: (the V1 net, index in `net.layers` of each of its layers, problems)."""
    folded, kept = fold_padding_layers(net, where)
    out, problems = pb.NetParameter(), []
    if folded.HasField("name"):
        out.name = folded.name
    for position, connection in zip(kept, folded.layers):
        layer, found = upgrade_v0_layer(connection, lambda: where(position))
        out.layers.add().CopyFrom(layer)
        problems += found
    out.input.extend(folded.input)
    out.input_dim.extend(folded.input_dim)
    if folded.HasField("force_backward"):
        out.force_backward = folded.force_backward
    return out, kept, problems


# -- V1 -> today's layers ---------------------------------------------------------------------------


def upgrade_data_transformation(net):
    """Caffe's UpgradeNetDataTransformation: the V1 data layers' scale/mean_file/crop_size/mirror moved into
    transform_param, in place."""
    for layer in net.layers:
        if layer.type not in _TRANSFORMED:
            continue
        own = getattr(layer, _TRANSFORMED[layer.type])
        for field in _TRANSFORM_FIELDS:
            if own.HasField(field):
                setattr(layer.transform_param, field, getattr(own, field))
                own.ClearField(field)


# V1 fields every layer carries over by name: the per-type parameter messages, transform_param and loss_param.
_V1_MESSAGES = tuple(field.name for field in V1.DESCRIPTOR.fields
                     if field.message_type is not None and field.name.endswith("_param"))


def upgrade_v1_layer(v1, where=_nowhere):
    """Caffe's UpgradeV1LayerParameter: (the LayerParameter of a V1 layer, problems)."""
    out, problems = pb.LayerParameter(), []
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    if v1.HasField("name"):
        out.name = v1.name
    out.include.extend(v1.include)
    out.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        if v1.type not in V1_TYPES:
            raise ConfigError(f"layer '{v1.name}': unknown V1 layer type {v1.type}", *where())
        out.type = V1_TYPES[v1.type]
    out.blobs.extend(v1.blobs)

    def param(i):
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        param(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        param(i).share_mode = mode  # STRICT and PERMISSIVE have the same numbers in both enums
    for i, rate in enumerate(v1.blobs_lr):
        param(i).lr_mult = rate
    for i, decay in enumerate(v1.weight_decay):
        param(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for field in _V1_MESSAGES:
        if v1.HasField(field):
            getattr(out, field).CopyFrom(getattr(v1, field))
    if v1.HasField("layer"):
        problems.append(f"layer '{v1.name}': input NetParameter has V0 layer -- ignoring")
    return out, problems


def upgrade_v1_net(net, where=_nowhere, first_layer=_nowhere):
    """Caffe's UpgradeV1Net: (the net with `layer` blocks, problems); a net with both kinds is refused."""
    if len(net.layer):
        raise ConfigError("the net has both 'layer' and 'layers' blocks; Caffe refuses to upgrade such a net "
                          "(write every layer as layer { type: 'Layer' ... })", *first_layer())
    out, problems = pb.NetParameter(), []
    out.CopyFrom(net)
    out.ClearField("layers")
    out.ClearField("layer")
    for i, v1 in enumerate(net.layers):
        layer, found = upgrade_v1_layer(v1, lambda: where(i))
        out.layer.add().CopyFrom(layer)
        problems += found
    return out, problems


# -- input fields, BatchNorm ----------------------------------------------------------------


def input_layer(net, where=_nowhere):
    """The Input layer named 'input' that Caffe's UpgradeNetInput makes of a net's `input:` fields with their
    input_shape or input_dim, or None when they have neither: bare `input:` names are dropped, as Caffe
    drops them (a legacy net whose Input layer or data layer makes those blobs)."""
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if not (has_shape or has_dim):
        return None
    layer = pb.LayerParameter(name="input", type="Input")
    for i, name in enumerate(net.input):
        layer.top.append(name)
        if has_shape:
            if i >= len(net.input_shape):
                raise ConfigError(f"input '{name}' has no input_shape ({len(net.input)} inputs, "
                                  f"{len(net.input_shape)} input_shape)", *where())
            layer.input_param.shape.add().CopyFrom(net.input_shape[i])
        else:
            dims = list(net.input_dim[4 * i:4 * i + 4])
            if len(dims) != 4:
                raise ConfigError(f"input '{name}' needs 4 input_dim values ({len(net.input)} inputs, "
                                  f"{len(net.input_dim)} input_dim)", *where())
            layer.input_param.shape.add().dim.extend(dims)
    return layer


def upgrade_input(net, where=_nowhere):
    """Caffe's UpgradeNetInput, in place: input_layer() first among the layers, the input fields cleared.
    True if a layer was added."""
    layer = input_layer(net, where)
    if layer is not None:
        layers = [layer] + list(net.layer)
        del net.layer[:]
        net.layer.extend(layers)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")
    return layer is not None


def upgrade_batch_norm(net):
    """Caffe's UpgradeNetBatchNorm, in place: BatchNorm's three old ParamSpecs (lr_mult 0) dropped."""
    for layer in net.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            layer.ClearField("param")


# -- the whole net, and the solver --------------------------------------------------------------


def upgrade_net(net, where=_nowhere, input_where=_nowhere):
    """Caffe's UpgradeNetAsNeeded: (the upgraded net, origins, problems).

    where(i): (file, line, col) of the i-th `layers` block of the file, for errors;
    input_where(): that of the `input:` fields. origins[k]: for layer k of the
    result, the index of the block it came from (of `layers` blocks for an old
    net, of `layer` blocks otherwise), or None for the Input layer made from the
    `input:` fields.
    """
    out = pb.NetParameter()
    out.CopyFrom(net)
    problems = []
    origins = list(range(max(len(net.layers), len(net.layer))))
    if needs_v0(out):
        out, origins, found = upgrade_v0_net(out, where)
        problems += found
    if needs_data_upgrade(out):
        upgrade_data_transformation(out)
    if needs_v1(out):
        blocks = origins
        out, found = upgrade_v1_net(out, lambda i: where(blocks[i]), lambda: where(0))
        problems += found
    if needs_input_upgrade(out) and upgrade_input(out, input_where):
        origins = [None] + origins
    if needs_batch_norm_upgrade(out):
        upgrade_batch_norm(out)
    return out, origins, problems


def upgrade_solver(param, where=_nowhere):
    """Caffe's UpgradeSolverAsNeeded, in place: the deprecated `solver_type` enum as the `type` string.
    True if it changed anything."""
    if not param.HasField("solver_type"):
        return False
    if param.HasField("type"):
        raise ConfigError("the old solver_type field (enum) and the new type field (string) cannot both be "
                          "given", *where())
    param.type = SOLVER_TYPES[param.solver_type]
    param.ClearField("solver_type")
    return True
