"""caffe.Classifier on deepspark.Net: images resized, cropped (centre or ten crops), preprocessed, classified."""

import numpy as np

from deepspark.errors import ConfigError
from deepspark.io import Transformer, crop_boxes, oversample as ten_crops, resize_image
from deepspark.net import Net


def read_labels(path):
    """The class names of a labels file, one per line in class order (Caffe's synset_words.txt)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f]
    except OSError as e:
        raise ConfigError(f"cannot read the labels file ({e.strerror})", path) from None


class Classifier(Net):
    """A Net that classifies HxWxK images (load_image's) as caffe.Classifier does.

    Each image is resized to image_dims (default: the net's input HxW), then
    cropped to the input's HxW, at the centre or ten times (corners, centre
    and their mirrors, the predictions averaged); preprocessed by a
    deepspark.io.Transformer with the transpose (2, 0, 1) and the given mean
    (array, per-channel values or a .binaryproto path), input_scale, raw_scale
    and channel_swap; and run through the net. predict returns the net's first
    output, one row per image; labels (a file of one name per line) give top_k
    its names.
    """

    def __init__(self, model_file, pretrained_file=None, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None, labels=None, backend="tensorflow"):
        super().__init__(model_file, weights=pretrained_file, phase="test", backend=backend)
        in_ = self.inputs[0]
        self.transformer = Transformer({in_: self.blobs[in_].data.shape})
        self.transformer.set_transpose(in_, (2, 0, 1))
        if mean is not None:
            self.transformer.set_mean(in_, mean)
        if input_scale is not None:
            self.transformer.set_input_scale(in_, input_scale)
        if raw_scale is not None:
            self.transformer.set_raw_scale(in_, raw_scale)
        if channel_swap is not None:
            self.transformer.set_channel_swap(in_, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].data.shape[2:])
        self.image_dims = self.crop_dims if image_dims is None else np.array(image_dims)
        self.labels = None
        if labels is not None:
            self.labels = read_labels(labels)
            self._check_labels(labels)

    def _check_labels(self, path):
        classes = int(np.prod(self.blobs[self.outputs[0]].data.shape[1:]))
        if len(self.labels) != classes:
            raise ConfigError(f"{len(self.labels)} labels for the {classes} classes of output "
                              f"{self.outputs[0]!r}", path)

    def predict(self, inputs, oversample=True):
        """(N, classes) predictions of N HxWxK images: the first output, averaged over ten crops when
        oversample, else of the centre crop."""
        input_ = np.zeros((len(inputs), int(self.image_dims[0]), int(self.image_dims[1]), inputs[0].shape[2]),
                          dtype=np.float32)
        for ix, image in enumerate(inputs):
            input_[ix] = resize_image(image, self.image_dims)
        if oversample:
            input_ = ten_crops(input_, self.crop_dims)
        else:
            top, left, bottom, right = crop_boxes(self.image_dims, self.crop_dims)[4]
            input_ = input_[:, top:bottom, left:right, :]
        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, crop) for crop in input_])
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions

    def top_k(self, predictions, k=5):
        """Per row of predictions, its k highest classes as (label, score), best first; the label is the
        labels file's line, or the class index without one."""
        predictions = np.asarray(predictions).reshape(len(predictions), -1)
        best = np.argsort(-predictions, axis=1, kind="stable")[:, :k]
        names = self.labels if self.labels is not None else range(predictions.shape[1])
        return [[(names[c], float(row[c])) for c in order] for row, order in zip(predictions, best)]

    def classify(self, inputs, k=5, oversample=True):
        """top_k of predict(inputs, oversample): per image its k best (label, score)."""
        return self.top_k(self.predict(inputs, oversample), k)
