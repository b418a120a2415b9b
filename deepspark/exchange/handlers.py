"""What an application of the exchange server is (Handler): the algorithms' handlers (deepspark.algorithms) serve one model frame type each, on decoded float32 arrays."""

import contextlib


class Handler:
    """What an application adds to ExchangeServer's one loop; the server calls it from each worker's connection thread.

    frame      the model frame type it serves (the other one is refused)
    kind       what that makes the server, for the refusal ("a synchronous")
    scratch    floats of scratch space each connection needs (Connection.allocate)
    copy_lock  held while ExchangeServer.pull() copies the center
    send_lock  held while the reply to a PULL frame sends the center
    """

    frame = None
    kind = None
    scratch = 0
    copy_lock = send_lock = contextlib.nullcontext()
    server = center = None

    def attach(self, server, center):
        """Serve `server`, whose center x̃ is the array `center` (called once, before it starts)."""
        if self.server is not None:
            raise ValueError("a handler serves one server; make one per ExchangeServer")
        self.server, self.center = server, center

    def serve(self, conn, header):
        """Answer one `frame` frame whose header has been read, through the connection's frames (conn.frames:
        float32 arrays in and out, whatever the codec); raise protocol.Declined to refuse the frame and go on,
        protocol.Refusal to end the connection."""
        raise NotImplementedError

    def start_iteration(self, worker_id):
        """The iteration a (re)joining worker starts at; None for its own last reported one
        (resume_iteration when the id is new). Never called under the server's bookkeeping lock."""
        return None

    def left(self, worker_id):
        """An authenticated worker's connection has ended."""
