"""Proposal's sort in TensorFlow ops against a line-by-line port of the fork's sort_box (proposal_layer.cpp's quicksort): the same order of tied scores on many fixed-seed arrays, ranges past num_top left as it leaves them (#43)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from deepspark.backends.tensorflow.layers.detection import fork_order, proposal_order  # noqa: E402

SIGNATURE = [tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([], tf.int32)]
# Traced once (as in a net's graph), not run op by op.
fork_order, proposal_order = (tf.function(f, input_signature=SIGNATURE) for f in (fork_order, proposal_order))


def sort_box(scores, num_top):
    """The fork's sort_box(list, 0, n - 1, num_top) on float32 scores, moving indices with them (its recursion
    as a stack: the two ranges it recurses into are disjoint)."""
    a, idx = np.asarray(scores, np.float32).copy(), np.arange(len(scores))
    ranges = [(0, len(a) - 1)]
    while ranges:
        start, end = ranges.pop()
        pivot, left, right = a[start], start + 1, end
        while left <= right:
            while left <= end and a[left] >= pivot:
                left += 1
            while right > start and a[right] <= pivot:
                right -= 1
            if left <= right:
                a[[left, right]], idx[[left, right]] = a[[right, left]], idx[[right, left]]
                left, right = left + 1, right - 1
        if right > start:
            a[[start, right]], idx[[start, right]] = a[[right, start]], idx[[right, start]]
        if start < right - 1:
            ranges.append((start, right - 1))
        if right + 1 < num_top and right + 1 < end:
            ranges.append((right + 1, end))
    return idx


def test_fork_order_is_sort_boxs_on_tied_scores():
    rng = np.random.default_rng(43)
    for trial in range(150):
        rows, size, num_top = int(rng.integers(1, 4)), int(rng.integers(1, 40)), int(rng.integers(0, 45))
        scores = (rng.integers(0, int(rng.integers(1, 6)), (rows, size)) / 2).astype(np.float32)
        if trial % 3 == 0:  # distinct scores with a run of zeros (boxes under min_size)
            scores = np.where(rng.uniform(size=(rows, size)) < 0.4, 0, rng.uniform(size=(rows, size)))
            scores = scores.astype(np.float32)
        want = np.stack([sort_box(row, num_top) for row in scores])
        np.testing.assert_array_equal(fork_order(tf.constant(scores), num_top).numpy(), want,
                                      err_msg=f"{scores} num_top {num_top}")
        k = min(num_top, size)
        np.testing.assert_array_equal(proposal_order(tf.constant(scores), num_top).numpy(), want[:, :k])


@pytest.mark.parametrize("scores", [
    [5, 4, 4, 3, 9, 1, 1, 2], [1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 3, 3], [2, 2, 1, 1, 2, 2, 1, 1, 3, 3],
    [9, 8, 7, 1, 1, 5, 5, 0, 0, 6]])
@pytest.mark.parametrize("num_top", [3, 100])
def test_peeled_heads_ascending_runs_and_one_value_as_sort_box(scores, num_top):
    """A head of descending maxima (which sort_box peels one by one and fork_order skips at once), scores in
    ascending order (its deepest recursion), all equal."""
    scores = np.array([scores, scores[::-1]], np.float32)
    np.testing.assert_array_equal(fork_order(tf.constant(scores), num_top).numpy(),
                                  np.stack([sort_box(row, num_top) for row in scores]))


def test_without_ties_the_order_is_the_descending_one():
    scores = np.random.default_rng(1).permutation(200).reshape(2, 100).astype(np.float32)
    np.testing.assert_array_equal(proposal_order(tf.constant(scores), 30).numpy(),
                                  np.argsort(-scores, axis=1)[:, :30])
    np.testing.assert_array_equal(fork_order(tf.constant(scores), 30).numpy()[:, :30],
                                  np.argsort(-scores, axis=1)[:, :30])
