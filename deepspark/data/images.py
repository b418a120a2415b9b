"""Batches for an ImageData layer: a list file of `path label` lines and the images it names, as Caffe's ImageDataLayer reads them.

Each line is a path and an integer label, split at the last space (paths may
hold spaces); the image is root_folder + path, read in colour (3 channels,
BGR, as OpenCV reads it) or gray (is_color: false), resized to new_height x
new_width when both are given, then transformed by transform_param (crop,
mirror, mean, scale) like a Data layer's records. The list is read in order,
looping; with shuffle, in a new random order every pass; rand_skip skips a
random number of lines at the start. A shard of the job reads its share of
the lines. Every image of a net must come out one size (Caffe reshapes per
batch; a net here has fixed shapes).
"""

import os

import numpy as np

from deepspark.data.convert import read_image, read_list_file
from deepspark.data.datum import DataError
from deepspark.data.lmdb_io import shard_range
from deepspark.data.resume import Resumable
from deepspark.data.table import feeds
from deepspark.data.transform import Transformer, _phase
from deepspark.errors import ConfigError
from deepspark.proto import deepspark_pb2 as pb


def listed_images(layer_param):
    """[(image path, label, line)] of an ImageData layer's list, each image checked to exist."""
    param = layer_param.image_data_param
    entries = read_list_file(param.source)
    images = []
    for filename, label, line in entries:
        path = param.root_folder + filename
        if not os.path.exists(path):
            raise ConfigError(f"image '{path}' not found (root_folder {param.root_folder!r} + the listed path)",
                              param.source, line)
        images.append((path, label, line))
    return images


def _resize(param):
    return (param.new_height, param.new_width) if param.new_height > 0 and param.new_width > 0 else None


def load(param, path, line):
    """uint8 CHW pixels of one listed image, as the layer reads it; a one-line error at the list's line."""
    try:
        return read_image(path, param.is_color, _resize(param))[2]
    except OSError as error:
        raise ConfigError(f"cannot read image {path} ({error.strerror or error})", param.source, line) from None
    except (ValueError, SyntaxError) as error:
        raise ConfigError(f"cannot decode image {path} ({error})", param.source, line) from None


def source_shape(layer_param):
    """(C, H, W) of an ImageData layer's images before transform: its first listed image's."""
    param = layer_param.image_data_param
    path, _, line = listed_images(layer_param)[0]
    return tuple(int(d) for d in load(param, path, line).shape)


class ImageFeeder(Resumable):
    """Batches {data: float32 NCHW, label: float32 (N,)} for one ImageData layer, lines [start, stop) of its
    list (shard `shard` of `num_shards`), transformed like a Data layer's."""

    unit = "images"

    def __init__(self, layer_param, phase=pb.TRAIN, shard=0, num_shards=1, seed=None, batch_size=None, mean=None):
        self.param = param = layer_param.image_data_param
        self.name = layer_param.name
        self.tops = list(layer_param.top)
        if len(self.tops) not in (1, 2):
            raise ConfigError(f"layer {self.name!r}: an ImageData layer has one or two tops (data, label)")
        self.batch_size = int(batch_size or param.batch_size)
        if self.batch_size <= 0:
            raise ConfigError(f"layer {self.name!r}: image_data_param.batch_size must be positive")
        images = listed_images(layer_param)
        start, stop = shard_range(len(images), shard, num_shards)
        if stop == start:
            raise DataError(f"shard {shard} of {num_shards} is empty: the list names only {len(images)} images",
                            param.source)
        self.images = images[start:stop]
        self.size = len(self.images)
        seeds = np.random.SeedSequence(seed).spawn(2)
        self.order_rng = np.random.default_rng(seeds[0])
        self.transformer = Transformer(layer_param.transform_param, _phase(phase), mean=mean, seed=seeds[1])
        self.shuffle = bool(param.shuffle)
        self.source_shape = tuple(load(param, *self.images[0][::2]).shape)
        self.transformer.check(self.source_shape)
        self._order = self._epoch_order()
        self._position = int(self.order_rng.integers(param.rand_skip)) % self.size if param.rand_skip else 0
        self.epoch = 0

    @property
    def shapes(self):
        out = {self.tops[0]: (self.batch_size,) + self.transformer.output_shape(self.source_shape)}
        if len(self.tops) > 1:
            out[self.tops[1]] = (self.batch_size,)
        return out

    def _next_indices(self):
        indices = []
        while len(indices) < self.batch_size:
            indices.append(int(self._order[self._position]) if self._order is not None else self._position)
            self._position += 1
            if self._position == self.size:
                self._position, self.epoch = 0, self.epoch + 1
                self._order = self._epoch_order()
        return indices

    def skip(self, batches):
        """Resumable's: the positions only, no image loaded, and the crops and mirrors those batches drew (so
        that the next batch draws what it would have)."""
        for _ in range(batches):
            self._next_indices()
            self.transformer.offsets(self.batch_size, self.source_shape)
        return True

    def next_batch(self):
        indices = self._next_indices()
        pixels = np.empty((self.batch_size,) + self.source_shape, np.uint8)
        labels = np.empty(self.batch_size, np.float32)
        for i, index in enumerate(indices):
            path, label, line = self.images[index]
            image = load(self.param, path, line)
            if image.shape != self.source_shape:
                raise ConfigError(f"image {path} is {'x'.join(map(str, image.shape))}, the first is "
                                  f"{'x'.join(map(str, self.source_shape))}: a net's images are one size (give "
                                  "new_height and new_width)", self.param.source, line)
            pixels[i], labels[i] = image, label
        batch = {self.tops[0]: self.transformer.apply(pixels)}
        if len(self.tops) > 1:
            batch[self.tops[1]] = labels
        return batch


feeds("ImageData", make=lambda layer_param, phase, where, options: ImageFeeder(layer_param, phase,
                                                                              mean=options.get("mean"), **where),
      param="image_data_param", listed=listed_images,
      shape=lambda layer_param, given: source_shape(layer_param) if given is None else given)
