"""Batches for an HDF5Data layer: the .h5 files its list names, one dataset per top, read as Caffe's HDF5DataLayer reads them.

hdf5_data_param.source is a text file of .h5 paths (whitespace-separated, as
Caffe reads it; relative ones from the working directory, else beside the
list). Top k reads the dataset named like the top: every dataset of a file has
the same first axis (its rows), and a batch is batch_size rows, so top k is
(batch_size,) + the dataset's other axes, float32. Rows come file by file in
the list's order, going back to the first file after the last; with shuffle,
the files' order is drawn anew every pass and each file's rows are permuted
when it is loaded, whole files never interleaved (Caffe's shuffle). Caffe
refuses transform_param here. A shard of the job reads its share of the rows of
all the files together; only the file it is in is held in memory.
"""

import os

import numpy as np

from deepspark.config import resolve
from deepspark.data.convert import read_list_text
from deepspark.data.datum import DataError
from deepspark.data.lmdb_io import shard_range
from deepspark.data.resume import Resumable
from deepspark.data.table import feeds
from deepspark.errors import ConfigError


def _h5py():
    import h5py  # deferred: only an HDF5 net needs it, and it loads libhdf5
    return h5py


def read_list(source):
    """[(path, line)] of the .h5 files an HDF5Data source list names, resolved (cwd, then the list's folder)."""
    text = read_list_text(source, "HDF5 list file")
    base = os.path.dirname(os.path.abspath(source))
    files = [(resolve(token, base), number) for number, line in enumerate(text.splitlines(), 1)
             for token in line.split()]
    if not files:
        raise DataError("the HDF5 list file names no .h5 files (Caffe needs at least one)", source)
    return files


def file_rows(path, line, source, tops):
    """(rows, {top: shape of one row}) of one listed .h5 file, each top's dataset checked."""
    if not os.path.exists(path):
        raise ConfigError(f"HDF5 file '{path}' not found", source, line)
    try:
        with _h5py().File(path, "r") as h5:
            shapes = {}
            for top in tops:
                dataset = h5.get(top)
                if dataset is None or not hasattr(dataset, "shape"):
                    have = ", ".join(name for name in h5 if hasattr(h5[name], "shape")) or "none"
                    raise ConfigError(f"HDF5 file '{path}' has no dataset '{top}' (each top of an HDF5Data layer "
                                      f"names the dataset it reads; the file has: {have})", source, line)
                if dataset.ndim < 1:
                    raise ConfigError(f"HDF5 file '{path}': dataset '{top}' is a scalar; it needs a first axis "
                                      "of rows", source, line)
                shapes[top] = tuple(int(d) for d in dataset.shape)
    except OSError as error:
        raise ConfigError(f"cannot read HDF5 file '{path}' ({error})", source, line) from None
    rows = {shape[0] for shape in shapes.values()}
    if len(rows) > 1:
        counts = ", ".join(f"'{top}' {shape[0]}" for top, shape in shapes.items())
        raise ConfigError(f"HDF5 file '{path}': its datasets differ in rows ({counts})", source, line)
    return rows.pop(), {top: shape[1:] for top, shape in shapes.items()}


def row_shapes(layer_param):
    """{top: the shape of one row} of an HDF5Data layer, from its first listed file."""
    source = layer_param.hdf5_data_param.source
    path, line = read_list(source)[0]
    return file_rows(path, line, source, list(layer_param.top))[1]


def given_rows(layer_param, shape):
    """{top: the shape of one row} of an HDF5Data layer given a (C, H, W) in place of its files (`--data-shape`
    when its list is absent): its first top's rows that shape, each other top's one value (a label, as Caffe's
    HDF5 examples store it)."""
    return {top: tuple(shape) if i == 0 else () for i, top in enumerate(layer_param.top)}


class HDF5Feeder(Resumable):
    """Batches {top: float32 array} for one HDF5Data layer: rows [start, stop) of all its files together
    (shard `shard` of `num_shards`), file by file as Caffe's HDF5DataLayer goes, looping. Its state: the file
    it is in and its row there, the files' order this pass, and `rng` (which draws both orders)."""

    unit = "rows"

    def __init__(self, layer_param, shard=0, num_shards=1, seed=None, batch_size=None):
        param = layer_param.hdf5_data_param
        self.name = layer_param.name
        self.tops = list(layer_param.top)
        if not self.tops:
            raise ConfigError(f"layer {self.name!r}: an HDF5Data layer needs at least one top (a dataset name)")
        if layer_param.HasField("transform_param"):
            raise ConfigError(f"layer {self.name!r}: HDF5Data does not transform data (Caffe refuses "
                              "transform_param here)")
        self.source = param.source
        self.batch_size = int(batch_size or param.batch_size)
        if self.batch_size <= 0:
            raise ConfigError(f"layer {self.name!r}: hdf5_data_param.batch_size must be positive")
        self.shuffle = bool(param.shuffle)
        self.rng = np.random.default_rng(seed)
        files = read_list(self.source)
        pieces, total, shapes = [], 0, None
        found = [file_rows(path, line, self.source, self.tops) for path, line in files]
        for (path, line), (rows, row_shapes_) in zip(files, found):
            if shapes is None:
                shapes = row_shapes_
            elif row_shapes_ != shapes:
                raise ConfigError(f"HDF5 file '{path}' has rows of shapes {row_shapes_}, the first file {shapes}",
                                  self.source, line)
            pieces.append((path, total, total + rows))
            total += rows
        start, stop = shard_range(total, shard, num_shards)
        if stop == start:
            raise DataError(f"shard {shard} of {num_shards} is empty: the listed files hold only {total} rows",
                            self.source)
        # This shard's part of each file: (path, first row, end row), in the list's order.
        self.pieces = [(path, max(lo, start) - lo, min(hi, stop) - lo) for path, lo, hi in pieces
                       if min(hi, stop) > max(lo, start)]
        self.row_shapes = shapes
        self.size = stop - start
        self.epoch = 0
        self._files = list(range(len(self.pieces)))  # the order of this pass's pieces
        self._piece = -1  # position in _files of the loaded piece
        self._rows = None  # {top: float32 rows} of the loaded piece, in the order they are served
        self._row = 0
        self._read_from = None  # the RNG's state before the loaded piece's rows were permuted

    @property
    def shapes(self):
        return {top: (self.batch_size,) + self.row_shapes[top] for top in self.tops}

    def _load_next(self):
        """Move to the next file of this shard (a new pass after the last, its order drawn anew) and read it."""
        self._piece += 1
        if self._piece == len(self._files):
            self._piece, self.epoch = 0, self.epoch + 1
        if self._piece == 0 and self.shuffle:
            self._files = self._epoch_order()
        self._read()

    def _epoch_order(self):
        """Caffe's shuffle of HDF5Data: the files in a new order every pass (their rows permuted as each is read)."""
        return [int(i) for i in self.rng.permutation(len(self.pieces))]

    def _read(self):
        """Read the current file's rows of this shard, permuted with shuffle."""
        self._read_from = self.rng.bit_generator.state
        path, lo, hi = self.pieces[self._files[self._piece]]
        with _h5py().File(path, "r") as h5:
            rows = {top: np.asarray(h5[top][lo:hi], np.float32) for top in self.tops}
        if self.shuffle:
            permutation = self.rng.permutation(hi - lo)
            rows = {top: array[permutation] for top, array in rows.items()}
        self._rows, self._row = rows, 0

    def next_batch(self):
        batch = {top: np.empty(shape, np.float32) for top, shape in self.shapes.items()}
        filled = 0
        while filled < self.batch_size:
            if self._rows is None or self._row == len(self._rows[self.tops[0]]):
                self._load_next()
            take = min(self.batch_size - filled, len(self._rows[self.tops[0]]) - self._row)
            for top in self.tops:
                batch[top][filled:filled + take] = self._rows[top][self._row:self._row + take]
            filled += take
            self._row += take
        return batch

    def _state(self):
        """(JSON-able position, None): _restore reads the current file again, its rows permuted the same way."""
        meta = {"piece": self._piece, "row": self._row, "order": list(self._files), "rng": self.rng.bit_generator.state,
                "read_from": self._read_from if self._rows is not None else None}
        return meta, None

    def _restore(self, meta, order):
        self._files, self._piece = list(meta["order"]), int(meta["piece"])
        self._rows = None
        if meta["read_from"] is not None:
            self.rng.bit_generator.state = meta["read_from"]
            self._read()
            self._row = int(meta["row"])
        self.rng.bit_generator.state = meta["rng"]

    def close(self):
        self._rows = None


def check_listed(layer_param):
    """A one-line error at the list's line for the first file an HDF5Data layer's list names that is not there,
    or that lacks a dataset the layer's tops name."""
    source = layer_param.hdf5_data_param.source
    for path, line in read_list(source):
        file_rows(path, line, source, list(layer_param.top))


feeds("HDF5Data", make=lambda layer_param, phase, where, options: HDF5Feeder(layer_param, **where),
      param="hdf5_data_param", listed=check_listed,
      shape=lambda layer_param, given: row_shapes(layer_param) if given is None else given_rows(layer_param, given))
