"""The TensorFlow backend: a Caffe net compiled into tf.functions (see base.Model for the contract)."""

from deepspark.backends.tensorflow.model import Model

__all__ = ["Model"]
