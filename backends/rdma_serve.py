"""``cxlrt serve``: expose local regions to other hosts over RDMA (``rdma:``'s server).

Each served region's whole mapping is registered once as an RDMA memory region
(remote READ and WRITE). A client attaches over TCP (backends/_rdmawire.py); the
server answers with the region's address and key and gives the attachment its own
queue pair, connected to the client's. From then on the client reads and writes the
region one-sided: this process never copies a byte of it. It only watches the control
connections, and drops an attachment's queue pair the moment its client goes.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from cxlrt.backends import _rdmawire as wire
from cxlrt.liveness import boot_hash

# Each connection is a thread and, once attached, a queue pair: a bound, so that a
# flood of connections runs into a refusal rather than the process's limits.
MAX_CONNECTIONS = 1024
FIRST_MESSAGE_S = 30.0


@dataclass
class Served:
    name: str
    spec: str
    size: int
    addr: int
    backend: object
    mr: object


@dataclass
class Attachment:
    region: str
    node: int
    host: str
    peer: str
    qp: object
    claimed: bool = False  # the client announced itself as `node` (not a tool or observer)
    since: float = field(default_factory=time.monotonic)


def _keepalive(sock: socket.socket) -> None:
    """A client host that vanished without closing (power loss, cable) lets go of its
    node after about 10 s, not TCP's two hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)


def parse_region_arg(text: str) -> tuple[str, str]:
    """``NAME=SPEC`` or ``SPEC`` (named after the medium's file name)."""
    name, sep, spec = text.partition("=")
    if sep and ":" not in name and "/" not in name and name:
        return name, spec
    path = text.partition(":")[2].partition("?")[0]
    return os.path.basename(path.rstrip("/")) or "region", text


class Server:
    """Serve `regions` ({name: spec}) on `listen` (host, port).

    Parameters
    ----------
    regions : dict
        Name -> region spec. Each must be mappable (``file:``, ``numa:``, ``dax:``)
        and already formatted or created by a client (``cxlrt format``).
    listen : tuple
        (host, port) of the control socket; port 0 picks one (see :attr:`port`).
    dev, ib_port, gid :
        The RDMA device, its port and GID index (as ``rdma:``'s spec parameters).
    """

    def __init__(self, regions: dict[str, str], listen: tuple[str, int], *, dev: str = "",
                 ib_port: int = 1, gid: int = -1, log=None) -> None:
        from cxlrt import api
        from cxlrt.backends import rdma
        self.log = log or (lambda msg: print(f"cxlrt serve: {msg}", file=sys.stderr,
                                             flush=True))
        # The user's specs first: a wrong path or spec is told as such, not hidden
        # behind a missing RDMA device.
        resolved = []
        for name, spec in regions.items():
            s, cls, params, fs = api._resolve(spec)
            if s.scheme == "rdma":
                raise ValueError(f"{spec}: serve a local region, not an rdma: one")
            resolved.append((name, s, cls, params, api._medium_size(fs, str(s),
                                                                    scheme=s.scheme)))
        self.device = rdma.Device(dev, ib_port, gid)
        self.regions: dict[str, Served] = {}
        self.attached: dict[int, Attachment] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.conns: set[socket.socket] = set()
        self.epoch = int.from_bytes(os.urandom(8), "little")
        try:
            for name, s, cls, params, size in resolved:
                backend = cls(s.path, params, 0, size)
                try:
                    addr = rdma.mapped_address(backend)
                    mr = rdma.MemoryRegion(self.device, addr, size)
                except BaseException:
                    backend.close()
                    raise
                self.regions[name] = Served(name, str(s), size, addr, backend, mr)
            host, port = listen
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.create_server((host, port), family=family, backlog=64)
        except BaseException:
            self._release()
            raise
        self.port = self.sock.getsockname()[1]

    def serve_forever(self) -> None:
        """Accept clients until :meth:`stop`."""
        self.sock.settimeout(0.2)
        while not self.stopping.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.stopping.is_set():
                    break
                # Out of descriptors, a connection reset before accept: one client's
                # trouble, never a reason to drop every other client's attachment.
                self.log(f"accept: {e}; going on")
                time.sleep(0.1)
                continue
            with self.lock:
                full = len(self.conns) >= MAX_CONNECTIONS
                if not full:
                    self.conns.add(conn)
            if full:
                self.log(f"{peer[0]}:{peer[1]}: refused, {MAX_CONNECTIONS} connections open")
                try:
                    wire.send(conn, {"ok": False, "error": f"the server holds "
                                     f"{MAX_CONNECTIONS} connections; try later"})
                except OSError:
                    pass
                conn.close()
                continue
            conn.settimeout(FIRST_MESSAGE_S)  # a connection that says nothing frees its slot
            _keepalive(conn)
            threading.Thread(target=self._client, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name="cxlrt-serve-client", daemon=True).start()

    def _client(self, conn: socket.socket, peer: str) -> None:
        f = conn.makefile("rb")
        att = None
        try:
            while True:
                try:
                    msg = wire.recv(f, peer)
                except wire.RdmaServerError:
                    return
                try:
                    reply = self._answer(msg, peer, att)
                except (TypeError, ValueError, OverflowError, RecursionError) as e:
                    reply = {"ok": False, "error": f"bad request: {type(e).__name__}: {e}"}
                if isinstance(reply, Attachment):
                    att = reply
                    reply = self._attach_reply(att, msg)
                    conn.settimeout(None)  # attached: silence is its liveness from now on
                if "seq" in msg:
                    reply["seq"] = msg["seq"]
                wire.send(conn, reply)
        except OSError:
            return
        finally:
            if att is not None:
                with self.lock:
                    self.attached.pop(id(att), None)
                att.qp.close()  # the client's later requests fail at once, never land
                self.log(f"{peer}: node {att.node} detached from {att.region}")
            with self.lock:
                self.conns.discard(conn)
            f.close()
            conn.close()

    def _answer(self, msg: dict, peer: str, att):
        from cxlrt.backends import rdma
        op, name = msg.get("op"), msg.get("name")
        if not isinstance(name, str):
            return {"ok": False, "error": "a request names its region (a string)"}
        if msg.get("version") != wire.VERSION:
            return {"ok": False, "error": f"protocol version {msg.get('version')!r}; this "
                    f"server speaks {wire.VERSION}"}
        served = self.regions.get(name)
        if served is None:
            return {"ok": False, "kind": "not_found",
                    "error": f"no region named {name!r} here (serving: "
                             f"{', '.join(sorted(self.regions)) or 'none'})"}
        if op == "info":
            with self.lock:
                nodes = sorted({(a.node, a.host) for a in self.attached.values()
                                if a.region == name})
            return {"ok": True, "size": served.size, "epoch": self.epoch,
                    "attached": [{"node": n, "host": h} for n, h in nodes]}
        if op == "claim":
            return self._claim(msg, att)
        if op != "attach":
            return {"ok": False, "error": f"unknown operation {op!r}"}
        if att is not None:
            return {"ok": False, "error": "this connection is already attached"}
        node, qpn, psn, gid = (msg.get(k) for k in ("node", "qpn", "psn", "gid"))
        mtu, rd_atom = msg.get("mtu", 0), msg.get("rd_atom", 0)
        if not all(isinstance(v, int) and 0 <= v < 1 << 24 for v in (qpn, psn)) or \
                not all(isinstance(v, int) and 0 <= v < 1 << 16 for v in (node, mtu, rd_atom)) \
                or not isinstance(gid, str):
            return {"ok": False, "error": "attach needs node, qpn, psn (24-bit ints), gid, "
                                          "and optionally mtu and rd_atom"}
        qp = rdma.QueuePair(self.device)
        try:
            qp.connect(qpn, psn, gid, mtu, rd_atom)
        except (OSError, ValueError) as e:
            qp.close()
            return {"ok": False, "error": f"connecting to the client's queue pair: {e}"}
        att = Attachment(name, node, str(msg.get("host", "?")), peer, qp)
        with self.lock:
            self.attached[id(att)] = att
        self.log(f"{peer}: node {node} attached to {name}")
        return att

    def _claim(self, msg: dict, att) -> dict:
        """Node `node` is one host: refuse it while a live attachment of another host
        claims it (their processes would not share the node's local lock state)."""
        if att is None:
            return {"ok": False, "error": "claim before attach"}
        node, host, nodes = msg.get("node"), str(msg.get("host", "?")), msg.get("nodes")
        if node != att.node or host != att.host:
            return {"ok": False, "error": "claim does not match the attachment"}
        if type(nodes) is not int or not 0 <= node < nodes:
            return {"ok": False, "error": f"node {node} is not one of the region's {nodes} "
                                          "nodes"}
        with self.lock:
            for other in self.attached.values():
                if other is not att and other.claimed and other.region == att.region and \
                        other.node == node and other.host != host:
                    return {"ok": False,
                            "error": f"node {node} of {att.region} is held by host {other.host} "
                                     f"(from {other.peer}); each node is one host"}
            att.claimed = True
        return {"ok": True}

    def _attach_reply(self, att: Attachment, msg: dict) -> dict:
        served = self.regions[att.region]
        return {"ok": True, "size": served.size, "addr": served.addr, "rkey": served.mr.rkey,
                "qpn": att.qp.qpn, "psn": att.qp.psn, "gid": self.device.gid,
                "mtu": self.device.mtu, "rd_atom": self.device.rd_atom, "epoch": self.epoch,
                "boot": f"{boot_hash():016x}"}

    def stop(self, why: str = "stopped") -> None:
        """Stop accepting, tell every client, drop every queue pair, release the regions."""
        self.stopping.set()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            try:
                wire.send(c, {"op": "bye", "why": why})
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.lock:
                if not self.attached:
                    break
            time.sleep(0.01)
        try:
            self.sock.close()
        except AttributeError:
            pass
        self._release()

    def _release(self) -> None:
        for s in self.regions.values():
            s.mr.close()
            s.backend.close()
        self.regions.clear()
