"""The flags generated from the schema: every DeepSparkParameter and CompareParameter field has one, typed
from its descriptor, with the .proto comment as help, and it reaches the message it sets."""

import pytest
from google.protobuf.descriptor import FieldDescriptor

from synthetic import make_job

from deepspark import cli, config
from deepspark.config import load_solver, override
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb


def values_for(field):
    """(flag arguments, the value the field should then hold) for a few values of a field's type."""
    flag = "--" + field.name.replace("_", "-")
    if field.type == FieldDescriptor.TYPE_BOOL:
        return [([flag], True), (["--no-" + field.name.replace("_", "-")], False)]
    if field.enum_type is not None:
        return [([flag, value.name.lower()], value.number) for value in field.enum_type.values]
    if field.name == "backend":
        return [([flag, name], name) for name in cli.CHOICES["backend"]]
    if field.type == FieldDescriptor.TYPE_STRING:
        return [([flag, "spark://10.0.0.1:7077"], "spark://10.0.0.1:7077")]
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return [([flag, "0.375"], 0.375)]  # exact in float32
    if field.name == "min_workers":  # never above workers (2)
        return [([flag, "1"], 1)]
    return [([flag, "7"], 7)]


DS_FIELDS = list(pb.DeepSparkParameter.DESCRIPTOR.fields)


@pytest.mark.parametrize("field", DS_FIELDS, ids=[f.name for f in DS_FIELDS])
def test_every_deepspark_field_is_a_train_flag_that_sets_it(tmp_path, field):
    solver_path = make_job(tmp_path)
    for arguments, expected in values_for(field):
        args = cli.parser().parse_args(["train", "--solver", solver_path, *arguments])
        knobs = cli.fields_of(args, pb.DeepSparkParameter)
        assert {name for name, value in knobs.items() if value is not None} == {field.name}
        solver = load_solver(solver_path)
        ds = solver.param.deepspark_param
        before = {f.name: getattr(ds, f.name) for f in DS_FIELDS if f.name != field.name}
        override(solver, **knobs)
        assert getattr(ds, field.name) == expected, arguments
        assert {f.name: getattr(ds, f.name) for f in DS_FIELDS if f.name != field.name} == before


def test_flag_help_is_the_proto_comment_and_defaults_stay_in_the_proto():
    text = cli.parser()._subparsers._group_actions[0].choices["train"].format_help()
    comments = config.field_comments("DeepSparkParameter")
    assert set(comments) == {f.name for f in DS_FIELDS}  # every knob is documented in the .proto
    for field in DS_FIELDS:
        assert "--" + field.name.replace("_", "-") in text
    assert "Communication period tau: local iterations between two" in text and "(default 10)" in text
    args = cli.parser().parse_args(["train", "--solver", "s.prototxt"])
    assert all(value is None for value in cli.fields_of(args, pb.DeepSparkParameter).values())


COMPARE_FIELDS = list(pb.CompareParameter.DESCRIPTOR.fields)


@pytest.mark.parametrize("field", COMPARE_FIELDS, ids=[f.name for f in COMPARE_FIELDS])
def test_every_compare_field_is_a_compare_flag(field):
    for arguments, expected in values_for(field):
        if field.name == "backends":
            arguments, expected = [arguments[0], "tensorflow,caffe"], "tensorflow,caffe"
        args = cli.parser().parse_args(["compare", "--model", "m", *arguments])
        param = config.set_fields(pb.CompareParameter(), cli.fields_of(args, pb.CompareParameter))
        assert getattr(param, field.name) == expected
        assert [f.name for f in COMPARE_FIELDS if param.HasField(f.name)] == [field.name]


def test_bad_values_are_one_line_errors(tmp_path):
    solver = load_solver(make_job(tmp_path))
    with pytest.raises(ConfigError, match="workers must be at least 1, not 0"):
        override(solver, workers=0)
    with pytest.raises(ConfigError, match=r"moving_rate must be in \(0, 1\], not -0.5"):
        override(load_solver(solver.path), moving_rate=-0.5)
    with pytest.raises(ConfigError, match="algorithm must be one of easgd, sync, average, single, not 'hogwild'"):
        override(load_solver(solver.path), algorithm="hogwild")
    with pytest.raises(ConfigError, match="iterations must be at least 1, not 0"):
        override(load_solver(solver.path), iterations=0)
    with pytest.raises(TypeError, match="unknown option"):
        override(load_solver(solver.path), wrokers=2)
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["train", "--solver", solver.path, "--workers", "-3"])


HDF5_NET = """name: "h5"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" hdf5_data_param { source: "absent_list.txt"
  batch_size: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_an_hdf5_layer_without_its_files_takes_the_data_shape_its_warning_advises(tmp_path):
    from deepspark import nets

    net = tmp_path / "net.prototxt"
    net.write_text(HDF5_NET)
    table, warnings = nets.describe(str(net))
    assert len(warnings) == 1 and warnings[0].endswith("or give --data-shape C,H,W") and "data ?" in table
    table, warnings = nets.describe(str(net), data_shape=(1, 5, 5))
    assert warnings == [], warnings
    assert "data 4x1x5x5, label 4" in table and "3x25, 3" in table and "total parameters: 78" in table
