"""Shape rules of the data layers: their shapes come from the prototxt or from the data itself."""

from deepspark.graph.registry import ShapeError, fmt, layer_type


@layer_type("Input", data=True, fed=True)
def _input(lp, bottoms, ctx):
    shapes = [tuple(s.dim) for s in lp.input_param.shape]
    if len(shapes) not in (1, len(lp.top)):
        raise ShapeError("Input needs one shape, or one per top")
    return (shapes * len(lp.top) if len(shapes) == 1 else shapes), []


@layer_type("DummyData", data=True)
def _dummy(lp, bottoms, ctx):
    param = lp.dummy_data_param
    if param.shape:
        shapes = [tuple(s.dim) for s in param.shape]
    else:
        fields = [list(param.num), list(param.channels), list(param.height), list(param.width)]
        n = max(len(f) for f in fields)
        if n == 0 or any(len(f) not in (1, n) for f in fields):
            raise ShapeError("DummyData needs shape, or num/channels/height/width given 1 or N times")
        shapes = [tuple(f[i] if len(f) > 1 else f[0] for f in fields) for i in range(n)]
    if len(shapes) not in (1, len(lp.top)):
        raise ShapeError("DummyData needs one shape, or one per top")
    return (shapes * len(lp.top) if len(shapes) == 1 else shapes), []


@layer_type("MemoryData", data=True, fed=True)
def _memory(lp, bottoms, ctx):
    p = lp.memory_data_param
    return [(p.batch_size, p.channels, p.height, p.width), (p.batch_size,)][:len(lp.top)], []


def crop_of(transform):
    """(height, width) that transform_param crops to: crop_h and crop_w, else crop_size for both; 0 where unset."""
    return transform.crop_h or transform.crop_size, transform.crop_w or transform.crop_size


def crop_shape(transform, shape):
    """(C, H, W) after transform_param's crop."""
    c, h, w = shape
    crop_h, crop_w = crop_of(transform)
    if crop_h and crop_w:
        if crop_h > h or crop_w > w:
            raise ShapeError(f"crop {crop_h}x{crop_w} is larger than the {h}x{w} images")
        return c, crop_h, crop_w
    return c, h, w


@layer_type("Data", data=True, fed=True)
def _data(lp, bottoms, ctx):
    if not lp.data_param.batch_size:
        raise ShapeError("Data needs data_param.batch_size")
    if len(lp.top) not in (1, 2):
        raise ShapeError("Data has one or two tops (data, label)")
    source_shape = ctx.data_shape(lp)
    batch = ctx.batch_size or lp.data_param.batch_size
    if source_shape is None:
        return [None, (batch,)][:len(lp.top)], []
    return [(batch,) + crop_shape(lp.transform_param, source_shape), (batch,)][:len(lp.top)], []


# The data layers that read files of their own kind: their rows or images come from the shared data
# pipeline (deepspark/data/) as a Data layer's records do, and reach both backends as fed tops.

@layer_type("HDF5Data", data=True, fed=True)
def _hdf5_data(lp, bottoms, ctx):
    batch = ctx.batch_size or lp.hdf5_data_param.batch_size
    if not batch:
        raise ShapeError("HDF5Data needs hdf5_data_param.batch_size")
    if not lp.top:
        raise ShapeError("HDF5Data needs a top per dataset it reads")
    rows = ctx.data_shape(lp)  # {top: the shape of one row}, from the first listed file
    return [None if rows is None else (batch,) + tuple(rows[top]) for top in lp.top], []


@layer_type("ImageData", data=True, fed=True)
def _image_data(lp, bottoms, ctx):
    if len(lp.top) not in (1, 2):
        raise ShapeError("ImageData has one or two tops (data, label)")
    batch = ctx.batch_size or lp.image_data_param.batch_size
    source_shape = ctx.data_shape(lp)
    data = None if source_shape is None else (batch,) + crop_shape(lp.transform_param, source_shape)
    return [data, (batch,)][:len(lp.top)], []


@layer_type("AnnotatedData", data=True, fed=True)
def _annotated_data(lp, bottoms, ctx):
    if not lp.data_param.batch_size:
        raise ShapeError("AnnotatedData needs data_param.batch_size")
    if len(lp.top) not in (1, 2):
        raise ShapeError("AnnotatedData has one or two tops (data, label)")
    batch = ctx.batch_size or lp.data_param.batch_size
    source = ctx.data_shape(lp)  # the first record's image, every record's box count (deepspark.data.annotated)
    if source is None:
        return [None, None][:len(lp.top)], []
    data = (batch,) + crop_shape(lp.transform_param, source["image"])
    # The fork's label is 1 x 1 x (the batch's boxes) x 8; a net here has fixed shapes, so it has the rows of a
    # batch of the record holding the most boxes (a shard smaller than a batch repeats its records), the batch's
    # own first and rows of -1 after them (deepspark.data.annotated.label_rows).
    label = (1, 1, max(1, batch * source["boxes"][0]), 8) if source["typed"][0] else (batch,)
    return [data, label][:len(lp.top)], []


@layer_type("WindowData", data=True, fed=True)
def _window_data(lp, bottoms, ctx):
    if len(lp.top) != 2:
        raise ShapeError("WindowData has two tops (data, label)")
    crop = lp.transform_param.crop_size
    if not crop:
        raise ShapeError("WindowData needs transform_param.crop_size (the size windows are warped to)")
    batch = ctx.batch_size or lp.window_data_param.batch_size
    return [(batch, 3, crop, crop), (batch,)], []  # windows of colour images, warped square


@layer_type("HDF5Output", bottoms=2, tops=0)
def _hdf5_output(lp, bottoms, ctx):
    if len(bottoms) != 2 or lp.top:
        raise ShapeError("HDF5Output takes two bottoms (data, label) and has no tops")
    if not lp.hdf5_output_param.file_name:
        raise ShapeError("HDF5Output needs hdf5_output_param.file_name")
    if bottoms[0][:1] != bottoms[1][:1]:
        raise ShapeError(f"HDF5Output's data {fmt(bottoms[0])} and label {fmt(bottoms[1])} differ in batch size")
    return [], []
