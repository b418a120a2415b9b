"""The `deepspark` command: Caffe's verbs (train, test, time) and DeepSpark's tools."""

import argparse
import os
import sys

from deepspark.errors import DeepSparkError


class UsageError(Exception):
    """A bad command line: printed as one line, exit status 2."""


def _phase(name):
    from deepspark.proto import deepspark_pb2 as pb

    try:
        return pb.Phase.Value(name.upper())
    except ValueError:
        raise UsageError(f"--phase must be TRAIN or TEST, not '{name}'") from None


def _shape(text):
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) <= 0:
        raise UsageError(f"--data-shape must be C,H,W with positive integers, not '{text}'")
    return dims


def net_path(path):
    """A net file, or a model folder: its deploy.prototxt, else the net its solver names."""
    if not os.path.isdir(path):
        return path
    for name in ("deploy.prototxt", "train_val.prototxt"):
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    solver = os.path.join(path, "solver.prototxt")
    if os.path.exists(solver):
        from deepspark.config import load_solver

        param = load_solver(solver).param
        return param.net or param.train_net
    from deepspark.errors import ConfigError

    raise ConfigError("no deploy.prototxt, train_val.prototxt or solver.prototxt in this folder", path)


def cmd_describe(args):
    from deepspark.config import load_net
    from deepspark.data import source_shape
    from deepspark.graph import Graph

    path = net_path(args.net)
    net, source = load_net(path)
    override = _shape(args.data_shape) if args.data_shape else None
    graph = Graph(net, _phase(args.phase), source=source, batch_size=args.batch_size,
                  data_shape=lambda layer: source_shape(layer, override))
    for warning in dict.fromkeys(graph.warnings):
        print(f"warning: {warning}", file=sys.stderr)
    print(graph.describe())
    return 0


def cmd_convert_mnist(args):
    from deepspark.data.convert import convert_mnist

    convert_mnist(args.images, args.labels, args.out)
    return 0


def cmd_convert_imageset(args):
    from deepspark.data.convert import convert_imageset

    if args.encode_type and args.encode_type not in ("png", "jpg"):
        raise UsageError(f"--encode-type must be png or jpg, not '{args.encode_type}'")
    convert_imageset(args.root, args.listfile, args.out, gray=args.gray, shuffle=args.shuffle,
                     resize_height=args.resize_height, resize_width=args.resize_width,
                     encoded=args.encoded, encode_type=args.encode_type)
    return 0


def cmd_compute_image_mean(args):
    from deepspark.data.convert import compute_image_mean

    compute_image_mean(args.lmdb, args.out)
    return 0


def _run(module, function):
    """A verb implemented elsewhere in the library, imported only when used."""
    def run(args):
        import importlib

        return getattr(importlib.import_module(module), function)(args)
    return run


def parser():
    top = argparse.ArgumentParser(
        prog="deepspark", description="Train Caffe-defined networks on Spark with asynchronous EASGD.")
    verbs = top.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    train = verbs.add_parser("train", help="train a net from a solver prototxt")
    train.add_argument("--solver", required=True, help="solver .prototxt")
    train.add_argument("--backend", choices=("tensorflow", "caffe"), help="default: the solver's, else tensorflow")
    train.add_argument("--workers", type=int, help="Spark workers (one per executor task)")
    train.add_argument("--master", help="Spark master URL (default: embedded local[N])")
    train.add_argument("--algorithm", choices=("easgd", "sync", "average", "single"))
    train.add_argument("--period", type=int, help="communication period tau")
    train.add_argument("--moving-rate", type=float, help="EASGD moving rate alpha")
    train.add_argument("--weights", help="initial weights .caffemodel (fine-tuning)")
    train.add_argument("--snapshot", help="resume from this .solverstate")
    train.add_argument("--output", help="folder for snapshots, logs and plots (default: the snapshot_prefix's)")
    train.add_argument("--shared-data", action="store_true", help="executors read the LMDB path directly")
    train.add_argument("--iterations", type=int, help="override max_iter")
    train.set_defaults(run=_run("deepspark.solver", "cmd_train"))

    test = verbs.add_parser("test", help="score a trained net on its TEST phase")
    test.add_argument("--model", required=True, help="net .prototxt (or model folder)")
    test.add_argument("--weights", required=True, help="trained .caffemodel")
    test.add_argument("--iterations", type=int, default=50, help="test batches (default 50)")
    test.add_argument("--backend", choices=("tensorflow", "caffe"), default="tensorflow")
    test.set_defaults(run=_run("deepspark.solver", "cmd_test"))

    time = verbs.add_parser("time", help="per-layer forward/backward milliseconds, like `caffe time`")
    time.add_argument("--model", required=True, help="net .prototxt (or model folder)")
    time.add_argument("--iterations", type=int, default=50)
    time.add_argument("--backend", choices=("tensorflow", "caffe"), default="tensorflow")
    time.add_argument("--phase", default="TRAIN")
    time.set_defaults(run=_run("deepspark.solver", "cmd_time"))

    compare = verbs.add_parser("compare", help="run one net on several backends and compare")
    compare.add_argument("--model", required=True)
    compare.add_argument("--weights")
    compare.add_argument("--solver")
    compare.add_argument("--iterations", type=int, default=10)
    compare.add_argument("--backends", default="caffe,tensorflow")
    compare.add_argument("--batch-size", type=int)
    compare.add_argument("--forward-tolerance", type=float, default=1e-4, help="relative, per blob")
    compare.add_argument("--loss-tolerance", type=float, default=1e-3, help="absolute, on the loss trajectory")
    compare.set_defaults(run=_run("deepspark.compare", "cmd_compare"))

    describe = verbs.add_parser("describe", help="layers, shapes and parameter counts of a net")
    describe.add_argument("net", help="net .prototxt or model folder")
    describe.add_argument("--phase", default="TRAIN", help="TRAIN or TEST (default TRAIN)")
    describe.add_argument("--data-shape", help="C,H,W of the Data layers when their LMDB is absent")
    describe.add_argument("--batch-size", type=int, help="override the batch size")
    describe.set_defaults(run=cmd_describe)

    mnist = verbs.add_parser("convert-mnist", help="MNIST-format IDX files (gzipped or not) to an LMDB")
    mnist.add_argument("images")
    mnist.add_argument("labels")
    mnist.add_argument("out")
    mnist.set_defaults(run=cmd_convert_mnist)

    imageset = verbs.add_parser("convert-imageset", help="images listed in LISTFILE ('path label' lines) to an LMDB")
    imageset.add_argument("root", help="folder the listed paths are relative to")
    imageset.add_argument("listfile")
    imageset.add_argument("out")
    imageset.add_argument("--gray", action="store_true", help="load images in grayscale")
    imageset.add_argument("--shuffle", action="store_true", help="shuffle the order of images")
    imageset.add_argument("--resize-height", type=int, default=0)
    imageset.add_argument("--resize-width", type=int, default=0)
    imageset.add_argument("--encoded", action="store_true", help="store encoded images")
    imageset.add_argument("--encode-type", default="", help="png or jpg (with --encoded)")
    imageset.set_defaults(run=cmd_convert_imageset)

    mean = verbs.add_parser("compute-image-mean", help="the mean image of an LMDB as a .binaryproto")
    mean.add_argument("lmdb")
    mean.add_argument("out")
    mean.set_defaults(run=cmd_compute_image_mean)

    plot = verbs.add_parser("plot", help="loss and accuracy against time from a training log")
    plot.add_argument("log")
    plot.add_argument("-o", "--output", required=True, help="PNG to write")
    plot.set_defaults(run=_run("deepspark.plot", "cmd_plot"))
    return top


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except UsageError as error:
        print(f"deepspark {args.verb}: error: {error}", file=sys.stderr)
        return 2
    except DeepSparkError as error:
        sys.stderr.flush()
        print(f"deepspark {args.verb}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deepspark {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
