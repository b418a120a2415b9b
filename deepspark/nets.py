"""A solver's nets built on a backend and fed by the data pipeline (the Trainer of a single run or of a Spark worker, the test nets of either), and Caffe's verbs that run them in this process (train --algorithm single, test, time, describe)."""

import logging
import time

import numpy as np
from google.protobuf import text_format

from deepspark import checkpoint, config, detection_eval, engine, upgrade
from deepspark.backends import create_model, use_gpu
from deepspark.config import load_net, net_path, random_seed
from deepspark.data import SOURCE_PARAMS, check_listed, feeder_for, missing_source, source_shape
from deepspark.data.feeder import BLOCK_BYTES, STREAM_WINDOW_BYTES
from deepspark.data.resume import BLOCKS
from deepspark.data.table import FEEDERS
from deepspark.errors import ConfigError
from deepspark.graph import DATA_TYPES, FED_TYPES, Graph, layer_included
from deepspark.log import Log, train_log
from deepspark.proto import deepspark_pb2 as pb

log = logging.getLogger(__name__)


def check_sources(net, source_map, phase):
    """A one-line error naming the first data layer of `net` in `phase` whose source is not there, or whose
    list names a file that is not (checked before a backend starts: they are cheap, a backend is not)."""
    state = pb.NetState(phase=phase)
    for index, layer in enumerate(net.layer):
        if layer.type in SOURCE_PARAMS and layer_included(layer, state):
            missing = missing_source(layer)
            if missing:
                raise ConfigError(missing, *source_map.where(index))
            if FEEDERS[layer.type].make is None:  # a source read and described, not trained on (WindowData)
                raise ConfigError(f"layer '{layer.name}': {FEEDERS[layer.type].refusal}", *source_map.where(index))
            check_listed(layer)


def feeders_for(model, phase, seed=None, shard=0, num_shards=1, shuffle=False):
    """One feeder per data layer of a model's net that reads a source (Data, HDF5Data, ImageData); a fed
    layer with no data source is an error. shuffle: a Data layer's order each epoch (train_order's); HDF5Data
    and ImageData keep their own `shuffle`, as Caffe defines it (their feeders take no other)."""
    feeders = []
    for layer in model.graph.layers:
        where = model.graph.source.where(layer.index)
        if layer.type in FED_TYPES and layer.type not in SOURCE_PARAMS:
            raise ConfigError(f"layer '{layer.name}' ({layer.type}) has no data to train or test on; "
                              "use a Data layer reading an LMDB or a Parquet dataset", *where)
        if layer.type in SOURCE_PARAMS:
            missing = missing_source(layer.param)
            if missing:
                raise ConfigError(missing, *where)
            options = {"shuffle": shuffle} if layer.type == "Data" else {}
            try:
                feeders.append(feeder_for(layer.param, phase, shard=shard, num_shards=num_shards, seed=seed,
                                          batch_size=model.graph.context.batch_size, **options))
            except ConfigError as error:
                if error.filename is None:  # about the layer itself: point at it
                    raise ConfigError(error.message, *where) from None
                raise
    return feeders


def train_order(ds, spark):
    """The train feeders' shuffle for DeepSparkParameter.data_order: BLOCKS (a new seeded order every epoch,
    which a streamed shard reads in bounded memory) or False (the source's order, Caffe's). DEFAULT: shuffled
    on Spark (a job's workers, fit) and the source's in this process (a single run, as pycaffe reads it)."""
    order = ds.data_order
    if order == pb.DeepSparkParameter.DEFAULT:
        order = pb.DeepSparkParameter.SHUFFLED if spark else pb.DeepSparkParameter.SOURCE
    return BLOCKS if order == pb.DeepSparkParameter.SHUFFLED else False


def order_line(shuffle, seed, feeders=(), buffer=STREAM_WINDOW_BYTES):
    """The log's line of the order a job's train shards are read in (`shuffle`: train_order's; `seed`: what
    seeds it, a number or words, None where random_seed is unset; `buffer`: the shuffle buffer's bytes) and, for
    `feeders` built, each layer's own: a Data layer's blocks and shuffle buffer in records, an HDF5Data's or
    ImageData's own `shuffle`."""
    if shuffle:
        seeded = "unseeded: random_seed is not set" if seed is None else f"seed {seed}"
        line = (f"Data order: shuffled per epoch ({seeded}), blocks of {BLOCK_BYTES >> 20} MB of records "
                f"through a {buffer >> 20} MB shuffle buffer")
    else:
        line = "Data order: as the source (Caffe's)"
    layers = []
    for feeder in feeders:
        if not hasattr(feeder, "blocks"):  # HDF5Data, ImageData: Caffe's shuffle param
            layers.append(f"'{feeder.name}' {'shuffled' if feeder.shuffle else 'in order'} by its own shuffle")
        elif feeder.shuffle == BLOCKS:
            block, window = feeder.blocks  # a shard smaller than either is one block, shuffled whole
            layers.append(f"'{feeder.name}' {min(block, feeder.size)} records a block, "
                          f"{min(block * window, feeder.size)} a buffer, of {feeder.size}")
    return line + (f"; {', '.join(layers)}" if layers else "")


def evaluator(solver, threads=None):
    """The solver's test nets on its backend, each with its test_iter and its feeders."""
    backend, seed = solver.param.deepspark_param.backend, random_seed(solver.param)
    ap_version = detection_eval.ap_version_of(solver.param)  # eval_type "detection": mAP, checked before building
    nets = []
    for (net, source, state), iterations in zip(solver.test_nets, solver.param.test_iter):
        model = create_model(backend, net, None, phase=pb.TEST, source=source, stages=list(state.stage),
                             data_shape=source_shape, seed=seed, threads=threads)
        nets.append((model, feeders_for(model, pb.TEST, seed=seed), iterations))
    return engine.Evaluator(nets, ap_version)


def worker_seed(seed, rank):
    """The seed of the feeders of worker `rank` in a job of random_seed `seed`: `seed` itself for worker 0 (and a
    single run, whose order stays as it was), a 32-bit draw of SeedSequence((seed, rank)) for any other, so that
    no two (seed, rank) pairs share an order as seed + rank made them (job s's worker 1 read job s+1's worker 0's).
    None (unseeded) stays None."""
    if seed is None or rank == 0:
        return seed
    return int(np.random.SeedSequence((seed, rank)).generate_state(1)[0])


def trainer(solver, *, shard=0, num_shards=1, rank=None, threads=None, evaluate=True, spark=False):
    """A Trainer of the solver's train net on the solver's backend, reading shard `shard` of `num_shards`.

    The feeders are seeded with worker_seed(random_seed, rank) (rank default: shard), so that
    every worker of a job sees its own order, in data_order's order (train_order: spark, a
    Spark worker's); evaluate: build the test nets too. The log says the order.
    """
    backend, seed = solver.param.deepspark_param.backend, random_seed(solver.param)
    model = create_model(backend, solver.train_net, solver.param, source=solver.train_map, data_shape=source_shape,
                         threads=threads)
    seed = worker_seed(seed, shard if rank is None else rank)
    shuffle = train_order(solver.param.deepspark_param, spark)
    try:
        feeders = feeders_for(model, pb.TRAIN, seed=seed, shard=shard, num_shards=num_shards, shuffle=shuffle)
        log.info(order_line(shuffle, seed, feeders))
        tests = evaluator(solver, threads) if evaluate and solver.test_nets else None
    except BaseException:
        model.close()
        raise
    return engine.Trainer(solver, model, feeders, tests)


def carry_on(trainer, batches):
    """Move the trainer's train feeders on `batches` batches without reading them (Resumable.skip), each epoch's
    order and each batch's crops and mirrors drawn on the way as reading them drew them (the same seed): where
    the same feeders stood after reading them. What the log says of it: '10 batches in (epoch 3)', and the
    feeders that cannot move on (they read from their shard's start)."""
    stuck = [feeder.name for feeder in trainer.feeders if not feeder.skip(batches)]
    epochs = sorted({feeder.epoch for feeder in trainer.feeders})
    return (f"{batches} batches in (epoch {', '.join(map(str, epochs))})"
            + (f"; {', '.join(stuck)} cannot move on and read from the shard's start" if stuck else ""))


def resume_order(run):
    """A resumed single run's train feeders moved on to where the uninterrupted run's stood at its iteration
    (iteration x iter_size batches in), so that it reads the batches that run would have read next; in Caffe's
    order (data_order SOURCE, a single run's default) they read from their shard's start, as Caffe's restore
    does, so that a resumed run stays comparable with pycaffe's."""
    if not train_order(run.param.deepspark_param, spark=False):
        return
    log.info(f"Data order: carried on at iteration {run.iter}, {carry_on(run, run.iter * run.model.iter_size)}")


def place(solver):
    """Caffe's solver_mode and device_id, before the backend builds a net in this process: a solver that says
    `solver_mode: GPU` (every BVLC solver does) runs on GPU device_id, and one line says where, or that there
    is no such GPU and it runs on the CPU; any other, on the CPU, as `caffe train` without --gpu. Where it runs."""
    param, backend = solver.param, solver.param.deepspark_param.backend
    asked = param.HasField("solver_mode") and param.solver_mode == pb.SolverParameter.GPU
    where = use_gpu(backend, param.device_id if asked else None)
    if asked and where == "CPU":
        which = "GPU" if param.device_id == 0 else f"GPU {param.device_id}"
        log.warning(f"solver_mode: GPU, but the {backend} backend has no {which} here: it runs on the CPU")
    elif asked:
        log.info(f"solver_mode: GPU: the {backend} backend runs on {where}")
    return where


def train(solver, weights=None, snapshot=None):
    """`deepspark train --algorithm single`: Caffe's Solver::Solve in this process, no exchange; its
    engine.JobResult (summary {"iterations", "weights", "wall_seconds", "test<i>/<output>": value}, the history,
    the final weights in memory, the snapshots)."""
    started = time.monotonic()
    check_sources(solver.train_net, solver.train_map, pb.TRAIN)  # before the backend starts
    output = config.output_folder(solver)
    with Log(train_log(output), append=bool(snapshot)):
        place(solver)
        run = trainer(solver)
        try:
            if weights:
                run.load_weights(weights)
            if snapshot:
                run.restore(snapshot)
                resume_order(run)
            with checkpoint.writes_behind():  # the snapshots' fsync off the training loop (#44)
                results = run.solve()
            arrays = checkpoint.layer_blobs(run.model.graph, run.model.get_params())
        finally:
            run.close()
    final = engine.first_values(results)
    last = run.snapshots[-1][0] if run.snapshotted == run.iter else None  # the final model's, if snapshotted
    summary = {"iterations": run.iter, "weights": last, "wall_seconds": time.monotonic() - started, **final}
    return engine.JobResult(summary, output, history=tuple(run.history), final_test=final, weights=tuple(arrays),
                            snapshots=tuple(run.snapshots), started=run.started)


def deploy_net(path, verb):
    """(NetParameter, SourceMap) of the deploy net at `path` (a file or a model folder); a one-line error
    naming `verb` if the net reads its own data rather than taking it through Input layers."""
    path = net_path(path)
    net, source = load_net(path)
    fed = [(i, layer) for i, layer in enumerate(net.layer) if layer.type in DATA_TYPES and layer.type != "Input"]
    if fed or not (net.input or any(layer.type == "Input" for layer in net.layer)):
        what = f"reads its data from a {fed[0][1].type} layer ('{fed[0][1].name}')" if fed else "has no Input layer"
        raise ConfigError(f"the net {what}; {verb} takes a deploy net, whose Input layers name what a caller "
                          "feeds (Caffe's deploy.prototxt)", *(source.where(fed[0][0]) if fed else (path,)))
    return net, source


def test_model(path, backend, phase=pb.TEST, batch_size=None, threads=None):
    """A backend model of the net at `path` (a .prototxt or a model folder) for a forward pass."""
    net, source = load_net(net_path(path))
    return create_model(backend, net, None, phase=phase, source=source, batch_size=batch_size,
                        data_shape=source_shape, threads=threads)


def test(path, weights, iterations, backend):
    """Caffe's `test`: the mean of every output of the net's TEST phase over `iterations` batches, logged."""
    model = test_model(path, backend)
    try:
        blobs = checkpoint.read_caffemodel(weights)
        model.set_params(checkpoint.weights_for(model.graph, blobs, model.get_params(), weights))
        feeders = feeders_for(model, pb.TEST)
        try:
            log.info(f"Running for {iterations} iterations.")
            means = engine.score(model, feeders, iterations)
        finally:
            engine.close_all(feeders)
        engine.log_outputs(model.graph, means, "")
    finally:
        model.close()
    return means


def timing(path, iterations, backend, phase=pb.TRAIN):
    """Caffe's `time`: per-layer forward/backward milliseconds, logged as `caffe time` prints them; an engine.Timing.

    One batch, timed over and over: the net's first real one when its LMDBs
    exist, else a seeded synthetic one (timing needs no real data; max
    pooling is faster on blank input, so a blank batch would flatter it).
    """
    model = test_model(path, backend, phase)
    try:
        try:
            feeders = feeders_for(model, model.phase)
        except ConfigError:  # Input layers, or no LMDB
            feeders = []
        try:
            batch = engine.next_batch(feeders) if feeders else engine.SyntheticBatches(model).next_batch()
        finally:
            engine.close_all(feeders)
        passes, loss = model.layer_passes(batch)
        return engine.benchmark(passes, loss, iterations)
    finally:
        model.close()


def upgrade_net(path, out):
    """Caffe's upgrade_net_proto_text: the net at `path` upgraded as Caffe reads it, written as text to `out`
    (a temporary name, then renamed). Returns what Caffe would log: [notes], or ["already in the latest
    format"] for a net that needs no upgrade (written as it is, as Caffe's tool writes it)."""
    text, net = config.read_net_text(path)
    if not upgrade.needs_upgrade(net):
        notes = [f"{path}: already in the latest proto format"]
    else:
        net, source = config.parse_net(text, path)
        notes = source.notes
    checkpoint.atomic_write(out, text_format.MessageToString(net).encode())
    return notes


def upgrade_solver(path, out):
    """Caffe's upgrade_solver_proto_text: `solver_type` as `type`, written as text to `out`; [notes]."""
    text, param = config.read_solver_text(path)
    changed = upgrade.upgrade_solver(param, lambda: (path, *config.field_position(text, "solver_type")))
    notes = [] if changed else [f"{path}: already in the latest proto format"]
    checkpoint.atomic_write(out, text_format.MessageToString(param).encode())
    return notes


def describe(path, phase=pb.TRAIN, data_shape=None, batch_size=None, stages=None):
    """(the `describe` table of a net, its warnings): layers, top shapes, parameter shapes, total. stages: the
    NetState stages that choose layers (Caffe's --stage), as a solver's test_state gives them."""
    net, source = load_net(net_path(path))
    net_graph = Graph(net, phase, stages=stages, source=source, batch_size=batch_size,
                      data_shape=lambda layer: source_shape(layer, data_shape))
    warnings = [f"{warning}, or give --data-shape C,H,W" for warning in dict.fromkeys(net_graph.warnings)]
    warnings += source.notes
    return net_graph.describe(), warnings
