"""Caffe's transform_param on whole batches: crop, mirror, mean (file or values), scale, in numpy."""

import numpy as np

from deepspark.errors import ConfigError
from deepspark.data.datum import load_mean
from deepspark.graph import crop_of, crop_shape
from deepspark.proto import deepspark_pb2 as pb


# The SSD fork's TransformationParameter extras, which its DataTransformer applies with annotations.
ANNOTATED_EXTRAS = ("old_resize_param", "noise_param", "emit_constraint")


def _phase(phase):
    if isinstance(phase, str):
        try:
            return pb.Phase.Value(phase.upper())
        except ValueError:
            raise ValueError(f"phase must be TRAIN or TEST, got {phase!r}") from None
    return int(phase)


class Transformer:
    """Caffe's DataTransformer::Transform(Datum) for a batch of N images.

    out[n, c, h, w'] = (x[n, c, h_off+h, w_off+w] - mean[c, h_off+h, w_off+w]) * scale
    with w' = crop_w-1-w when the image is mirrored (probability 1/2 in either phase, as Caffe's
    do_mirror = mirror() && Rand(2) has no phase), h_off, w_off random in TRAIN and centred in TEST,
    and mean either the mean file
    at the uncropped position or mean_value[c].
    """

    def __init__(self, transform_param=None, phase=pb.TRAIN, mean=None, seed=None):
        self.param = transform_param if transform_param is not None else pb.TransformationParameter()
        extras = [name for name in ANNOTATED_EXTRAS if self.param.HasField(name)]
        if extras:  # AnnotatedFeeder does these itself and hands the rest here
            raise ConfigError(f"transform_param.{extras[0]}: only an AnnotatedData layer takes the SSD fork's "
                              f"{', '.join(ANNOTATED_EXTRAS)} here; on another data layer the bundled pycaffe "
                              "applies none of them to a raw record (it aborts where old_resize_param's size is "
                              "not the record's, and on any encoded record): remove it")
        self.phase = _phase(phase)
        self.scale = np.float32(self.param.scale)
        self.crop_h, self.crop_w = crop_of(self.param)
        if bool(self.crop_h) != bool(self.crop_w):
            raise ConfigError("transform_param: crop_h and crop_w go together (or use crop_size)")
        self.mirror = bool(self.param.mirror)
        self.random_crop = self.phase == pb.TRAIN
        self.rng = np.random.default_rng(seed)
        if self.param.mean_file and len(self.param.mean_value):
            raise ConfigError("transform_param: give mean_file or mean_value, not both")
        if mean is None and self.param.mean_file:
            mean = load_mean(self.param.mean_file)
        self.mean = None if mean is None else np.ascontiguousarray(mean, dtype=np.float32)
        self.mean_value = (np.array(self.param.mean_value, dtype=np.float32)
                           if len(self.param.mean_value) else None)

    def output_shape(self, shape):
        """(C, H, W) of the transformed images for (C, H, W) input."""
        return crop_shape(self.param, tuple(shape))

    def check(self, shape):
        """ConfigError unless the mean, mean_value and crop fit (C, H, W) images."""
        c, h, w = shape
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise ConfigError(f"transform_param: the mean is {'x'.join(map(str, self.mean.shape))} "
                              f"but the images are {c}x{h}x{w}")
        if self.mean_value is not None and len(self.mean_value) not in (1, c):
            raise ConfigError(f"transform_param: {len(self.mean_value)} mean_value for {c}-channel "
                              "images (give one, or one per channel)")
        if self.crop_h and (self.crop_h > h or self.crop_w > w):
            raise ConfigError(f"transform_param: crop {self.crop_h}x{self.crop_w} is larger "
                              f"than the {h}x{w} images")

    def offsets(self, n, shape):
        """Per-image (h_off, w_off, mirror) arrays for a batch of n images of shape (C, H, W)."""
        _, h, w = shape
        # Caffe draws mirror before the crop offsets; the order matters only for
        # reproducing a seed, which we do among our own backends.
        mirror = (self.rng.integers(0, 2, size=n).astype(bool) if self.mirror
                  else np.zeros(n, dtype=bool))
        if not self.crop_h:
            zeros = np.zeros(n, dtype=np.int64)
            return zeros, zeros, mirror
        if self.random_crop:
            h_off = self.rng.integers(0, h - self.crop_h + 1, size=n)
            w_off = self.rng.integers(0, w - self.crop_w + 1, size=n)
        else:
            h_off = np.full(n, (h - self.crop_h) // 2)
            w_off = np.full(n, (w - self.crop_w) // 2)
        return h_off, w_off, mirror

    def apply(self, batch, out=None, offsets=None):
        """uint8 (or float32) NCHW → float32 NCHW, transformed; offsets from .offsets() if given."""
        batch = np.asarray(batch)
        if batch.ndim != 4:
            raise ValueError(f"a batch is NCHW, got shape {batch.shape}")
        n, c, h, w = batch.shape
        self.check((c, h, w))
        oc, oh, ow = self.output_shape((c, h, w))
        if out is None:
            out = np.empty((n, oc, oh, ow), dtype=np.float32)
        h_off, w_off, mirror = offsets if offsets is not None else self.offsets(n, (c, h, w))
        mean_file = self.mean

        if not self.crop_h and not mirror.any():
            # The common case (LeNet, CIFAR): one vectorised expression for the batch.
            if mean_file is not None:
                np.subtract(batch, mean_file, out=out, dtype=np.float32)
            else:
                np.copyto(out, batch, casting="unsafe")
        else:
            for i in range(n):
                hs = slice(h_off[i], h_off[i] + oh)
                ws = slice(w_off[i], w_off[i] + ow)
                image = batch[i, :, hs, ws]
                m = None if mean_file is None else mean_file[:, hs, ws]
                if mirror[i]:
                    image = image[:, :, ::-1]
                    m = None if m is None else m[:, :, ::-1]
                if m is None:
                    np.copyto(out[i], image, casting="unsafe")
                else:
                    np.subtract(image, m, out=out[i], dtype=np.float32)
        if self.mean_value is not None:
            mv = self.mean_value
            out -= mv[0] if len(mv) == 1 else mv[:, None, None]
        if self.scale != 1:
            out *= self.scale
        return out
