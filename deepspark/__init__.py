"""DeepSpark: Caffe-defined networks trained on Spark with asynchronous EASGD."""

__version__ = "0.1.0"
