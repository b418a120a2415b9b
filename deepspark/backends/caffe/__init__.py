"""The Caffe backend: a Caffe net run by real pycaffe (see base.Model for the contract)."""

from deepspark.backends.caffe.model import Model

__all__ = ["Model"]
