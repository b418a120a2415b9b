"""export's and detect's flags come from the schema (ExportParameter, DetectParameter), as train's and compare's:
every field is a flag of its verb that sets it alone, repeated fields as comma-separated values, and a flag not
given leaves the proto's default."""

import pytest
from google.protobuf.descriptor import FieldDescriptor

from deepspark import cli, config, detect
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb

VERBS = {"export": (pb.ExportParameter, ["--model", "m", "--weights", "w", "--output", "o"]),
         "detect": (pb.DetectParameter, ["--model", "m", "--weights", "w", "image.png"])}
FIELDS = [(verb, field) for verb, (message, _) in VERBS.items() for field in message.DESCRIPTOR.fields]


def given(field):
    """(flag arguments, the value the field should then hold)."""
    flag = "--" + field.name.replace("_", "-")
    if field.type == FieldDescriptor.TYPE_BOOL:
        return [flag], True
    if field.type == FieldDescriptor.TYPE_STRING:
        return [flag, "mean.binaryproto"], "mean.binaryproto"
    if field.is_repeated:
        return ([flag, "1,0,2"], [1, 0, 2]) if field.type == FieldDescriptor.TYPE_UINT32 else \
            ([flag, "104,117.5,123"], [104, 117.5, 123])
    return [flag, "0.375"], 0.375  # exact in float32


@pytest.mark.parametrize("verb, field", FIELDS, ids=[f"{verb}-{field.name}" for verb, field in FIELDS])
def test_every_field_is_a_flag_of_its_verb_that_sets_it(verb, field):
    message, required = VERBS[verb]
    arguments, expected = given(field)
    args = cli.parser().parse_args([verb, *arguments, *required])
    param = config.set_fields(message(), cli.fields_of(args, message))
    value = getattr(param, field.name)
    assert (list(value) if field.is_repeated else value) == expected
    assert [f.name for f in message.DESCRIPTOR.fields if f.name != field.name and
            (getattr(param, f.name) if f.is_repeated else param.HasField(f.name))] == []


@pytest.mark.parametrize("verb", VERBS)
def test_no_flag_leaves_the_protos_defaults(verb):
    message, required = VERBS[verb]
    args = cli.parser().parse_args([verb, *required])
    assert config.set_fields(message(), cli.fields_of(args, message)) == message()
    assert pb.DetectParameter().raw_scale == 255  # the default the help shows


def test_bad_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parser().parse_args(["detect", "--channel-swap", "2,x", *VERBS["detect"][1]])
    assert stop.value.code == 2 and "comma-separated numbers" in capsys.readouterr().err


def test_a_mean_given_both_ways_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="mean_value or mean_file, not both") as error:
        detect.detector("m", "w", mean_value=[1, 2, 3], mean_file="mean.binaryproto")
    assert "\n" not in str(error.value)
