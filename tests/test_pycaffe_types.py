"""Every layer type the bundled pycaffe registers is supported (docs/layers.md's table) or refused in one line saying why, and each refusal's why holds: pycaffe aborts on it too, in a subprocess (#43)."""

import os

import pytest

from conftest import ROOT
from deepspark import graph
from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.graph.dag import UNRUNNABLE
from deepspark.proto import deepspark_pb2 as pb
from test_annotated_opencv import pycaffe_forward
from test_zoo_layers import caffe  # noqa: F401 (a fixture: pycaffe, or the tests skip)

pytestmark = pytest.mark.caffe
NETS = {  # a net of the type, with bottoms of shapes its layer takes
    "PSROIPooling": ('layer { name: "in" type: "Input" top: "x" top: "rois" input_param { shape { dim: 1 dim: 8 '
                     'dim: 4 dim: 4 } shape { dim: 1 dim: 5 } } }\nlayer { name: "it" type: "PSROIPooling" '
                     'bottom: "x" bottom: "rois" top: "y" psroi_pooling_param { spatial_scale: 1 output_dim: 2 '
                     'group_size: 2 } }\n', "Not Implemented Yet"),
    "BN": ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } } }\n'
           'layer { name: "it" type: "BN" bottom: "x" top: "y" bn_param { frozen: true } }\n',
           "Unknown layer type: BN"),
}


def test_every_registered_type_is_supported_or_refused_saying_why(caffe):
    theirs = set(caffe.layer_type_list())
    assert theirs - set(graph.supported_types()) == {"PSROIPooling"}  # BN is not registered at all
    with open(os.path.join(ROOT, "docs", "layers.md"), encoding="utf-8") as stream:
        docs = stream.read()
    assert all(f"{kind}," in docs or f"`{kind}`" in docs for kind in UNRUNNABLE)
    assert set(NETS) == set(UNRUNNABLE)


@pytest.mark.parametrize("kind", sorted(NETS))
def test_each_refusal_says_why_and_pycaffe_aborts_on_it(caffe, kind, tmp_path):
    text, abort = NETS[kind]
    with pytest.raises(ConfigError) as caught:
        graph.Graph(parse_net(text)[0], pb.TEST)
    refusal = str(caught.value)
    assert "\n" not in refusal and f"{kind} is refused: the bundled pycaffe cannot run it either" in refusal
    assert abort in refusal
    status, err = pycaffe_forward(text, tmp_path)
    assert status != 0 and abort in err, err[-2000:]
