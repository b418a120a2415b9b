"""Caffe's Python layer on numpy, without pycaffe: the user's module imported, its layer run on blobs as pycaffe hands them.

A `type: "Python"` layer names a module and a class (python_param { module
layer param_str }). pycaffe imports the module from sys.path and calls the
class's setup(bottom, top) once, then reshape and forward (and backward) on
lists of blobs whose .data and .diff are numpy arrays. Here the same happens
in plain Python, for the graph's shapes (setup and reshape on zero arrays of
the bottoms' shapes) and for the TensorFlow backend's numpy bridge; the Caffe
backend runs the layer natively in pycaffe instead.

The module may `import caffe` and subclass `caffe.Layer`. It is imported under
a private name with `caffe` bound to a stand-in holding Layer, TRAIN and TEST,
so that pycaffe is never imported here (a process that has TensorFlow loaded
must not load it, and an executor may not have it), while a real pycaffe in
the same process keeps its own copy of the module for its net. Where this
process has loaded pycaffe (the Caffe backend loads it first), the stand-in
hands on every other name to it, so that a module using pycaffe's own parts
(`caffe._caffe`, `caffe.io`) imports and runs as under pycaffe.
The module is found in the prototxt's folder, then on sys.path (PYTHONPATH).
"""

import importlib.machinery
import importlib.util
import os
import sys
import threading
import types

import numpy as np

TRAIN, TEST = 0, 1  # Caffe's Phase values, as pycaffe's caffe.TRAIN and caffe.TEST


class PythonLayerError(ValueError):
    """The user's module is missing, or its layer failed: one line saying which and why."""


class Blob:
    """pycaffe's Blob as a Python layer sees it: .data and .diff arrays (float32), reshape(), shape and the
    legacy num/channels/height/width."""

    def __init__(self, shape=()):
        self.data = np.zeros(shape, np.float32)
        self.diff = np.zeros(shape, np.float32)

    def reshape(self, *shape):
        shape = tuple(int(d) for d in shape)
        if shape != self.data.shape:
            self.data, self.diff = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def count(self):
        return int(self.data.size)

    def _legacy(self, axis):
        return self.shape[axis] if axis < len(self.shape) else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))


class BlobVec(list):
    """pycaffe's BlobVec (a layer's `blobs`): add_blob(*shape) appends a zero Blob."""

    def add_blob(self, *shape):
        self.append(Blob(shape))


class Layer:
    """pycaffe's caffe.Layer for a Python layer: param_str and phase set before setup, blobs its own.

    setup, reshape, forward and backward are the subclass's, called as pycaffe calls them.
    """

    def __init__(self, param=None):
        self.param_str = param.python_param.param_str if param is not None else ""
        self.phase = TRAIN
        self.blobs = BlobVec()

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError("a Python layer defines reshape(bottom, top)")

    def forward(self, bottom, top):
        raise NotImplementedError("a Python layer defines forward(bottom, top)")

    def backward(self, top, propagate_down, bottom):
        pass


def _missing(name):
    raise AttributeError(f"caffe.{name} is pycaffe's: DeepSpark runs Python layers outside the Caffe backend "
                         "without pycaffe, with caffe.Layer, caffe.TRAIN and caffe.TEST")


def stand_in(pycaffe=None):
    """The `caffe` a Python layer's module imports here: our Layer, TRAIN and TEST, and any other name from
    `pycaffe` (the real module, where this process has loaded it), else an AttributeError saying why not."""
    module = types.ModuleType("caffe", "DeepSpark's stand-in for pycaffe inside a Python layer's module.")
    module.Layer, module.TRAIN, module.TEST = Layer, TRAIN, TEST
    module.__getattr__ = _missing if pycaffe is None else lambda name: getattr(pycaffe, name)
    return module


CAFFE = stand_in()


def loaded_pycaffe():
    """The real pycaffe module where this process has loaded it (its compiled caffe._caffe is there), or None."""
    module = sys.modules.get("caffe")
    return module if "caffe._caffe" in sys.modules and module is not None else None

_modules = {}  # (module name, folder) -> the module, imported once per process
_lock = threading.Lock()  # sys.modules['caffe'] is swapped while a module imports


def search_path(folder):
    """Where a Python layer's module is looked for: the prototxt's folder, then sys.path."""
    return ([folder] if folder else []) + [p for p in sys.path if p != folder]


def import_module(name, folder=None):
    """The user's module `name` (dotted names too), with `caffe` bound to the stand-in while it runs."""
    with _lock:
        pycaffe = loaded_pycaffe()
        key = (name, folder, pycaffe is not None)
        if key in _modules:
            return _modules[key]
        spec = _find(name, folder)
        if spec is None:
            where = f"{folder} and " if folder else ""
            raise PythonLayerError(f"cannot import module '{name}' (looked in {where}sys.path, which "
                                   "PYTHONPATH extends)")
        private = "deepspark_python_layer_" + name.replace(".", "_")
        spec = importlib.util.spec_from_file_location(private, spec.origin,
                                                      submodule_search_locations=spec.submodule_search_locations)
        module = importlib.util.module_from_spec(spec)
        saved = sys.modules.get("caffe")
        sys.modules["caffe"] = CAFFE if pycaffe is None else stand_in(pycaffe)
        added = folder and folder not in sys.path
        if added:
            sys.path.insert(0, folder)  # the module's own imports of its neighbours
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            needs = isinstance(error, ImportError) and (error.name or "").startswith("caffe.") and pycaffe is None
            hint = (" (a part of pycaffe: load it in this process first, `import caffe` before DeepSpark and "
                    "TensorFlow, or run the net on the Caffe backend)") if needs else ""
            raise PythonLayerError(f"module '{name}' ({spec.origin}) raised {_one_line(error)} on import{hint}") \
                from None
        finally:
            if saved is None:
                sys.modules.pop("caffe", None)
            else:
                sys.modules["caffe"] = saved
            if added:
                sys.path.remove(folder)
        _modules[key] = module
        return module


def module_file(name, folder=None):
    """The file of the user's module `name` (its package's __init__.py for a package), as import_module finds it."""
    spec = _find(name, folder)
    if spec is None:
        where = f"{folder} and " if folder else ""
        raise PythonLayerError(f"cannot find module '{name}' (looked in {where}sys.path, which PYTHONPATH extends)")
    return spec.origin


def _find(name, folder):
    """The import spec of `name` on search_path(folder), its parent packages imported as usual."""
    parent, _, leaf = name.rpartition(".")
    try:
        path = importlib.import_module(parent).__path__ if parent else search_path(folder)
    except ImportError:
        return None
    spec = importlib.machinery.PathFinder.find_spec(leaf, path)
    return spec if spec is not None and spec.origin not in (None, "built-in", "frozen") else None


def _one_line(error):
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def new_layer(layer_param, folder=None, phase=TRAIN):
    """An instance of the layer's class, param_str and phase set as pycaffe sets them."""
    python = layer_param.python_param
    if not python.module or not python.layer:
        raise PythonLayerError("python_param needs module and layer (the module's class)")
    module = import_module(python.module, folder)
    cls = getattr(module, python.layer, None)
    if not isinstance(cls, type):
        raise PythonLayerError(f"module '{python.module}' has no layer class '{python.layer}'")
    try:
        instance = cls(layer_param)
    except Exception as error:
        raise PythonLayerError(f"{python.module}.{python.layer}({layer_param.name!r}) raised "
                               f"{_one_line(error)}") from None
    instance.param_str = python.param_str
    instance.phase = int(phase)
    return instance


def call(layer_param, step, *args):
    """layer.step(*args), with an exception from the user's code as one PythonLayerError."""
    instance = args[0]
    try:
        return getattr(instance, step)(*args[1:])
    except Exception as error:
        python = layer_param.python_param
        raise PythonLayerError(f"{python.module}.{python.layer}.{step} raised {_one_line(error)}") from None


class Runner:
    """One Python layer set up on blobs of the bottoms' shapes: its top shapes, forward and backward on arrays.

    As Caffe does: setup once, then reshape before every forward. A layer that
    adds learnable blobs of its own, or that changes a top's shape after setup,
    is refused: DeepSpark's nets have static shapes and train the parameters
    its layers declare.
    """

    def __init__(self, layer_param, bottom_shapes, folder=None, phase=TRAIN):
        self.param = layer_param
        self.layer = new_layer(layer_param, folder, phase)
        self.bottom = [Blob(shape) for shape in bottom_shapes]
        self.top = [Blob() for _ in layer_param.top]
        call(layer_param, "setup", self.layer, self.bottom, self.top)
        call(layer_param, "reshape", self.layer, self.bottom, self.top)
        if len(getattr(self.layer, "blobs", ())):
            raise PythonLayerError(f"{layer_param.python_param.layer} adds {len(self.layer.blobs)} parameter "
                                   "blob(s) in setup; DeepSpark trains the blobs of Caffe's own layers only")
        self.top_shapes = [blob.shape for blob in self.top]

    def _load(self, blobs, arrays, field="data"):
        for blob, array in zip(blobs, arrays):
            array = np.asarray(array, np.float32)
            blob.reshape(*array.shape)
            setattr(blob, field, array.copy())

    def forward(self, *bottoms):
        """The tops' data (float32 arrays) for the bottoms' data."""
        self._load(self.bottom, bottoms)
        call(self.param, "reshape", self.layer, self.bottom, self.top)
        shapes = [blob.shape for blob in self.top]
        if shapes != self.top_shapes:
            raise PythonLayerError(f"{self.param.python_param.layer}.reshape gave the tops shapes "
                                   f"{shapes} after setup gave {self.top_shapes}; a net's shapes are fixed")
        call(self.param, "forward", self.layer, self.bottom, self.top)
        return [np.array(blob.data, np.float32) for blob in self.top]

    def backward(self, bottoms, tops, top_diffs):
        """The bottoms' diffs, from the data of bottoms and tops and the tops' diffs (Caffe's Backward)."""
        self._load(self.bottom, bottoms)
        self._load(self.top, tops)
        self._load(self.top, top_diffs, "diff")
        for blob in self.bottom:
            blob.diff = np.zeros_like(blob.data)
        call(self.param, "backward", self.layer, self.top, [True] * len(self.bottom), self.bottom)
        return [np.array(blob.diff, np.float32) for blob in self.bottom]


def source_folder(filename):
    """The folder of the prototxt a layer was read from (where its module is looked for first), or None."""
    if not filename or filename.startswith("<") or not os.path.exists(filename):
        return None
    return os.path.dirname(os.path.abspath(filename))
