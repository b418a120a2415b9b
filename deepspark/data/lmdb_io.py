"""LMDB reading by record range (shards), and writing under a temp name that is renamed at the end."""

import contextlib
import itertools
import os
import shutil
import threading

import lmdb

from deepspark.data.datum import DataError

# Caffe commits every 1000 records; so do we (it bounds what a retry after a
# full map has to redo).
COMMIT_EVERY = 1000
INITIAL_MAP_SIZE = 1 << 26  # grows by doubling; LMDB files are as large as the data, not the map


def is_lmdb(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "data.mdb"))


# py-lmdb refuses to open one environment twice in a process, and a feeder, the
# describe step and a converter may all want the same database: share one
# environment per path, counted.
_environments = {}
# Re-entrant: a feeder dropped in a reference cycle is closed by the garbage collector, which runs at whatever
# allocation comes next, in whichever thread, open_db's own (inside lmdb.open) included; its close_db then takes
# this lock in the thread that already holds it. With a plain Lock that thread waited for itself for ever (the
# suite hung there, test_data's feeders). The books stay whole: open_db reads them before lmdb.open and writes
# its own entry after it, and a close_db in between touches another path's entry (this path has none yet).
_environments_lock = threading.RLock()


def open_db(path):
    """Open an LMDB directory read-only (shared, no locks: readers only), or DataError saying why not.

    Pair every open_db with close_db(path), or use `with opened(path) as env:`.
    """
    if not os.path.exists(path):
        raise DataError("no such LMDB (create it with deepspark convert-mnist / convert-imageset, "
                        "or fix data_param.source)", path)
    if not is_lmdb(path):
        raise DataError("not an LMDB (expected a directory holding data.mdb)", path)
    real = os.path.realpath(path)
    with _environments_lock:
        entry = _environments.get(real)
        if entry is None:
            try:
                env = lmdb.open(real, readonly=True, lock=False, readahead=False, max_readers=512)
            except lmdb.Error as e:
                empty = os.path.getsize(os.path.join(real, "data.mdb")) == 0
                raise DataError(f"not a readable LMDB ({'its data.mdb is empty' if empty else _reason(e, real)})",
                                path) from None
            try:
                _check_whole(env, real, path)
            except BaseException:
                env.close()
                raise
            entry = _environments[real] = [env, 0]
        entry[1] += 1
        return entry[0]


def _reason(error, real):
    """py-lmdb's message without the path it starts with (the one line names the path once)."""
    return str(error).removeprefix(f"{real}: ")


def _check_whole(env, real, path):
    """DataError if the LMDB's data.mdb is shorter than its newest meta page says (a copy or download cut
    short): reading a page past the end of a mapped file kills the process with SIGBUS, no exception."""
    data = os.path.join(real, "data.mdb")
    size, end = os.path.getsize(data), (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if size < end:
        raise DataError(f"truncated: its data.mdb holds {size} bytes but its pages run to byte {end}; "
                        "copy or rebuild the LMDB", path)


def close_db(path):
    """Release an open_db(path); the environment closes with its last user."""
    real = os.path.realpath(path)
    with _environments_lock:
        entry = _environments.get(real)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _environments[real]
            entry[0].close()


@contextlib.contextmanager
def opened(path):
    env = open_db(path)
    try:
        yield env
    finally:
        close_db(path)


def count(path):
    """Number of records in the LMDB at path."""
    with opened(path) as env:
        return env.stat()["entries"]


def first_record(path):
    """(key, value) of the first record, or DataError if the database is empty."""
    for key, value in read_records(path, 0, 1):
        return key, value
    raise DataError("the LMDB is empty", path)


def shard_range(n_records, shard, num_shards):
    """[start, stop) of shard i of n: contiguous, sizes differ by at most one."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in 0..{num_shards - 1}")
    return n_records * shard // num_shards, n_records * (shard + 1) // num_shards


def _positioned(txn, start):
    """A cursor on record `start` (LMDB has no index by position: step over the keys), or None."""
    cursor = txn.cursor()
    if not cursor.first():
        return None
    for _ in range(start):
        if not cursor.next():
            return None
    return cursor


@contextlib.contextmanager
def _reading(path, start):
    """A cursor on record `start` (None past the end) of the LMDB at path; a page that LMDB cannot read on
    the way is one DataError naming the LMDB."""
    with opened(path) as env, env.begin(buffers=False) as txn:
        try:
            yield _positioned(txn, start)
        except lmdb.Error as e:
            raise DataError(f"corrupt LMDB: a page cannot be read ({_reason(e, os.path.realpath(path))}); "
                            "copy or rebuild it", path) from None


def read_records(path, start=0, stop=None, keys_only=False):
    """(key, value) bytes of records start..stop-1 in key order (keys only: key)."""
    with _reading(path, start) as cursor:
        if cursor is None:
            return
        items = cursor.iternext(keys=True, values=not keys_only)
        yield from (items if stop is None else itertools.islice(items, max(stop - start, 0)))


def read_chunks(path, start=0, stop=None, chunk=4096):
    """Lists of up to `chunk` (key, value) pairs of records start..stop-1, read in C."""
    with _reading(path, start) as cursor:
        if cursor is None:
            return
        items = cursor.iternext(keys=True, values=True)
        remaining = float("inf") if stop is None else stop - start
        while remaining > 0:
            block = list(itertools.islice(items, int(min(chunk, remaining))))
            if not block:
                return
            remaining -= len(block)
            yield block


# ---------------------------------------------------------------------------
# Writing

def temp_path(out_path):
    return f"{out_path.rstrip(os.sep)}.tmp-{os.getpid()}"


def refuse_existing(out_path, overwrite):
    if os.path.lexists(out_path) and not overwrite:
        raise DataError("already exists; remove it or choose another output name", out_path)
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise DataError(f"the output's directory {parent} does not exist", out_path)


def rename_into(tmp, out_path):
    """Move tmp to out_path; an existing out_path is swapped out first, then removed."""
    old = None
    if os.path.lexists(out_path):
        old = f"{out_path.rstrip(os.sep)}.old-{os.getpid()}"
        os.rename(out_path, old)
    os.rename(tmp, out_path)
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)


def remove_path(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


# While records are still being written, the pages committed so far go to disk in a thread of their
# own once this many bytes have been committed since it last started: the disk works while the records
# are read and put, and the sync before the rename finds little left to write.
FLUSH_BYTES = 64 << 20


class _Flusher:
    """fdatasync of an LMDB's data file in the background, at most one at a time (any descriptor of a
    file flushes the file's dirty pages)."""

    def __init__(self, folder):
        self.fd = os.open(os.path.join(folder, "data.mdb"), os.O_RDONLY)
        self.thread, self.pending = None, 0

    def committed(self, size):
        self.pending += size
        if self.pending >= FLUSH_BYTES and (self.thread is None or not self.thread.is_alive()):
            self.pending = 0
            self.thread = threading.Thread(target=os.fdatasync, args=(self.fd,), name="lmdb-flush", daemon=True)
            self.thread.start()

    def close(self):
        if self.thread is not None:
            self.thread.join()
        os.close(self.fd)


def write_lmdb(out_path, records, overwrite=False, map_size=INITIAL_MAP_SIZE,
               commit_every=COMMIT_EVERY):
    """Write (key, value) bytes pairs to a new LMDB at out_path; returns the record count.

    Records go to `out_path.tmp-<pid>` and are renamed to out_path only when all
    are committed and on disk, so a failed or interrupted run never leaves a
    half-written database at out_path. The map doubles whenever it fills.
    """
    refuse_existing(out_path, overwrite)
    tmp = temp_path(out_path)
    remove_path(tmp)
    written = 0
    try:
        # No sync per commit: the one env.sync at the end makes it durable before the rename publishes it.
        env = lmdb.open(tmp, map_size=map_size, subdir=True, meminit=False, sync=False)
        flusher = None
        try:
            flusher = _Flusher(tmp)
            pending, size = [], 0
            for key, value in records:
                pending.append((key.encode() if isinstance(key, str) else key, value))
                size += len(value)
                if len(pending) >= commit_every:
                    _commit(env, pending)
                    written += len(pending)
                    flusher.committed(size)
                    pending, size = [], 0
            if pending:
                _commit(env, pending)
                written += len(pending)
            env.sync(True)
        finally:
            if flusher is not None:
                flusher.close()
            env.close()
        rename_into(tmp, out_path)
    except BaseException:
        remove_path(tmp)
        raise
    return written


def _commit(env, pending):
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in pending:
                    txn.put(key, value)
            return
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)
