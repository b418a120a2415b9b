"""The committed generated code matches proto/deepspark.proto, and the schema matches Caffe's numbering."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT
from deepspark.proto import deepspark_pb2 as pb


def test_generated_code_is_fresh(tmp_path):
    protoc = shutil.which("protoc")
    assert protoc, "protoc is missing: `make test` installs protobuf-compiler"
    subprocess.run([protoc, f"-I{ROOT}/proto", f"--python_out={tmp_path}", "--include_source_info",
                    f"--descriptor_set_out={tmp_path}/deepspark.desc", f"{ROOT}/proto/deepspark.proto"], check=True)
    for name in ("deepspark_pb2.py", "deepspark.desc"):
        fresh = (tmp_path / name).read_bytes()
        committed = open(os.path.join(ROOT, "deepspark/proto", name), "rb").read()
        assert fresh == committed, f"deepspark/proto/{name} is stale: run `make proto` and commit the result"


def caffe_fields(text, message):
    body = re.search(r"\nmessage %s \{(.*?)\n\}" % message, text, re.S).group(1)
    return {m.group(2): int(m.group(3)) for m in
            re.finditer(r"^\s*(optional|repeated|required)\s+[\w.]+\s+(\w+)\s*=\s*(\d+)", body, re.M)}


# BVLC Caffe's layers newer than the brocolli-caffe source (ClipLayer, SwishLayer), numbered as BVLC's caffe.proto has them.
BVLC_LATER = {"LayerParameter": {"swish_param": 147, "clip_param": 148}}


@pytest.mark.parametrize("name", [
    "BlobShape", "BlobProto", "Datum", "FillerParameter", "NetParameter", "SolverParameter", "SolverState",
    "NetState", "NetStateRule", "ParamSpec", "LayerParameter", "TransformationParameter", "LossParameter",
    "AccuracyParameter", "ArgMaxParameter", "ConcatParameter", "BatchNormParameter", "BiasParameter",
    "ConvolutionParameter", "DataParameter", "DropoutParameter", "DummyDataParameter", "EltwiseParameter",
    "ELUParameter", "ExpParameter", "FlattenParameter", "InnerProductParameter", "InputParameter",
    "LogParameter", "LRNParameter", "MemoryDataParameter", "PoolingParameter", "PowerParameter",
    "ReLUParameter", "ReshapeParameter", "ScaleParameter", "SigmoidParameter", "SliceParameter",
    "SoftmaxParameter", "TanHParameter", "PReLUParameter", "ContrastiveLossParameter", "CropParameter",
    "EmbedParameter", "HDF5DataParameter", "HDF5OutputParameter", "HingeLossParameter", "ImageDataParameter",
    "InfogainLossParameter", "MVNParameter", "ParameterParameter", "PythonParameter", "RecurrentParameter",
    "ReductionParameter", "SPPParameter", "ThresholdParameter", "TileParameter", "WindowDataParameter",
    "V1LayerParameter", "V0LayerParameter"])
def test_field_names_and_numbers_match_caffe(caffe_source, name):
    caffe = caffe_fields(open(os.path.join(caffe_source, "src/caffe/proto/caffe.proto")).read(), name)
    ours = {f.name: f.number for f in getattr(pb, name).DESCRIPTOR.fields}
    own = {field: ours.pop(field) for field in ("deepspark_param", "worker_state") if field in ours}
    assert all(number >= 8000 for number in own.values()), own  # DeepSpark's own, numbered far from Caffe's
    caffe.update(BVLC_LATER.get(name, {}))
    for field, number in ours.items():
        assert caffe.get(field) == number, f"{name}.{field} = {number}, Caffe has {caffe.get(field)}"
