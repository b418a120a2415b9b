"""The throughput model of a DeepSpark job and `deepspark plan`: what N workers on a network will do, from one worker's step and the center's exchange, measured here.

The model is the paper's: a worker's time is its computation T_comp and its
communication T_comm, and the single center is a shared resource. Each
function below states its formula; `measure` times the two costs that
depend on the machine (a solver step on the backend, the center's work per
exchange) and the rest comes from the network's bandwidth and latency.
Every projection assumes one worker per node and the center on the
driver's node, as `deepspark train` places them on a cluster.
"""

import dataclasses
import logging
import math
import os
import re
import statistics
import time

import numpy as np

from deepspark import algorithms, checkpoint, config, engine, rules, schedule
from deepspark.algorithms.base import center_rate
from deepspark.algorithms.easgd import EasgdHandler
from deepspark.backends import create_model
from deepspark.data import source_shape
from deepspark.errors import ConfigError
from deepspark.exchange import ExchangeClient, ExchangeServer
from deepspark.exchange import codec as codecs
from deepspark.exchange import protocol
from deepspark.graph import Graph
from deepspark.proto import deepspark_pb2 as pb

# How long each measurement runs at least, and its fewest repetitions: the median of short runs
# is steadier on a busy 2-core machine than one long run.
MEASURE_SECONDS = 1.0
MIN_REPEATS = 5
WARMUP_STEPS = 2  # a backend traces and allocates in its first steps

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one worker and the center cost, in seconds, and what they move.

    step     T_comp: one solver iteration of one worker (`batch` images)
    floats   the parameter count
    server   the center's own work per exchange: receiving x, the rule, the codec, the tags, the reply
    worker   a worker's own work per exchange beside its steps: reading and writing its
             parameters, the snapshot, applying d, the codec, its tags
    codec    how the exchanger's model frames travel (exchange_codec's name)
    """

    step: float
    batch: int
    floats: int
    server: float
    worker: float
    codec: str = "float32"

    @property
    def bytes(self):
        """What one exchange moves each way through the exchanger: a model frame in the job's codec."""
        return codecs.get(self.codec).payload_bytes(self.floats)

    @property
    def spark_bytes(self):
        """What `average` moves per worker each way through Spark: the float32 parameters."""
        return 4 * self.floats


@dataclasses.dataclass(frozen=True)
class Network:
    """Each node's link: `bandwidth` bytes per second each way (full duplex), `latency` seconds one way."""

    bandwidth: float
    latency: float

    @classmethod
    def of(cls, gbit, ms):
        return cls(gbit * 1e9 / 8, ms / 1e3)


def project(costs, network, ds, workers, shared=1.0):
    """The Projection of `workers` workers running the algorithm of DeepSparkParameter `ds` (its row's cost)."""
    return algorithms.of(ds).cost(costs, network, ds, workers, shared)


def saturation(costs, network, ds):
    """The most workers the single center serves without their exchanges queueing (EASGD: R x cycle);
    None for an algorithm that does not exchange through it."""
    return algorithms.of(ds).saturation(costs, network, ds)


# -- measuring the costs here ---------------------------------------------------------


def _repeat(run, seconds=MEASURE_SECONDS, repeats=MIN_REPEATS):
    """The median seconds of run() over at least `repeats` calls and `seconds` in all."""
    times, started = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - started < seconds:
        at = time.perf_counter()
        run()
        times.append(time.perf_counter() - at)
    return statistics.median(times)


def training_net(path, data_shape=None):
    """(train NetParameter, its SourceMap, SolverParameter, the (C, H, W) its Data layers take where their
    LMDB is absent) of what `plan` times: a model folder's solver.prototxt (with its deepspark.prototxt),
    a solver, or a net .prototxt. A Data layer's shape comes from its LMDB, else `data_shape`, else a model
    folder's deploy.prototxt Input."""
    folder = path if os.path.isdir(path) else None
    if folder:
        path = config.model_file(folder, "solver.prototxt", "train_val.prototxt")
        if not path:
            raise ConfigError("no solver.prototxt or train_val.prototxt in this folder", folder)
        deploy = config.model_file(folder, "deploy.prototxt")
        if data_shape is None and deploy:
            inputs = [layer for layer in Graph(config.load_net(deploy)[0], pb.TEST).layers if layer.type == "Input"]
            data_shape = tuple(inputs[0].top_shapes[0][1:]) if inputs else None
    if re.search(r"^\s*(train_)?net\s*:", checkpoint.read_bytes(path, "prototxt").decode("utf-8", "replace"), re.M):
        solver = config.load_solver(path)
        return solver.train_net, solver.train_map, solver.param, data_shape
    net, source = config.load_net(path)
    return net, source, pb.SolverParameter(), data_shape


def measure(net, source, param, pp, data_shape=None):
    """The Costs of a train net here: a step on its solver's deepspark_param.backend with `pp.cores` threads
    (unless pp.step_ms), the center's work per exchange at its size (unless pp.server_ms), and a worker's."""
    ds = param.deepspark_param
    model = create_model(ds.backend, net, param, source=source, batch_size=pp.batch_size or None,
                         data_shape=lambda layer: source_shape(layer, data_shape), threads=pp.cores)
    try:
        if not any(any(layer.loss_weights) for layer in model.graph.layers):
            raise ConfigError("plan times a training step, and this net has no loss: give a model folder, its "
                              "solver or its train_val.prototxt", source.filename)
        batch = next(iter(model.feeds.values()))[0]
        if pp.step_ms:
            step = pp.step_ms / 1e3
        else:
            one = engine.SyntheticBatches(model, seed=0).next_batch()
            for _ in range(WARMUP_STEPS):
                model.step(one)
            step = _repeat(lambda: model.step(one))
            log.info(f"Measured a {ds.backend} step of {model.graph.name} (batch {batch}, {pp.cores} "
                     f"thread{'s' * (pp.cores != 1)}): {1e3 * step:.2f} ms")
        flat = model.get_flat()
        codec = codecs.get(ds.exchange_codec).name
        worker = worker_seconds(model, flat, ds.exchange_integrity, codec)
    finally:
        model.close()
    server = pp.server_ms / 1e3 if pp.server_ms else server_seconds(flat.size, ds.exchange_integrity, codec)
    return Costs(step, int(batch), int(flat.size), server, worker, codec)


def worker_seconds(model, flat, integrity, codec="float32"):
    """A worker's own time per exchange: its parameters read out and written back, the snapshot copied,
    d applied (x -= d), x coded and d decoded (a codec other than float32), and the tags of both frames."""
    snapshot, d = np.empty_like(flat), np.zeros_like(flat)
    link = None if codec == "float32" else codecs.Channel(codecs.get(codec), flat.size)
    sealer = protocol.Sealer(b"k" * 32)
    header = bytes(protocol.HEADER_SIZE)

    def once():
        model.get_flat(flat)
        np.copyto(snapshot, flat)
        frames = [memoryview(snapshot).cast("B"), memoryview(d).cast("B")]
        if link is not None:
            frames = [link.send_toward(snapshot), link.payload]
            link.receive_difference(d)
        rules.apply_to_worker(flat, d)
        model.set_flat(flat)
        if integrity:
            for frame in frames:
                tag = sealer.begin(header)
                tag.update(frame)
                tag.digest()

    return _repeat(once)


def server_seconds(floats, integrity, codec="float32"):
    """The center's work per exchange, measured: a server here and one blocking worker on loopback, the
    server's own time from each EXCHANGE header to its reply handed to the kernel (the stats' latency),
    the median over the exchanges of MEASURE_SECONDS."""
    secret, x = b"plan", np.zeros(floats, np.float32)
    with ExchangeServer(x, secret, EasgdHandler(0.5), integrity=integrity, codec=codec) as server:
        client = ExchangeClient(server.address, secret, 0, timeout=30.0, integrity=integrity, codec=codec)
        latencies, started = [], time.perf_counter()
        try:
            while len(latencies) < 3 * MIN_REPEATS or time.perf_counter() - started < MEASURE_SECONDS:
                client.exchange(x)
                latency = server.stats()[0]["latency"]
                if latency is not None:
                    latencies.append(latency)
        finally:
            client.close()
    return statistics.median(latencies)


# -- `deepspark plan` ---------------------------------------------------------------------------


def workers_to_show(most):
    """1, 2, 4, ... up to `most`, and `most` itself."""
    counts = [2 ** k for k in range(int(math.log2(most)) + 1)] if most >= 1 else [1]
    return counts + ([most] if counts[-1] != most else [])


def table(costs, network, ds, most):
    """The plan's rows for 1, 2, 4, ... `most` workers and its closing lines, as text."""
    rows = [project(costs, network, ds, n) for n in workers_to_show(most)]
    lines = [f"{'workers':>7}  {'images/s':>10}  {'speedup':>8}  {'exchange share':>14}  {'center load':>11}"]
    lines += [f"{p.workers:>7}  {p.images_per_second:>10,.0f}  {p.speedup:>7.2f}x  {100 * p.exchange_share:>13.1f}%  "
              f"{100 * p.center_load:>10.1f}%" for p in rows]
    most_served = saturation(costs, network, ds)
    if most_served is not None:
        ceiling = center_rate(costs, network) * ds.period * costs.batch
        lines.append(f"The single center saturates at {most_served} workers: beyond that the job stays near "
                     f"{ceiling:,.0f} images/s (a longer period, or a faster link to the driver, moves it)")
    return "\n".join(lines), rows


def run(path, knobs, pp, data_shape=None):
    """`deepspark plan`: the net at `path` (training_net's) with DeepSparkParameter `knobs` over its solver's;
    (the report: the header, the table and its closing line, for the CLI to print; the Projections)."""
    net, source, param, data_shape = training_net(path, data_shape)
    ds = param.deepspark_param
    config.set_fields(ds, knobs, "the command line")
    config.check_deepspark(ds, path)
    algorithms.check(ds, path)
    costs = measure(net, source, param, pp, data_shape)
    network = Network.of(pp.bandwidth, pp.latency)
    algorithm = algorithms.of(ds)
    how = algorithm.plan_note(ds)
    coded = "" if costs.codec == "float32" else f", {costs.bytes / 1e6:.2f} MB in {costs.codec}"
    header = (f"{costs.floats:,} parameters ({costs.spark_bytes / 1e6:.1f} MB a vector{coded}), batch {costs.batch}; "
              f"a step {1e3 * costs.step:.2f} ms ({ds.backend}, {pp.cores} thread{'s' * (pp.cores != 1)}"
              f"{'' if pp.step_ms else ', measured here'}); the center {1e3 * costs.server:.2f} ms an exchange"
              f"{'' if pp.server_ms else ' (measured here)'}, a worker {1e3 * costs.worker:.2f} ms; "
              f"{pp.bandwidth:g} Gbit/s links, {pp.latency:g} ms latency; {algorithm.name}" + (f", {how}" if how else ""))
    text, rows = table(costs, network, ds, ds.workers)
    rule = schedule.scaling_line(param)  # the rate its workers run at, where lr_scaling scales it
    return header + "\n" + text + (f"\n{rule}" if rule else ""), rows
