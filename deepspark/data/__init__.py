"""The shared data pipeline: Datum, record sources (LMDB, Parquet, DataFrame), sharding, Caffe's transform_param, batches, converters."""

import os

from deepspark.data import annotated, hdf5, images  # noqa: F401 (they register their feeders in the table)
from deepspark.data.datum import (DataError, check_datum, checked_records, decode_datum, encode_datum,
                                  load_mean)
from deepspark.data.feeder import DataFeeder
from deepspark.data.lmdb_io import shard_range
from deepspark.data.parquet import is_uri
from deepspark.data.sources import SOURCES, RecordSource, Shard, source_for
from deepspark.data.table import FEEDERS, check_feeders, feeder_for
from deepspark.data.transform import Transformer
from deepspark.graph import FED_TYPES, crop_of
from deepspark.proto import deepspark_pb2 as pb

__all__ = ["LISTED_SOURCES", "READ_SOURCES", "SOURCES", "SOURCE_PARAMS", "absolute_sources", "check_listed",
           "DataError", "DataFeeder", "RecordSource", "Shard", "Transformer", "check_datum", "checked_records", "count",
           "decode_datum", "encode_datum", "feeder_for", "load_mean", "missing_source", "peek_shape", "shard_range",
           "source_for", "source_of", "source_shape"]


def count(source):
    """Number of records in an LMDB or a Parquet dataset."""
    return source_for(source).count()


def peek_shape(source):
    """(C, H, W) of the first record of an LMDB or a Parquet dataset (decoding it if it is an encoded image)."""
    key, value = source_for(source).first_record()
    array, _ = decode_datum(value, key, source)
    return tuple(int(d) for d in array.shape)


# hdf5, images and feeder registered their rows in the feeder table as they were imported above: every fed
# type of the layer registry must have one (a type added to deepspark/graph alone fails here, at once).
check_feeders(FED_TYPES)

# The data layers that read a source of their own, and the parameter message that names it.
SOURCE_PARAMS = {kind: FEEDERS[kind].param for kind in sorted(FEEDERS) if FEEDERS[kind].param}
# Of those, the ones the pipeline reads (WindowData names a source but is refused), and the ones whose source
# is a list of files, of which each shard of a Spark job reads its own share.
READ_SOURCES = frozenset(kind for kind in SOURCE_PARAMS if FEEDERS[kind].make)
LISTED_SOURCES = frozenset(kind for kind in SOURCE_PARAMS if FEEDERS[kind].listed)


def source_of(layer_param):
    """The source a data layer names (an LMDB, a list file, a window file), as written."""
    return getattr(layer_param, SOURCE_PARAMS[layer_param.type]).source


def source_shape(layer_param, data_shape=None):
    """What a data layer's shapes need from its source: (C, H, W) of a Data or ImageData layer's images
    before transform, {top: row shape} of an HDF5Data layer's datasets; or a warning string if it cannot tell.
    Other layers (WindowData, Input, ...) take their shapes from the prototxt: None."""
    row = FEEDERS.get(layer_param.type)
    if row is None or row.make is None or row.param is None:
        return None
    if row.shape is not None:
        return _listed_shape(row, layer_param, data_shape)
    return _data_shape(layer_param, data_shape)


def _given_shape(layer_param, data_shape):
    """--data-shape: (C, H, W), or a dict by layer name or first top; None if it does not name this layer."""
    if isinstance(data_shape, dict):
        data_shape = next((data_shape[k] for k in [layer_param.name, *layer_param.top[:1]] if k in data_shape), None)
    return None if data_shape is None else tuple(int(d) for d in data_shape)


def _listed_shape(row, layer_param, data_shape):
    """source_shape of a layer that reads a list of files (HDF5Data, ImageData): its first listed file's, else
    --data-shape (the first top's row, for HDF5Data: hdf5.given_rows), else why not; `row` its Feeds row."""
    if os.path.exists(source_of(layer_param)):
        return row.shape(layer_param, None)
    given = _given_shape(layer_param, data_shape)
    if given is not None:
        return row.shape(layer_param, given)
    return missing_source(layer_param)


def _data_shape(layer_param, data_shape=None):
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
    given = _given_shape(layer_param, data_shape)
    if given is not None:
        return given
    tp = layer_param.transform_param
    if tp.mean_file and os.path.exists(tp.mean_file):
        return tuple(int(d) for d in load_mean(tp.mean_file).shape)
    crop_h, crop_w = crop_of(tp)
    if crop_h and crop_w and len(tp.mean_value) > 1:
        return (len(tp.mean_value), crop_h, crop_w)
    return unread or missing_source(layer_param)


def absolute_sources(net):
    """A copy of `net` whose list-reading data layers name their lists (and an ImageData layer its image folder)
    by absolute paths, as the driver sees them: an executor's working directory is not the driver's."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    for layer in out.layer:
        if layer.type in FEEDERS and FEEDERS[layer.type].listed and source_of(layer):
            param = getattr(layer, SOURCE_PARAMS[layer.type])
            param.source = os.path.abspath(param.source)
            if layer.type == "ImageData" and not os.path.isabs(param.root_folder):
                # Caffe joins root_folder and the listed path as strings: keep a trailing separator's meaning.
                param.root_folder = os.path.join(os.getcwd(), param.root_folder) if param.root_folder else \
                    os.getcwd() + os.sep
    return out


def check_listed(layer_param):
    """A one-line error at the list's line for the first file an HDF5Data or ImageData layer's list names
    that is not there (or, for HDF5, lacks a dataset the layer's tops name): its Feeds row's `listed`."""
    row = FEEDERS.get(layer_param.type)
    if row is not None and row.listed is not None:
        row.listed(layer_param)


def missing_source(layer_param):
    """The one line that says a data layer's source is not there (and where a relative one was looked
    for), or None when it exists. A URI (`hdfs://`, `file:`, ...) is not checked here: its readers
    say whether they can open it."""
    source = source_of(layer_param)
    if not source:
        return (f"layer {layer_param.name!r}: no {SOURCE_PARAMS[layer_param.type]}.source; its data shape "
                "is unknown")
    if os.path.exists(source) or is_uri(source):
        return None
    where = "" if os.path.isabs(source) else \
        f" (a relative source is read from the current directory, {os.getcwd()}, as Caffe reads it)"
    return f"layer {layer_param.name!r}: source {source!r} not found{where}; create it or correct the path"
