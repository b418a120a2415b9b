"""pycaffe's Net on either backend: a prototxt and its weights; blobs and params as numpy arrays; forward, reshape.

    net = deepspark.Net("deploy.prototxt", "weights.caffemodel", phase="test", backend="tensorflow")
    net.blobs["data"].reshape(2, 3, 227, 227)
    net.reshape()
    out = net.forward(data=images)            # {output blob: array}, as pycaffe's
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
from deepspark.graph import Graph, fmt, tap_name, with_taps
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
        if isinstance(prototxt, pb.NetParameter):
            net, source = prototxt, None
        else:
            net, source = config.load_net(config.net_path(prototxt))
        self._graph = Graph(net, phase, source=source)  # the net as written: its blobs, inputs and outputs
        # Every blob copied out as an output (graph.with_taps): a backend returns outputs only.
        self._model = create_model(backend, with_taps(net, self._graph), None, phase=phase, **options)
        self.backend = backend
        self.inputs = list(self._model.feeds)
        self.outputs = sorted(self._graph.outputs)  # Caffe's Net lists them from a std::set: by name
        shapes = self._model.graph.blobs
        names = OrderedDict((top, None) for layer in self._graph.layers for top in layer.tops)
        self.blobs = OrderedDict((name, Blob(np.zeros(shapes[name], np.float32))) for name in names)
        tapped = set(self._model.graph.outputs)
        self._taps = {name: tap_name(self._graph, name) for name in names}  # an input only if rewritten in place
        self._taps = {name: tap for name, tap in self._taps.items() if tap in tapped}
        self._params = [Blob(array) for array in self._model.get_params()]
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
                                        [blob.data for blob in self._params], weights)
        for blob, array in zip(self._params, arrays):
            blob.data = array

    def reshape(self):
        """Caffe's Net::Reshape: every blob's shape recomputed from the input blobs' shapes (after
        `net.blobs[input].reshape(...)`); a ValueError where Caffe's rules refuse them."""
        self._model.reshape({name: self.blobs[name].shape for name in self.inputs})
        shapes = self._model.graph.blobs
        for name, blob in self.blobs.items():
            if blob.shape != tuple(shapes[name]):
                blob.reshape(*shapes[name])

    def forward(self, blobs=None, **inputs):
        """One forward pass: the inputs given by name (the input blobs' data for those not given; an input of
        another shape reshapes the net first); returns {output: array} and the blobs named in `blobs`."""
        wanted = list(self.outputs) + [name for name in blobs or () if name not in self.outputs]
        for name in wanted:
            if name not in self.blobs:
                raise KeyError(f"the net has no blob '{name}'; its blobs are {', '.join(self.blobs)}")
        arrays = {}
        for name, value in inputs.items():
            if name not in self.inputs:
                raise KeyError(f"'{name}' is not an input of this net; its inputs are {', '.join(self.inputs)}")
            arrays[name] = np.asarray(value, np.float32)
            if arrays[name].shape != self.blobs[name].shape:
                self.blobs[name].reshape(*arrays[name].shape)
        if any(self.blobs[name].shape != tuple(self._model.feeds[name]) for name in self.inputs):
            self.reshape()
        for name, array in arrays.items():
            self.blobs[name].data[...] = array
        self._model.set_params([blob.data for blob in self._params])  # what the caller wrote into params
        results = self._model.forward({name: self.blobs[name].data for name in self.inputs})
        for name, tap in self._taps.items():
            self.blobs[name]._data = np.asarray(results[tap], np.float32)
        return {name: self.blobs[name].data for name in wanted}

    def save(self, path):
        """Write the parameters as a .caffemodel (Caffe's NetParameter with blobs; .caffemodel.h5: HDF5)."""
        checkpoint.save_caffemodel(path, self._graph, [blob.data for blob in self._params])

    def close(self):
        """Release the backend's net (pycaffe's, its scratch folder)."""
        self._model.close()
