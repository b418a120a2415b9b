"""Caffe's Python layer on the Caffe backend: pycaffe runs the user's module natively; this makes it importable first.

Caffe's layer factory imports python_param.module with pycaffe's own import
(sys.path), and a failure there aborts or leaves a half-built net. So the
prototxt's folder goes on sys.path first (Caffe resolves the module from
PYTHONPATH; the folder beside the net is where a user keeps it), and the
module is imported here, with the real pycaffe, so that an import error is one
line at the layer.
"""

import importlib
import sys

from deepspark.errors import ConfigError


def prepare(graph):
    """Every Python layer of `graph` importable by Caffe's layer factory; a ConfigError at the layer if not."""
    for layer in graph.layers:
        if layer.type != "Python":
            continue
        folder = graph.context.folder
        if folder and folder not in sys.path:
            sys.path.append(folder)
        module = layer.param.python_param.module
        try:
            importlib.import_module(module)
        except Exception as error:
            raise ConfigError(f"layer '{layer.name}' (Python): importing module '{module}' with pycaffe raised "
                              f"{type(error).__name__}: {' '.join(str(error).split())}",
                              *graph.source.where(layer.index)) from None
