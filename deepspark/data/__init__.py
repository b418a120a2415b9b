"""The shared data pipeline: Datum, LMDB and Parquet I/O, sharding, Caffe's transform_param, batches, converters."""

import os

from deepspark.data.datum import (DataError, check_datum, checked_records, decode_datum, encode_datum,
                                  load_mean)
from deepspark.data.feeder import DataFeeder, feeder_for
from deepspark.data.lmdb_io import shard_range
from deepspark.data.parquet import is_parquet, is_uri, reader
from deepspark.data.transform import Transformer

__all__ = ["DataError", "DataFeeder", "Transformer", "check_datum", "checked_records", "count", "decode_datum",
           "encode_datum", "feeder_for", "is_parquet", "load_mean", "missing_source", "peek_shape", "shard_range",
           "source_shape"]


def count(source):
    """Number of records in an LMDB or a Parquet dataset."""
    return reader(source).count(source)


def peek_shape(source):
    """(C, H, W) of the first record of an LMDB or a Parquet dataset (decoding it if it is an encoded image)."""
    key, value = reader(source).first_record(source)
    array, _ = decode_datum(value, key, source)
    return tuple(int(d) for d in array.shape)


def source_shape(layer_param, data_shape=None):
    """(C, H, W) of a Data layer's records before crop, or a warning string if it cannot tell.

    In order: the LMDB or Parquet dataset at data_param.source (relative to cwd) if
    it exists (a URI: if pyarrow can open it here, else the reason is the warning); the
    data_shape override ((C, H, W), or a dict by layer name or data top); what the
    prototxt fixes (the mean file's dims; crop size with the channel count that
    per-channel mean_value gives).
    """
    source = layer_param.data_param.source
    unread = None
    if source and (os.path.exists(source) or is_uri(source)):
        try:
            return peek_shape(source)
        except DataError as error:
            if os.path.exists(source):
                raise
            unread = str(error)  # a URI this process cannot open: the prototxt may still tell
    if isinstance(data_shape, dict):
        data_shape = next((data_shape[k] for k in [layer_param.name, *layer_param.top[:1]]
                           if k in data_shape), None)
    if data_shape is not None:
        return tuple(int(d) for d in data_shape)
    tp = layer_param.transform_param
    if tp.mean_file and os.path.exists(tp.mean_file):
        return tuple(int(d) for d in load_mean(tp.mean_file).shape)
    crop_h, crop_w = tp.crop_h or tp.crop_size, tp.crop_w or tp.crop_size
    if crop_h and crop_w and len(tp.mean_value) > 1:
        return (len(tp.mean_value), crop_h, crop_w)
    return unread or missing_source(layer_param)


def missing_source(layer_param):
    """The one line that says a Data layer's source is not there (and where a relative one was looked
    for), or None when it exists. A URI (`hdfs://`, `file:`, ...) is not checked here: its readers
    say whether they can open it."""
    source = layer_param.data_param.source
    if not source:
        return f"layer {layer_param.name!r}: no data_param.source; its data shape is unknown"
    if os.path.exists(source) or is_uri(source):
        return None
    where = "" if os.path.isabs(source) else \
        f" (a relative source is read from the current directory, {os.getcwd()}, as Caffe reads it)"
    return f"layer {layer_param.name!r}: source {source!r} not found{where}; create it or correct the path"
