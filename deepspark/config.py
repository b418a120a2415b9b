"""Prototxt files into schema messages, with errors that point at FILE:LINE:COL."""

import functools
import os
import re

from google.protobuf import descriptor_pb2, text_format

from deepspark import graph, schedule, upgrade
from deepspark.errors import ConfigError, SourceMap
from deepspark.proto import deepspark_pb2 as pb


_TOKEN = re.compile(
    r'"(?:[^"\\\n]|\\.)*"'      # double-quoted string
    r"|'(?:[^'\\\n]|\\.)*'"     # single-quoted string
    r"|#[^\n]*"                   # comment
    r"|(?P<field>[A-Za-z_]\w*)(?=\s*[:{<])"  # a field name: followed by ':' or a block
    r"|(?P<open>[{<])|(?P<close>[}>])|(?P<newline>\n)")


def _scan_layers(text, block="layer"):
    """Positions of the top-level `block` blocks (`layer`, or an old net's `layers`) and of each one's own fields."""
    layers, depth, line, line_start = [], 0, 1, 0
    last_field, last_position = None, None
    for match in _TOKEN.finditer(text):
        kind = match.lastgroup
        if kind == "newline":
            line, line_start = line + 1, match.end()
        elif kind == "field":
            last_field = match.group()
            if depth == 1 and layers and layers[-1] is not None:
                layers[-1].setdefault(last_field, (line, match.start() - line_start + 1))
            elif depth == 0:
                last_position = (line, match.start() - line_start + 1)
        elif kind == "open":
            if depth == 0:
                layers.append({"layer": last_position} if last_field == block else None)
            depth += 1
        elif kind == "close":
            depth = max(depth - 1, 0)
    return [fields for fields in layers if fields is not None]


def _parse(text, message, filename):
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as error:
        raise _parse_error(error, text, message, filename) from None
    return message


_NO_FIELD = re.compile(r'Message type "deepspark\.(\w+)" has no field named "(\w+)"')
# weiliu89/caffe's SSD TransformationParameter fields that the bundled fork (brocolli-caffe) lacks: an SSD
# prototxt written for weiliu89's carries them, and the bare "unknown field" would not say what to write instead.
_WEILIU89_FIELDS = {
    "resize_param": "the bundled fork names it 'old_resize_param' (WARP only)",
    "distort_param": "the bundled fork has no photometric distortion: remove it",
    "expand_param": "the bundled fork has no expansion: remove it",
}


def _parse_error(error, text, message, filename):
    line, col = error.GetLine(), error.GetColumn()
    detail = str(error)
    detail = re.sub(r"^\d+:\d+ : ", "", detail)
    known = _NO_FIELD.search(detail)
    if known:
        owner, field = known.groups()
        detail = f"unknown field '{field}' in {owner}"
        if owner == "TransformationParameter" and field in _WEILIU89_FIELDS:
            detail += f" ('{field}' is weiliu89/caffe's SSD field; {_WEILIU89_FIELDS[field]})"
        if owner == "NetParameter" and field in pb.SolverParameter.DESCRIPTOR.fields_by_name:
            detail = (f"this is a solver prototxt ('{field}' is a solver field), where a net is expected; "
                      "give the net it names, or the model folder")
        if isinstance(message, pb.NetParameter) and owner == "LayerParameter":
            unsupported = _unsupported_type_at(text, line)
            if unsupported:
                detail = (f"layer type '{unsupported}' is not supported (its '{field}' is "
                          "unknown; docs/layers.md lists the supported types)")
    detail = detail.replace("deepspark.", "")
    return ConfigError(detail, filename, line if line > 0 else None, col if col > 0 else None)


def _unsupported_type_at(text, line):
    """The `type:` of the layer block that contains `line`, if it is not one we support."""
    offset = sum(len(l) + 1 for l in text.split("\n")[: line - 1])
    blocks = [m.start() for m in re.finditer(r"^\s*layer\s*[{<]", text, re.M)]
    start = max([b for b in blocks if b <= offset], default=None)
    if start is None:
        return None
    end = min([b for b in blocks if b > start], default=len(text))
    # The layer's own type: the first `type:` at the block's top level, in either quote style.
    kind = re.search(r"""^\s{0,8}type\s*:\s*["']([^"']*)["']""", text[start:end], re.M) or \
        re.search(r"""\btype\s*:\s*["']([^"']*)["']""", text[start:end])
    if kind and kind.group(1) not in graph.supported_types():
        return kind.group(1)
    return None


def _read(path, what):
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found", path) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {what} file: {error}", path) from None


def parse_net(text, filename="<string>", upgrade_old=True):
    """A NetParameter and its SourceMap from prototxt text, upgraded as Caffe upgrades an old net when it
    reads one (V0/V1 layers, input fields; upgrade.upgrade_net), unless upgrade_old is False. What Caffe
    would only log about the upgrade is in the SourceMap's notes."""
    net = _parse(text, pb.NetParameter(), filename)
    layers = _scan_layers(text)
    if not (upgrade_old and upgrade.needs_upgrade(net)):
        return net, SourceMap(filename, layers)
    blocks = _scan_layers(text, "layers") if len(net.layers) else layers
    inputs = {"layer": field_position(text, "input")}

    def where(i):
        return (filename, *blocks[i]["layer"]) if i < len(blocks) else (filename, None, None)

    net, origins, notes = upgrade.upgrade_net(net, where, lambda: (filename, *inputs["layer"]))
    return net, SourceMap(filename, [inputs if o is None else blocks[o] for o in origins], notes)


def load_net(path):
    """A NetParameter and its SourceMap from a net .prototxt file."""
    return parse_net(_read(path, "net"), path)


def read_net_text(path):
    """(the net file's text, its NetParameter as written, not upgraded): for `deepspark upgrade-net`."""
    text = _read(path, "net")
    return text, _parse(text, pb.NetParameter(), path)


def read_solver_text(path):
    """(the solver file's text, its SolverParameter as written, not upgraded): for `deepspark upgrade-solver`."""
    text = _read(path, "solver")
    return text, _parse(text, pb.SolverParameter(), path)


def model_file(path, *names):
    """The first of `names` that exists in the model folder of `path` (path itself when it is a folder, else the
    folder the file `path` is in), or None: the one rule by which deploy.prototxt, train_val.prototxt and
    solver.prototxt are found beside what a verb was given."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return next((os.path.join(folder, name) for name in names if os.path.exists(os.path.join(folder, name))), None)


def output_folder(solver, given=None):
    """The folder a run writes its snapshots, train.log, plots and scalars to: `given` (`--output`, the
    Estimator's output Param), else the snapshot_prefix's folder, else "." (the working directory).

    One default for every algorithm, single and Spark alike, and the one a Caffe user expects: Caffe writes
    `<snapshot_prefix>_iter_N.caffemodel` as the prefix is given, relative to where it runs, so a prefix
    without a folder puts the snapshots, and here the log beside them, in the working directory."""
    return given or os.path.dirname(solver.param.snapshot_prefix) or "."


def net_path(path, names=("deploy.prototxt", "train_val.prototxt")):
    """A net file, or a model folder: the first of its `names` (deploy.prototxt, else train_val.prototxt; a verb
    that reads the net's data, as score does, asks for train_val.prototxt first), else the net its solver names."""
    if not os.path.isdir(path):
        return path
    found = model_file(path, *names)
    if found:
        return found
    solver = model_file(path, "solver.prototxt")
    if solver:
        param = load_solver(solver).param
        return param.net or param.train_net
    raise ConfigError("no deploy.prototxt, train_val.prototxt or solver.prototxt in this folder", path)


def parse_deepspark(text, filename="<string>"):
    return _parse(text, pb.DeepSparkParameter(), filename)


# DeepSpark's knobs in a file of their own beside a solver, so that the solver stays one Caffe parses.
DEEPSPARK_FILE = "deepspark.prototxt"


def deepspark_file(solver_path, given=None):
    """The DeepSparkParameter prototxt that goes with a solver: `given`, else deepspark.prototxt beside
    the solver if there is one, else None."""
    if given:
        return given
    beside = os.path.join(os.path.dirname(os.path.abspath(solver_path)), DEEPSPARK_FILE)
    return beside if os.path.exists(beside) else None


def resolve(path, base_dir):
    """Caffe resolves paths against the working directory; we also try the referring file's folder."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.join(base_dir, path)
    if os.path.exists(candidate):
        return candidate
    # A path written relative to a project root (as Caffe's examples are)
    # still resolves when its tail exists beside the referring file.
    tail = os.path.join(base_dir, os.path.basename(path))
    return tail if os.path.exists(tail) else path


def resolve_output_prefix(prefix, base_dir):
    """A snapshot prefix whose folder exists relative to the working directory or base_dir."""
    if not prefix or os.path.isabs(prefix):
        return prefix
    folder = os.path.dirname(prefix)
    if not folder or os.path.isdir(folder):
        return prefix
    candidate = os.path.join(base_dir, prefix)
    return candidate if os.path.isdir(os.path.dirname(candidate)) else prefix


class Solver:
    """A solver prototxt with its nets loaded: train net, test nets, source maps."""

    def __init__(self, param, path, train_net, train_map, test_nets):
        self.param = param
        self.path = path
        self.train_net = train_net
        self.train_map = train_map
        self.test_nets = test_nets  # list of (NetParameter, SourceMap, NetState)


def load_solver(path, deepspark=None):
    """Parse a solver prototxt, resolve and load the nets it names, check its arithmetic.

    DeepSpark's knobs: the solver's own deepspark_param block if it has one, then, field by field over
    it, the `deepspark` prototxt (default: deepspark.prototxt beside the solver, when there is one).
    """
    text = _read(path, "solver")
    param = _parse(text, pb.SolverParameter(), path)
    upgrade.upgrade_solver(param, lambda: (path, *field_position(text, "solver_type")))
    knobs = deepspark_file(path, deepspark)
    if knobs:
        param.deepspark_param.MergeFrom(parse_deepspark(_read(knobs, "DeepSpark parameter"), knobs))
    base = os.path.dirname(os.path.abspath(path))

    def net_from_file(field):
        net_path = resolve(getattr(param, field), base)
        if not os.path.exists(net_path):
            raise ConfigError(f"{field}: net file '{getattr(param, field)}' not found "
                              f"(looked in {os.getcwd()} and {base})", path)
        setattr(param, field, net_path)
        return load_net(net_path)

    train_fields = [f for f in ("train_net_param", "train_net", "net_param", "net") if param.HasField(f)]
    if len(train_fields) != 1:
        raise ConfigError("a solver needs exactly one of train_net_param, train_net, net_param, net "
                          f"(found {len(train_fields) or 'none'})", path)
    field = train_fields[0]
    if field.endswith("_param"):
        train, train_map = inline_net(getattr(param, field), path), SourceMap(path)
    else:
        train, train_map = net_from_file(field)

    tests = []
    for net in param.test_net_param:
        tests.append((inline_net(net, path), SourceMap(path)))
    for i, test_path in enumerate(param.test_net):
        resolved = resolve(test_path, base)
        if not os.path.exists(resolved):
            raise ConfigError(f"test_net: net file '{test_path}' not found", path)
        param.test_net[i] = resolved
        tests.append(load_net(resolved))
    if param.HasField("net") or param.HasField("net_param"):
        # Caffe's generic net: one test net of it per test_iter past the explicit test nets
        # (BVLC's mnist_autoencoder tests it twice, a test_state each).
        tests += [(train, train_map)] * max(len(param.test_iter) - len(tests), 0)
    if len(param.test_iter) != len(tests):
        raise ConfigError(f"test_iter must be given once per test net ({len(tests)} test nets, "
                          f"{len(param.test_iter)} test_iter)", path)
    if param.test_state and len(param.test_state) != len(tests):
        raise ConfigError("test_state must be given once per test net, or not at all", path)
    test_nets = []
    for i, (net, source) in enumerate(tests):
        state = pb.NetState()
        state.CopyFrom(param.test_state[i]) if param.test_state else None
        state.phase = pb.TEST
        test_nets.append((net, source, state))

    check_solver(param, path, text)
    param.snapshot_prefix = resolve_output_prefix(param.snapshot_prefix, base)
    return Solver(param, path, train, train_map, test_nets)


def inline_net(net, path):
    """A net given inside a solver (net_param, train_net_param, test_net_param), upgraded like a net file."""
    if not upgrade.needs_upgrade(net):
        return net
    return upgrade.upgrade_net(net, lambda i=None: (path, None, None), lambda: (path, None, None))[0]


def random_seed(param):
    """The solver's random_seed, or None when it is negative (Caffe then seeds from the clock)."""
    return param.random_seed if param.random_seed >= 0 else None


def field_position(text, field):
    """(line, col) of the first `field:` in a prototxt's text, or (None, None)."""
    match = re.search(rf"^[ \t]*({field})\s*[:{{<]", text, re.M)
    if not match:
        return None, None
    return text.count("\n", 0, match.start()) + 1, match.start(1) - text.rfind("\n", 0, match.start(1))


def check_solver(param, path, text=""):
    """Solver values Caffe would refuse or run wrongly: one line pointing at the field in `text`."""
    def error(message, field):
        return ConfigError(message, path, *field_position(text, field))

    kind = schedule.solver_type(param)
    if kind not in schedule.SOLVER_TYPES:
        raise error(f"type: unknown solver type '{kind}'; supported: {', '.join(schedule.SOLVER_TYPES)}", "type")
    policy = param.lr_policy or "fixed"
    if policy not in schedule.LR_POLICIES:
        raise error(f"lr_policy: unknown policy '{policy}'; supported: {', '.join(schedule.LR_POLICIES)}",
                    "lr_policy")
    for field in schedule.LR_POLICIES[policy]:
        present = len(param.stepvalue) if field == "stepvalue" else param.HasField(field)
        if not present:
            raise error(f"lr_policy '{policy}' needs {field}", "lr_policy")
    if policy == "step" and param.stepsize <= 0:
        raise error("stepsize must be positive for lr_policy 'step'", "stepsize")
    if policy == "poly" and param.max_iter <= 0:
        raise error("max_iter must be positive for lr_policy 'poly' (its rate falls to 0 there)", "max_iter")
    if list(param.stepvalue) != sorted(param.stepvalue):
        raise error("stepvalue must be increasing", "stepvalue")
    if param.regularization_type not in ("L1", "L2"):
        raise error(f"regularization_type: '{param.regularization_type}' is not L1 or L2", "regularization_type")
    for field, least in (("iter_size", 1), ("average_loss", 1), ("max_iter", 0), ("test_interval", 0)):
        if getattr(param, field) < least:
            raise error(f"{field} must be at least {least}, not {getattr(param, field)}", field)
    if any(t < 0 for t in param.test_iter):
        raise error("test_iter must not be negative", "test_iter")


def check_deepspark(ds, path):
    """DeepSparkParameter values that no algorithm can run: one line naming the field (what one algorithm cannot
    run, its row's check says: deepspark.algorithms.check, where a solver is loaded to train or plan)."""
    if ds.workers < 1:
        raise ConfigError(f"workers must be at least 1, not {ds.workers}", path)
    if ds.min_workers > ds.workers:
        raise ConfigError(f"min_workers ({ds.min_workers}) must not exceed workers ({ds.workers})", path)
    if ds.period < 1:
        raise ConfigError(f"period must be at least 1, not {ds.period}", path)
    if ds.HasField("iterations") and ds.iterations < 1:  # unset: max_iter
        raise ConfigError(f"iterations must be at least 1, not {ds.iterations}", path)
    if not 0.0 < ds.moving_rate <= 1.0:
        raise ConfigError(f"moving_rate must be in (0, 1], not {ds.moving_rate:g}", path)
    if ds.moving_rate_limit < 0:
        raise ConfigError(f"moving_rate_limit must not be negative, not {ds.moving_rate_limit:g}", path)
    for field in ("exchange_timeout", "connect_timeout", "outer_learning_rate"):
        if getattr(ds, field) <= 0:
            raise ConfigError(f"{field} must be positive, not {getattr(ds, field):g}", path)
    if not 0.0 <= ds.outer_momentum < 1.0:
        raise ConfigError(f"outer_momentum must be in [0, 1), not {ds.outer_momentum:g}", path)
    if ds.exchange_port > 65535:
        raise ConfigError(f"exchange_port must be a TCP port (0 to 65535), not {ds.exchange_port}", path)
    if ds.exchange_address:
        host_port(ds.exchange_address, path)
    if ds.lr_warmup and ds.lr_scaling and ds.backend == "caffe":
        raise ConfigError("lr_warmup runs on the tensorflow backend only: pycaffe's solver computes its own rate "
                          "(set lr_warmup: 0, or backend: \"tensorflow\")", path)


def host_port(text, path="<options>"):
    """(host, port) of "host:port"; a one-line error for anything else."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"exchange_address must be host:port, not '{text}'", path)
    return host.strip("[]"), int(port)


def set_fields(message, values, path="<options>"):
    """Set fields of a schema message from {field name: value}; None leaves a field as it is.

    Enum fields take their value's name in any case ("easgd") or number. An
    unknown name is a TypeError, as for any unknown keyword argument.
    """
    fields = message.DESCRIPTOR.fields_by_name
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; {message.DESCRIPTOR.name} has "
                        f"{', '.join(fields)}")
    for name, value in values.items():
        if value is None:
            continue
        enum = fields[name].enum_type
        if enum is not None and isinstance(value, str):
            if value.upper() not in enum.values_by_name:
                raise ConfigError(f"{name} must be one of {', '.join(v.name.lower() for v in enum.values)}, "
                                  f"not '{value}'", path)
            value = enum.values_by_name[value.upper()].number
        try:
            if fields[name].is_repeated:
                message.ClearField(name)
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{name}: {error}", path) from None
    return message


def override(solver, output=None, **knobs):
    """Options over a loaded solver, as `deepspark train`'s flags give them: DeepSparkParameter fields by
    name (knobs; `iterations` stops training there, max_iter and the schedule as the solver says) and the
    folder snapshots and logs go to (output)."""
    set_fields(solver.param.deepspark_param, knobs, solver.path)
    param = solver.param
    if (param.lr_policy or "fixed") == "poly" and schedule.stop_iteration(param) > param.max_iter:
        raise ConfigError(f"iterations {schedule.stop_iteration(param)} goes past max_iter {param.max_iter}, where "
                          "lr_policy 'poly' has brought the learning rate to 0", solver.path)
    if output:
        prefix = os.path.basename(solver.param.snapshot_prefix or solver.train_net.name or "snapshot")
        solver.param.snapshot_prefix = os.path.join(output, prefix)
    check_deepspark(solver.param.deepspark_param, solver.path)
    return solver


# The schema's descriptor set, with the comments of proto/deepspark.proto (`make proto` writes it).
DESCRIPTOR_SET = os.path.join(os.path.dirname(pb.__file__), "deepspark.desc")


@functools.cache
def field_comments(message_name):
    """{field name: its comment in proto/deepspark.proto, on one line} of a top-level message."""
    with open(DESCRIPTOR_SET, "rb") as stream:
        (schema,) = descriptor_pb2.FileDescriptorSet.FromString(stream.read()).file
    names = [message.name for message in schema.message_type]
    index = names.index(message_name)
    fields = schema.message_type[index].field
    comments = {}
    # A field's location path is (message_type = 4, message index, field = 2, field index).
    for location in schema.source_code_info.location:
        if list(location.path[:3]) == [4, index, 2] and len(location.path) == 4:
            comments[fields[location.path[3]].name] = " ".join(location.leading_comments.split())
    return comments
