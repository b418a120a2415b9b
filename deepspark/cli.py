"""The `deepspark` command: Caffe's verbs (train, test, time) and DeepSpark's tools — argument handling only.

The flags that set a schema message (train's DeepSparkParameter, compare's
CompareParameter) are generated from the message's descriptor: name, type,
enum values, and the .proto comment as the help; their defaults live in the
proto alone.
"""

import argparse
import os
import sys

from google.protobuf.descriptor import FieldDescriptor

from deepspark import compare, config, detect, export, nets, plan
from deepspark.backends import BACKENDS, defer_keras
from deepspark.data import annotated, convert
from deepspark.errors import DeepSparkError
from deepspark.plot import plot_log
from deepspark.proto import deepspark_pb2 as pb

# String fields whose values come from a registry, not the schema.
CHOICES = {"backend": sorted(BACKENDS)}
DEFAULT_BACKEND = pb.DeepSparkParameter().backend


class Parser(argparse.ArgumentParser):
    """argparse with a bad command line as one line, `deepspark VERB: error: ...`, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def non_negative(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def positive(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def data_shape(text):
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"must be C,H,W with positive integers, not '{text}'")
    return dims


def phase(text):
    if text.upper() not in pb.Phase.keys():
        raise argparse.ArgumentTypeError(f"must be TRAIN or TEST, not '{text}'")
    return pb.Phase.Value(text.upper())


_TYPES = {FieldDescriptor.TYPE_UINT32: non_negative, FieldDescriptor.TYPE_UINT64: non_negative,
          FieldDescriptor.TYPE_INT32: int, FieldDescriptor.TYPE_INT64: int,
          FieldDescriptor.TYPE_FLOAT: float, FieldDescriptor.TYPE_DOUBLE: float, FieldDescriptor.TYPE_STRING: str}


def add_fields(parser, message, only=None):
    """One flag per field of a schema message (`--moving-rate` for moving_rate), or per field named in
    `only`, default None: a flag not given leaves the prototxt's value (or the proto's default) as it is."""
    comments = config.field_comments(message.DESCRIPTOR.name)
    group = parser.add_argument_group(f"{message.DESCRIPTOR.name} (over the prototxt's)")
    for field in message.DESCRIPTOR.fields:
        if only is not None and field.name not in only:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default_value
        if field.enum_type is not None:
            default = field.enum_type.values_by_number[default].name.lower()
        if isinstance(default, float):
            default = f"{default:g}"
        shown = field.has_default_value and default not in ("", None)  # a field without one says what unset means
        help_text = comments.get(field.name, "") + (f" (default {default})" if shown else "")
        help_text = help_text.replace("%", "%%")
        if field.type == FieldDescriptor.TYPE_BOOL:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif field.enum_type is not None:
            group.add_argument(flag, choices=[v.name.lower() for v in field.enum_type.values], type=str.lower,
                               help=help_text)
        elif field.is_repeated:  # comma-separated values
            group.add_argument(flag, type=listed(_TYPES[field.type]), help=help_text)
        else:
            group.add_argument(flag, type=_TYPES[field.type], choices=CHOICES.get(field.name), help=help_text)


def listed(kind):
    """An argparse type of comma-separated values of `kind`, as a list."""
    def parse(text):
        try:
            return [kind(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    return parse


def fields_of(args, message):
    """{field: value} of the flags add_fields made for `message`."""
    return {field.name: getattr(args, field.name) for field in message.DESCRIPTOR.fields if hasattr(args, field.name)}


def message_of(args, message):
    """`message` with the fields its flags set (config.set_fields checks them)."""
    instance = message()
    config.set_fields(instance, fields_of(args, message), "the command line")
    return instance


# The DeepSparkParameter fields that say where a forward-only job on Spark runs.
SPARK_FIELDS = ("master", "workers", "backend", "max_failures", "executor_env")
# The DeepSparkParameter fields the throughput model reads (plan's table goes 1, 2, 4, ... up to `workers`), and the
# learning-rate rule its closing line says.
PLAN_FIELDS = ("algorithm", "workers", "period", "overlap", "backend", "exchange_integrity", "lr_scaling", "lr_warmup")


# -- the verbs ----------------------------------------------------------------------------


def cmd_train(args):
    from deepspark import spark  # deferred: deepspark.spark imports pyspark, which the other verbs need not

    spark.train(args.solver, deepspark=args.deepspark, weights=args.weights, snapshot=args.snapshot,
                output=args.output, **fields_of(args, pb.DeepSparkParameter))
    return 0


def cmd_test(args):
    nets.test(args.model, args.weights, args.iterations, args.backend)
    return 0


def cmd_time(args):
    nets.timing(args.model, args.iterations, args.backend, args.phase)
    return 0


def cmd_compare(args):
    result = compare.run(args.model, weights=args.weights, solver_path=args.solver, data_shape=args.data_shape,
                         **fields_of(args, pb.CompareParameter))
    return 0 if result["ok"] else 1


def cmd_plan(args):
    report, _ = plan.run(args.model, fields_of(args, pb.DeepSparkParameter), message_of(args, pb.PlanParameter),
                         args.data_shape)
    print(report)
    return 0


def cmd_export(args):
    inputs, outputs = export.export(args.model, args.weights, args.output, overwrite=args.overwrite,
                                    **fields_of(args, pb.ExportParameter))
    takes = ", ".join(f"{name} ({'x'.join(str(d or 'N') for d in shape)} float32)" for name, shape in inputs.items())
    print(f"Wrote the SavedModel {args.output}: signature '{export.SIGNATURE}' takes {takes} and gives "
          f"{', '.join(outputs)}")
    return 0


def cmd_score(args):
    from deepspark.spark import scoring  # deferred: pyspark loads only for the verbs that run on Spark

    scoring.score(args.model, args.weights, source=args.data, batch_size=args.batch_size or 0,
                  ds=message_of(args, pb.DeepSparkParameter))
    return 0


def cmd_extract_features(args):
    from deepspark.spark import scoring  # deferred: pyspark loads only for the verbs that run on Spark

    scoring.extract_features(args.model, args.weights, split_list(args.blobs), split_list(args.output),
                             source=args.data, batch_size=args.batch_size or 0,
                             ds=message_of(args, pb.DeepSparkParameter), overwrite=args.overwrite)
    return 0


def cmd_detect(args):
    options = fields_of(args, pb.DetectParameter)
    detector = detect.detector(args.model, args.weights, backend=args.backend, **options)
    threshold = message_of(args, pb.DetectParameter).threshold
    try:
        images = [detect.read_image(path) for path in args.images]
        for path, found in zip(args.images, detector.detect(images)):
            for box, score, label in zip(*found):
                if score >= threshold:
                    print("\t".join([path, str(label), f"{score:.6f}"] + [f"{v:.2f}" for v in box]))
    finally:
        detector.close()
    return 0


def split_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def cmd_describe(args):
    phase = pb.TRAIN if args.phase is None else args.phase
    try:
        table, warnings = nets.describe(args.net, phase, args.data_shape, args.batch_size, args.stage)
    except DeepSparkError as error:
        if args.phase is not None:
            raise
        try:  # a deploy-only net (LRCN's) may not build in the default TRAIN phase: name the flag where TEST builds
            nets.describe(args.net, pb.TEST, args.data_shape, args.batch_size, args.stage)
        except DeepSparkError:
            raise error from None
        raise DeepSparkError(f"{error} (in the TRAIN phase, describe's default; the TEST phase builds: "
                             "give --phase TEST)") from None
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(table)
    return 0


def cmd_upgrade_net(args):
    for note in nets.upgrade_net(args.input, args.output):
        print(f"warning: {note}", file=sys.stderr)
    print(f"Wrote upgraded NetParameter text proto to {args.output}")
    return 0


def cmd_upgrade_solver(args):
    for note in nets.upgrade_solver(args.input, args.output):
        print(f"warning: {note}", file=sys.stderr)
    print(f"Wrote upgraded SolverParameter text proto to {args.output}")
    return 0


def cmd_convert_mnist(args):
    convert.convert_mnist(args.images, args.labels, args.out)
    return 0


def cmd_convert_imageset(args):
    convert.convert_imageset(args.root, args.listfile, args.out, gray=args.gray, shuffle=args.shuffle,
                             resize_height=args.resize_height, resize_width=args.resize_width,
                             encoded=args.encoded, encode_type=args.encode_type)
    return 0


def cmd_convert_annoset(args):
    annotated.convert_annoset(args.root, args.listfile, args.out, label_map_file=args.label_map_file,
                              anno_type=args.anno_type, label_type=args.label_type, gray=args.gray,
                              shuffle=args.shuffle, resize_height=args.resize_height,
                              resize_width=args.resize_width, min_dim=args.min_dim, max_dim=args.max_dim,
                              encoded=args.encoded, encode_type=args.encode_type, check_label=args.check_label)
    return 0


def cmd_convert_lmdb(args):
    convert.convert_lmdb(args.source, args.dest, overwrite=args.overwrite)
    return 0


def cmd_compute_image_mean(args):
    convert.compute_image_mean(args.lmdb, args.out)
    return 0


def cmd_plot(args):
    print(f"wrote {plot_log(args.log, args.output)}")
    return 0


def forward_job(verbs, name, help_text, data):
    """A verb that runs a trained net forward on Spark's executors: its net, weights, data and Spark flags."""
    verb = verbs.add_parser(name, help=help_text)
    verb.add_argument("--model", required=True, help="a net .prototxt with one Data layer in its TEST phase "
                                                     "(train_val.prototxt), or a model folder")
    verb.add_argument("--weights", required=True, help="trained .caffemodel")
    verb.add_argument("--data", help=f"{data}: an LMDB, or Parquet at any URI Spark reads (default: the Data "
                                     "layer's source)")
    verb.add_argument("--batch-size", type=positive, help="records per forward pass (default: the Data layer's)")
    add_fields(verb, pb.DeepSparkParameter, SPARK_FIELDS)
    return verb


def upgrade_verbs(verbs):
    """upgrade-net and upgrade-solver: Caffe's upgrade tools, each an old file in and today's out."""
    for name, what, tool, help_text in (
            ("upgrade-net", "net", "upgrade_net_proto_text", "an old net (V0/V1 layers, input fields) as today's "
                                                              "prototxt"),
            ("upgrade-solver", "solver", "upgrade_solver_proto_text", "an old solver's solver_type enum as its "
                                                                        "type string")):
        verb = verbs.add_parser(name, help=f"Caffe's {tool}: {help_text}")
        verb.add_argument("input", help=f"the old {what} .prototxt")
        verb.add_argument("output", help="the upgraded .prototxt to write")
        verb.set_defaults(run=cmd_upgrade_net if what == "net" else cmd_upgrade_solver)


def parser():
    top = Parser(
        prog="deepspark", description="Train Caffe-defined networks on Spark with asynchronous EASGD.")
    verbs = top.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    for add in (add_training_verbs, add_net_verbs, add_detect_verb, upgrade_verbs, add_data_verbs):
        add(verbs)
    return top


def add_training_verbs(verbs):
    """train, test, time, compare, plan."""
    train = verbs.add_parser("train", help="train a net from a solver prototxt")
    train.add_argument("--solver", required=True, help="solver .prototxt")
    train.add_argument("--deepspark", help=f"DeepSparkParameter .prototxt over the solver's deepspark_param block "
                                           f"(default: {config.DEEPSPARK_FILE} beside the solver, if there is one)")
    train.add_argument("--weights", help="initial weights .caffemodel (fine-tuning)")
    train.add_argument("--snapshot", help="resume from this .solverstate")
    train.add_argument("--output", help="folder for snapshots, logs and plots (default: the snapshot_prefix's folder, "
                       "else the working directory, as Caffe)")
    add_fields(train, pb.DeepSparkParameter)
    train.set_defaults(run=cmd_train)

    test = verbs.add_parser("test", help="score a trained net on its TEST phase")
    test.add_argument("--model", required=True, help="net .prototxt (or model folder)")
    test.add_argument("--weights", required=True, help="trained .caffemodel")
    test.add_argument("--iterations", type=positive, default=50, help="test batches (default 50)")
    test.add_argument("--backend", choices=CHOICES["backend"], default=DEFAULT_BACKEND)
    test.set_defaults(run=cmd_test)

    time = verbs.add_parser("time", help="per-layer forward/backward milliseconds, like `caffe time`")
    time.add_argument("--model", required=True, help="net .prototxt (or model folder)")
    time.add_argument("--iterations", type=positive, default=50)
    time.add_argument("--backend", choices=CHOICES["backend"], default=DEFAULT_BACKEND)
    time.add_argument("--phase", type=phase, default=pb.TRAIN, help="TRAIN or TEST (default TRAIN)")
    time.set_defaults(run=cmd_time)

    comparison = verbs.add_parser("compare", help="run one net on several backends and compare")
    comparison.add_argument("--model", required=True, help="net .prototxt (or model folder)")
    comparison.add_argument("--weights", help="weights .caffemodel (default: the first backend's fillers)")
    comparison.add_argument("--solver", help="also train --iterations from the same weights and batches; its first "
                                             "test_state's stages choose the TEST net's layers")
    comparison.add_argument("--data-shape", type=data_shape, help="C,H,W of the data layers whose source is absent "
                                                                  "(as describe takes it)")
    add_fields(comparison, pb.CompareParameter)
    comparison.set_defaults(run=cmd_compare)

    planner = verbs.add_parser("plan", help="what N workers will do on a network: images/s, speedup, exchange share "
                                            "and where the single center saturates (the throughput model, from a "
                                            "step and an exchange measured here)")
    planner.add_argument("--model", required=True, help="a model folder (its solver.prototxt and deepspark.prototxt), a "
                                                        "solver, or a train_val .prototxt")
    planner.add_argument("--data-shape", type=data_shape, help="C,H,W of the Data layers when their LMDB is absent "
                                                               "(default: a model folder's deploy.prototxt input)")
    add_fields(planner, pb.DeepSparkParameter, PLAN_FIELDS)
    add_fields(planner, pb.PlanParameter)
    planner.set_defaults(run=cmd_plan)


def add_net_verbs(verbs):
    """export, score, extract-features, describe: what runs a trained net, or describes one."""
    saved = verbs.add_parser("export", help="a deploy net and its .caffemodel as a TensorFlow SavedModel (Caffe's "
                                            "numerics, N x C x H x W input; served without DeepSpark)")
    saved.add_argument("--model", required=True, help="deploy .prototxt (or model folder)")
    saved.add_argument("--weights", required=True, help="trained .caffemodel")
    saved.add_argument("--output", required=True, help="the SavedModel folder to write")
    saved.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    add_fields(saved, pb.ExportParameter)
    saved.set_defaults(run=cmd_export)

    scoring = forward_job(verbs, "score", "Caffe's test over a whole dataset, on Spark's executors: the mean of "
                                          "every output of the net's TEST phase", "the dataset to score")
    scoring.set_defaults(run=cmd_score)

    features = forward_job(verbs, "extract-features", "Caffe's extract_features on Spark's executors: blobs of a "
                                                      "net for every record of a dataset, as Datums", "the dataset to read")
    features.add_argument("--blobs", required=True, help="blob names, comma-separated (ip1,ip2)")
    features.add_argument("--output", required=True, help="one dataset per blob, comma-separated: an LMDB, or "
                                                          "Parquet for a name ending in .parquet")
    features.add_argument("--overwrite", action="store_true", help="replace an output that exists")
    features.set_defaults(run=cmd_extract_features)

    describe = verbs.add_parser("describe", help="layers, shapes and parameter counts of a net")
    describe.add_argument("net", help="net .prototxt or model folder")
    describe.add_argument("--phase", type=phase, help="TRAIN or TEST (default TRAIN)")
    describe.add_argument("--data-shape", type=data_shape, help="C,H,W of the Data layers when their LMDB is absent")
    describe.add_argument("--batch-size", type=positive, help="override the batch size")
    describe.add_argument("--stage", action="append", help="a NetState stage that chooses layers, as Caffe's --stage "
                                                           "(repeat it for several)")
    describe.set_defaults(run=cmd_describe)



def add_detect_verb(verbs):
    """detect: an SSD deploy net's boxes in images, one line each."""
    found = verbs.add_parser("detect", help="boxes an SSD deploy net (a DetectionOutput layer) finds in images: one "
                                            "tab-separated line per box, image, class, score, xmin, ymin, xmax, ymax "
                                            "(pixels)")
    found.add_argument("images", nargs="+", help="image files (each resized to the net's input)")
    found.add_argument("--model", required=True, help="deploy .prototxt (or model folder)")
    found.add_argument("--weights", required=True, help="trained .caffemodel")
    add_fields(found, pb.DetectParameter)
    found.add_argument("--backend", choices=CHOICES["backend"], default=DEFAULT_BACKEND)
    found.set_defaults(run=cmd_detect)


def add_annoset_verb(verbs):
    """convert-annoset: the SSD fork's convert_annoset (images and VOC XML or txt boxes to AnnotatedDatum)."""
    anno = verbs.add_parser("convert-annoset", help="images and their annotation files listed in LISTFILE "
                                                    "('image annotation' pairs) to an LMDB of AnnotatedDatum, "
                                                    "as the SSD fork's convert_annoset")
    anno.add_argument("root", help="folder the listed paths are relative to")
    anno.add_argument("listfile")
    anno.add_argument("out")
    anno.add_argument("--label-map-file", default="", help="a LabelMap text proto naming the classes")
    anno.add_argument("--anno-type", default="detection", choices=("detection", "classification"),
                      help="detection (boxes, default) or classification ('image label' lines)")
    anno.add_argument("--label-type", default="xml", choices=("xml", "txt"),
                      help="VOC XML files, or txt rows 'label xmin ymin xmax ymax' in pixels")
    anno.add_argument("--check-label", action="store_true", help="refuse a label map that repeats a name")
    anno.add_argument("--gray", action="store_true", help="load images in grayscale")
    anno.add_argument("--shuffle", action="store_true", help="shuffle the order of images")
    anno.add_argument("--resize-height", type=non_negative, default=0)
    anno.add_argument("--resize-width", type=non_negative, default=0)
    anno.add_argument("--min-dim", type=non_negative, default=0, help="scale up so the short side is at least this")
    anno.add_argument("--max-dim", type=non_negative, default=0, help="scale down so the long side is at most this")
    anno.add_argument("--encoded", action="store_true", help="store encoded images")
    anno.add_argument("--encode-type", default="", choices=("", "png", "jpg"), help="png or jpg (with --encoded)")
    anno.set_defaults(run=cmd_convert_annoset)


def add_data_verbs(verbs):
    """Caffe's data tools (convert-mnist, convert-imageset, convert-lmdb, compute-image-mean) and plot."""
    mnist = verbs.add_parser("convert-mnist", help="MNIST-format IDX files (gzipped or not) to an LMDB "
                                                   "(or Parquet: OUT ending in .parquet)")
    mnist.add_argument("images")
    mnist.add_argument("labels")
    mnist.add_argument("out")
    mnist.set_defaults(run=cmd_convert_mnist)

    imageset = verbs.add_parser("convert-imageset", help="images listed in LISTFILE ('path label' lines) to an LMDB "
                                                         "(or Parquet: OUT ending in .parquet)")
    imageset.add_argument("root", help="folder the listed paths are relative to")
    imageset.add_argument("listfile")
    imageset.add_argument("out")
    imageset.add_argument("--gray", action="store_true", help="load images in grayscale")
    imageset.add_argument("--shuffle", action="store_true", help="shuffle the order of images")
    imageset.add_argument("--resize-height", type=non_negative, default=0)
    imageset.add_argument("--resize-width", type=non_negative, default=0)
    imageset.add_argument("--encoded", action="store_true", help="store encoded images")
    imageset.add_argument("--encode-type", default="", choices=("", "png", "jpg"), help="png or jpg (with --encoded)")
    imageset.set_defaults(run=cmd_convert_imageset)

    add_annoset_verb(verbs)

    lmdb = verbs.add_parser("convert-lmdb", help="an LMDB to Parquet, or Parquet to an LMDB (the direction "
                                                 "read from SOURCE); keys and Datum bytes as they are")
    lmdb.add_argument("source", help="an LMDB folder, or a Parquet file, folder of part files or URI")
    lmdb.add_argument("dest", help="the LMDB, or the Parquet dataset: one file if DEST ends in .parquet, "
                                   "else a folder of part files")
    lmdb.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    lmdb.set_defaults(run=cmd_convert_lmdb)

    mean = verbs.add_parser("compute-image-mean", help="the mean image of an LMDB (or Parquet) as a .binaryproto")
    mean.add_argument("lmdb")
    mean.add_argument("out")
    mean.set_defaults(run=cmd_compute_image_mean)

    plot = verbs.add_parser("plot", help="loss and accuracy against time from a training log")
    plot.add_argument("log")
    plot.add_argument("-o", "--output", required=True, help="PNG to write")
    plot.set_defaults(run=cmd_plot)


def main(argv=None):
    defer_keras()  # this process is DeepSpark's own
    args = parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except DeepSparkError as error:
        sys.stderr.flush()
        print(f"deepspark {args.verb}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deepspark {args.verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`deepspark describe X | head -3`): end quietly, as Unix tools do;
        # stdout goes to /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
