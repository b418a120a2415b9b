"""pycaffe's Net on either backend: a prototxt and its weights; blobs and params as numpy arrays; forward, reshape.

    net = deepspark.Net("deploy.prototxt", "weights.caffemodel", phase="test", backend="tensorflow")
    net.blobs["data"].reshape(2, 3, 227, 227)
    net.reshape()
    out = net.forward(data=images)            # {output blob: array}, as pycaffe's
    pool5 = net.forward(end="pool5")["pool5"] # the layers up to pool5 only; start= runs from a layer on
    net.params["conv1"][0].data[...] *= 0.5   # Caffe's shapes, writable; the next forward runs with them

Every blob's shape follows Caffe's rules at the inputs' shapes (batch and
spatial size, as Caffe's Net::Reshape): the TensorFlow backend compiles one
pass per input shape and keeps it for the next forward at that shape; the
Caffe backend is pycaffe's own Net. Blobs hold what the last forward left in
them, each a float32 array in Caffe's layout (N x C x H x W).
"""

from collections import OrderedDict

import numpy as np

from deepspark import checkpoint, config
from deepspark.backends import create_model
from deepspark.data import READ_SOURCES, feeder_for, source_shape
from deepspark.errors import ConfigError
from deepspark.graph import Graph, fmt, layers_between, tap_name, with_input_shapes, with_taps
from deepspark.proto import deepspark_pb2 as pb

PHASES = {"train": pb.TRAIN, "test": pb.TEST}


def phase_of(phase):
    """pb.TRAIN or pb.TEST from "train"/"test" (any case) or Caffe's own caffe.TRAIN/caffe.TEST (0/1)."""
    if isinstance(phase, str) and phase.lower() in PHASES:
        return PHASES[phase.lower()]
    if phase in (pb.TRAIN, pb.TEST) and not isinstance(phase, bool):
        return int(phase)
    raise ValueError(f"phase must be 'train' or 'test', not {phase!r}")


class Blob:
    """A blob as pycaffe shows it: `data`, a float32 array in Caffe's layout, its `shape`, and `reshape`."""

    def __init__(self, data):
        self._data = data

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data[...] = value  # as pycaffe's: the blob keeps its own memory and shape

    @property
    def shape(self):
        return self._data.shape

    @property
    def count(self):
        return self._data.size

    def reshape(self, *shape):
        """A new shape (its values zero); for an input blob, `Net.reshape` then reshapes the rest of the net."""
        self._data = np.zeros(tuple(int(d) for d in shape), np.float32)

    def __repr__(self):
        return f"Blob({fmt(self.shape)})"


def tapped_model(net, graph, backend, phase, options):
    """(a backend model of `net`, whose Graph is `graph`, with every blob copied out as an output (graph.with_taps):
    a backend returns outputs only; {blob: the output that carries it}, an input only if rewritten in place)."""
    model = create_model(backend, with_taps(net, graph), None, phase=phase, **options)
    outputs = set(model.graph.outputs)
    taps = {top: tap_name(graph, top) for layer in graph.layers for top in layer.tops}
    return model, {name: tap for name, tap in taps.items() if tap in outputs}


PROBE_SIZES = (16, 64, 256, 1024)  # the height and width tried for placeholder inputs: the first every layer takes


def built(net, phase, source, data_shape):
    """(the net as Net builds it, its Graph, {input: declared shape} of placeholder inputs, else empty).

    OpenPose's deploy nets declare a 1x3x1x1 input "defined at runtime", reshaped before every forward: Caffe
    sets them up at that size and checks the shapes at Reshape, while the graph's rules refuse a 2x2 pooling
    over a 1x1 map at construction. Where the declared input shapes are refused, the net is built with its
    inputs' height and width raised to the first of PROBE_SIZES that every layer takes (the parameters' shapes
    do not depend on it), and its input blobs keep the declared shapes: the next forward reshapes the net to
    them or to the caller's, a ValueError there if refused. Where no size is taken, the first error stands."""
    try:
        return net, Graph(net, phase, source=source, data_shape=data_shape), {}
    except ConfigError as error:
        refused = error
    net = with_input_shapes(net, {})  # legacy input fields as Input layers
    declared = {}
    for layer in net.layer:
        shapes = [tuple(shape.dim) for shape in layer.input_param.shape] if layer.type == "Input" else []
        declared.update(zip(layer.top, shapes * len(layer.top) if len(shapes) == 1 else shapes))
    placeholders = {top: shape for top, shape in declared.items() if len(shape) > 2}
    for size in PROBE_SIZES if placeholders else ():
        probe = with_input_shapes(net, {top: shape[:2] + tuple(max(d, size) for d in shape[2:])
                                        for top, shape in placeholders.items()})
        try:
            return probe, Graph(probe, phase, source=source, data_shape=data_shape), placeholders
        except ConfigError:
            continue
    raise refused


def check_input_shape(name, shape, net_shape):
    """A one-line ValueError where input `name` of `shape` cannot be fed to a net whose input is `net_shape` now
    (before the layers' shape rules would name a layer far from the cause, or TensorFlow's and Caffe's kernels
    would fail on an empty batch): another number of axes, or an axis of no items."""
    if len(shape) != len(net_shape):
        fix = " (a batch of one item is array[None])" if len(shape) == len(net_shape) - 1 else ""
        raise ValueError(f"input '{name}' is {fmt(shape)}, {len(shape)} axes; the net takes {len(net_shape)} "
                         f"(as {fmt(net_shape)}){fix}")
    if 0 in shape:
        raise ValueError(f"input '{name}' is {fmt(shape)}: an empty {'batch' if shape[0] == 0 else 'axis'}; "
                         "every axis needs at least one item")


SNAPSHOT_BYTES = 1 << 20  # a parameter blob up to this size is remembered as its bytes, a larger one as a copy


def snapshot(array):
    """What `unchanged` compares `array` with later. Bytes compare in about 0.2 us where np.array_equal takes 3
    (13 blobs: half of MTCNN P-Net's Python per forward at 12 x 12, bench/tf_speed.py); a large blob's bytes
    would cost a fresh allocation per forward (4x array_equal's time at 200 MB, measured), so it stays an array."""
    return array.tobytes() if array.nbytes <= SNAPSHOT_BYTES else np.array(array, copy=True)


def unchanged(array, snap):
    """Whether `array` holds what it held at snapshot(array): the same bits (small) or values (large)."""
    return array.tobytes() == snap if isinstance(snap, bytes) else np.array_equal(array, snap)


class ParamBlob(Blob):
    """A parameter blob that counts the writes it is given (`data = ...`, reshape) and knows whether its array
    was handed out (read through `data`), after which a write may come through that array unseen.

    Net.forward sets the parameters into the backend only where one may have changed since (`mark`,
    `unchanged_since`): comparing every blob's values at each forward read all of them, as many bytes again
    for the copies, and pushed the net's own weights out of the cache (measured: a third of MTCNN O-Net's
    forward at batch 1 on either backend, bench/tf_speed.py); a blob never handed out needs no comparing."""

    def __init__(self, data):
        super().__init__(data)
        self.writes, self.handed_out = 0, False

    @property
    def data(self):
        self.handed_out = True
        return self._data

    @data.setter
    def data(self, value):
        self._data[...] = value
        self.writes += 1

    def reshape(self, *shape):
        super().reshape(*shape)
        self.writes += 1

    def mark(self):
        """What unchanged_since takes: the writes so far, and the values where the array is handed out."""
        return self.writes, snapshot(self._data) if self.handed_out else None

    def unchanged_since(self, mark):
        """Whether the blob surely holds what it held at `mark` (handed out since, it may not)."""
        writes, snap = mark
        if writes != self.writes:
            return False
        return not self.handed_out or (snap is not None and unchanged(self._data, snap))


class Net:
    """A Caffe net with its parameters, run forward as pycaffe's caffe.Net is.

    prototxt: a net .prototxt (or a model folder, or a NetParameter); weights:
    a .caffemodel to copy in by layer name (None: the prototxt's fillers);
    phase: "test" or "train" (or caffe.TEST / caffe.TRAIN); backend:
    "tensorflow" or "caffe". options: the backend model's (seed, threads,
    stages). As in pycaffe, `Net(prototxt, caffe.TEST)` reads the second
    argument as the phase.
    """

    def __init__(self, prototxt, weights=None, phase="test", backend="tensorflow", **options):
        if isinstance(weights, int):  # pycaffe's Net(prototxt, phase)
            weights, phase = None, weights
        phase = phase_of(phase)
        if backend == "caffe":  # pycaffe before the graph: a Python layer's module may use its parts (pylayer)
            from deepspark.backends.caffe import runtime  # deferred: it loads pycaffe

            runtime.caffe()
        if isinstance(prototxt, pb.NetParameter):
            net, source = prototxt, None
        else:
            net, source = config.load_net(config.net_path(prototxt))
        # A data layer that reads a source (HDF5Data, ImageData, Data) takes its shape from it, as describe does.
        options.setdefault("data_shape", source_shape)
        net, self._graph, placeholders = built(net, phase, source, options["data_shape"])  # the net as written
        self._model, self._taps = tapped_model(net, self._graph, backend, phase, options)
        self._options = options
        self._spans = {}  # (first, last) layer: (model, taps, its params' indices) for forward's start and end
        self._sent = {}  # id(backend model): the marks of the params last set into it (see _send_params)
        self.backend = backend
        # Such a layer reads its next batch at each forward, as Caffe's does: its tops are not pycaffe's inputs.
        self._sourced = [layer for layer in self._graph.layers if layer.type in READ_SOURCES]
        self._feeders = {}  # layer name: its batches, opened at the first forward that reads them
        read = {top for layer in self._sourced for top in layer.tops}
        self.inputs = [name for name in self._model.feeds if name not in read]
        self.outputs = sorted(self._graph.outputs)  # Caffe's Net lists them from a std::set: by name
        shapes = self._model.graph.blobs
        names = OrderedDict((top, None) for layer in self._graph.layers for top in layer.tops)
        self.blobs = OrderedDict((name, Blob(np.zeros(shapes[name], np.float32))) for name in names)
        for name, shape in placeholders.items():  # the next forward reshapes the net to them, or to the caller's
            self.blobs[name].reshape(*shape)
        self._params = [ParamBlob(array) for array in self._model.get_params()]
        # pycaffe's names of the layers in order, and of each one's bottoms and tops (Caffe's splits not listed)
        self._layer_names = [layer.name for layer in self._graph.layers]
        self.bottom_names = OrderedDict((layer.name, list(layer.bottoms)) for layer in self._graph.layers)
        self.top_names = OrderedDict((layer.name, list(layer.named_tops)) for layer in self._graph.layers)
        self.params = OrderedDict((layer.name, [self._params[i] for i in layer.blob_params])
                                  for layer in self._model.graph.layers if layer.blob_params)
        if weights is not None:
            self.copy_from(weights)

    @property
    def phase(self):
        return self._model.phase

    def copy_from(self, weights):
        """Copy the layers of the .caffemodel `weights` in by name, as Caffe's Net::CopyTrainedLayersFrom."""
        arrays = checkpoint.weights_for(self._model.graph, checkpoint.read_caffemodel(weights),
                                        [blob._data for blob in self._params], weights)
        for blob, array in zip(self._params, arrays):
            blob.data = array

    def reshape(self):
        """Caffe's Net::Reshape: every blob's shape recomputed from the input blobs' shapes (after
        `net.blobs[input].reshape(...)`); a ValueError where Caffe's rules refuse them."""
        for name in self.inputs:
            check_input_shape(name, self.blobs[name].shape, self._model.feeds[name])
        self._model.reshape({name: self.blobs[name].shape for name in self.inputs})
        shapes = self._model.graph.blobs
        for name, blob in self.blobs.items():
            if blob.shape != tuple(shapes[name]):
                blob.reshape(*shapes[name])

    def _layer_index(self, name, default):
        """The index of the layer called `name` (pycaffe's: the first so called), `default` if None."""
        if name is None:
            return default
        if name not in self._layer_names:
            raise KeyError(f"the net has no layer '{name}'; its layers are {', '.join(self._layer_names)}")
        return self._layer_names.index(name)

    def forward(self, blobs=None, start=None, end=None, **inputs):
        """One forward pass, as pycaffe's: the inputs given by name (the input blobs' data for those not given; an
        input of another shape reshapes the net first), through the layers from `start` to `end` (both run; the
        first and the last by default: the layers before `start` leave their blobs as they are, as Caffe's
        ForwardFromTo); returns the tops of `end` (the net's outputs where no end is given) and the blobs named
        in `blobs`, {name: array}."""
        first = self._layer_index(start, 0)
        last = self._layer_index(end, len(self._graph.layers) - 1)
        if first > last:
            raise ValueError(f"layer '{start}' comes after layer '{end}' in the net")
        outputs = list(self._graph.layers[last].named_tops) if end is not None else list(self.outputs)
        wanted = outputs + [name for name in blobs or () if name not in outputs]
        for name in wanted:
            if name not in self.blobs:
                raise KeyError(f"the net has no blob '{name}'; its blobs are {', '.join(self.blobs)}")
        arrays = {}
        for name, value in {**self._read_sources(inputs), **inputs}.items():
            if name not in self._model.feeds:
                raise KeyError(f"'{name}' is not an input of this net; its inputs are {', '.join(self.inputs)}")
            arrays[name] = np.asarray(value, np.float32)
            if arrays[name].shape != self.blobs[name].shape:
                self.blobs[name].reshape(*arrays[name].shape)
        if any(self.blobs[name].shape != tuple(self._model.feeds[name]) for name in self.inputs):
            self.reshape()
        for name, array in arrays.items():
            self.blobs[name].data[...] = array
        if (first, last) == (0, len(self._graph.layers) - 1):
            model, taps, indices = self._model, self._taps, range(len(self._params))
        else:
            model, taps, indices = self._span(first, last)
        self._send_params(model, [self._params[i] for i in indices])  # what the caller wrote into params
        results = model.forward({name: self.blobs[name].data for name in model.feeds})
        for name, tap in taps.items():
            self.blobs[name]._data = np.asarray(results[tap], np.float32)
        return {name: self.blobs[name].data for name in wanted}

    def _send_params(self, model, params):
        """Set the ParamBlobs `params` into `model` unless they hold what was last set there: setting is most of
        a small net's forward at batch 1 (a variable assigned per blob). In the TEST phase only, where a forward
        changes no parameter (TRAIN's BatchNorm moves its running statistics in the model)."""
        marks = self._sent.get(id(model))
        if self.phase == pb.TEST and marks is not None and all(map(ParamBlob.unchanged_since, params, marks)):
            return
        model.set_params([param._data for param in params])
        self._sent[id(model)] = [param.mark() for param in params]

    def _read_sources(self, given):
        """{top: array} of the next batch of each data layer that reads a source, for the tops not `given`."""
        batch = {}
        for layer in self._sourced:
            if all(top in given for top in layer.tops):
                continue
            if layer.name not in self._feeders:
                self._feeders[layer.name] = feeder_for(layer.param, self.phase, batch_size=layer.top_shapes[0][0])
            batch.update(self._feeders[layer.name].next_batch())
        return {top: array for top, array in batch.items() if top not in given}

    def _span(self, first, last):
        """(model, taps, indices) of the layers first..last, made once per span (layers_between: the blobs they
        read from earlier layers are its inputs) and reshaped to what those blobs hold now: its backend model,
        {blob: the output that carries it}, and the index in self._params of each of its parameters."""
        shapes = {name: blob.shape for name, blob in self.blobs.items()}
        if (first, last) not in self._spans:
            net = layers_between(self._graph, first, last, shapes)
            graph = Graph(net, self.phase)
            model, taps = tapped_model(net, graph, self.backend, self.phase, self._options)
            ours = {layer.name: layer.blob_params for layer in self._model.graph.layers}
            indices = [None] * len(model.graph.params)
            for layer in model.graph.layers:
                for j, i in enumerate(layer.blob_params):
                    indices[i] = ours[layer.name][j]
            self._spans[(first, last)] = model, taps, indices
        model = self._spans[(first, last)][0]
        if any(tuple(model.feeds[name]) != shapes[name] for name in model.feeds):
            model.reshape({name: shapes[name] for name in model.feeds})
        return self._spans[(first, last)]

    def forward_all(self, blobs=None, **inputs):
        """pycaffe's forward_all: every item of the inputs (by name, the same number of each), a batch of the
        net's size at a time, the last padded with zeros; returns the outputs and the blobs named in `blobs`
        for all the items, {name: array}, without the padding's."""
        sizes = {len(array) for array in inputs.values()}
        if len(sizes) != 1:
            raise ValueError("forward_all takes the net's inputs by name, each with the same number of items")
        items, batch = sizes.pop(), self.blobs[self.inputs[0]].shape[0]
        results = {}
        for start in range(0, items, batch):
            chunk = {name: np.asarray(array[start:start + batch], np.float32) for name, array in inputs.items()}
            chunk = {name: np.concatenate([array, np.zeros((batch - len(array),) + array.shape[1:], np.float32)])
                     for name, array in chunk.items()}
            for name, value in self.forward(blobs=blobs, **chunk).items():
                results.setdefault(name, []).append(np.array(value, copy=True))
        return {name: np.concatenate(values)[:items] for name, values in results.items()}

    def save(self, path):
        """Write the parameters as a .caffemodel (Caffe's NetParameter with blobs; .caffemodel.h5: HDF5)."""
        checkpoint.save_caffemodel(path, self._graph, [blob._data for blob in self._params])

    def close(self):
        """Release the backend's nets (pycaffe's, their scratch folders)."""
        for model, _, _ in self._spans.values():
            model.close()
        for feeder in self._feeders.values():
            feeder.close()
        self._model.close()
