"""Shape rules of the vision layers: convolution, pooling, LRN, Im2col, SPP, Crop, the fork's resamplings."""

import math

import numpy as np

from deepspark.graph.registry import ShapeError, canonical_axis, count, exactly, fmt, layer_type, weight_and_bias
from deepspark.proto import deepspark_pb2 as pb


@layer_type("LRN")
def _lrn(lp, bottoms, ctx):
    if len(bottoms[0]) != 4:
        raise ShapeError(f"LRN needs a 4-axis input, got {fmt(bottoms[0])}")
    if lp.lrn_param.local_size % 2 == 0:
        raise ShapeError("LRN local_size must be odd")
    return [bottoms[0]], []


def _per_axis(repeated, h, w, has_hw, default, spatial, what):
    """Caffe's rule for kernel/pad/stride: the _h/_w pair (2D), else one value or one per axis."""
    if has_hw:
        if spatial != 2:
            raise ShapeError(f"{what}_h/{what}_w are for 2D only")
        return [h, w]
    values = list(repeated)
    if not values:
        if default is None:
            raise ShapeError(f"{what} is required")
        return [default] * spatial
    if len(values) == 1:
        return values * spatial
    if len(values) != spatial:
        raise ShapeError(f"{what} needs 1 or {spatial} values, got {len(values)}")
    return values


def conv_geometry(param, spatial):
    """kernel, pad, stride, dilation lists of a ConvolutionParameter (Caffe's defaults)."""
    kernel = _per_axis(param.kernel_size, param.kernel_h, param.kernel_w,
                       param.HasField("kernel_h") or param.HasField("kernel_w"), None, spatial, "kernel_size")
    pad = _per_axis(param.pad, param.pad_h, param.pad_w,
                    param.HasField("pad_h") or param.HasField("pad_w"), 0, spatial, "pad")
    stride = _per_axis(param.stride, param.stride_h, param.stride_w,
                       param.HasField("stride_h") or param.HasField("stride_w"), 1, spatial, "stride")
    dilation = _per_axis(param.dilation, 0, 0, False, 1, spatial, "dilation")
    if any(k <= 0 for k in kernel) or any(s <= 0 for s in stride) or any(d <= 0 for d in dilation):
        raise ShapeError("kernel, stride and dilation must be positive")
    return kernel, pad, stride, dilation


def _conv_output(lp, shape):
    """(channel axis, kernel, output size of each spatial axis) of a Convolution, Deconvolution or Im2col layer."""
    param = lp.convolution_param
    axis = canonical_axis(param.axis, len(shape))
    spatial = len(shape) - axis - 1
    if spatial < 1:
        raise ShapeError(f"{lp.type} needs spatial axes after axis {axis}, got {fmt(shape)}")
    kernel, pad, stride, dilation = conv_geometry(param, spatial)
    out = []
    for size, k, p, s, d in zip(shape[axis + 1:], kernel, pad, stride, dilation):
        extent = d * (k - 1) + 1
        if lp.type == "Deconvolution":
            o = s * (size - 1) + extent - 2 * p
        else:
            if size + 2 * p < extent:
                raise ShapeError(f"kernel extent {extent} is larger than the padded input "
                                 f"{size}+2*{p} of {fmt(shape)}")
            o = (size + 2 * p - extent) // s + 1
        if o <= 0:
            raise ShapeError(f"output size {o} from input {fmt(shape)} is not positive")
        out.append(o)
    return axis, kernel, out


@layer_type("Convolution", "Deconvolution", fillers=lambda lp: weight_and_bias(lp.convolution_param))
def _convolution(lp, bottoms, ctx):
    """One top per bottom, all through the same blobs (Caffe's BaseConvolutionLayer: EqualNumBottomTopBlobs,
    every bottom of bottom[0]'s shape)."""
    param, shape = lp.convolution_param, bottoms[0]
    if len(lp.top) != len(bottoms):
        raise ShapeError(f"{lp.type} makes one top per bottom: {len(bottoms)} bottom{'s' * (len(bottoms) != 1)}, "
                         f"{len(lp.top)} top{'s' * (len(lp.top) != 1)}")
    for other in bottoms[1:]:
        if other != shape:
            raise ShapeError(f"{lp.type}'s bottoms must all have one shape (they share its blobs), got "
                             f"{', '.join(fmt(s) for s in bottoms)}")
    axis, kernel, out = _conv_output(lp, shape)
    channels, outputs, group = shape[axis], param.num_output, param.group
    if not outputs:
        raise ShapeError(f"{lp.type} needs num_output")
    if group < 1 or channels % group or outputs % group:
        raise ShapeError(f"group {group} must divide both input channels {channels} and num_output {outputs}")
    if lp.type == "Deconvolution":
        weights = (channels, outputs // group) + tuple(kernel)
    else:
        weights = (outputs, channels // group) + tuple(kernel)
    params = [weights] + ([(outputs,)] if param.bias_term else [])
    return [shape[:axis] + (outputs,) + tuple(out)] * len(bottoms), params


def pool_geometry(param, height, width):
    """kernel, pad, stride (each as (h, w)) of a PoolingParameter, as Caffe's PoolingLayer sets them up."""
    if param.global_pooling:
        if param.HasField("kernel_size") or param.HasField("kernel_h") or param.HasField("kernel_w"):
            raise ShapeError("global_pooling takes no kernel size")
        kernel = (height, width)
    elif param.HasField("kernel_size") and not (param.HasField("kernel_h") or param.HasField("kernel_w")):
        kernel = (param.kernel_size, param.kernel_size)
    elif param.HasField("kernel_h") and param.HasField("kernel_w") and not param.HasField("kernel_size"):
        kernel = (param.kernel_h, param.kernel_w)
    else:
        raise ShapeError("Pooling needs kernel_size, or kernel_h and kernel_w (not both)")
    for name in ("pad", "stride"):  # Caffe's CHECKs: one or the other form, and both of a pair
        pair = [param.HasField(f"{name}_{side}") for side in "hw"]
        if any(pair) and (param.HasField(name) or not all(pair)):
            raise ShapeError(f"Pooling takes {name} or both {name}_h and {name}_w")
    pad = (param.pad_h, param.pad_w) if param.HasField("pad_h") or param.HasField("pad_w") else (param.pad,) * 2
    if param.HasField("stride_h") or param.HasField("stride_w"):
        stride = (param.stride_h, param.stride_w)
    else:
        stride = (param.stride,) * 2
    if param.global_pooling and (any(pad) or any(s != 1 for s in stride)):
        raise ShapeError("global_pooling needs pad 0 and stride 1")
    if min(kernel) <= 0 or min(stride) <= 0:
        raise ShapeError("Pooling kernel and stride must be positive")
    if any(pad) and param.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
        raise ShapeError("padding is implemented for MAX and AVE pooling only")
    if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
        raise ShapeError(f"pad {pad} must be smaller than the kernel {kernel}")
    return kernel, pad, stride


def pooled_size(size, kernel, pad, stride, ceil_mode=True):
    """Caffe's pooled output size: ceil, then clipped so the last window starts inside the input."""
    if size + 2 * pad < kernel:
        raise ShapeError(f"kernel {kernel} is larger than the padded input {size}+2*{pad}")
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


@layer_type("Pooling")
def _pooling(lp, bottoms, ctx):
    shape, param = bottoms[0], lp.pooling_param
    if len(shape) != 4:
        raise ShapeError(f"Pooling needs a 4-axis input, got {fmt(shape)}")
    kernel, pad, stride = pool_geometry(param, shape[2], shape[3])
    is_max = param.pool == pb.PoolingParameter.MAX
    if len(lp.top) > 1 + is_max:
        most = "1 or 2 tops (the second its mask)" if is_max else "1 top (only MAX gives a mask)"
        raise ShapeError(f"{pb.PoolingParameter.PoolMethod.Name(param.pool)} Pooling makes {most}, got {len(lp.top)}")
    out = [pooled_size(shape[2 + i], kernel[i], pad[i], stride[i], param.ceil_mode) for i in range(2)]
    tops = [shape[:2] + tuple(out)] * max(len(lp.top), 1)
    return tops, []


def crop_offsets(param, rank):
    """Caffe's Crop offset of every axis of a `rank`-axis input: 0 before crop_param.axis, then the offsets."""
    axis = canonical_axis(param.axis, rank)
    offsets = list(param.offset)
    if len(offsets) > 1 and axis + len(offsets) != rank:
        raise ShapeError(f"Crop gives {len(offsets)} offsets for the {rank - axis} axes from axis {axis}")
    return [0] * axis + [offsets[0] if len(offsets) == 1 else offsets[i] if offsets else 0
                         for i in range(rank - axis)]


@layer_type("Crop", bottoms=2)
def _crop(lp, bottoms, ctx):
    exactly(lp, bottoms, 2, 1)
    shape, reference = bottoms
    offsets = crop_offsets(lp.crop_param, len(shape))
    axis = canonical_axis(lp.crop_param.axis, len(shape))
    if len(reference) < len(shape):
        raise ShapeError(f"Crop's reference {fmt(reference)} has fewer axes than its input {fmt(shape)}")
    top = list(shape)
    for i in range(axis, len(shape)):
        if shape[i] - offsets[i] < reference[i]:
            raise ShapeError(f"the crop of axis {i} to {reference[i]} at offset {offsets[i]} is out of bounds "
                             f"of {fmt(shape)}")
        top[i] = reference[i]
    return [tuple(top)], []


def spp_levels(param, shape):
    """(PoolingParameter, pooled N x C x H x W) of each level of Caffe's SPP pyramid over `shape`."""
    if len(shape) != 4:
        raise ShapeError(f"SPP needs a 4-axis input, got {fmt(shape)}")
    if param.pyramid_height < 1:
        raise ShapeError("SPP needs pyramid_height of at least 1")
    levels = []
    for level in range(param.pyramid_height):
        bins = 2 ** level
        kernel = [-(-size // bins) for size in shape[2:]]
        pad = [(k * bins - size + 1) // 2 for k, size in zip(kernel, shape[2:])]
        pool = pb.PoolingParameter(pool=param.pool, kernel_h=kernel[0], kernel_w=kernel[1], pad_h=pad[0],
                                   pad_w=pad[1], stride_h=kernel[0], stride_w=kernel[1])
        geometry = pool_geometry(pool, *shape[2:])
        out = [pooled_size(shape[2 + i], geometry[0][i], geometry[1][i], geometry[2][i]) for i in range(2)]
        levels.append((pool, shape[:2] + tuple(out)))
    return levels


@layer_type("SPP")
def _spp(lp, bottoms, ctx):
    exactly(lp, bottoms, 1, 1)
    levels = spp_levels(lp.spp_param, bottoms[0])
    if len(levels) == 1:
        return [levels[0][1]], []
    return [(bottoms[0][0], sum(count(shape, 1) for _, shape in levels))], []


@layer_type("Im2col")
def _im2col(lp, bottoms, ctx):
    exactly(lp, bottoms, 1, 1)
    shape = bottoms[0]
    axis, kernel, out = _conv_output(lp, shape)
    return [shape[:axis] + (shape[axis] * math.prod(kernel),) + tuple(out)], []


@layer_type("Pad")
def _pad(lp, bottoms, ctx):
    """The fork's Pad: a 4-axis blob's H and W grown by pad_u + pad_d and pad_l + pad_r (CONSTANT, REPLICATE,
    REFLECT), or all four negative, cut; Caffe's Backward is empty. Its Forward indexes past the blob where the
    pads mix signs or a REFLECT pad reaches the edge, and its other ranks read a 4-axis blob's axes: refused."""
    p = lp.pad_param
    shape = bottoms[0]
    if lp.top[0] == lp.bottom[0]:
        raise ShapeError("Pad does not allow in-place computation")
    if len(shape) != 4:
        raise ShapeError(f"Pad takes a 4-axis input here, got {fmt(shape)}")
    pads = (p.pad_u, p.pad_d, p.pad_l, p.pad_r)
    if not (all(q >= 0 for q in pads) or all(q < 0 for q in pads)):
        raise ShapeError(f"Pad's pads must be all non-negative or all negative, got {pads}")
    height, width = shape[2] + p.pad_u + p.pad_d, shape[3] + p.pad_l + p.pad_r
    if height < 0 or width < 0:
        raise ShapeError(f"Pad {pads} leaves a negative size of {fmt(shape)}")
    if p.pad_type == pb.PadParameter.REFLECT and (max(p.pad_u, p.pad_d) >= shape[2]
                                                 or max(p.pad_l, p.pad_r) >= shape[3]):
        raise ShapeError(f"Pad REFLECT pads {pads} must be smaller than the input's {shape[2]}x{shape[3]}")
    return [(shape[0], shape[1], height, width)], []


@layer_type("Upsample")
def _upsample(lp, bottoms, ctx):
    """The fork's Upsample: nearest neighbour, the last two axes (dims_num 4, an NCHW blob) or the last (dims_num 3,
    NCW) times `scale`; Caffe's Backward is empty. Its Forward reads exactly that many axes, and in place it
    would read the input it overwrites: the rest refused."""
    p = lp.upsample_param
    shape = bottoms[0]
    if p.dims_num not in (3, 4):
        raise ShapeError(f"Upsample dims_num must be 3 or 4, got {p.dims_num}")
    if len(shape) != p.dims_num:
        raise ShapeError(f"Upsample dims_num {p.dims_num} needs a {p.dims_num}-axis input, got {fmt(shape)}")
    if p.scale < 1:
        raise ShapeError(f"Upsample scale must be at least 1, got {p.scale}")
    if lp.top[0] == lp.bottom[0]:
        raise ShapeError("Upsample in place would read the input it overwrites")
    scaled = 2 if p.dims_num == 4 else 1
    return [shape[:-scaled] + tuple(d * p.scale for d in shape[-scaled:])], []


@layer_type("PixelShuffle")
def _pixel_shuffle(lp, bottoms, ctx):
    """The fork's PixelShuffle: a 4-axis blob's channels p r^2 + i r + j moved to channel p at (h r + i, w r + j);
    Caffe CHECKs the channels divide by r (not r^2) and keeps C / r^2 of them, rounded down; its Backward is
    empty."""
    p = lp.pixelshuffle_param
    shape = bottoms[0]
    if not p.HasField("upscale_factor") or p.upscale_factor < 1:
        raise ShapeError("PixelShuffle needs a pixelshuffle_param.upscale_factor of at least 1")
    if len(shape) != 4:
        raise ShapeError(f"PixelShuffle takes a 4-axis input, got {fmt(shape)}")
    r = p.upscale_factor
    if shape[1] % r:
        raise ShapeError(f"PixelShuffle's {shape[1]} channels do not divide by upscale_factor {r}")
    if lp.top[0] == lp.bottom[0]:
        raise ShapeError("PixelShuffle in place would read the input it overwrites")
    return [(shape[0], shape[1] // (r * r), shape[2] * r, shape[3] * r)], []


@layer_type("MaxUnPool", bottoms=2)
def _max_unpool(lp, bottoms, ctx):
    """The fork's MaxUnPool: each value of a 4-axis blob put at its mask's index (a max Pooling's second top) in
    a zeroed dst_h x dst_w plane of its item and channel; Caffe's Backward is empty. Its Forward steps through the
    mask by the data's plane, so a mask of another shape is refused."""
    p = lp.max_unpool_param
    exactly(lp, bottoms, 2, 1)
    if not (p.HasField("dst_h") and p.HasField("dst_w")):
        raise ShapeError("MaxUnPool needs max_unpool_param.dst_h and dst_w")
    shape = bottoms[0]
    if len(shape) != 4:
        raise ShapeError(f"MaxUnPool's input must have 4 axes, got {fmt(shape)}")
    if bottoms[1] != shape:
        raise ShapeError(f"MaxUnPool's mask {fmt(bottoms[1])} is not the shape of its input {fmt(shape)}")
    if lp.top[0] in lp.bottom:
        raise ShapeError("MaxUnPool in place would read the input it overwrites")
    return [(shape[0], shape[1], p.dst_h, p.dst_w)], []


def _bilinear_grid(lp, shape):
    """BilinearInterpolate's output height and width: dst_h/dst_w (the input's where one is missing) when no
    scale_factor is given, int(size * scale_factor) when only it is; the fork leaves them unset otherwise."""
    p = lp.bilinear_interpolate_param
    sized = p.HasField("dst_h") or p.HasField("dst_w")
    if sized == p.HasField("scale_factor"):
        raise ShapeError("BilinearInterpolate takes dst_h/dst_w or scale_factor, one of the two (the fork leaves "
                         "its size unset otherwise)")
    if sized:
        return (p.dst_h if p.HasField("dst_h") else shape[2], p.dst_w if p.HasField("dst_w") else shape[3])
    return tuple(int(np.float32(size) * np.float32(p.scale_factor)) for size in shape[2:4])  # in float, as Caffe


@layer_type("BilinearInterpolate")
def _bilinear_interpolate(lp, bottoms, ctx):
    """The fork's BilinearInterpolate: a 4-axis blob resized to its grid; Caffe's Backward is empty. Its Forward
    reads outside the plane where a side is under 2, and divides by zero where align_corners meets a side of 1:
    refused."""
    shape = bottoms[0]
    if len(shape) != 4:
        raise ShapeError(f"BilinearInterpolate takes a 4-axis input, got {fmt(shape)}")
    height, width = _bilinear_grid(lp, shape)
    if min(shape[2:4]) < 2:
        raise ShapeError(f"BilinearInterpolate needs an input of at least 2x2, got {fmt(shape)}")
    if height < 1 or width < 1 or (lp.bilinear_interpolate_param.align_corners and min(height, width) < 2):
        raise ShapeError(f"BilinearInterpolate's output {height}x{width} is too small")
    if lp.top[0] == lp.bottom[0]:
        raise ShapeError("BilinearInterpolate in place would read the input it overwrites")
    return [(shape[0], shape[1], height, width)], []


@layer_type("Resize")
def _resize(lp, bottoms, ctx):
    """The fork's Resize: a 4-axis blob resized bilinearly to height x width, or (is_pyramid_test) to
    int(out_height_scale * H) x int(out_width_scale * W), in float as Caffe; its Backward is the gradient."""
    p, shape = lp.resize_param, bottoms[0]
    if len(shape) != 4:
        raise ShapeError(f"Resize takes a 4-axis input, got {fmt(shape)}")
    if p.is_pyramid_test:
        if not (p.HasField("out_height_scale") and p.HasField("out_width_scale")):
            raise ShapeError("Resize with is_pyramid_test needs out_height_scale and out_width_scale")
        size = (int(np.float32(p.out_height_scale) * np.float32(shape[2])),
                int(np.float32(p.out_width_scale) * np.float32(shape[3])))
    else:
        if not (p.HasField("height") and p.HasField("width")):
            raise ShapeError("Resize needs resize_param.height and width")
        size = (p.height, p.width)
    if min(size) < 1:
        raise ShapeError(f"Resize's output {size[0]}x{size[1]} is empty")
    if lp.top[0] == lp.bottom[0]:
        raise ShapeError("Resize in place would read the input it overwrites")
    return [(shape[0], shape[1]) + size], []
