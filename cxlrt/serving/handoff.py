"""What a prefill worker tells a decode worker, as bytes: over a cxlrt Channel or TCP.

Both data planes carry the same hand-off: request id, the prompt's tokens, how
many tokens to generate, and how many full KV blocks the prefill side made
ready. They differ in where the KV travels:

- cxlrt: the message carries the blocks' cache keys ("request R: these keys are
  ready"); the KV itself stays in the shared region and decode loads it.
- TCP: the message carries the KV bytes themselves, as a NIC transfer would.

A stop message (request id ``STOP``) tells a decode worker that this sender is
done.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import numpy as np

STOP = (1 << 64) - 1
KEY_BYTES = 16  # cxlrt.block_hashes keys

# rid, n_blocks, n_tokens, n_new, kv_nbytes (TCP only; 0 in channel messages)
_HEADER = struct.Struct("<QIIIQ")


@dataclass
class Handoff:
    """One request handed from prefill to decode.

    Parameters
    ----------
    rid : int
        Request id (``STOP`` ends the sender's stream).
    tokens : numpy.ndarray
        The prompt, int32.
    n_new : int
        Tokens to generate.
    n_blocks : int
        Full KV blocks the prefill side made ready (cxlrt) or sent (TCP).
    keys : list of bytes
        cxlrt only: the cache keys of those blocks.
    """

    rid: int
    tokens: np.ndarray
    n_new: int
    n_blocks: int
    keys: list[bytes]

    @property
    def is_stop(self) -> bool:
        return self.rid == STOP


def stop() -> Handoff:
    return Handoff(STOP, np.zeros(0, np.int32), 0, 0, [])


def message_bytes(max_tokens: int, block_tokens: int) -> int:
    """Largest channel message for prompts of up to ``max_tokens`` tokens."""
    return _HEADER.size + (max_tokens // block_tokens) * KEY_BYTES + 4 * max_tokens


# --- cxlrt channel messages --------------------------------------------------------


def encode(h: Handoff) -> bytes:
    """The channel message for ``h``: header, keys, tokens."""
    if any(len(k) != KEY_BYTES for k in h.keys):
        raise ValueError(f"cache keys must be {KEY_BYTES} bytes")
    return b"".join([_HEADER.pack(h.rid, len(h.keys), len(h.tokens), h.n_new, 0), *h.keys,
                     np.ascontiguousarray(h.tokens, dtype="<i4").tobytes()])


def decode(msg: bytes) -> Handoff:
    """Parse a channel message; ValueError when it is truncated or malformed."""
    if len(msg) < _HEADER.size:
        raise ValueError(f"hand-off message of {len(msg)} bytes is shorter than its header")
    rid, n_keys, n_tokens, n_new, _ = _HEADER.unpack_from(msg)
    want = _HEADER.size + n_keys * KEY_BYTES + 4 * n_tokens
    if len(msg) != want:
        raise ValueError(f"hand-off message of {len(msg)} bytes; its header says {want}")
    off = _HEADER.size
    keys = [msg[off + i * KEY_BYTES: off + (i + 1) * KEY_BYTES] for i in range(n_keys)]
    tokens = np.frombuffer(msg, dtype="<i4", count=n_tokens,
                           offset=off + n_keys * KEY_BYTES).astype(np.int32)
    return Handoff(rid, tokens, n_new, n_keys, keys)


# --- TCP framing -------------------------------------------------------------------


def send_tcp(sock: socket.socket, h: Handoff, kv: memoryview | list[memoryview] | None) -> int:
    """Send ``h`` and its KV bytes (one buffer, or blocks in order); returns the KV bytes
    sent."""
    parts = [] if kv is None else kv if isinstance(kv, list) else [kv]
    nbytes = sum(p.nbytes for p in parts)
    tokens = np.ascontiguousarray(h.tokens, dtype="<i4").tobytes()
    sock.sendall(_HEADER.pack(h.rid, h.n_blocks, len(h.tokens), h.n_new, nbytes) + tokens)
    for p in parts:
        sock.sendall(p)
    return nbytes


def recv_tcp_header(sock: socket.socket) -> tuple[Handoff, int]:
    """Read one hand-off up to its KV bytes; returns it and how many KV bytes follow.

    The caller reads those into its KV buffer with :func:`recv_into`.
    """
    head = bytearray(_HEADER.size)
    recv_into(sock, memoryview(head))
    rid, n_blocks, n_tokens, n_new, nbytes = _HEADER.unpack(head)
    tokens = np.empty(n_tokens, dtype="<i4")
    recv_into(sock, tokens.data.cast("B"))
    return Handoff(rid, tokens.astype(np.int32), n_new, n_blocks, []), nbytes


def recv_into(sock: socket.socket, buf: memoryview) -> None:
    """Fill ``buf`` from ``sock``; ConnectionError if the peer closes first."""
    got = 0
    while got < buf.nbytes:
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of "
                                  f"{buf.nbytes} bytes")
        got += n
