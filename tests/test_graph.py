"""Prototxt loading, phase filtering and Caffe's shape inference."""

import pytest

from deepspark.config import parse_net
from deepspark.errors import ConfigError
from deepspark.graph import Graph, pooled_size
from deepspark.proto import deepspark_pb2 as pb


def graph(text, phase=pb.TRAIN, **kwargs):
    net, source = parse_net(text, "net.prototxt")
    return Graph(net, phase, source=source, **kwargs)


def input_layer(shape, top="data"):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f'layer {{ name: "{top}" type: "Input" top: "{top}" input_param {{ shape {{ {dims} }} }} }}\n'


def layer(name, kind, bottom, body="", top=None):
    bottoms = "".join(f'bottom: "{b}" ' for b in ([bottom] if isinstance(bottom, str) else bottom))
    return f'layer {{ name: "{name}" type: "{kind}" {bottoms} top: "{top or name}" {body} }}\n'


def top_shape(text, name, **kwargs):
    return graph(text, **kwargs).blobs[name]


# -- shapes ----------------------------------------------------------------------

@pytest.mark.parametrize("size,kernel,pad,stride,expected", [
    (24, 2, 0, 2, 12),   # exact
    (7, 3, 0, 2, 3),     # ceil: (7-3)/2 = 2 -> 3
    (6, 3, 0, 2, 3),     # ceil of 1.5 -> 2, +1 = 3 (floor would give 2)
    (5, 3, 1, 2, 3),     # padded
    (6, 2, 1, 2, 4),     # padded: ceil(6/2)+1 = 4, last window starts at 6 < 6+1, kept
    (4, 3, 2, 3, 2),     # clip: ceil(5/3)+1 = 3, (3-1)*3 = 6 >= 4+2 -> 2
])
def test_pooled_size_follows_caffe_ceil_and_clipping(size, kernel, pad, stride, expected):
    assert pooled_size(size, kernel, pad, stride) == expected


def test_pooled_size_floor_mode():
    assert pooled_size(6, 3, 0, 2, ceil_mode=False) == 2


def test_convolution_floor_dilation_group_and_params():
    text = input_layer((2, 4, 11, 11)) + layer("conv", "Convolution", "data", """
        convolution_param { num_output: 6 kernel_size: 3 stride: 2 pad: 1 dilation: 2 group: 2 }""")
    g = graph(text)
    # dilated extent 5: (11 + 2 - 5) // 2 + 1 = 5
    assert g.blobs["conv"] == (2, 6, 5, 5)
    assert g.layer("conv").param_shapes == [(6, 2, 3, 3), (6,)]


def test_convolution_rectangular_kernel_and_no_bias():
    text = input_layer((1, 3, 10, 8)) + layer("conv", "Convolution", "data", """
        convolution_param { num_output: 4 kernel_h: 3 kernel_w: 1 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 2
                            bias_term: false }""")
    g = graph(text)
    assert g.blobs["conv"] == (1, 4, 4, 12)
    assert g.layer("conv").param_shapes == [(4, 3, 3, 1)]


def test_deconvolution_shape_and_weights():
    text = input_layer((1, 8, 5, 5)) + layer("up", "Deconvolution", "data", """
        convolution_param { num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2 }""")
    g = graph(text)
    assert g.blobs["up"] == (1, 4, 10, 10)  # 2*(5-1) + 4 - 2
    assert g.layer("up").param_shapes == [(8, 2, 4, 4), (4,)]


def test_pooling_global_and_padded():
    text = (input_layer((2, 3, 7, 9))
            + layer("g", "Pooling", "data", "pooling_param { pool: AVE global_pooling: true }")
            + layer("p", "Pooling", "data", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }"))
    g = graph(text)
    assert g.blobs["g"] == (2, 3, 1, 1)
    assert g.blobs["p"] == (2, 3, 4, 5)


def test_inner_product_axis_and_transpose():
    text = input_layer((2, 3, 4, 5)) + layer("ip", "InnerProduct", "data",
                                             "inner_product_param { num_output: 7 axis: 2 transpose: true }")
    g = graph(text)
    assert g.blobs["ip"] == (2, 3, 7)
    assert g.layer("ip").param_shapes == [(20, 7), (7,)]


def test_concat_slice_flatten_reshape():
    text = (input_layer((2, 3, 4, 5), "a") + input_layer((2, 6, 4, 5), "b")
            + layer("cat", "Concat", ["a", "b"])
            + 'layer { name: "sl" type: "Slice" bottom: "cat" top: "s1" top: "s2" top: "s3" '
              'slice_param { axis: 1 slice_point: 2 slice_point: 7 } }\n'
            + layer("flat", "Flatten", "cat", "flatten_param { axis: 2 }")
            + layer("re", "Reshape", "cat", "reshape_param { shape { dim: 0 dim: -1 dim: 10 } }")
            + layer("re2", "Reshape", "cat", "reshape_param { shape { dim: 3 dim: 3 } axis: 1 num_axes: 1 }"))
    g = graph(text)
    assert g.blobs["cat"] == (2, 9, 4, 5)
    assert [g.blobs[s] for s in ("s1", "s2", "s3")] == [(2, 2, 4, 5), (2, 5, 4, 5), (2, 2, 4, 5)]
    assert g.blobs["flat"] == (2, 9, 20)
    assert g.blobs["re"] == (2, 18, 10)
    assert g.blobs["re2"] == (2, 3, 3, 4, 5)


def test_batchnorm_scale_prelu_argmax_accuracy_loss_shapes():
    text = (input_layer((4, 3, 5, 5)) + input_layer((4,), "label")
            + layer("bn", "BatchNorm", "data", top="data")
            + layer("sc", "Scale", "data", "scale_param { bias_term: true }", top="data")
            + layer("pr", "PReLU", "data")
            + layer("ip", "InnerProduct", "pr", "inner_product_param { num_output: 10 }")
            + layer("am", "ArgMax", "ip", "argmax_param { top_k: 3 out_max_val: true }")
            + layer("acc", "Accuracy", ["ip", "label"], "accuracy_param { top_k: 5 }")
            + layer("loss", "SoftmaxWithLoss", ["ip", "label"]))
    g = graph(text)
    assert g.layer("bn").param_shapes == [(3,), (3,), (1,)]
    assert g.layer("sc").param_shapes == [(3,), (3,)]
    assert g.layer("pr").param_shapes == [(3,)]
    assert g.blobs["am"] == (4, 2, 3)
    assert g.blobs["acc"] == () and g.blobs["loss"] == ()
    assert g.layer("loss").loss_weights == [1.0]
    assert g.layer("acc").loss_weights == [0.0]
    assert g.outputs == ["am", "acc", "loss"]


def test_in_place_layers_and_implicit_splits():
    text = (input_layer((1, 2, 3, 3)) + layer("relu", "ReLU", "data", top="data")
            + layer("a", "Power", "data") + layer("b", "Power", "data")
            + layer("sum", "Eltwise", ["a", "b"], "eltwise_param { coeff: 1 coeff: -1 }"))
    g = graph(text)
    assert g.layer("relu").in_place
    # where Caffe inserts its implicit Split layers: blobs more than one layer consumes
    assert {blob: layers for blob, layers in g.consumers.items() if len(layers) > 1} == {"data": ["relu", "a", "b"]}
    assert g.outputs == ["sum"]


def test_phase_stage_and_level_filtering():
    text = (input_layer((1, 2)) + layer("train_only", "Power", "data", "include { phase: TRAIN }", top="x")
            + layer("test_only", "AbsVal", "data", "include { phase: TEST }", top="x")
            + layer("deep", "Power", "x", "include { min_level: 2 }")
            + layer("staged", "Power", "x", "include { stage: 'fancy' }")
            + layer("not_staged", "Power", "x", "exclude { stage: 'fancy' }"))
    names = lambda **kw: [l.name for l in graph(text, **kw).layers]
    assert names(phase=pb.TRAIN) == ["data", "train_only", "not_staged"]
    assert names(phase=pb.TEST) == ["data", "test_only", "not_staged"]
    assert names(phase=pb.TEST, level=2, stages=["fancy"]) == ["data", "test_only", "deep", "staged"]


def test_shared_parameters_counted_once():
    shared = 'param { name: "w" } param { name: "b" } inner_product_param { num_output: 3 }'
    text = (input_layer((2, 4)) + layer("ip1", "InnerProduct", "data", shared)
            + layer("ip2", "InnerProduct", "data", shared))
    g = graph(text)
    assert g.param_count == 4 * 3 + 3
    assert g.params[0].sharers == [("ip2", 0)]


def test_deprecated_net_inputs_become_an_input_layer():
    g = graph('input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8\n'
              + layer("conv", "Convolution", "data", "convolution_param { num_output: 2 kernel_size: 3 }"))
    assert g.blobs["conv"] == (1, 2, 6, 6)


def test_data_layer_uses_the_shape_callback_crop_and_batch_override():
    text = ('layer { name: "d" type: "Data" top: "data" top: "label" transform_param { crop_size: 5 } '
            'data_param { source: "nowhere" batch_size: 8 } }\n')
    assert graph(text, data_shape=lambda lp: (3, 7, 7)).blobs["data"] == (8, 3, 5, 5)
    assert graph(text, data_shape=lambda lp: (3, 7, 7), batch_size=2).blobs["label"] == (2,)
    unknown = graph(text + layer("ip", "InnerProduct", "data", "inner_product_param { num_output: 2 }"),
                    data_shape=lambda lp: "LMDB 'nowhere' not found")
    assert unknown.blobs["data"] is None and unknown.param_count is None
    assert unknown.warnings == ["LMDB 'nowhere' not found"]


# -- errors point at FILE:LINE:COL -------------------------------------------------

def error_of(text, **kwargs):
    with pytest.raises(ConfigError) as caught:
        graph(text, **kwargs)
    return str(caught.value)


def test_syntax_error_has_file_line_col():
    message = error_of('name: "x"\nlayer {\n  name: "a"\n  type "Input"\n}\n')
    assert message.startswith("net.prototxt:4:8: ") and "\n" not in message


def test_unknown_field_names_field_and_line():
    message = error_of('name: "x"\nlayer {\n  name: "a"\n  colour: 3\n}\n')
    assert message.startswith("net.prototxt:4:3: ") and "unknown field 'colour' in LayerParameter" in message


@pytest.mark.parametrize("field, hint", [("resize_param", "names it 'old_resize_param'"),
                                         ("distort_param", "no photometric distortion"),
                                         ("expand_param", "no expansion")])
def test_weiliu89_transform_fields_say_what_the_bundled_fork_has(field, hint):
    message = error_of(f'layer {{\n  name: "d"\n  type: "Input"\n  transform_param {{ {field} {{ }} }}\n}}\n')
    assert message.startswith("net.prototxt:4:21: unknown field '" + field + "' in TransformationParameter")
    assert "weiliu89/caffe's SSD field" in message and hint in message and "\n" not in message


def test_unknown_layer_type_is_one_line_naming_it_where_it_is_used():
    message = error_of(input_layer((1, 2)) + '\nlayer {\n  name: "w"\n  type: "Wobble"\n  bottom: "data"\n'
                       '  top: "w"\n}\n')
    assert message == ("net.prototxt:5:3: layer 'w': unknown layer type 'Wobble' (docs/layers.md lists the "
                       "supported types)")


def test_unsupported_layer_with_its_own_param_message():
    """A type of a Caffe fork (DeepLab's Interp) whose parameter message the bundled Caffe's schema lacks."""
    message = error_of('layer {\n  name: "interp"\n  type: "Interp"\n  bottom: "x"\n  top: "y"\n'
                       '  interp_param { zoom_factor: 2 }\n}\n')
    assert message.startswith("net.prototxt:6:3: layer type 'Interp' is not supported")
    assert "Convolution" not in message and "\n" not in message


def test_bottom_not_produced_is_named_with_phase():
    message = error_of(input_layer((1, 2)) + 'layer {\n  name: "r"\n  type: "ReLU"\n  bottom: "nope"\n'
                       '  top: "r"\n}\n')
    assert message == ("net.prototxt:5:3: layer 'r': bottom 'nope' is not produced by any earlier layer "
                       "in phase TRAIN")


def test_blob_written_twice_outside_in_place():
    message = error_of(input_layer((1, 2)) + layer("a", "Power", "data", top="x") + layer("b", "Power", "data", top="x"))
    assert "top 'x' is already produced by layer 'a'" in message


def test_impossible_shapes_name_the_layer():
    too_big = input_layer((1, 1, 4, 4)) + layer("conv", "Convolution", "data",
                                                 "convolution_param { num_output: 1 kernel_size: 7 }")
    assert "layer 'conv' (Convolution): kernel extent 7 is larger than the padded input" in error_of(too_big)
    mismatch = input_layer((1, 2, 4, 4), "a") + input_layer((1, 2, 5, 4), "b") + layer("cat", "Concat", ["a", "b"])
    assert "layer 'cat' (Concat): Concat inputs must match except on axis 1" in error_of(mismatch)


def test_v1_layers_format_is_upgraded_as_caffe_reads_it():
    net, source = parse_net('name: "old"\nlayers {\n  name: "a"\n  type: RELU\n  bottom: "x"\n'
                                   '  top: "x"\n}\n', "net.prototxt")
    assert [(layer.name, layer.type) for layer in net.layer] == [("a", "ReLU")] and not net.layers
    assert source.where(0, "type") == ("net.prototxt", 4, 3)
    message = error_of('name: "old"\nlayers {\n  name: "a"\n  type: RELU\n  bottom: "x"\n  top: "y"\n}\n')
    assert message.startswith("net.prototxt:5:3: layer 'a': bottom 'x' is not produced")


# -- the rest of BVLC Caffe's layers: shapes, blobs and describe ---------------------------------------

ZOO_NET = """name: "zoo"
layer { name: "in" type: "Input" top: "x" top: "ref" top: "seq" top: "cont" top: "label" top: "index"
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 9 } shape { dim: 2 dim: 3 dim: 5 dim: 5 }
                shape { dim: 4 dim: 2 dim: 6 } shape { dim: 4 dim: 2 } shape { dim: 2 } shape { dim: 3 } } }
layer { name: "crop" type: "Crop" bottom: "x" bottom: "ref" top: "crop" crop_param { axis: 2 offset: 1 offset: 3 } }
layer { name: "cols" type: "Im2col" bottom: "crop" top: "cols" convolution_param { kernel_size: 3 stride: 2 } }
layer { name: "spp" type: "SPP" bottom: "x" top: "spp" spp_param { pyramid_height: 3 } }
layer { name: "tile" type: "Tile" bottom: "spp" top: "tile" tile_param { tiles: 2 } }
layer { name: "sum" type: "Reduction" bottom: "x" top: "sum" reduction_param { axis: 1 } }
layer { name: "mvn" type: "MVN" bottom: "x" top: "mvn" }
layer { name: "step" type: "Threshold" bottom: "mvn" top: "step" }
layer { name: "pick" type: "BatchReindex" bottom: "x" bottom: "index" top: "pick" }
layer { name: "keep" type: "Filter" bottom: "x" bottom: "label" top: "keep" }
layer { name: "embed" type: "Embed" bottom: "cont" top: "embed" embed_param { num_output: 5 input_dim: 10 } }
layer { name: "lstm" type: "LSTM" bottom: "seq" bottom: "cont" top: "lstm" recurrent_param { num_output: 7 } }
layer { name: "rnn" type: "RNN" bottom: "seq" bottom: "cont" top: "rnn" recurrent_param { num_output: 7 } }
layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 4 } } }
layer { name: "loss" type: "HingeLoss" bottom: "p" bottom: "label" top: "loss" }
"""


def test_zoo_layer_shapes_and_blobs():
    net = graph(ZOO_NET)
    assert net.blobs["crop"] == (2, 3, 5, 5)
    assert net.blobs["cols"] == (2, 27, 2, 2)
    assert net.blobs["spp"] == (2, 3 * (1 + 4 + 16))
    assert net.blobs["tile"] == (2, 126)
    assert net.blobs["sum"] == (2,)
    assert net.blobs["pick"] == (3, 3, 8, 9) and net.blobs["keep"] == (2, 3, 8, 9)
    assert net.blobs["embed"] == (4, 2, 5) and net.blobs["lstm"] == net.blobs["rnn"] == (4, 2, 7)
    assert net.layer("lstm").param_shapes == [(28, 6), (28,), (28, 7)]
    assert net.layer("rnn").param_shapes == [(7, 6), (7,), (7, 7), (7, 7), (7,)]
    assert net.blobs["loss"] == ()


def test_describe_lists_the_zoo_layers(tmp_path):
    from conftest import run_cli

    path = tmp_path / "zoo.prototxt"
    path.write_text(ZOO_NET)
    status, out, err = run_cli("describe", str(path))
    assert status == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert "LSTM" in rows["lstm"] and "lstm 4x2x7" in rows["lstm"] and "28x6, 28, 28x7" in rows["lstm"]
    assert rows["spp"].split()[1:3] == ["SPP", "spp"]
    expected = 5 * 10 + 5 + 28 * 6 + 28 + 28 * 7 + 7 * 6 + 7 + 7 * 7 * 2 + 7 + 2 * 4
    assert out.splitlines()[-1] == f"total parameters: {expected}"


@pytest.mark.parametrize("body, message", [
    ('layer { name: "c" type: "Crop" bottom: "x" top: "c" }', "needs 2 bottoms"),
    ('layer { name: "c" type: "Crop" bottom: "x" bottom: "big" top: "c" }', "out of bounds"),
    ('layer { name: "l" type: "LSTM" bottom: "x" bottom: "x" top: "l" recurrent_param { num_output: 2 } }',
     "cont of T x N"),
    ('layer { name: "s" type: "SPP" bottom: "x" top: "s" spp_param { pyramid_height: 4 } }', "pad"),
    ('layer { name: "t" type: "Tile" bottom: "x" top: "t" }', "tiles"),
    ('layer { name: "i" type: "InfogainLoss" bottom: "x" bottom: "x" top: "i" }', "one per item"),
])
def test_zoo_layer_shape_errors_are_one_line_at_the_layer(body, message):
    text = ('layer { name: "in" type: "Input" top: "x" top: "big" input_param { shape { dim: 2 dim: 3 dim: 2 dim: 2 } '
            'shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }\n' + body + "\n")
    error = error_of(text)
    assert error.startswith("net.prototxt:2:") and message in error and "\n" not in error
