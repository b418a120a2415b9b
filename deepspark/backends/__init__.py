"""Backends behind one contract (base.Model); pick one by name, imported only when asked for."""

import importlib

BACKENDS = {
    "tensorflow": "deepspark.backends.tensorflow",
    "caffe": "deepspark.backends.caffe",
}


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
