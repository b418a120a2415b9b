"""deepspark.io and deepspark.Classifier against pycaffe's caffe.io and caffe.Classifier, on real image files."""

import os

import numpy as np
import pytest
from PIL import Image

import deepspark
from deepspark import checkpoint, io
from deepspark.backends.caffe import runtime
from deepspark.classifier import Classifier
from deepspark.data.convert import IDX_IMAGES_MAGIC, read_idx
from deepspark.errors import ConfigError

pytestmark = pytest.mark.caffe

caffe = runtime.caffe()

FASHION = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz"

# A small classification net (conv, pool, two inner products, softmax) taking a batch of ten 3x32x32 images.
NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 10 dim: 3 dim: 32 dim: 32 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 5 stride: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool1" top: "fc1" inner_product_param { num_output: 16 } }
layer { name: "relu2" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2" inner_product_param { num_output: 10 } }
layer { name: "prob" type: "Softmax" bottom: "fc2" top: "prob" }
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Image files as users bring them: a colour JPEG (three Fashion-MNIST pictures as its red, green and blue,
    upscaled to 300x240), a gray JPEG, an RGBA PNG, palette PNGs without and with transparency, a 16-bit gray
    PNG."""
    folder = tmp_path_factory.mktemp("images")
    _, raw = read_idx(FASHION, IDX_IMAGES_MAGIC)
    pictures = np.frombuffer(raw, np.uint8)[:8 * 784].reshape(8, 28, 28)
    rgb = np.stack(pictures[:3], axis=-1)
    paths = {name: str(folder / name) for name in ("color.jpg", "gray.jpg", "rgba.png", "palette.png",
                                                "transparent.png", "gray16.png")}
    Image.fromarray(rgb).resize((300, 240), Image.BICUBIC).save(paths["color.jpg"], quality=90)
    Image.fromarray(pictures[3]).resize((200, 170), Image.BICUBIC).save(paths["gray.jpg"], quality=90)
    Image.fromarray(np.dstack([rgb, pictures[4]]), "RGBA").resize((90, 70)).save(paths["rgba.png"])
    Image.fromarray(pictures[5]).convert("P").save(paths["palette.png"])
    Image.fromarray(pictures[7]).convert("P").save(paths["transparent.png"], transparency=0)
    Image.fromarray(pictures[6].astype(np.uint16) * 257).save(paths["gray16.png"])
    return paths


@pytest.fixture(scope="module")
def imagenet_mean(caffe_source, tmp_path_factory):
    """(the ILSVRC 2012 mean shipped with pycaffe as 3x256x256 float64, the same as a .binaryproto mean file)."""
    mean = np.load(os.path.join(caffe_source, "python", "caffe", "imagenet", "ilsvrc_2012_mean.npy"))
    path = tmp_path_factory.mktemp("mean") / "imagenet_mean.binaryproto"
    path.write_bytes(checkpoint.array_to_blob(mean[np.newaxis], legacy_dims=True).SerializeToString())
    return mean, str(path)


@pytest.mark.parametrize("color", [True, False])
@pytest.mark.parametrize("name", ["color.jpg", "gray.jpg", "rgba.png", "palette.png", "transparent.png", "gray16.png"])
def test_load_image_equals_pycaffe(images, name, color):
    ours = io.load_image(images[name], color=color)
    theirs = caffe.io.load_image(images[name], color=color)
    assert ours.dtype == theirs.dtype == np.float32
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    with Image.open(images[name]) as image:
        assert ours.shape == (image.height, image.width, 3 if color else 1)
    assert 0 <= ours.min() and ours.max() <= 1 and ours.max() > 0.5


def test_load_image_reads_the_pixels(images):
    with Image.open(images["color.jpg"]) as image:
        pixels = np.asarray(image.convert("RGB"))
    np.testing.assert_allclose(io.load_image(images["color.jpg"]), pixels / 255.0, atol=1e-7)
    gray = io.load_image(images["gray.jpg"])
    np.testing.assert_array_equal(gray[:, :, 0], gray[:, :, 2])
    with Image.open(images["gray16.png"]) as image:
        np.testing.assert_allclose(io.load_image(images["gray16.png"], color=False)[:, :, 0],
                                   np.asarray(image) / 65535.0, atol=1e-7)


@pytest.mark.parametrize("dims", [(227, 227), (100, 80), (240, 300), (3, 500), (1, 1)])
def test_resize_image_equals_pycaffe(images, dims):
    image = io.load_image(images["color.jpg"])
    ours = io.resize_image(image, dims)
    assert ours.shape == dims + (3,) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, caffe.io.resize_image(image, dims), rtol=0, atol=1e-6)
    # Pixel centres aligned: a 2x upscale's inner samples are 3/4 + 1/4 of the two nearest pixels.
    small = image[:4, :4]
    doubled = io.resize_image(small * 10 + 5, (8, 8))
    np.testing.assert_allclose(doubled[3, 3], 5 + 10 * (0.5625 * small[1, 1] + 0.1875 * (small[1, 2] + small[2, 1])
                                                        + 0.0625 * small[2, 2]), rtol=1e-5)


def test_resize_image_of_other_channel_counts_and_constants():
    rng = np.random.default_rng(0)
    many = rng.random((30, 20, 5)).astype(np.float32)
    for dims in [(60, 47), (10, 7)]:
        np.testing.assert_allclose(io.resize_image(many, dims), caffe.io.resize_image(many, dims), atol=1e-6)
    # Corners aligned for these (scipy's zoom): the corners keep their values.
    np.testing.assert_allclose(io.resize_image(many, (60, 47))[[0, -1]][:, [0, -1]], many[[0, -1]][:, [0, -1]],
                               atol=1e-6)
    constant = np.full((5, 6, 3), 0.25, np.float32)
    np.testing.assert_array_equal(io.resize_image(constant, (7, 9)), caffe.io.resize_image(constant, (7, 9)))
    with pytest.raises(ValueError, match="interp_order"):
        io.resize_image(many, (4, 4), interp_order=3)


def test_oversample_equals_pycaffe(images):
    batch = np.stack([io.resize_image(io.load_image(images[name]), (40, 36)) for name in ("color.jpg", "gray.jpg")])
    ours = io.oversample(batch, (32, 30))
    assert ours.shape == (20, 32, 30, 3)
    np.testing.assert_array_equal(ours, caffe.io.oversample(batch, (32, 30)))
    np.testing.assert_array_equal(ours[5], ours[0][:, ::-1])


def _transformers(shape, steps):
    """A deepspark.io.Transformer and a caffe.io.Transformer for input 'data' of `shape`, each given `steps`,
    [(method, our argument, pycaffe's argument)]."""
    ours, theirs = io.Transformer({"data": shape}), caffe.io.Transformer({"data": shape})
    for method, our_arg, their_arg in steps:
        getattr(ours, method)("data", our_arg)
        getattr(theirs, method)("data", their_arg)
    return ours, theirs


@pytest.mark.parametrize("case", ["mean file", "mean file at the input size", "mean values", "no mean"])
def test_transformer_preprocess_equals_pycaffe(images, imagenet_mean, case):
    mean, mean_path = imagenet_mean
    size = 256 if case == "mean file at the input size" else 227
    steps = [("set_transpose", (2, 0, 1), (2, 0, 1)), ("set_channel_swap", (2, 1, 0), (2, 1, 0)),
             ("set_raw_scale", 255.0, 255.0), ("set_input_scale", 0.017, 0.017)]
    if case.startswith("mean file"):
        steps.append(("set_mean", mean_path, mean))
    elif case == "mean values":
        steps.append(("set_mean", [104.0, 117.0, 123.0], np.array([104.0, 117.0, 123.0])))
    ours, theirs = _transformers((1, 3, size, size), steps)
    for name in ("color.jpg", "gray.jpg", "rgba.png"):
        image = io.load_image(images[name])
        got = ours.preprocess("data", image)
        want = theirs.preprocess("data", image.copy())
        assert got.shape == (3, size, size) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
        assert np.abs(got).max() > 0.5
        np.testing.assert_allclose(ours.deprocess("data", got), theirs.deprocess("data", want), rtol=1e-5, atol=2e-5)
    if case == "mean file at the input size":
        # deprocess undoes preprocess, but for the resize to the input's size.
        np.testing.assert_allclose(ours.deprocess("data", got), io.resize_image(image, (size, size)), atol=1e-5)


def test_transformer_gray_input(images, tmp_path):
    mean = np.random.default_rng(1).uniform(0, 100, (1, 20, 24))
    path = tmp_path / "gray_mean.binaryproto"
    path.write_bytes(checkpoint.array_to_blob(mean[np.newaxis], legacy_dims=True).SerializeToString())
    ours, theirs = _transformers((4, 1, 28, 28), [("set_transpose", (2, 0, 1), (2, 0, 1)),
                                                  ("set_raw_scale", 255, 255), ("set_mean", str(path), mean)])
    image = io.load_image(images["gray.jpg"], color=False)
    got = ours.preprocess("data", image)
    assert got.shape == (1, 28, 28)
    np.testing.assert_allclose(got, theirs.preprocess("data", image.copy()), rtol=1e-5, atol=2e-5)


def test_transformer_errors_name_the_input():
    transformer = io.Transformer({"data": (1, 3, 8, 8)})
    with pytest.raises(ValueError, match="'image' is not one of the net's inputs: data"):
        transformer.set_raw_scale("image", 255)
    with pytest.raises(ValueError, match="channel swap names its 3 channels"):
        transformer.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="2 mean values for 3 channels"):
        transformer.set_mean("data", [1, 2])
    with pytest.raises(ValueError, match="mean of shape"):
        transformer.set_mean("data", np.zeros((1, 8, 8)))
    with pytest.raises(ValueError, match="transpose order has 3 axes"):
        transformer.set_transpose("data", (1, 0))


def test_transformer_leaves_the_callers_image_alone():
    transformer = io.Transformer({"data": (1, 3, 4, 5)})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_raw_scale("data", 255)
    image = np.full((4, 5, 3), 0.5, np.float32)
    assert transformer.preprocess("data", image).max() == 127.5
    assert image.max() == 0.5


@pytest.fixture(scope="module")
def small_net(tmp_path_factory):
    """(prototxt, caffemodel) of NET with weights drawn by numpy with a fixed seed and saved by pycaffe."""
    folder = tmp_path_factory.mktemp("small_net")
    prototxt, weights = str(folder / "deploy.prototxt"), str(folder / "small.caffemodel")
    with open(prototxt, "w") as f:
        f.write(NET)
    net = caffe.Net(prototxt, caffe.TEST)
    rng = np.random.default_rng(7)
    for blobs in net.params.values():
        fan_in = np.prod(blobs[0].data.shape[1:])
        blobs[0].data[...] = rng.standard_normal(blobs[0].data.shape) * np.sqrt(2.0 / fan_in)
        blobs[1].data[...] = rng.standard_normal(blobs[1].data.shape) * 0.1
    net.save(weights)
    return prototxt, weights


def test_pycaffe_classifier_predicts(images, small_net, imagenet_mean):
    prototxt, weights = small_net
    classifier = caffe.Classifier(prototxt, weights, image_dims=(36, 36), mean=imagenet_mean[0],
                                  raw_scale=255, channel_swap=(2, 1, 0), input_scale=0.017)
    inputs = [caffe.io.load_image(images["color.jpg"]), caffe.io.load_image(images["gray.jpg"])]
    for oversample in (True, False):
        predictions = classifier.predict(inputs, oversample=oversample)
        assert predictions.shape == (2, 10)
        np.testing.assert_allclose(predictions.sum(axis=1), 1, rtol=1e-5)
        assert predictions.max() > 0.2  # the weights tell the images apart, not a uniform 0.1


@pytest.mark.parametrize("backend", ["caffe", "tensorflow"])
def test_classifier_equals_pycaffe(images, small_net, imagenet_mean, backend, tmp_path):
    prototxt, weights = small_net
    mean, mean_path = imagenet_mean
    labels = tmp_path / "synset_words.txt"
    labels.write_text("".join(f"n0{i:07d} class {i}, the {i}th\n" for i in range(10)))
    options = dict(image_dims=(36, 36), raw_scale=255, channel_swap=(2, 1, 0), input_scale=0.017)
    ours = deepspark.Classifier(prototxt, weights, mean=mean_path, labels=str(labels), backend=backend, **options)
    assert isinstance(ours, Classifier) and ours.backend == backend
    theirs = caffe.Classifier(prototxt, weights, mean=mean, **options)
    # Three images: ten crops each fill three batches of ten, the centre crops one padded batch.
    inputs = [io.load_image(images[name]) for name in ("color.jpg", "gray.jpg", "rgba.png")]
    for oversample in (False, True):
        got = ours.predict(inputs, oversample=oversample)
        want = theirs.predict(inputs, oversample=oversample)
        assert got.shape == want.shape == (3, 10)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    best = ours.classify(inputs, k=3)  # oversampled, as `want` last
    for row, top in zip(want, best):
        order = np.argsort(-row)[:3]
        assert [label for label, _ in top] == [f"n0{i:07d} class {i}, the {i}th" for i in order]
        np.testing.assert_allclose([score for _, score in top], row[order], rtol=1e-4, atol=1e-4)


def test_classifier_labels_must_fit(small_net, tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\ndog\n")
    with pytest.raises(ConfigError, match=r"labels.txt: 2 labels for the 10 classes of output 'prob'"):
        Classifier(*small_net, labels=str(labels), backend="caffe")
    with pytest.raises(ConfigError, match=r"missing.txt: cannot read the labels file"):
        Classifier(*small_net, labels=str(tmp_path / "missing.txt"), backend="caffe")
