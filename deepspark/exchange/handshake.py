"""The exchange's handshake, both sides: HELLO, CHALLENGE, AUTH (the job's secret and the model's fingerprint), WELCOME, and the session keys that seal the connection after it."""

from deepspark.exchange import protocol as P
from deepspark.exchange.transport import send_frame


def refused(conn, h):
    """An ERROR frame whose header `h` was read, as the RefusedError it means (NonFiniteError-like codes are the
    caller's to map); None for any other frame."""
    if h.type != P.ERROR:
        return None
    return P.RefusedError(h.flags, P.decode_error(conn.read_small(h.length)))


def authenticate(conn, secret, fingerprint, shapes, codec="float32", on_hello=None):
    """The server's side up to WELCOME: the peer proves it holds `secret`, speaks `codec` and was built with the
    model of `fingerprint` (blob `shapes`), else Refusal; (its worker id, the session keys (c2s, s2c)).
    on_hello() runs once a whole HELLO is in (the server's admission ranks such a peer above one still sending it)."""
    h = conn.read_header(None)
    if h.type != P.HELLO:
        raise P.ProtocolError(f"expected HELLO, got {P.TYPE_NAMES[h.type]}")
    wid = h.worker_id
    client_nonce = bytes(conn.read_small(h.length))
    if on_hello is not None:
        on_hello()
    server_nonce = P.new_nonce()
    proof = P.server_proof(secret, client_nonce, server_nonce, wid)
    send_frame(conn.sock, P.encode_header(P.CHALLENGE, wid, length=len(server_nonce) + len(proof)),
               server_nonce + proof)
    h = conn.read_header(None)
    if h.type != P.AUTH or h.worker_id != wid:
        raise P.ProtocolError(f"expected AUTH from worker {wid}, got {P.TYPE_NAMES[h.type]} from worker {h.worker_id}")
    auth = conn.read_small(h.length)
    their_proof, bound = bytes(auth[:P.PROOF_SIZE]), bytes(auth[P.PROOF_SIZE:])  # bound: codec id, fingerprint
    if not P.proofs_match(their_proof, P.client_proof(secret, client_nonce, server_nonce, wid, bound)):
        raise P.Refusal(P.E_AUTH, f"authentication failed: worker {wid} does not hold this job's secret")
    their_codec, their_fp = P.CODEC_NAMES.get(bound[0], f"unknown (id {bound[0]})"), bound[1:]
    if their_codec != codec:
        raise P.Refusal(P.E_FINGERPRINT, f"codec mismatch: the server exchanges {codec}, worker {wid} {their_codec}")
    if their_fp != fingerprint:
        mine = P.describe_shapes(P.shapes_size(shapes), shapes)
        try:
            theirs = P.describe_shapes(*P.parse_fingerprint(their_fp))
        except P.ProtocolError as e:
            theirs = f"a malformed fingerprint ({e})"
        raise P.Refusal(P.E_FINGERPRINT, f"model mismatch: the server holds {mine}, worker {wid} was built with "
                        f"{theirs}")
    return wid, P.session_keys(secret, client_nonce, server_nonce, wid)


def welcome(conn, wid, iteration, keys=None):
    """WELCOME the authenticated worker to start at `iteration`; sealed from then on under `keys` (None: not)."""
    send_frame(conn.sock, P.encode_header(P.WELCOME, wid, iteration=iteration))
    if keys is not None:
        c2s, s2c = keys
        conn.seal(send_key=s2c, recv_key=c2s)


def join(conn, secret, wid, fingerprint, integrity, where):
    """The client's side on a new socket: prove `secret` and `fingerprint` (the codec's id, then the model's
    fingerprint) as worker `wid` to the
    server at `where` ("host:port"), and check its proof; the iteration it welcomes the worker at. A
    server's ERROR becomes RefusedError; with `integrity` the connection is sealed after."""
    conn.unseal()  # a new socket: its handshake is untagged
    nonce = P.new_nonce()
    conn.send(P.HELLO, nonce)
    h = _reply(conn)
    if h.type != P.CHALLENGE:
        raise P.ProtocolError(f"expected CHALLENGE, got {P.TYPE_NAMES[h.type]}")
    reply = conn.read_small(h.length)
    server_nonce, proof = bytes(reply[:P.NONCE_SIZE]), bytes(reply[P.NONCE_SIZE:])
    server_ok = P.proofs_match(proof, P.server_proof(secret, nonce, server_nonce, wid))
    # Our proof goes out even when the server's failed: it is bound to this
    # server's nonce, so it is useless elsewhere, and it lets a real server
    # with a different secret say so (and log it) instead of seeing a hang-up.
    conn.send(P.AUTH, P.client_proof(secret, nonce, server_nonce, wid, fingerprint) + fingerprint)
    h = _reply(conn)
    if not server_ok:
        raise P.RefusedError(P.E_AUTH, f"the server at {where} does not hold this job's secret")
    if h.type != P.WELCOME:
        raise P.ProtocolError(f"expected WELCOME, got {P.TYPE_NAMES[h.type]}")
    if integrity:
        c2s, s2c = P.session_keys(secret, nonce, server_nonce, wid)
        conn.seal(send_key=c2s, recv_key=s2c)
    return h.iteration


def _reply(conn):
    h = conn.read_header(None)
    error = refused(conn, h)
    if error is not None:
        raise error
    return h
