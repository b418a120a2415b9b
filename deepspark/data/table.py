"""The feeder table: for each fed data layer type, the feeder that reads its batches, or why it has none."""

from dataclasses import dataclass

from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb


@dataclass(frozen=True)
class Feeds:
    """How the data pipeline feeds one fed layer type (graph's `fed=True`), registered beside its feeder."""

    type: str
    # make(layer_param, phase, where, options) -> its feeder (where: shard, num_shards, seed, batch_size;
    # options: DataFeeder's own, shuffle, prefetch, mean, ...); None where the pipeline does not feed it.
    make: object = None
    param: str = None  # the LayerParameter field whose `source` it reads; None: it names no source
    # Where its source is a list of files: listed(layer_param) raises a one-line error for the first listed
    # file that is not there.
    listed: object = None
    # shape(layer_param, given): what its graph shape rule needs from its source's first listed file, or from
    # `given` ((C, H, W) of --data-shape) when that is not None; None: a source of Datum records (Data's).
    shape: object = None
    refusal: str = None  # where make is None but the layer names a source: why a run refuses it


FEEDERS = {}  # fed layer type -> Feeds


def feeds(kind, **row):
    """Register how the data pipeline feeds layer type `kind` (a Feeds row)."""
    FEEDERS[kind] = Feeds(kind, **row)


def check_feeders(fed_types):
    """Raise a RuntimeError naming the types if the fed types of the layer registry and the feeder table differ.

    deepspark.data calls it as it is imported, so that a fed type registered in deepspark/graph with no row
    here fails at once, not when a net first uses it.
    """
    missing, extra = sorted(set(fed_types) - set(FEEDERS)), sorted(set(FEEDERS) - set(fed_types))
    problems = []
    if missing:
        problems.append(f"fed in deepspark/graph but with no feeder in deepspark/data: {', '.join(missing)} "
                        "(register one with data.table.feeds)")
    if extra:
        problems.append(f"in the feeder table but not a fed type in deepspark/graph: {', '.join(extra)}")
    if problems:
        raise RuntimeError(f"the feeder table and graph.FED_TYPES differ: {'; '.join(problems)}")


def feeder_for(layer_param, phase=pb.TRAIN, shard=0, num_shards=1, seed=None, batch_size=None, **kwargs):
    """The batch source of a data layer that reads its own source: Data (LMDB, Parquet), HDF5Data (.h5 files
    from a list), ImageData (images from a list), each its row's make. kwargs: DataFeeder's own (shuffle,
    prefetch, ...)."""
    where = dict(shard=shard, num_shards=num_shards, seed=seed, batch_size=batch_size)
    row = FEEDERS.get(layer_param.type)
    if row is not None and row.make is not None:
        return row.make(layer_param, phase, where, kwargs)
    if row is not None and row.refusal:
        raise ConfigError(f"layer {layer_param.name!r}: {row.refusal}")
    read = sorted(kind for kind, row in FEEDERS.items() if row.make is not None)
    raise ConfigError(f"layer {layer_param.name!r}: the data pipeline reads {', '.join(read[:-1])} and {read[-1]} "
                      f"layers; {layer_param.type} is handled by the backend")


# Fed by the backend from the caller's arrays (a deploy net's inputs), not by the data pipeline.
feeds("Input")
feeds("MemoryData")
