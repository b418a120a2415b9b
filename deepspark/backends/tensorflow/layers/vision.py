"""Vision layers in TensorFlow: convolution, pooling, LRN, im2col, SPP, crop, the fork's resamplings."""

import numpy as np

from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import HWIO, Blob
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import Layer, canonical_axis, conv_geometry, count, crop_offsets, pool_geometry, spp_levels
from deepspark.proto import deepspark_pb2 as pb


def _explicit_pad(pad):
    return [[0, 0], [pad[0], pad[0]], [pad[1], pad[1]], [0, 0]] if any(pad) else "VALID"


def _check_2d(layer, what):
    param = layer.param.convolution_param
    if len(layer.bottom_shapes[0]) != 4 or canonical_axis(param.axis, 4) != 1:
        raise NotImplementedError(f"layer '{layer.name}': the TensorFlow backend supports 2D {what} only")


def dilate_kernel(weights, dilation):
    """An HWIO kernel with dilation-1 zeros between taps: TF on CPU has no dilated convolution gradients."""
    for axis, d in enumerate(dilation):
        if d == 1:
            continue
        size = weights.shape[axis]
        spaced = tf.stack([weights] + [tf.zeros_like(weights)] * (d - 1), axis=axis + 1)
        shape = weights.shape.as_list()
        shape[axis] = size * d
        weights = tf.reshape(spaced, shape)
        weights = weights[:(size - 1) * d + 1] if axis == 0 else weights[:, :(size - 1) * d + 1]
    return weights


@layer("Convolution", param_order={0: HWIO})
def convolution(layer, bottoms, params, ctx):
    """Each bottom through the same blobs, a top each (Caffe's N bottoms to N tops)."""
    _check_2d(layer, "convolution")
    param = layer.param.convolution_param
    kernel, pad, stride, dilation = conv_geometry(param, 2)
    weights = dilate_kernel(params[0], dilation)  # HWIO (its param_order)
    convolve = grouped_convolution(weights, param.group, layer.bottom_shapes[0][1], stride, _explicit_pad(pad))

    def run(x):
        y = convolve(x)
        return tf.nn.bias_add(y, params[1]) if param.bias_term else y

    return [Blob(run(bottom.as_nhwc), True) for bottom in bottoms]


def grouped_convolution(weights, group, channels, stride, padding):
    """NHWC x -> Caffe's convolution of x by the HWIO `weights` (kh, kw, channels/group, num_output) in `group`
    groups, as one op: a depthwise convolution where each group is one input channel (MobileNet, Xception),
    else one grouped conv2d. (Split into `group` convolutions, a 728-group Xception took minutes to trace.)"""
    strides = [1, *stride, 1]
    if group == 1:
        return lambda x: tf.nn.conv2d(x, weights, strides, padding)
    if group == channels:
        # Caffe's output channel o = c M + m reads input channel c (M = num_output / channels): TF's depthwise
        # order, so the (kh, kw, 1, C M) kernel is TF's (kh, kw, C, M) as it lies.
        shape = weights.shape.as_list()
        depthwise = tf.reshape(weights, shape[:2] + [channels, shape[3] // channels])
        # Padded apart: grappler's shape inference of a depthwise op with explicit paddings aborts the process.
        return lambda x: tf.nn.depthwise_conv2d(tf.pad(x, padding) if padding != "VALID" else x, depthwise, strides,
                                                "VALID")
    return lambda x: _grouped_conv2d(x, weights, group, strides, padding)


def _split_conv2d(x, weights, group, strides, padding):
    """A grouped convolution as `group` convolutions and a concat (what TF differentiates on CPU)."""
    ys = [tf.nn.conv2d(xg, wg, strides, padding)
          for xg, wg in zip(tf.split(x, group, axis=3), tf.split(weights, group, axis=3))]
    return tf.concat(ys, axis=3)


def _grouped_conv2d(x, weights, group, strides, padding):
    """One grouped conv2d forward; its gradient through _split_conv2d, as TF has no grouped-convolution gradient
    on CPU (the split forward it differentiates is pruned from the graph: the gradients read only its inputs)."""
    @tf.custom_gradient
    def convolve(x, weights):
        def gradient(dy):
            with tf.GradientTape() as tape:
                tape.watch([x, weights])
                y = _split_conv2d(x, weights, group, strides, padding)
            return tape.gradient(y, [x, weights], output_gradients=dy)

        return tf.nn.conv2d(x, weights, strides, padding), gradient

    return convolve(x, weights)


@layer("Deconvolution", param_order={0: HWIO})
def deconvolution(layer, bottoms, params, ctx):
    """The adjoint of Caffe's convolution with the same (C_in, C_out/group, kh, kw) blob; each bottom through
    the same blobs, a top each."""
    _check_2d(layer, "deconvolution")
    param = layer.param.convolution_param
    kernel, pad, stride, dilation = conv_geometry(param, 2)
    group, outputs = param.group, param.num_output
    weights = dilate_kernel(params[0], dilation)  # (kh, kw, C_out/group, C_in): Caffe's blob in HWIO order
    filters = tf.split(weights, group, axis=3) if group > 1 else [weights]

    def deconvolve(x):
        # The batch, height and width as the tensor knows them, else as the data gives them (a SavedModel of
        # any batch and size): Caffe's output, s * (size - 1) + d * (k - 1) + 1 - 2 * pad, is `full` cut by pad.
        n, h, w = (x.shape[i] if x.shape[i] is not None else tf.shape(x)[i] for i in range(3))
        full = [s * (size - 1) + d * (k - 1) + 1 for size, k, s, d in zip((h, w), kernel, stride, dilation)]
        inputs = tf.split(x, group, axis=3) if group > 1 else [x]
        ys = [tf.nn.conv2d_transpose(xg, wg, [n, *full, outputs // group], strides=[1, *stride, 1],
                                     padding="VALID") for xg, wg in zip(inputs, filters)]
        y = tf.concat(ys, axis=3) if group > 1 else ys[0]
        y = y[:, pad[0]:full[0] - pad[0], pad[1]:full[1] - pad[1], :]
        return tf.nn.bias_add(y, params[1]) if param.bias_term else y

    return [Blob(deconvolve(bottom.as_nhwc), True) for bottom in bottoms]


def average_divisor(size, out, kernel, pad, stride):
    """Caffe's AVE pooling divisor per output position on one axis: the window clipped to size+pad."""
    starts = np.arange(out) * stride - pad
    return np.minimum(starts + kernel, size + pad) - starts


@layer("Pooling")
def pooling(layer, bottoms, params, ctx):
    param = layer.param.pooling_param
    _, _, h, w = layer.bottom_shapes[0]
    kernel, pad, stride = pool_geometry(param, h, w)
    out = layer.top_shapes[0][2:]
    x = bottoms[0].as_nhwc
    if param.pool not in (pb.PoolingParameter.MAX, pb.PoolingParameter.AVE):
        raise NotImplementedError(f"layer '{layer.name}': only MAX and AVE pooling are supported")
    is_max = param.pool == pb.PoolingParameter.MAX
    if len(layer.tops) > 1:  # any size too: a SavedModel's
        values, mask = max_pooling_mask(x, kernel, pad, stride, param.ceil_mode)
        return [Blob(values, True), Blob(mask, True)]
    if None in x.shape[1:3] and not param.global_pooling:  # a SavedModel of any size: the data's, not the graph's
        return [Blob(pooling_any_size(x, kernel, pad, stride, param.ceil_mode, is_max), True)]
    if param.global_pooling or (tuple(kernel) == (h, w) and tuple(out) == (1, 1) and not any(pad)):
        y = tf.reduce_max(x, (1, 2), keepdims=True) if is_max else tf.reduce_mean(x, (1, 2), keepdims=True)
        return [Blob(y, True)]
    # Pad so the VALID windows are exactly Caffe's ceil-mode windows: padding
    # never wins a max and adds nothing to a sum.
    needed = [(o - 1) * s + k for o, s, k in zip(out, stride, kernel)]
    after = [max(n - size - p, 0) for n, size, p in zip(needed, (h, w), pad)]
    if any(pad) or any(after):
        fill = np.finfo(np.float32).min if is_max else 0.0
        x = tf.pad(x, [[0, 0], [pad[0], after[0]], [pad[1], after[1]], [0, 0]], constant_values=fill)
    if any(n < size + p + a for n, size, p, a in zip(needed, (h, w), pad, after)):
        x = x[:, :needed[0], :needed[1], :]
    if is_max:
        return [Blob(tf.nn.max_pool2d(x, kernel, stride, "VALID"), True)]
    y = tf.nn.avg_pool2d(x, kernel, stride, "VALID")
    divisor = np.outer(average_divisor(h, out[0], kernel[0], pad[0], stride[0]),
                       average_divisor(w, out[1], kernel[1], pad[1], stride[1]))
    ratio = (kernel[0] * kernel[1]) / divisor
    if not np.all(ratio == 1):
        y = y * tf.constant(ratio[:, :, None], tf.float32)
    return [Blob(y, True)]


def caffe_windows(x, kernel, pad, stride, ceil_mode):
    """graph.pooled_size's rule on an NHWC tensor's own height and width (the data's where the graph knows none):
    (its sizes, the pooled sizes, the padded sizes the windows span, the padding after each axis)."""
    sizes = tf.shape(x)[1:3]
    out, needed, after = [], [], []
    for i in range(2):
        size, k, p, s = sizes[i], kernel[i], pad[i], stride[i]
        span = size + 2 * p - k
        out.append((-(-span // s) if ceil_mode else span // s) + 1)
        if p:
            out[i] = tf.where((out[i] - 1) * s >= size + p, out[i] - 1, out[i])
        needed.append((out[i] - 1) * s + k)
        after.append(tf.maximum(needed[i] - size - p, 0))
    tf.debugging.assert_non_negative(tf.reduce_min(sizes + np.array(pad, np.int32) * 2 - np.array(kernel, np.int32)),
                                     message=f"the pooling kernel {kernel} is larger than the padded input")
    return sizes, out, needed, after


def max_pooling_mask(x, kernel, pad, stride, ceil_mode):
    """Caffe's max Pooling of an NHWC tensor with its mask (a second top): each window's first largest value,
    row by row as Caffe's loop (a later equal one does not replace it), and its index h W + w in the input's
    plane; -1 where nothing beats -FLT_MAX, Caffe's start. (values, mask), both N x out x C."""
    sizes, out, needed, after = caffe_windows(x, kernel, pad, stride, ceil_mode)
    lowest = np.finfo(np.float32).min  # Caffe's start: padding never beats it
    x = tf.pad(x, [[0, 0], [pad[0], after[0]], [pad[1], after[1]], [0, 0]], constant_values=lowest)
    x = x[:, :needed[0], :needed[1], :]
    patches = tf.image.extract_patches(x, [1, *kernel, 1], [1, *stride, 1], [1, 1, 1, 1], "VALID")
    size = kernel[0] * kernel[1]
    patches = tf.reshape(patches, tf.concat([tf.shape(patches)[:3], [size, -1]], 0))  # window positions by row
    largest = tf.reduce_max(patches, axis=3, keepdims=True)
    position = tf.range(size)[None, None, None, :, None]
    first = tf.reduce_min(tf.where(patches == largest, position, size), axis=3)
    # the value read at the chosen position, so that the diff goes to it alone, as Caffe's Backward by the mask
    values = tf.reduce_sum(tf.where(position == first[:, :, :, None], patches, 0.0), axis=3)
    rows = (tf.range(out[0]) * stride[0] - pad[0])[None, :, None, None] + first // kernel[1]
    cols = (tf.range(out[1]) * stride[1] - pad[1])[None, None, :, None] + first % kernel[1]
    mask = tf.where(values > lowest, tf.cast(rows * sizes[1] + cols, tf.float32), -1.0)
    return tf.where(values > lowest, values, lowest), tf.stop_gradient(mask)


def pooling_any_size(x, kernel, pad, stride, ceil_mode, is_max):
    """Caffe's pooling of an NHWC tensor whose height and width only the data knows (graph.pooled_size's rule
    on tensors): padded after to the last window Caffe starts, an AVE window's divisor clipped to size+pad."""
    sizes, _, needed, after = caffe_windows(x, kernel, pad, stride, ceil_mode)
    paddings = [[0, 0], [pad[0], after[0]], [pad[1], after[1]], [0, 0]]
    fill = np.finfo(np.float32).min if is_max else 0.0
    x = tf.pad(x, paddings, constant_values=fill)[:, :needed[0], :needed[1], :]
    if is_max:
        return tf.nn.max_pool2d(x, kernel, stride, "VALID")
    padded = tf.concat([[1], sizes + np.array(pad, np.int32) * 2, [1]], 0)
    inside = tf.pad(tf.ones(padded), [[0, 0], [0, after[0]], [0, after[1]], [0, 0]])  # 1 up to size+pad: the divisor
    inside = inside[:, :needed[0], :needed[1], :]
    return tf.nn.avg_pool2d(x, kernel, stride, "VALID") / tf.nn.avg_pool2d(inside, kernel, stride, "VALID")


@layer("LRN")
def lrn(layer, bottoms, params, ctx):
    param = layer.param.lrn_param
    size, alpha, beta = param.local_size, param.alpha, param.beta
    x = bottoms[0].as_nhwc
    if param.norm_region == pb.LRNParameter.ACROSS_CHANNELS:
        # TF's sqr_sum runs over depth_radius on each side: Caffe's window of local_size.
        y = tf.nn.local_response_normalization(x, depth_radius=(size - 1) // 2, bias=param.k,
                                               alpha=alpha / size, beta=beta)
        return [Blob(y, True)]
    # WITHIN_CHANNEL: Caffe's square -> AVE pool (zero padded, divisor size^2) -> (1 + alpha*s)^-beta.
    half = (size - 1) // 2
    squares = tf.pad(tf.square(x), [[0, 0], [half, half], [half, half], [0, 0]])
    mean = tf.nn.avg_pool2d(squares, size, 1, "VALID")
    return [Blob(x * tf.pow(1.0 + alpha * mean, -beta), True)]


@layer("Crop")
def crop(layer, bottoms, params, ctx):
    """Bottom 0 cut to bottom 1's shape from `axis` on, at Caffe's offsets; the axes before `axis` kept whole."""
    shape = layer.bottom_shapes[0]
    axis = canonical_axis(layer.param.crop_param.axis, len(shape))
    begin = crop_offsets(layer.param.crop_param, len(shape))
    reference = bottoms[1].caffe  # its sizes as the tensor knows them, else as the data gives them (any size)
    size = [-1] * axis + [reference.shape[i] if reference.shape[i] is not None else tf.shape(reference)[i]
                          for i in range(axis, len(shape))]
    return [Blob(tf.slice(bottoms[0].caffe, begin, size))]


@layer("SPP")
def spp(layer, bottoms, params, ctx):
    """Caffe's SPP: one Pooling per pyramid level, each flattened, concatenated (a single level is not)."""
    levels = spp_levels(layer.param.spp_param, layer.bottom_shapes[0])
    pieces = []
    for i, (pooling_param, shape) in enumerate(levels):
        level = Layer(f"{layer.name}/level{i}", "Pooling", layer.bottoms, [f"{layer.name}/level{i}"],
                      pb.LayerParameter(type="Pooling", pooling_param=pooling_param), None,
                      bottom_shapes=layer.bottom_shapes, top_shapes=[shape])
        pooled = pooling(level, bottoms, [], ctx)[0]
        if len(levels) == 1:
            return [pooled]
        pieces.append(tf.reshape(pooled.caffe, (-1, count(shape, 1))))
    return [Blob(tf.concat(pieces, axis=1))]


@layer("Im2col")
def im2col(layer, bottoms, params, ctx):
    """Caffe's im2col: channel c, kernel row i and column j become channel (c kh + i) kw + j of each output place."""
    _check_2d(layer, "im2col")
    kernel, pad, stride, dilation = conv_geometry(layer.param.convolution_param, 2)
    x = bottoms[0].as_nhwc
    if any(pad):
        x = tf.pad(x, [[0, 0], [pad[0], pad[0]], [pad[1], pad[1]], [0, 0]])
    patches = tf.image.extract_patches(x, [1, *kernel, 1], [1, *stride, 1], [1, *dilation, 1], "VALID")
    channels = layer.bottom_shapes[0][1]
    _, _, height, width = layer.top_shapes[0]
    patches = tf.reshape(patches, (-1, height, width, kernel[0], kernel[1], channels))  # TF orders (i, j, c)
    y = tf.reshape(tf.transpose(patches, (0, 1, 2, 5, 3, 4)), (-1, height, width, channels * kernel[0] * kernel[1]))
    return [Blob(y, True)]


@layer("Pad")
def pad(layer, bottoms, params, ctx):
    """The fork's Pad: H and W grown by the pads (CONSTANT with pad_value, REPLICATE as TensorFlow's SYMMETRIC
    cannot: the edge repeated, REFLECT without the edge), or all four negative, cut; either layout kept.
    Caffe's Backward is empty: no diff reaches the input."""
    p = layer.param.pad_param
    blob = bottoms[0]
    x = blob.tensor
    h, w = blob.axis(2), blob.axis(3)
    if p.pad_u < 0:
        begin = [0] * 4
        begin[h], begin[w] = -p.pad_u, -p.pad_l
        size = [-1] * 4
        top = layer.top_shapes[0]
        size[h], size[w] = top[2], top[3]
        return [blob.like(tf.stop_gradient(tf.slice(x, begin, size)))]
    paddings = [[0, 0] for _ in range(4)]
    paddings[h], paddings[w] = [p.pad_u, p.pad_d], [p.pad_l, p.pad_r]
    if p.pad_type == pb.PadParameter.CONSTANT:
        y = tf.pad(x, paddings, constant_values=p.pad_value)
    elif p.pad_type == pb.PadParameter.REFLECT:
        y = tf.pad(x, paddings, mode="REFLECT")
    else:
        for axis, (before, after) in ((h, paddings[h]), (w, paddings[w])):
            size = tf.shape(x)[axis]
            index = tf.concat([tf.zeros([before], tf.int32), tf.range(size), tf.fill([after], size - 1)], 0)
            x = tf.gather(x, index, axis=axis)
        y = x
    return [blob.like(tf.stop_gradient(y))]


@layer("Upsample")
def upsample(layer, bottoms, params, ctx):
    """The fork's Upsample: each value repeated `scale` times along H and W (dims_num 4, either layout kept) or
    along the last axis (dims_num 3). Caffe's Backward is empty: no diff reaches the input."""
    p = layer.param.upsample_param
    blob = bottoms[0]
    y = blob.tensor
    for axis in ((2, 3) if p.dims_num == 4 else (2,)):
        y = tf.repeat(y, p.scale, axis=blob.axis(axis))
    return [blob.like(tf.stop_gradient(y))]


@layer("PixelShuffle")
def pixel_shuffle(layer, bottoms, params, ctx):
    """The fork's PixelShuffle in Caffe's layout: channel p r^2 + i r + j to channel p at (h r + i, w r + j), the
    channels past the last whole r^2 dropped. Caffe's Backward is empty: no diff reaches the input."""
    r = layer.param.pixelshuffle_param.upscale_factor
    _, channels, height, width = layer.top_shapes[0]
    x = bottoms[0].caffe[:, :channels * r * r]
    y = tf.reshape(x, (-1, channels, r, r, height // r, width // r))
    y = tf.reshape(tf.transpose(y, (0, 1, 4, 2, 5, 3)), (-1, channels, height, width))
    return [Blob(tf.stop_gradient(y))]


@layer("MaxUnPool")
def max_unpool(layer, bottoms, params, ctx):
    """The fork's MaxUnPool: each value at its mask's index in a zeroed dst_h x dst_w plane; where two share an
    index the later one wins, as Caffe's loop writes them in order. An index outside the plane stops the forward
    pass (Caffe aborts). Caffe's Backward is empty: neither input takes a diff."""
    _, channels, height, width = layer.top_shapes[0]
    plane = height * width
    x = tf.stop_gradient(bottoms[0].caffe)
    size = count(layer.bottom_shapes[0], 2)
    values = tf.reshape(x, (-1, size))
    index = tf.cast(tf.reshape(tf.stop_gradient(bottoms[1].caffe), (-1, size)), tf.int32)
    checks = [tf.debugging.assert_less(index, plane, message=f"layer '{layer.name}': a MaxUnPool index is out "
                                       f"of its {height}x{width} plane"),
              tf.debugging.assert_non_negative(index, message=f"layer '{layer.name}': a MaxUnPool index is "
                                               "negative")]
    with tf.control_dependencies(checks):
        planes = tf.shape(values)[0]
        segments = tf.range(planes)[:, None] * plane + index
        position = tf.broadcast_to(tf.range(size)[None, :], tf.shape(index))
        last = tf.math.unsorted_segment_max(position, segments, planes * plane)  # the last write to each place
    found = last >= 0
    offsets = tf.repeat(tf.range(planes), plane) * size
    picked = tf.gather(tf.reshape(values, [-1]), tf.where(found, last, 0) + offsets)
    y = tf.where(found, picked, 0.0)
    return [Blob(tf.reshape(y, (-1, channels, height, width)))]


def _bilinear_axis(source, size, align_corners):
    """The fork's source coordinates for one axis, in its float arithmetic: (h, h0, h1) with h clamped into the
    source and h0 into [0, source - 2]."""
    i = np.arange(size)
    if align_corners:
        h = (np.float32(source - 1) / np.float32(size - 1) * i.astype(np.float32)).astype(np.float32)
    else:
        h = (np.float64(np.float32(source) / np.float32(size)) * (i + 0.5) - 0.5).astype(np.float32)
    h = np.clip(h, 0, source - 1).astype(np.float32)
    h0 = np.clip(np.floor(h).astype(np.int64), 0, source - 2)
    return h, h0, h0 + 1


@layer("BilinearInterpolate")
def bilinear_interpolate(layer, bottoms, params, ctx):
    """The fork's BilinearInterpolate: each output point from the four around its source coordinates, r0 and r1
    along W, then along H, as Caffe computes them; either layout kept. Caffe's Backward is empty."""
    align = layer.param.bilinear_interpolate_param.align_corners
    blob = bottoms[0]
    x = tf.stop_gradient(blob.tensor)
    source, top = layer.bottom_shapes[0], layer.top_shapes[0]
    hs, ws = blob.axis(2), blob.axis(3)
    h, h0, h1 = _bilinear_axis(source[2], top[2], align)
    w, w0, w1 = _bilinear_axis(source[3], top[3], align)

    def along(values, axis):  # a 1-D table shaped to broadcast along a tensor axis
        shape = [1] * 4
        shape[axis] = -1
        return tf.constant(values.astype(np.float32).reshape(shape))

    rows = [tf.gather(x, h0, axis=hs), tf.gather(x, h1, axis=hs)]
    q = [[tf.gather(row, w0, axis=ws), tf.gather(row, w1, axis=ws)] for row in rows]
    right, left = along(w1 - w, ws), along(w - w0, ws)
    r0, r1 = right * q[0][0] + left * q[0][1], right * q[1][0] + left * q[1][1]
    y = along(h1 - h, hs) * r0 + along(h - h0, hs) * r1
    return [blob.like(y)]


def _resize_axis(source, size):
    """The fork's Resize rule for one axis, in its float arithmetic: the source index i0 = floor(i source / size),
    its neighbour i1 (i0 where past the edge) and their weights |1 - f| and |f| (0 past the edge)."""
    f = np.arange(size, dtype=np.float32) * (np.float32(source) / np.float32(size))
    i0 = np.floor(f).astype(np.int64)
    f = (f - i0.astype(np.float32)).astype(np.float32)
    inside = i0 + 1 < source
    return i0, np.where(inside, i0 + 1, i0), np.abs(np.float32(1) - f), np.where(inside, np.abs(f), np.float32(0))


@layer("Resize")
def resize(layer, bottoms, params, ctx):
    """The fork's Resize: each point the sum, in Caffe's order, of its four neighbours times (row weight x column
    weight); a neighbour past the edge drops out, its weight not given to the others. The backward is its
    gradient, as Caffe's (the same weights added into the input's diff); either layout kept."""
    blob = bottoms[0]
    x = blob.tensor
    source, top = layer.bottom_shapes[0], layer.top_shapes[0]
    hs, ws = blob.axis(2), blob.axis(3)
    h0, h1, wh0, wh1 = _resize_axis(source[2], top[2])
    w0, w1, ww0, ww1 = _resize_axis(source[3], top[3])

    def table(rows, cols):  # the (row weight x column weight) products, shaped to the tensor's H and W axes
        values = (rows[:, None] * cols[None, :]).astype(np.float32)
        shape = [1] * 4
        shape[hs], shape[ws] = top[2], top[3]
        return tf.constant(values.reshape(shape))  # H before W in either layout

    rows = [tf.gather(x, h0, axis=hs), tf.gather(x, h1, axis=hs)]
    y = table(wh0, ww0) * tf.gather(rows[0], w0, axis=ws)
    y = y + table(wh0, ww1) * tf.gather(rows[0], w1, axis=ws)
    y = y + table(wh1, ww0) * tf.gather(rows[1], w0, axis=ws)
    y = y + table(wh1, ww1) * tf.gather(rows[1], w1, axis=ws)
    return [blob.like(y)]
