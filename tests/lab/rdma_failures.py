"""rdma: failures, run in a lab guest with SoftRoCE on lo (tests/test_lab.py).

Each case prints ``PASS <case> (<seconds> s)`` or raises. The bound every failure
must meet is BOUND_S: the backend's access timeout (rdma:'s `timeout`, 5 s by
default) plus the TCP connect timeout, with room for a TCG guest; with reconnecting
on, the bound is the `reconnect` window plus that.

The server serves two regions: r0 (the default 2 s lease) and r1 (a 60 s lease, so
that an outage of a few seconds stays inside it).
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
FILE1 = "/tmp/rdma-fail-region1"


def start_server(name="r0", boot=None):
    """`cxlrt serve` of both regions; `boot` stands in for its host's boot id (a server
    host that restarted, without restarting the guest)."""
    log = open(f"/tmp/rdma-fail-{PORT}.log", "ab")
    cmd = [PY, "-m", "cxlrt"]
    if boot is not None:
        cmd = [PY, "-c", f"import cxlrt.liveness as l; l.boot_hash = lambda: {boot}; "
               "import sys; from cxlrt.cli import main; sys.exit(main(sys.argv[1:]))"]
    p = subprocess.Popen(cmd + ["serve", f"r0=file:{FILE}", f"r1=file:{FILE1}",
                                "--listen", f"127.0.0.1:{PORT}"], stdout=log,
                         stderr=subprocess.STDOUT)
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


def bounded(fn, s):
    """fn() in a thread that must end within s seconds (a wait that never ends fails
    here rather than at pytest's timeout); fn's exception is raised here."""
    import threading
    box = []

    def run():
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001  re-raised below
            box.append((False, e))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(s)
    assert box, f"still waiting after {s} s"
    ok, v = box[0]
    if not ok:
        raise v
    return v


def kill(server):
    server.send_signal(signal.SIGKILL)
    server.wait()


def main():
    spec = f"rdma:127.0.0.1:{PORT}/r0"
    spec0 = spec + "?reconnect=0"  # the first failure breaks the attachment for good
    spec1 = f"rdma:127.0.0.1:{PORT}/r1"
    for f in (FILE, FILE1):
        if os.path.exists(f):
            os.unlink(f)
    cxlrt.format(f"file:{FILE}", size="16M", nodes=4)
    cxlrt.format(f"file:{FILE1}", size="16M", nodes=4, lease=60)

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
    # The server checks the node against the count itself, not only Region's attach.
    timed("node outside the count refused by the server", lambda: expect(
        wire.RdmaServerError,
        lambda: conn.ask({"op": "claim", "node": 1, "nodes": 1, "host": "00000000deadbeef"}, 5),
        "not one of the region's 1 nodes"))
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
    r = cxlrt.open(spec0, node=1)
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

    # With reconnecting on, a READ refused for its key is a clean break: the attachment
    # is made again, with the server's key, and the read goes on. An observer: no beat
    # thread reads with the bad key first (and repairs it by its own reconnect).
    r = cxlrt.open(spec, node=1, observer=True)
    r.backend._set_rkey(r.backend.server["rkey"] ^ 0x5A5A)

    def key_renewed():
        assert r.dma_read(off, 4096) == b"x" * 4096
        assert r.backend.failure() is None, r.backend.failure()
        assert r.backend.stats()["reconnects"] == 1, r.backend.stats()
    timed("corrupted key renewed by a reconnect", key_renewed)
    # A WRITE refused for its key may not be repeated (a WRITE can land after its
    # failure): broken for good, whatever the window.
    r.backend._set_rkey(r.backend.server["rkey"] ^ 0x5A5A)
    timed("failed write never repeated", lambda: (
        expect(OSError, lambda: r.dma_write(off, b"y" * 4096)),
        expect(OSError, lambda: r.dma_read(off, 8))))
    assert "remote access error" in r.backend.failure(), r.backend.failure()
    r.close()
    r = cxlrt.open(spec, node=1)
    r.free(off)
    r.close()

    # The server killed while a client holds a lock: the client's next access fails
    # within the bound, and its hold is broken like a stalled node's once the server
    # is back (the region file is the same; the keys are new).
    a = cxlrt.open(spec0, node=1)
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

    reconnect_cases(server, spec, spec1)
    server = start_server()

    # The server stopped cleanly tells its clients at once.
    c = cxlrt.open(spec0, node=3)
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


def reconnect_cases(server, spec, spec1):
    """The server killed and back: what waits, what resumes, what is fenced. Returns
    with the server stopped."""
    import threading

    # An outage inside the lease: the holder's hold survives, its accesses wait and go
    # on, and its release lands (the next node takes the lock at once). The window is
    # longer than the default 10 s: the restarted server is a Python process in a TCG
    # guest whose host may be busy (the window running out is its own case below).
    x = cxlrt.open(spec1 + "?reconnect=60", node=1)
    lk = x.lock("resume")
    lk.acquire()
    off = x.alloc(1 << 16)
    data = os.urandom(1 << 16)
    x.dma_write(off, data)
    kill(server)
    got = []
    reader = threading.Thread(target=lambda: got.append(x.dma_read(off, 1 << 16)))
    reader.start()
    deadline = time.monotonic() + BOUND_S
    while x.backend.outage() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert x.backend.outage() is not None, "no outage seen with the server killed"
    assert reader.is_alive(), "an access returned while the server was down"
    server = start_server("r1")
    t = time.monotonic()
    reader.join(BOUND_S)

    def resumed():
        assert not reader.is_alive() and got == [data], "the waiting read did not resume"
        assert x.backend.failure() is None and x.backend.outage() is None
        assert x.backend.stats()["reconnects"] == 1, x.backend.stats()
        lk.release()  # inside the 60 s lease: no LeaseLost
        y = cxlrt.open(spec1, node=2)
        ly = y.lock("resume")
        assert ly.acquire(timeout=5), "the resumed holder's release did not land"
        ly.release()
        y.close()
    t0 = time.monotonic()
    resumed()
    print(f"PASS outage inside the lease resumed ({t0 - t:.2f} s after the server "
          f"listened, {time.monotonic() - t0:.2f} s more)", flush=True)
    x.free(off)
    x.close()

    # An outage past the lease is a stall: the holder comes back, and its release is
    # published but raises LeaseLost (another node may have held the lock meanwhile).
    s = cxlrt.open(spec + "?reconnect=60", node=3)
    lease = s.lease_ms / 1000
    ls = s.lock("stalled")
    ls.acquire()
    kill(server)
    time.sleep(lease * 2)
    server = start_server()

    def stalled():
        s.load64(0)  # waits for the reconnect
        assert s.backend.stats()["reconnects"] == 1
        expect(cxlrt.LeaseLost, ls.release, "silent")
        o = cxlrt.open(spec, node=2)
        lo = o.lock("stalled")
        assert lo.acquire(timeout=5), "the stalled holder's release did not land"
        lo.release()
        o.close()
    timed("outage past the lease fenced like a stall", stalled)
    s.close()
    for sp in (spec, spec1):
        problems = check(sp)["problems"]
        assert not problems, (sp, problems)
    print("PASS cxlrt check after the reconnects", flush=True)

    # The server back on another region under the same name: refused, for good.
    z = cxlrt.open(spec1 + "?reconnect=60", node=3)
    kill(server)
    cxlrt.format(f"file:{FILE1}", size="16M", nodes=4, lease=60, force=True)
    server = start_server("r1")
    timed("another region under the name refused", lambda: (
        expect(OSError, lambda: z.load64(0)),
        expect(OSError, lambda: z.load64(0))))
    assert "another region" in z.backend.failure(), z.backend.failure()
    z.close()

    # The server not back within the window: the waiting access fails then, naming it.
    w = cxlrt.open(spec + "?reconnect=2", node=3)
    kill(server)
    t = time.monotonic()
    expect(OSError, lambda: w.load64(0))
    dt = time.monotonic() - t
    assert 1.5 < dt < 2 + BOUND_S, f"gave up after {dt:.1f} s, not the 2 s window"
    assert "did not come back within 2.0 s" in w.backend.failure(), w.backend.failure()
    print(f"PASS server not back within the window ({dt:.2f} s)", flush=True)
    w.close()

    # A queue pair that stops completing (a hung device; rxe gives up on a lost peer
    # by itself, in about 0.5 s, so the hang is made by a test hook): the access's
    # deadline ends it. With reconnecting on, the READ goes on over a new queue pair.
    server = start_server()
    v0 = cxlrt.open(spec + "?reconnect=0&timeout=1", node=1)
    v = cxlrt.open(spec + "?timeout=1", node=2)
    word = v.load64(0)
    v0.backend._stall()
    timed("no completion: the deadline", lambda: expect(OSError, lambda: v0.load64(0)))
    assert "no completion for the attachment's timeout (1.0 s)" in v0.backend.failure(), \
        v0.backend.failure()
    v.backend._stall()

    def healed():
        assert v.load64(0) == word
        assert v.backend.stats()["reconnects"] == 1 and v.backend.failure() is None
    timed("no completion: a new queue pair", healed)

    # The heartbeat's words may be written again (the liveness layer says so through
    # CXL_HINT_REPEAT): a beat whose completion is lost costs a reconnect, not the
    # attachment. The beat word is written here, on the stalled queue pair, right after
    # a beat (the beat thread's next READ is a period away and cannot hit it first).
    beat = v.node_area(v.node)
    value = v.load64(beat)
    deadline = time.monotonic() + BOUND_S
    while v.load64(beat) == value and time.monotonic() < deadline:
        time.sleep(0.002)
    value = v.load64(beat)
    v.backend._stall()

    def beat_repeated():
        v.store64(beat, value + 1)
        st = v.backend.stats()
        assert st["repeated_writes"] == 1 and st["reconnects"] == 2, st
        assert v.backend.failure() is None, v.backend.failure()
        assert v.load64(0) == word
    timed("a beat whose completion was lost written again", beat_repeated)
    v0.close()
    v.close()
    server = again_cases(server, spec, spec1)
    kill(server)


def again_cases(server, spec, spec1):
    """A READ failing on every new attachment; close() racing a swap; a server whose
    host restarted. Returns the server running."""
    import threading

    # Every new attachment gets a key that is not valid (a test hook): the READ fails on
    # each, and ends when its own window does, saying so; the attachments back off.
    u = cxlrt.open(spec + "?reconnect=2", node=3, observer=True)
    u.backend._poison_swaps(True)
    u.backend._set_rkey(u.backend.server["rkey"] ^ 0x5A5A)
    t = time.monotonic()
    bounded(lambda: expect(OSError, lambda: u.load64(0)), 2 + BOUND_S)
    dt = time.monotonic() - t
    n = u.backend.stats()["reconnects"]
    assert 1.5 < dt < 2 + BOUND_S, f"gave up after {dt:.1f} s, not the 2 s window"
    assert "a READ kept failing across reconnects for 2.0 s" in u.backend.failure(), \
        u.backend.failure()
    # Backing off from 40 ms, doubling: at most 6 in 2 s (an attach here takes ~20 ms,
    # so without it there would be dozens).
    assert 1 <= n <= 8, f"{n} new attachments in 2 s: no backoff"
    expect(OSError, lambda: u.load64(0))  # broken for good
    print(f"PASS a READ failing on every attachment ({dt:.2f} s, {n} attachments)",
          flush=True)
    u.close()

    # close() while the supervisor holds a checked new attachment, not yet swapped in:
    # close() returns at once, the waiting access says closed, and the late swap is
    # dropped (its queue pair and connection go; nothing touches freed buffers).
    q = cxlrt.open(spec + "?reconnect=60", node=3, observer=True)
    gate = (threading.Event(), threading.Event())
    q.backend._gate_swaps(gate)
    kill(server)
    got = []

    def waiter():
        try:
            got.append(q.load64(0))
        except Exception as e:  # noqa: BLE001  the kind is asserted below
            got.append(e)
    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    server = start_server()
    assert gate[0].wait(BOUND_S), "no reconnect reached the swap"

    def closed_mid_swap():
        assert th.is_alive() and q.backend.outage() is not None, "the access is not waiting"
        q.close()
        th.join(BOUND_S)
        assert not th.is_alive(), "the waiting access did not end with close()"
        assert len(got) == 1 and isinstance(got[0], RegionError), got
        gate[1].set()
        deadline = time.monotonic() + BOUND_S
        while q.backend.stats()["reconnects"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # a swap after close() must not count: wait it out
            if not q.backend._supervising():
                break
        assert q.backend.stats()["reconnects"] == 0, q.backend.stats()
        assert not q.backend._supervising(), "the supervisor outlived close()"
    timed("close() racing a swap", closed_mid_swap)

    # A claim asked while the server is down (an outage between attach and claim, as in
    # an open) is not a refusal: it waits and is asked again on the next attachment. The
    # supervisor's new attachment is held at a gate until the claim has met the dead
    # connection, so its handshake carries no claim: only the claim's own second ask can
    # make the node held (another host's claim of it is then refused).
    k = cxlrt.open(spec + "?reconnect=60", node=3, observer=True)
    gate = (threading.Event(), threading.Event())
    k.backend._gate_swaps(gate)
    kill(server)
    deadline = time.monotonic() + BOUND_S
    while k.backend.outage() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    server = start_server()
    assert gate[0].wait(BOUND_S), "no reconnect reached the swap"
    claimed = []

    def claimer():
        try:
            k.backend.claim(4)
            claimed.append(True)
        except Exception as e:  # noqa: BLE001  asserted below
            claimed.append(e)
    th = threading.Thread(target=claimer, daemon=True)
    th.start()
    time.sleep(0.3)
    assert th.is_alive() and not claimed, f"the claim ended during the outage: {claimed}"
    gate[1].set()

    def claim_waited():
        th.join(BOUND_S)
        assert claimed == [True], claimed
        assert k.backend.stats()["reconnects"] == 1, k.backend.stats()
        from cxlrt.backends import _rdmawire as wire
        from cxlrt.backends import rdma
        dev = rdma.Device()
        qp = rdma.QueuePair(dev)
        conn, _ = wire.attach(spec.partition(":")[2], node=3, qpn=qp.qpn, psn=qp.psn,
                              gid=dev.gid, timeout=5, host="00000000deadbeef")
        threading.Thread(target=conn.wait_closed, daemon=True).start()
        expect(wire.RdmaServerError, lambda: conn.ask(
            {"op": "claim", "node": 3, "nodes": 4, "host": "00000000deadbeef"}, 5),
            "held by host")
        conn.close()
        qp.close()
    timed("a claim during an outage goes through the next attachment", claim_waited)
    k.close()

    # The server back with the same file but on a host that has restarted (its boot id
    # differs): the file may have lost pages the node wrote, so it is refused for good.
    b = cxlrt.open(spec1 + "?reconnect=60", node=3, observer=True)
    kill(server)
    server = start_server("r1", boot=0x1234)
    timed("a server host that restarted refused", lambda: expect(OSError, lambda: b.load64(0)))
    assert "host has restarted" in b.backend.failure(), b.backend.failure()
    b.close()
    kill(server)
    return start_server()


if __name__ == "__main__":
    main()
