"""Backends behind one contract (base.Model); pick one by name, imported only when asked for."""

import contextlib
import importlib
import importlib.util
import os
import sys

BACKENDS = {
    "tensorflow": "deepspark.backends.tensorflow",
    "caffe": "deepspark.backends.caffe",
}


LEGACY_KERAS = "TF_USE_LEGACY_KERAS"  # TensorFlow's choice of tf_keras over Keras 3 (keras_deferred)
# Whether this process loads TensorFlow without the Keras it imports eagerly (defer_keras).
_keras_deferred = False


def defer_keras():
    """Have this process load TensorFlow, when a backend first needs it, without the Keras that TensorFlow imports
    as it loads (keras_deferred): the processes DeepSpark owns ask for it, the CLI and the executors' daemon. A
    library user's process loads TensorFlow as TensorFlow does."""
    global _keras_deferred
    _keras_deferred = True


@contextlib.contextmanager
def keras_deferred():
    """While TensorFlow loads, in a process that asked for it (defer_keras), have it skip its eager import of
    Keras (tensorflow/__init__.py imports keras.src.optimizers for their SavedModel registrations): 0.7 s of its
    2.8 s on this machine (#44), for a package DeepSpark does not use. Told to use the legacy tf_keras, which is
    not installed, TensorFlow passes over that import (it allows the ImportError); the setting is taken back as
    soon as it has loaded, with the None that the legacy branch put on TensorFlow's __path__ for tf_keras, and
    tf.keras still loads Keras on first use (TensorFlow's lazy loader reads the setting then). A user's own
    TF_USE_LEGACY_KERAS, or an installed tf_keras, is left as it is."""
    if (not _keras_deferred or "tensorflow" in sys.modules or LEGACY_KERAS in os.environ
            or importlib.util.find_spec("tf_keras") is not None):
        yield
        return
    os.environ[LEGACY_KERAS] = "1"
    try:
        yield
    finally:
        del os.environ[LEGACY_KERAS]
        loaded = sys.modules.get("tensorflow")
        if loaded is not None and isinstance(getattr(loaded, "__path__", None), list):
            loaded.__path__[:] = [entry for entry in loaded.__path__ if entry is not None]


def backend_module(name):
    """The module of backend `name`; importing it is what loads TensorFlow or pycaffe."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}'; supported: {', '.join(sorted(BACKENDS))}")
    return importlib.import_module(BACKENDS[name])


def device(name):
    """Where backend `name` computes in this process: "GPU:0", or "CPU"."""
    return importlib.import_module(BACKENDS[name] + ".runtime").device()


def use_gpu(name, index):
    """Pin backend `name` in this process to CUDA device `index` (None: to the CPU); where it computes now:
    "GPU:i", or "CPU" where it sees no such GPU (a CPU-only build, no device, no driver)."""
    return importlib.import_module(BACKENDS[name] + ".runtime").use_gpu(index)


def create_model(backend_name, net_param, solver_param=None, **kw):
    """A base.Model of backend `backend_name` for this net (and solver, to train it).

    kw: base.Model's arguments (phase, source, batch_size, seed, stages,
    data_shape, threads), then the backend's own (jit_compile, data_layers).
    """
    return backend_module(backend_name).Model(net_param, solver_param, **kw)
