"""The control protocol between ``cxlrt serve`` and its ``rdma:`` clients.

One TCP connection per attachment carries JSON lines: ``info`` (the region's size),
then ``attach`` (node, this side's queue pair and GID; the reply is the region's
address, key and the server's queue pair). The connection then stays open and
silent: it is the liveness of both ends. The server drops the queue pair when the
client's end goes, and the client breaks its attachment when the server's goes.
No KV byte ever crosses it.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import socket
import weakref

VERSION = 1
CONNECT_TIMEOUT_S = 5.0
MAX_LINE = 1 << 16


class RdmaServerError(ConnectionError):
    """The server refused, or broke the protocol."""


class ConnectionLost(RdmaServerError):
    """The control connection ended before the server answered (nothing was refused)."""


class ClaimRefused(RdmaServerError):
    """The server refused this host's claim of a node (another host holds it)."""


def split(path: str) -> tuple[str, int, str]:
    """``HOST:PORT/NAME`` -> (host, port, name); IPv6 hosts go in brackets."""
    where, sep, name = path.partition("/")
    if not sep or not name:
        raise ValueError(f"rdma:{path}: expected rdma:HOST:PORT/NAME (NAME: a region the "
                         "server serves, see `cxlrt serve --help`)")
    if where.startswith("["):
        host, _, rest = where[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rdma:{path}: expected HOST:PORT before '/', got {where!r}")
    return host, int(port), name


def send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


def recv(f, what: str) -> dict:
    """One message from the buffered reader `f`; RdmaServerError on EOF or junk."""
    line = f.readline(MAX_LINE)
    if not line:
        raise RdmaServerError(f"{what}: the connection closed")
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        raise RdmaServerError(f"{what}: not a protocol message: {line[:80]!r}") from None
    if not isinstance(msg, dict):
        raise RdmaServerError(f"{what}: not a protocol message: {line[:80]!r}")
    return msg


def _connect(path: str, timeout: float) -> tuple[socket.socket, str]:
    host, port, name = split(path)
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout, CONNECT_TIMEOUT_S))
    except ConnectionRefusedError:
        raise ConnectionRefusedError(
            f"rdma:{path}: nothing listens on {host}:{port} (is `cxlrt serve` running "
            "there?)") from None
    except OSError as e:
        raise ConnectionError(f"rdma:{path}: cannot reach {host}:{port}: {e}") from None
    sock.settimeout(timeout)
    return sock, name


def _ask(sock: socket.socket, f, path: str, msg: dict) -> dict:
    send(sock, msg)
    try:
        reply = recv(f, f"rdma:{path}")
    except TimeoutError:
        raise TimeoutError(f"rdma:{path}: the server did not answer {msg['op']!r} in time") \
            from None
    if not reply.get("ok"):
        err = reply.get("error", "no reason given")
        if reply.get("kind") == "not_found":
            raise FileNotFoundError(f"rdma:{path}: {err}")
        raise RdmaServerError(f"rdma:{path}: the server refused: {err}")
    return reply


def info(path: str, timeout: float = CONNECT_TIMEOUT_S) -> dict:
    """The served region's size and the server's identity."""
    sock, name = _connect(path, timeout)
    with sock, sock.makefile("rb") as f:
        return _ask(sock, f, path, {"op": "info", "name": name, "version": VERSION})


_open: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child's copies of our connections would keep them open after the parent
    # died, and the server would keep the parent's queue pairs and node claims.
    for c in list(_open):
        c.sock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Control:
    """An attachment's open control connection: its end is the peer's end."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.replies: queue.Queue = queue.Queue()
        self.seq = itertools.count(1)
        _open.add(self)

    def wait_closed(self) -> str:
        """Read the connection until the peer's end goes (one thread does, for good);
        why it went. Replies to :meth:`ask` are handed over on the way. Plain recv, no
        buffered reader: close() from another thread (or a dealloc at interpreter
        exit, with this thread frozen inside) must never wait for a reader's lock."""
        buf = b""
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    return "end of stream"
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        msg = json.loads(line)
                    except (ValueError, RecursionError):
                        continue
                    if not isinstance(msg, dict):
                        continue
                    if msg.get("op") == "bye":
                        return f"the server shut down: {msg.get('why', '')}".rstrip(": ")
                    self.replies.put(msg)
                if len(buf) > MAX_LINE:
                    return "a protocol line too long"
        except (OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            self.replies.put(None)

    def ask(self, msg: dict, timeout: float) -> dict:
        """Send `msg` and wait for the server's reply (wait_closed must be running).
        Replies carry the request's sequence number: a late answer to an earlier ask
        that timed out is dropped, never taken for this one's."""
        seq = next(self.seq)
        try:
            send(self.sock, {"version": VERSION, "name": split(self.path)[2], "seq": seq,
                             **msg})
        except OSError as e:  # shut down by an access that met an outage, or reset
            raise ConnectionLost(f"rdma:{self.path}: the connection closed before "
                                 f"{msg['op']!r} ({e})") from None
        while True:
            try:
                reply = self.replies.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"rdma:{self.path}: the server did not answer "
                                   f"{msg['op']!r} in {timeout} s") from None
            if reply is None or reply.get("seq", seq) == seq:
                break
        if reply is None:
            raise ConnectionLost(f"rdma:{self.path}: the connection closed during "
                                 f"{msg['op']!r}")
        if not reply.get("ok"):
            raise RdmaServerError(f"rdma:{self.path}: the server refused: "
                                  f"{reply.get('error', 'no reason given')}")
        return reply

    def close(self, hang_up: bool = True) -> None:
        """Close our end; `hang_up` also ends the connection for the peer (not from a
        forked child, whose descriptor is its parent's connection too)."""
        # Also from a dealloc at interpreter exit, when the GC may have cleared us first.
        sock = getattr(self, "sock", None)
        if sock is None:
            return
        if hang_up:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader's recv
            except OSError:
                pass
        sock.close()


def attach(path: str, *, node: int, qpn: int, psn: int, gid: str, timeout: float,
           host: str | None = None, mtu: int = 0, rd_atom: int = 0,
           claim: int | None = None) -> tuple[Control, dict]:
    """Attach a queue pair; the open connection (keep it) and the server's reply.

    `claim` (the region's node count) also claims the node, before anyone else reads
    the connection: a reconnect restores its claim in the same handshake."""
    if host is None:
        from cxlrt.liveness import claim_id
        host = f"{claim_id():016x}"
    sock, name = _connect(path, timeout)
    f = sock.makefile("rb")
    try:
        reply = _ask(sock, f, path, {"op": "attach", "name": name, "version": VERSION,
                                     "node": node, "host": host, "qpn": qpn, "psn": psn,
                                     "gid": gid, "mtu": mtu, "rd_atom": rd_atom})
    except BaseException:
        f.close()
        sock.close()
        raise
    for key in ("size", "addr", "rkey", "qpn", "psn", "gid"):
        if key not in reply:
            f.close()
            sock.close()
            raise RdmaServerError(f"rdma:{path}: the server's reply has no {key!r}")
    if claim is not None:
        try:
            _ask(sock, f, path, {"op": "claim", "name": name, "version": VERSION,
                                 "node": node, "nodes": claim, "host": host})
        except RdmaServerError as e:
            f.close()
            sock.close()
            if "refused" in str(e):
                raise ClaimRefused(str(e)) from None
            raise
        except BaseException:
            f.close()
            sock.close()
            raise
    f.close()  # the server says nothing more until asked: no bytes are left in it
    sock.settimeout(None)
    return Control(sock, path), reply
