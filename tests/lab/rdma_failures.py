"""rdma: failures, run in a lab guest with SoftRoCE on lo (tests/test_lab.py).

Each case prints ``PASS <case> (<seconds> s)`` or raises. The bound every failure
must meet is BOUND_S: the backend's access timeout (rdma:'s `timeout`, 5 s by
default) plus the TCP connect timeout, with room for a TCG guest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import cxlrt
from cxlrt.check import check, repair
from cxlrt.errors import RegionError

PY = sys.executable
PORT = 7480
BOUND_S = 10.0
FILE = "/tmp/rdma-fail-region"


def start_server(name="r0"):
    log = open(f"/tmp/rdma-fail-{PORT}.log", "ab")
    p = subprocess.Popen([PY, "-m", "cxlrt", "serve", f"{name}=file:{FILE}", "--listen",
                          f"127.0.0.1:{PORT}"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            cxlrt.inspect(f"rdma:127.0.0.1:{PORT}/{name}")
            return p
        except (ConnectionError, OSError, RegionError):
            if p.poll() is not None:
                raise RuntimeError(f"the server exited ({p.returncode})") from None
            time.sleep(0.1)
    raise RuntimeError("the server did not come up")


def timed(case, fn):
    t = time.monotonic()
    fn()
    dt = time.monotonic() - t
    assert dt < BOUND_S, f"{case}: took {dt:.1f} s, over the {BOUND_S} s bound"
    print(f"PASS {case} ({dt:.2f} s)", flush=True)


def expect(exc, fn, match=""):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"expected {match!r} in {e!r}"
        return e
    raise AssertionError(f"expected {exc.__name__}")


def main():
    spec = f"rdma:127.0.0.1:{PORT}/r0"
    if os.path.exists(FILE):
        os.unlink(FILE)
    cxlrt.format(f"file:{FILE}", size="16M", nodes=4)

    timed("connection refused", lambda: expect(
        ConnectionRefusedError, lambda: cxlrt.open(spec, node=1), "nothing listens"))

    server = start_server()
    timed("unknown region", lambda: expect(
        FileNotFoundError, lambda: cxlrt.open(spec.replace("/r0", "/nope"), node=1),
        "no region named 'nope'"))
    timed("wrong geometry", lambda: expect(
        RegionError, lambda: cxlrt.open(spec, node=1, size="16M", nodes=8), "nodes"))
    timed("node id outside the region", lambda: expect(
        Exception, lambda: cxlrt.open(spec, node=4), "node"))

    # Node 1 held by this host: another host's claim of it is refused (each node is one
    # host). The other host is played through the protocol itself.
    import threading

    from cxlrt.backends import _rdmawire as wire
    from cxlrt.backends import rdma
    holder = cxlrt.open(spec, node=1)
    dev = rdma.Device()
    qp = rdma.QueuePair(dev)
    conn, _ = wire.attach(spec.partition(":")[2], node=1, qpn=qp.qpn, psn=qp.psn, gid=dev.gid,
                          timeout=5, host="00000000deadbeef")
    threading.Thread(target=conn.wait_closed, daemon=True).start()
    timed("node held by another host", lambda: expect(
        wire.RdmaServerError,
        lambda: conn.ask({"op": "claim", "node": 1, "nodes": 4, "host": "00000000deadbeef"}, 5),
        "held by host"))
    conn.close()
    qp.close()
    holder.close()

    # Zero copy through a registered buffer, and an unregistered one beside it (above or
    # below it in memory) through staging: both exact, neither breaks the attachment.
    import numpy as np
    z = cxlrt.open(spec, node=2)
    blob = np.frombuffer(os.urandom(3 << 20), np.uint8)
    zoff = z.alloc(blob.nbytes)
    z.dma_write(zoff, blob)
    reg = np.zeros(blob.nbytes, np.uint8)
    others = [np.zeros(blob.nbytes, np.uint8) for _ in range(3)]
    z.backend.register(reg)

    def zero_copy():
        before = z.backend.stats()["direct_bytes"]
        for buf in (reg, *others):
            z.dma_read_into(zoff, buf)
            assert (buf == blob).all()
        assert z.backend.failure() is None, z.backend.failure()
        # Only the registered buffer went straight into place.
        assert z.backend.stats()["direct_bytes"] - before == blob.nbytes
    timed("registered and unregistered buffers", zero_copy)
    z.backend.unregister(reg)
    z.free(zoff)
    z.close()

    # A key that is no longer valid: the server side checks every request against the
    # registered region's key; a wrong one completes with a remote access error.
    r = cxlrt.open(spec, node=1)
    off = r.alloc(4096)
    r.dma_write(off, b"x" * 4096)
    r.backend._set_rkey(r.backend.server["rkey"] ^ 0x5A5A)

    def bad_key():
        e = expect(OSError, lambda: r.dma_read(off, 4096))
        assert "remote access error" in r.backend.failure(), r.backend.failure()
        # Broken for good: the next access fails at once, with the same reason.
        t = time.monotonic()
        expect(OSError, lambda: r.dma_read(off, 8))
        assert time.monotonic() - t < 0.5
        return e
    timed("corrupted key", bad_key)
    r.close()

    # The server killed while a client holds a lock: the client's next access fails
    # within the bound, and its hold is broken like a stalled node's once the server
    # is back (the region file is the same; the keys are new).
    a = cxlrt.open(spec, node=1)
    lock = a.lock("held")
    lock.acquire()
    blk = a.alloc(1 << 16)
    a.dma_write(blk, os.urandom(1 << 16))
    server.send_signal(signal.SIGKILL)
    server.wait()

    def server_gone():
        expect(OSError, lambda: a.dma_read(blk, 1 << 16))
        assert a.backend.failure() is not None
    timed("server killed", server_gone)

    server = start_server()
    b = cxlrt.open(spec, node=2)
    lease = b.lease_ms / 1000

    def fenced():
        lb = b.lock("held")
        assert lb.acquire(timeout=lease * 5 + 5), "the dead attachment's hold was not broken"
        lb.release()
    timed("hold of a cut-off client broken", fenced)
    try:
        lock.release()
    except (OSError, cxlrt.CxlrtError) as e:
        print(f"PASS cut-off client cannot release ({type(e).__name__})", flush=True)
    else:
        raise AssertionError("a client cut off from the server released a lock")
    b.close()
    try:
        a.close()
    except Exception:  # noqa: BLE001  (a broken attachment may refuse a clean detach)
        pass

    repair(spec, 1)  # the cut-off node: dead to the region, its leftovers reclaimed
    problems = check(spec)["problems"]
    assert not problems, problems
    print("PASS cxlrt check after the restart", flush=True)

    # The server stopped cleanly tells its clients at once.
    c = cxlrt.open(spec, node=3)
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)

    def told():
        deadline = time.monotonic() + BOUND_S
        while c.backend.failure() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "shut down" in (c.backend.failure() or ""), c.backend.failure()
    timed("server stopped", told)
    try:
        c.close()
    except Exception:  # noqa: BLE001
        pass
    print("rdma failures: all passed", flush=True)


if __name__ == "__main__":
    main()
