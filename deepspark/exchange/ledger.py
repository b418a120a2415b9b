"""The job's ledger of record blocks (work stealing): each job epoch, every block of every worker's record range is claimed by exactly one worker, its own range's first and then the range most behind, from the back."""

import collections
import threading
from typing import NamedTuple

import numpy as np


class Grant(NamedTuple):
    """One block claimed: records [first, first + count) of the source, of worker `owner`'s range, in job epoch
    `epoch`; `ticket` names it when its claimer reports it read (or it goes back)."""

    ticket: int
    epoch: int
    owner: int
    first: int
    count: int


class Ledger:
    """The blocks of a job's record ranges and who claimed them, epoch by epoch (thread-safe).

    ranges   per worker (its id the index): its record range [start, stop) of the source
    block    records per block (the feeder's: data.feeder.records_per_block); a range's last block may be shorter
    seed     seeds each epoch's order of every range's blocks (with shuffle); None: unseeded
    shuffle  False: each range's blocks in order (data_order SOURCE)

    A worker claims its own range's next unclaimed block; when none is left, the last unclaimed block of the range
    with the most left (the one most behind), so that a straggler's blocks go from the end it reaches last. When
    every block of epoch e is claimed, epoch e + 1 begins: whatever the workers' speeds, each record is claimed
    once a job epoch and no worker waits. A worker reports the blocks it has read (their tickets) with its next
    claim; those it holds unread go back (give_back: its connection was lost, or it joined again, its process
    having started over) and are handed out first, so that the epoch they are of is read whole, those of their
    records it had read read again; a worker done training (keep) leaves its blocks claimed.
    """

    def __init__(self, ranges, block, seed=None, shuffle=True):
        self.ranges = [(int(start), int(stop)) for start, stop in ranges]
        if not self.ranges or any(stop <= start for start, stop in self.ranges):
            raise ValueError(f"a ledger needs non-empty record ranges, got {ranges!r}")
        self.block = int(block)
        if self.block < 1:
            raise ValueError(f"a block holds at least one record, got {block!r}")
        self.blocks = [-(-(stop - start) // self.block) for start, stop in self.ranges]
        self.seed, self.shuffle = seed, shuffle
        self._lock = threading.Lock()
        self._tickets = 0
        self._returned = collections.deque()  # (epoch, owner, number) given back: handed out first
        self._held = {}  # worker -> {ticket: (epoch, owner, number)} claimed, not yet reported read
        self.read = collections.defaultdict(collections.Counter)  # epoch -> {(owner, number): times reported read}
        self.taken = collections.defaultdict(collections.Counter)  # worker -> {owner: records taken of its range}
        self.returned = 0  # blocks given back so far
        self._begin(0)

    @property
    def workers(self):
        return len(self.ranges)

    def _begin(self, epoch):
        """Epoch `epoch`'s unclaimed blocks: per range, its block numbers in the epoch's order."""
        self.epoch = epoch
        rng = np.random.default_rng(None if self.seed is None else (self.seed, epoch))
        self._open = [collections.deque(rng.permutation(n).tolist() if self.shuffle else range(n))
                      for n in self.blocks]

    def grant_of(self, ticket, epoch, owner, number):
        start, stop = self.ranges[owner]
        first = start + number * self.block
        return Grant(ticket, epoch, owner, first, min(self.block, stop - first))

    def _next(self, worker):
        """(epoch, owner, number) of the block `worker` claims next."""
        if self._returned:
            return self._returned.popleft()
        if not any(self._open):
            self._begin(self.epoch + 1)
        own = self._open[worker]
        if own:
            return self.epoch, worker, own.popleft()
        behind = max(range(self.workers), key=lambda owner: len(self._open[owner]))  # the first, of a tie
        return self.epoch, behind, self._open[behind].pop()

    def claim(self, worker, wanted, done=()):
        """`wanted` blocks for `worker` (a list of Grant), once the blocks of tickets `done` are counted as read by
        it; ValueError (nothing changed) for a worker not of the job or a ticket it does not hold."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} has no record range (the job's ledger has {self.workers})")
        with self._lock:
            held = self._held.setdefault(worker, {})
            unknown = [ticket for ticket in done if ticket not in held]
            if unknown or len(set(done)) != len(done):
                raise ValueError(f"worker {worker} reports block {(unknown or list(done))[0]} read, which it does "
                                 "not hold (or reports it twice)")
            for ticket in done:
                epoch, owner, number = held.pop(ticket)
                self.read[epoch][owner, number] += 1
            grants = []
            for _ in range(wanted):
                epoch, owner, number = self._next(worker)
                self._tickets += 1
                held[self._tickets] = (epoch, owner, number)
                grant = self.grant_of(self._tickets, epoch, owner, number)
                if owner != worker:
                    self.taken[worker][owner] += grant.count
                grants.append(grant)
            return grants

    def give_back(self, worker):
        """The blocks `worker` holds unread go back, handed out first (oldest epoch first); how many."""
        with self._lock:
            held = self._held.pop(worker, {})
            for epoch, owner, number in held.values():
                start, stop = self.ranges[owner]
                count = min(self.block, stop - start - number * self.block)
                if owner != worker:
                    self.taken[worker][owner] -= count
            self._returned.extend(sorted(held.values()))
            self._returned = collections.deque(sorted(self._returned))
            self.returned += len(held)
            return len(held)

    def keep(self, worker):
        """`worker` is done training: the blocks it holds stay claimed, read in part (given back, another would read
        again what it read of them); the epoch they are of ends short by what it left unread."""
        with self._lock:
            self._held.pop(worker, None)

    def epochs(self):
        """Per job epoch begun: (records read, records in an epoch, whether some block was read twice)."""
        total = sum(stop - start for start, stop in self.ranges)
        with self._lock:
            out = []
            for epoch in range(self.epoch + 1):
                read = self.read.get(epoch, {})
                records = sum(self.grant_of(0, epoch, owner, number).count for owner, number in read)
                out.append((records, total, any(times > 1 for times in read.values())))
            return out

    def line(self):
        """The end's line: the job epochs read whole, and how many records each worker took of others' ranges."""
        epochs = self.epochs()
        whole = sum(read == total and not twice for read, total, twice in epochs)
        twice = [epoch for epoch, (_, _, again) in enumerate(epochs) if again]
        short = [f"epoch {epoch}: {read} read" for epoch, (read, total, _) in enumerate(epochs) if read < total]
        with self._lock:
            taken = {worker: dict(by_owner) for worker, by_owner in self.taken.items()}
        parts = []
        for worker in range(self.workers):
            took = {owner: n for owner, n in taken.get(worker, {}).items() if n}
            parts.append(f"worker {worker} " + (", ".join(f"{n} of worker {owner}'s" for owner, n in sorted(took.items()))
                                               if took else "none of the others'"))
        return (f"Records read through the job's ledger (blocks of {self.block} records): {whole} of {len(epochs)} "
                f"job epochs of {epochs[0][1]} begun read whole, each record once"
                + (f" ({', '.join(short)} when the job ended)" if short else "")
                + (f"; read twice in epoch(s) {', '.join(map(str, twice))}" if twice else "")
                + f"; taken from others' ranges: {'; '.join(parts)}"
                + (f"; {self.returned} blocks went back from workers that left" if self.returned else ""))
