"""The control protocol between ``cxlrt serve`` and its ``rdma:`` clients.

One TCP connection per attachment carries JSON lines: ``info`` (the region's size),
then ``attach`` (node, this side's queue pair and GID; the reply is the region's
address, key and the server's queue pair). The connection then stays open and
silent: it is the liveness of both ends. The server drops the queue pair when the
client's end goes, and the client breaks its attachment when the server's goes.
No KV byte ever crosses it.
"""

from __future__ import annotations

import json
import socket

VERSION = 1
CONNECT_TIMEOUT_S = 5.0
MAX_LINE = 1 << 16


class RdmaServerError(ConnectionError):
    """The server refused, or broke the protocol."""


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
    except ValueError:
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


class Control:
    """An attachment's open control connection: its end is the peer's end."""

    def __init__(self, sock: socket.socket, reader) -> None:
        self.sock = sock
        self.reader = reader

    def wait_closed(self) -> str:
        """Block until the peer's end goes; why it went."""
        try:
            while True:
                line = self.reader.readline(MAX_LINE)
                if not line:
                    return "end of stream"
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("op") == "bye":
                    return f"the server shut down: {msg.get('why', '')}".rstrip(": ")
        except (OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.reader.close()
        self.sock.close()


def attach(path: str, *, node: int, qpn: int, psn: int, gid: str,
           timeout: float) -> tuple[Control, dict]:
    """Attach a queue pair; the open connection (keep it) and the server's reply."""
    from cxlrt.liveness import host_id
    sock, name = _connect(path, timeout)
    f = sock.makefile("rb")
    try:
        reply = _ask(sock, f, path, {"op": "attach", "name": name, "version": VERSION,
                                     "node": node, "host": f"{host_id():016x}",
                                     "qpn": qpn, "psn": psn, "gid": gid})
    except BaseException:
        f.close()
        sock.close()
        raise
    for key in ("size", "addr", "rkey", "qpn", "psn", "gid"):
        if key not in reply:
            f.close()
            sock.close()
            raise RdmaServerError(f"rdma:{path}: the server's reply has no {key!r}")
    sock.settimeout(None)
    return Control(sock, f), reply
