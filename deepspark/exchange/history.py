"""The workers' solver histories on the exchange server: held per worker for the driver's snapshots, asked for, and handed back to a worker as it joins (HISTORY and GET_HISTORY frames)."""

import threading
from typing import NamedTuple

import numpy as np

from deepspark import rules
from deepspark.exchange import protocol as P
from deepspark.exchange.transport import mapped


class Held(NamedTuple):
    """A worker's solver history as the server holds it: Caffe's history blobs as one float32 vector, the
    worker's iteration and current_step when it was taken, and the request it answered (0: none)."""

    vector: np.ndarray
    iteration: int
    current_step: int
    request: int


class HistoryHandler:
    """What the server loop hands HISTORY and GET_HISTORY frames to.

    floats   a worker's history: history sets (Caffe's SolverState history: 1 for SGD, 2 for Adam) ×
             the model's floats; 0 keeps none
    held     {worker id: (iteration, current_step, float32 vector)} to hold from the start (a resumed job's)

    A worker's history is what it last sent (HISTORY, unprompted or asked for by `request`),
    else what `held` gave; GET_HISTORY hands it back, or an empty HISTORY.
    """

    frames = (P.HISTORY, P.GET_HISTORY)

    def __init__(self, floats, held=None):
        self.floats = int(floats)
        self._lock = threading.Lock()
        self._held = {int(wid): Held(self._checked(vector), int(iteration), int(step), 0)
                      for wid, (iteration, step, vector) in (held or {}).items()}
        self._request = 0  # request's count: a worker is asked until it has sent one since
        self.server = None

    def attach(self, server):
        self.server = server

    def _checked(self, vector):
        vector = np.ascontiguousarray(vector, dtype=np.float32).ravel()
        if vector.size != self.floats:
            raise ValueError(f"a solver history of {vector.size} values; this server's is {self.floats}")
        return vector

    def request(self):
        """Ask every worker for its solver history: the replies to its model frames carry F_SEND_HISTORY until
        it has sent one. Returns the request's number, for since()."""
        if not self.floats:
            raise RuntimeError("this server keeps no solver history (history_sets=0)")
        with self._lock:
            self._request += 1
            return self._request

    def since(self, request=0):
        """{worker id: Held} held now, sent in answer to request `request` or later (0: any); the vectors are
        the server's own, replaced (never changed) by a newer one."""
        with self._lock:
            return {wid: held for wid, held in self._held.items() if held.request >= request}

    def reply_flags(self, worker_id):
        """F_SEND_HISTORY while a request is open for the worker, else 0."""
        if not self.floats:
            return 0
        held = self._held.get(worker_id)
        return P.F_SEND_HISTORY if (held.request if held else 0) < self._request else 0

    def serve(self, conn, h):
        """A HISTORY frame is held (verified and finite); GET_HISTORY is answered with what is held."""
        if h.type == P.HISTORY:
            self._receive(conn, h)
        else:
            self._send(conn)

    def _receive(self, conn, h):
        if not h.length:
            raise P.ProtocolError(f"empty HISTORY from worker {conn.worker_id}")
        # A mapping of its own, as a connection's buffers: model-sized, and freed when the next snapshot's replaces it.
        vector = mapped(self.floats, np.float32)
        conn.frames.receive_history(vector)  # verified before it replaces what is held
        if not rules.all_finite(vector):
            raise P.Refusal(P.E_NONFINITE, f"worker {conn.worker_id} sent a solver history holding NaN or Inf at "
                            f"iteration {h.iteration}")
        with self._lock:
            self._held[conn.worker_id] = Held(vector, h.iteration, int(h.value), self._request)
        self.server.record(conn.worker_id, history_iteration=h.iteration)

    def _send(self, conn):
        with self._lock:
            held = self._held.get(conn.worker_id)
        if held is None:
            conn.frames.send_history()
            return
        conn.frames.send_history(held.vector, held.iteration, held.current_step)
        self.server.record(conn.worker_id, restored_history=held.iteration)
