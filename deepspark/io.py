"""pycaffe's caffe.io for inference: load_image, resize_image, oversample and the Transformer, in numpy and Pillow.

The numbers are pycaffe's as it ran with the scikit-image of Caffe's day:
load_image is skimage.img_as_float(skimage.io.imread(path, as_grey=not
color)) as float32 HxWxK in [0, 1]; resize_image is skimage's
resize(order=1, mode='constant') (pixel centres aligned, zero beyond the
edge, no anti-aliasing) on the image scaled to [0, 1], or scipy's zoom(order=1)
(corners aligned) for images of other than 1 or 3 channels. Transformer
applies, per net input, resize to the input's HxW, transpose, channel swap,
raw scale, mean subtraction and input scale, in that order, as
caffe.io.Transformer does.
"""

import os

import numpy as np

from deepspark.data.datum import load_mean

# skimage.color.rgb2gray's weights (ITU-R BT.709), which as_grey applied to a colour image.
GRAY_WEIGHTS = np.array([0.2125, 0.7154, 0.0721])


def load_image(filename, color=True):
    """An image file as float32 in [0, 1]: HxWx3 RGB (a gray image repeated) when color, else HxWx1 intensity.

    An alpha channel is dropped; 16-bit images scale by 1/65535, others by 1/255.
    """
    from PIL import Image  # deferred: Pillow is needed only to read files

    with Image.open(filename) as image:
        image.load()
        if image.mode in ("I;16", "I;16B", "I;16L"):
            pixels = np.asarray(image, dtype=np.uint16).astype(np.float64) / 65535.0
        else:
            if image.mode not in ("L", "RGB", "RGBA"):
                # A palette's transparency goes through RGBA, as Pillow asks; the alpha is dropped below.
                image = image.convert("RGBA" if "transparency" in image.info else "RGB")
            pixels = np.asarray(image, dtype=np.float64) / 255.0
    if pixels.ndim == 3:
        pixels = pixels[:, :, :3]
        if not color:
            pixels = pixels @ GRAY_WEIGHTS
    pixels = pixels.astype(np.float32)
    if pixels.ndim == 2:
        pixels = pixels[:, :, np.newaxis]
        if color:
            pixels = np.tile(pixels, (1, 1, 3))
    return pixels


def _interpolation(n_in, n_out, centres):
    """(n_out, n_in) weights of linear interpolation from n_in samples to n_out.

    centres: output pixel o samples x = (o + 0.5) n_in / n_out - 0.5, and a
    neighbour beyond the edge counts as 0 (skimage's resize, mode='constant');
    otherwise x = o (n_in - 1) / (n_out - 1), corners to corners (scipy's zoom).
    """
    o = np.arange(n_out)
    if centres:
        x = (o + 0.5) * n_in / n_out - 0.5
    else:
        x = o * (n_in - 1) / max(n_out - 1, 1)
    x0 = np.floor(x).astype(np.int64)
    w = x - x0
    weights = np.zeros((n_out, n_in + 2))  # a column of zeros each side takes the neighbours beyond the edge
    np.add.at(weights, (o, x0 + 1), 1 - w)
    np.add.at(weights, (o, np.minimum(x0 + 2, n_in + 1)), w)
    return weights[:, 1:-1]


def _resample(im, new_dims, centres):
    """HxWxK → new_dims[0] x new_dims[1] x K, linear in each axis (separable), in float64."""
    h, w, k = im.shape
    rows = _interpolation(h, int(new_dims[0]), centres)
    cols = _interpolation(w, int(new_dims[1]), centres)
    out = (rows @ im.reshape(h, w * k).astype(np.float64)).reshape(len(rows), w, k)
    return np.einsum("pw,hwk->hpk", cols, out)


def resize_image(im, new_dims, interp_order=1):
    """caffe.io.resize_image: an HxWxK array resized to new_dims (height, width) by linear interpolation, float32.

    Images of 1 or 3 channels are scaled to [0, 1] by their own min and max
    and back around the resize (a constant image stays that constant).
    """
    if interp_order != 1:
        raise ValueError(f"resize_image: interp_order {interp_order} is not supported (1, linear, is)")
    im = np.asarray(im)
    if im.ndim != 3:
        raise ValueError(f"resize_image takes an HxWxK array, got shape {im.shape}")
    if im.shape[-1] not in (1, 3):
        return _resample(im, new_dims, centres=False).astype(np.float32)
    im_min, im_max = im.min(), im.max()
    if im_max <= im_min:
        return np.full((int(new_dims[0]), int(new_dims[1]), im.shape[-1]), im_min, dtype=np.float32)
    im_std = (im - im_min) / (im_max - im_min)
    resized_std = np.clip(_resample(im_std, new_dims, centres=True), 0.0, 1.0)
    return (resized_std * (im_max - im_min) + im_min).astype(np.float32)


def crop_boxes(image_dims, crop_dims):
    """(5, 4) [top, left, bottom, right] crops of an image: the four corners, then the centre (oversample's)."""
    image_dims, crop_dims = np.asarray(image_dims[:2]), np.asarray(crop_dims)
    boxes = np.empty((5, 4), dtype=int)
    corner = 0
    for top in (0, image_dims[0] - crop_dims[0]):
        for left in (0, image_dims[1] - crop_dims[1]):
            boxes[corner] = (top, left, top + crop_dims[0], left + crop_dims[1])
            corner += 1
    boxes[4] = np.tile(image_dims / 2.0, 2) + np.concatenate([-crop_dims / 2.0, crop_dims / 2.0])
    return boxes


def oversample(images, crop_dims):
    """caffe.io.oversample: (10N, h, w, K) float32 crops of N HxWxK images, per image the four corners and the
    centre, then the same five mirrored left to right."""
    boxes = np.tile(crop_boxes(images[0].shape, crop_dims), (2, 1))
    crops = np.empty((10 * len(images), int(crop_dims[0]), int(crop_dims[1]), images[0].shape[-1]),
                     dtype=np.float32)
    ix = 0
    for im in images:
        for top, left, bottom, right in boxes:
            crops[ix] = im[top:bottom, left:right, :]
            ix += 1
        crops[ix - 5:ix] = crops[ix - 5:ix, :, ::-1, :]
    return crops


class Transformer:
    """caffe.io.Transformer: turns HxWxK images into the CxHxW arrays of a net's inputs, and back.

    `inputs` maps each input name to its blob shape (N, C, H, W), or is a net
    with .inputs and .blobs (a deepspark.Net or a caffe.Net).
    """

    def __init__(self, inputs):
        if hasattr(inputs, "blobs"):
            inputs = {name: inputs.blobs[name].data.shape for name in inputs.inputs}
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise ValueError(f"{in_!r} is not one of the net's inputs: {', '.join(self.inputs)}")

    def preprocess(self, in_, data):
        """An HxWxK image → the CxHxW float32 array for input in_: resized to the input's HxW, transposed,
        channels swapped, times raw_scale, less the mean, times input_scale."""
        self._check_input(in_)
        data = np.asarray(data)
        caffe_in = data.astype(np.float32, copy=False)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if in_ in self.transpose:
            caffe_in = caffe_in.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            caffe_in = caffe_in[list(self.channel_swap[in_]), :, :]
        if np.shares_memory(caffe_in, data):
            caffe_in = caffe_in.copy()  # the steps below work in place, never on the caller's array
        if in_ in self.raw_scale:
            caffe_in *= self.raw_scale[in_]
        if in_ in self.mean:
            caffe_in -= self.mean[in_]
        if in_ in self.input_scale:
            caffe_in *= self.input_scale[in_]
        return caffe_in

    def deprocess(self, in_, data):
        """preprocess undone: a CxHxW (or 1xCxHxW) array of input in_ → the HxWxK image (at the input's size)."""
        self._check_input(in_)
        decaf_in = np.array(data, copy=True)
        if decaf_in.ndim == 4 and decaf_in.shape[0] == 1:
            decaf_in = decaf_in[0]
        if in_ in self.input_scale:
            decaf_in /= self.input_scale[in_]
        if in_ in self.mean:
            decaf_in += self.mean[in_]
        if in_ in self.raw_scale:
            decaf_in /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            decaf_in = decaf_in[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            decaf_in = decaf_in.transpose(np.argsort(self.transpose[in_]))
        return decaf_in

    def set_transpose(self, in_, order):
        """The order of the image's axes for the net, e.g. (2, 0, 1) for HxWxC → CxHxW."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise ValueError(f"input {in_!r}: a transpose order has {len(self.inputs[in_]) - 1} axes, "
                             f"got {tuple(order)}")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        """The order to take channels in, after the transpose: (2, 1, 0) makes RGB into BGR."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise ValueError(f"input {in_!r}: a channel swap names its {self.inputs[in_][1]} channels, "
                             f"got {tuple(order)}")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        """The factor from load_image's [0, 1] to the net's raw range (255 for the ImageNet models), before the
        mean."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """The mean to subtract: per-channel values (a sequence of C numbers), a CxHxW (or HxW) array, or the
        path of a .binaryproto mean file; an array of another HxW is resized to the input's."""
        self._check_input(in_)
        if isinstance(mean, (str, os.PathLike)):
            mean = load_mean(os.fspath(mean))
        mean = np.asarray(mean)
        channels, in_dims = self.inputs[in_][1], self.inputs[in_][2:]
        if mean.ndim == 1:
            if len(mean) != channels:
                raise ValueError(f"input {in_!r}: {len(mean)} mean values for {channels} channels")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if mean.ndim == 2:
                mean = mean[np.newaxis]
            if mean.ndim != 3 or mean.shape[0] != channels:
                raise ValueError(f"input {in_!r}: a mean of shape {mean.shape} for {channels}-channel input "
                                 "(give CxHxW, or one value per channel)")
            if mean.shape[1:] != in_dims:
                # As pycaffe: resized within [0, 1] and scaled back (resize_image keeps a constant mean).
                m_min, m_max = mean.min(), mean.max()
                m_max = m_max if m_max > m_min else m_min + 1
                normal_mean = (mean - m_min) / (m_max - m_min)
                mean = resize_image(normal_mean.transpose((1, 2, 0)), in_dims).transpose((2, 0, 1)) * \
                    (m_max - m_min) + m_min
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """The factor applied last, after the mean is subtracted (0.017 for some nets)."""
        self._check_input(in_)
        self.input_scale[in_] = scale
