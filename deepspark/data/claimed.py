"""A Data layer's records as the job's ledger hands them out (work stealing): blocks claimed a few at a time, read from this worker's shard or the source every executor reads, shuffled through the blocks held."""

import itertools

import numpy as np

from deepspark.data import lmdb_io
from deepspark.data.sources import Lookup

# Blocks a worker holds claimed at once: its shuffle buffer. Two keep a straggler from holding more than two blocks
# of the job's records out of the others' reach, and mix each batch from two places in the source (the ledger
# draws every range's block order per epoch, so the places change each block).
HELD_BLOCKS = 2
# Every STRIDE-th key of an LMDB is read once: a run from any position is a cursor placed by the key before it
# and stepped at most STRIDE - 1 records (LMDB has no index by position), from a list 1/STRIDE of the keys' size.
STRIDE = 64


class Positions:
    """An LMDB's records by their position: every STRIDE-th key read once, at the first run."""

    def __init__(self, path):
        self.path, self._keys, self._lookup = path, None, Lookup(path)

    def run(self, first, count):
        """The (key, value) records [first, first + count) of the LMDB."""
        if self._keys is None:
            self._keys = list(itertools.islice(lmdb_io.read_records(self.path, keys_only=True), 0, None, STRIDE))
        return self._lookup.run(self._keys[first // STRIDE], count, skip=first % STRIDE)

    def close(self):
        self._lookup.close()


class ClaimedStream:
    """A worker's batches from the blocks the job's ledger grants it (exchange/ledger.py): it holds `held` blocks,
    draws each batch uniformly from the records they hold unread (shuffle; else in order, the oldest block first),
    and claims another block as one is read whole, reporting it read with that claim.

    claim(wanted, done)  [(ticket, epoch, owner, first, count)] granted, having read the blocks of tickets `done`;
                         and the connection they were granted on
    current()            the connection now: blocks granted on an earlier one went back to the ledger as the worker
                         joined again, and are dropped unread (another worker reads them)
    read(first, count)   (images, labels) of the source's records [first, first + count)
    rng                  the worker's order rng (its seed as the feeder's)
    """

    def __init__(self, claim, current, read, rng, held=HELD_BLOCKS, shuffle=True):
        self._claim, self._current, self._read, self.rng = claim, current, read, rng
        self.held, self.shuffle = int(held), shuffle
        self._blocks = []  # [ticket, epoch, owner, images, labels, order, taken], oldest first
        self._done = []  # tickets read whole, reported with the next claim
        self._at = None  # the connection the blocks held were granted on
        self.epoch = 0  # the job epoch of the newest block granted
        self.claims = self.dropped = 0
        self.records = {}  # owner -> records read whole of its range

    def _refill(self, n):
        """Claim until `held` blocks are held and they hold `n` records unread."""
        if self._at is not None and self._current() != self._at:
            self.dropped += len(self._blocks)
            self._blocks, self._done = [], []
        while len(self._blocks) < self.held or sum(len(b[5]) - b[6] for b in self._blocks) < n:
            grants, self._at = self._claim(max(self.held - len(self._blocks), 1), self._done)
            self.claims, self._done = self.claims + 1, []
            for ticket, epoch, owner, first, count in grants:
                images, labels = self._read(first, count)
                order = self.rng.permutation(count) if self.shuffle else np.arange(count)
                self._blocks.append([ticket, epoch, owner, images, labels, order, 0])
                self.epoch = max(self.epoch, epoch)

    def read(self, n):
        """(images, labels) of the next `n` records."""
        self._refill(n)
        unread = [len(b[5]) - b[6] for b in self._blocks]
        if self.shuffle:
            counts = self.rng.multivariate_hypergeometric(unread, n)
        else:  # in order: the oldest block's first
            counts = np.diff(np.minimum(np.cumsum([0] + unread), n))
        images, labels = [], []
        for block, take in zip(self._blocks, counts):
            picked = block[5][block[6]:block[6] + take]
            block[6] += take
            images.append(block[3][picked])
            labels.append(block[4][picked])
        images, labels = np.concatenate(images), np.concatenate(labels)
        if self.shuffle:
            mixed = self.rng.permutation(n)
            images, labels = images[mixed], labels[mixed]
        for block in self._blocks:
            if block[6] == len(block[5]):
                self._done.append(block[0])
                self.records[block[2]] = self.records.get(block[2], 0) + len(block[5])
        self._blocks = [b for b in self._blocks if b[6] < len(b[5])]
        return images, labels
