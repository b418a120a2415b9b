"""Shape rules of the neuron layers: elementwise, one top the shape of the bottom."""

from deepspark.graph.registry import ShapeError, constant_filler, given_filler, layer_type, same


layer_type("ReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL", "Dropout")(same)
layer_type("Threshold", no_backward=(0,))(same)
layer_type("Clip", "Swish")(same)
# The fork's (brocolli-caffe 9.0.2): ReLU6 with its Backward; HardSwish and HardSigmoid with an empty one.
layer_type("ReLU6", "HardSwish", "HardSigmoid")(same)


@layer_type("PReLU", fillers=lambda lp: [given_filler(lp.prelu_param, "filler", constant_filler(0.25))])
def _prelu(lp, bottoms, ctx):
    if len(bottoms[0]) < 2:
        raise ShapeError("PReLU needs an input with a channel axis")
    slopes = () if lp.prelu_param.channel_shared else (bottoms[0][1],)
    return [bottoms[0]], [slopes]
