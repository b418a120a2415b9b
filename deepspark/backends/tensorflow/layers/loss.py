"""Loss and score layers in TensorFlow: Caffe's normalisations, Accuracy's partial sort, Caffe's own Backward."""

import math

from deepspark.backends.base import infogain_matrix
from deepspark.backends.tensorflow.layers.table import layer
from deepspark.backends.tensorflow.layout import Blob, _permute, batch_free
from deepspark.backends.tensorflow.runtime import tf
from deepspark.graph import canonical_axis, count
from deepspark.proto import deepspark_pb2 as pb


def items(tensor):
    """The length of a tensor's first axis as a float: the static one, or the data's where only the data says
    (the tops of a Filter layer)."""
    known = tensor.shape[0]
    return float(known) if known is not None else tf.cast(tf.shape(tensor)[0], tf.float32)


def _class_rows(layer, blob, axis):
    """Scores as (outer*inner, classes) rows, Caffe's class axis last."""
    shape = layer.bottom_shapes[0]
    classes = shape[axis]
    x = tf.reshape(blob.caffe, (-1, classes, math.prod(shape[axis + 1:])))
    return tf.reshape(_permute(x, (0, 2, 1)), (-1, classes))


def _labels(blob):
    return tf.cast(tf.reshape(blob.caffe, (-1,)), tf.int32)


def loss_normalizer(loss_param, outer, inner, valid):
    """Caffe's LossLayer::GetNormalizer (with the legacy `normalize` flag), at least 1."""
    mode = loss_param.normalization
    if not loss_param.HasField("normalization") and loss_param.HasField("normalize"):
        mode = pb.LossParameter.VALID if loss_param.normalize else pb.LossParameter.BATCH_SIZE
    if mode == pb.LossParameter.FULL:
        value = outer * inner
    elif mode == pb.LossParameter.VALID:
        value = valid
    elif mode == pb.LossParameter.BATCH_SIZE:
        value = outer
    else:
        value = 1.0
    return tf.maximum(tf.cast(value, tf.float32), 1.0)


@layer("SoftmaxWithLoss")
def softmax_loss(layer, bottoms, params, ctx):
    shape = layer.bottom_shapes[0]
    loss_param = layer.param.loss_param
    axis = canonical_axis(layer.param.softmax_param.axis, len(shape))
    logits = _class_rows(layer, bottoms[0], axis)
    labels = _labels(bottoms[1])
    if loss_param.HasField("ignore_label"):
        valid = tf.not_equal(labels, loss_param.ignore_label)
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.where(valid, labels, 0), logits=logits)
        nll = tf.where(valid, nll, 0.0)
        count = tf.reduce_sum(tf.cast(valid, tf.float32))
    else:
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        count = items(nll)
    inner = math.prod(shape[axis + 1:])
    outer = items(logits) / inner
    loss = tf.reduce_sum(nll) / loss_normalizer(loss_param, outer, inner, count)
    tops = [Blob(loss)]
    if len(layer.tops) > 1:
        tops.append(Blob(tf.nn.softmax(bottoms[0].caffe, axis=axis)))
    return tops


@layer("EuclideanLoss")
def euclidean_loss(layer, bottoms, params, ctx):
    """sum((a - b)^2) / (2 N)."""
    a = bottoms[0].caffe
    b = tf.reshape(bottoms[1].caffe, batch_free(layer.bottom_shapes[0]))
    return [Blob(tf.reduce_sum(tf.square(a - b)) / (2.0 * items(a)))]


@layer("SigmoidCrossEntropyLoss")
def sigmoid_cross_entropy_loss(layer, bottoms, params, ctx):
    """Caffe's SigmoidCrossEntropyLoss: the summed cross-entropy over N (the batch)."""
    logits = bottoms[0].caffe
    targets = tf.reshape(bottoms[1].caffe, batch_free(layer.bottom_shapes[0]))
    entropy = tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits)
    return [Blob(tf.reduce_sum(entropy) / items(logits))]


def _ranks_above(scores, classes, mine, label):
    """Caffe's pair order (std::greater on (score, class)): whether (scores, classes) come before (mine, label).

    Ties go to the higher class; a NaN is neither above nor below, so the class decides against it too.
    (Not `~(scores < mine)`: Grappler rewrites that to `scores >= mine`, false where a NaN is.)
    """
    not_below = (scores >= mine) | tf.math.is_nan(scores) | tf.math.is_nan(mine)
    return (mine < scores) | (not_below & (label < classes))


def _heap_top_k(scores, k):
    """The classes of each row that libstdc++'s std::partial_sort puts first, k per row, with Caffe's pair order:
    its __heap_select (a heap of the first k, then each later pair that ranks above the heap's top replaces it)
    step for step, one row per lane.

    Where a row holds a NaN the order is no strict weak order and which classes end first is what the algorithm
    does with it, not a sort; elsewhere it is the k highest.
    """
    n = scores.shape[1]
    depth = k.bit_length() + 1  # a heap of k holds no path longer
    classes = tf.zeros_like(scores, tf.int32) + tf.range(n)  # (a row count known when traced stays known)
    first = tf.zeros_like(classes[:, 0])

    def get(heap, pos):
        return tuple(tf.gather(h, pos[:, None], batch_dims=1)[:, 0] for h in heap)

    def put(heap, pos, pair, where):
        spot = tf.one_hot(pos, k, on_value=True, off_value=False) & where[:, None]
        return tuple(tf.where(spot, p[:, None], h) for h, p in zip(heap, pair))

    def adjust(heap, hole, pair, where):
        """__adjust_heap: sink the hole at `hole` to a leaf, then __push_heap `pair` up from there."""
        top, second = hole, hole
        for _ in range(depth):
            going = where & (second < (k - 1) // 2)
            second = tf.where(going, 2 * (second + 1), second)
            right, left = get(heap, second), get(heap, tf.maximum(second - 1, 0))
            second = tf.where(going & _ranks_above(*right, *left), second - 1, second)
            heap = put(heap, hole, get(heap, second), going)
            hole = tf.where(going, second, hole)
        if k % 2 == 0:
            last = where & (second == (k - 2) // 2)
            child = tf.minimum(2 * second + 1, k - 1)  # the only child, in the rows that have it
            heap = put(heap, hole, get(heap, child), last)
            hole = tf.where(last, child, hole)
        for _ in range(depth):
            parent = tf.maximum((hole - 1) // 2, 0)
            going = where & (hole > top) & _ranks_above(*get(heap, parent), *pair)
            heap = put(heap, hole, get(heap, parent), going)
            hole = tf.where(going, parent, hole)
        return put(heap, hole, pair, where)

    everywhere = tf.ones_like(first, tf.bool)
    heap = (scores[:, :k], classes[:, :k])

    def make(parent, heap):  # __make_heap
        at = first + parent
        return parent - 1, adjust(heap, at, get(heap, at), everywhere)

    def select(i, heap):  # __heap_select's loop: __pop_heap where the pair ranks above the top
        pair = (scores[:, i], classes[:, i])
        above = _ranks_above(*pair, *get(heap, first))
        return i + 1, adjust(heap, first, pair, above)

    if k > 1:
        heap = tf.while_loop(lambda parent, heap: parent >= 0, make, (tf.constant((k - 2) // 2), heap))[1]
    return tf.while_loop(lambda i, heap: i < n, select, (tf.constant(k), heap))[1][1]


@layer("Accuracy")
def accuracy(layer, bottoms, params, ctx):
    """Caffe's Accuracy: correct when std::partial_sort puts the label among the first top_k (score, class) pairs.

    Caffe sorts the pairs descending, so a class ranks above the label when its
    score is greater, or equal with a higher class index: without a NaN, the
    label is correct when fewer than top_k classes rank above it. With a NaN
    the pairs have no order and the result is what libstdc++'s partial_sort
    does with them (_heap_top_k): all NaN, only the last top_k classes count.
    """
    param = layer.param.accuracy_param
    shape = layer.bottom_shapes[0]
    axis = canonical_axis(param.axis, len(shape))
    scores = tf.stop_gradient(_class_rows(layer, bottoms[0], axis))
    labels = _labels(bottoms[1])
    valid = tf.not_equal(labels, param.ignore_label) if param.HasField("ignore_label") else \
        tf.ones_like(labels, tf.bool)
    safe = tf.where(valid, labels, 0)
    mine = tf.gather(scores, safe, batch_dims=1)[:, None]
    classes = tf.range(shape[axis])[None, :]

    def ordered():
        above = _ranks_above(scores, classes, mine, safe[:, None])
        return tf.reduce_sum(tf.cast(above, tf.int32), axis=1) < param.top_k

    def unordered():
        return tf.reduce_any(tf.equal(_heap_top_k(scores, param.top_k), safe[:, None]), axis=1)

    correct = tf.cond(tf.reduce_any(tf.math.is_nan(scores)), unordered, ordered) & valid
    # Counts as float64, each quotient rounded once to float32: Caffe's float division (TF's float32 division
    # can be an ulp off it).
    correct = tf.cast(correct, tf.float64)
    weights = tf.cast(valid, tf.float64)
    tops = [Blob(tf.cast(tf.reduce_sum(correct) / tf.reduce_sum(weights), tf.float32))]
    if len(layer.tops) > 1:
        hits = tf.math.unsorted_segment_sum(correct, safe, shape[axis])
        totals = tf.math.unsorted_segment_sum(weights, safe, shape[axis])
        tops.append(Blob(tf.cast(tf.where(totals > 0, hits / tf.maximum(totals, 1.0), 0.0), tf.float32)))
    return tops


LOG_THRESHOLD = 1e-20  # Caffe's kLOG_THRESHOLD: the least probability its logs take


def _rows(layer, blob):
    """A blob as Caffe's N x (count / N) rows."""
    return tf.reshape(blob.caffe, (-1, count(layer.bottom_shapes[0], 1)))


def _weighted_log_loss(probabilities, weights):
    """-sum(weights * log(max(p, 1e-20))) / N, with Caffe's diff -weights / max(p, 1e-20) / N (the
    clipped entries too, where the gradient of the clipped forward would be 0)."""
    n = items(probabilities)

    @tf.custom_gradient
    def loss(p):
        clipped = tf.maximum(p, LOG_THRESHOLD)

        def grad(upstream):
            return upstream * (-weights / clipped / n)
        return -tf.reduce_sum(weights * tf.math.log(clipped)) / n, grad
    return loss(probabilities)


@layer("MultinomialLogisticLoss")
def multinomial_logistic_loss(layer, bottoms, params, ctx):
    p = _rows(layer, bottoms[0])
    return [Blob(_weighted_log_loss(p, tf.one_hot(_labels(bottoms[1]), p.shape[1])))]


@layer("InfogainLoss")
def infogain_loss(layer, bottoms, params, ctx):
    """-sum_j H[label, j] log p_j over N; H from the third bottom, or the `source` file."""
    p = _rows(layer, bottoms[0])
    if len(bottoms) > 2:
        matrix = tf.reshape(bottoms[2].caffe, (p.shape[1], p.shape[1]))
    else:
        matrix = tf.constant(infogain_matrix(layer, ctx.graph.source))
    return [Blob(_weighted_log_loss(p, tf.gather(matrix, _labels(bottoms[1]))))]


@layer("HingeLoss")
def hinge_loss(layer, bottoms, params, ctx):
    """sum of max(0, 1 -+ x) (minus at the label), L1 or squared (L2), over N."""
    x = _rows(layer, bottoms[0])
    sign = 1.0 - 2.0 * tf.one_hot(_labels(bottoms[1]), x.shape[1])
    margins = tf.maximum(0.0, 1.0 + sign * x)  # 0 first: at a tie the diff is 0, as Caffe's sign(0)
    if layer.param.hinge_loss_param.norm == pb.HingeLossParameter.L2:
        margins = tf.square(margins)
    return [Blob(tf.reduce_sum(margins) / items(x))]


@layer("ContrastiveLoss")
def contrastive_loss(layer, bottoms, params, ctx):
    """sum over pairs of d^2 (similar) or max(margin - d, 0)^2 (max(margin - d^2, 0) legacy), over 2N; the
    diff of a dissimilar pair divides by d + 1e-4, as Caffe's Backward does."""
    param = layer.param.contrastive_loss_param
    a = _rows(layer, bottoms[0])
    n, size = tf.shape(a)[0], tf.size(a)
    similar = tf.not_equal(tf.cast(tf.reshape(bottoms[2].caffe, (-1,))[:n], tf.int32), 0)
    b = tf.reshape(tf.reshape(bottoms[1].caffe, (-1,))[:size], tf.shape(a))  # Caffe reads count(a) values of b
    pairs = items(a)

    @tf.custom_gradient
    def loss(a, b):
        diff = a - b
        squared = tf.reduce_sum(tf.square(diff), axis=1)
        distance = tf.sqrt(squared)
        if param.legacy_version:
            short = param.margin - squared
            apart, scale = tf.maximum(short, 0.0), -1.0
        else:
            short = param.margin - distance
            apart, scale = tf.square(tf.maximum(short, 0.0)), -short / (distance + 1e-4)

        def grad(upstream):
            alpha = upstream / pairs
            coefficient = tf.where(similar, alpha, tf.where(short > 0, alpha * scale, 0.0))
            return coefficient[:, None] * diff, -coefficient[:, None] * diff
        return tf.reduce_sum(tf.where(similar, squared, apart)) / pairs / 2.0, grad
    return [Blob(loss(a, b))]


@layer("SmoothL1Loss")
def smooth_l1_loss(layer, bottoms, params, ctx):
    """The fork's SmoothL1Loss: d = a - b, sum(0.5 d^2 where |d| < 1, else |d| - 0.5) / N. Caffe's Backward,
    +-f'(d) / N to a and b (f'(d) = d inside 1, else its sign), is the gradient of its Forward."""
    a = bottoms[0].caffe
    d = a - tf.reshape(bottoms[1].caffe, batch_free(layer.bottom_shapes[0]))
    return [Blob(tf.reduce_sum(tf.where(tf.abs(d) < 1.0, 0.5 * d * d, tf.abs(d) - 0.5)) / items(a))]
