"""Allocator-lock holders stalled past their lease are fenced (issue 9, stall mode).

A process of node 1 is SIGSTOPped holding the allocator lock at a remote free or a
drain; the other nodes wait out its lease, take the lock over and queue more remote
frees. When it resumes it must stop with LeaseLost instead of publishing the queue
line from what it read before the stall, and every acknowledged free must still be
applied. Without the fences both tests lose the frees queued during the stall.
"""

from __future__ import annotations

import os
import signal

import pytest

import cxlrt
from cxlrt import check, crash
from cxlrt.lock import LeaseLost
from tests.nodes import _CTX

LEASE = 0.5  # seconds; the stalled holder's hold is broken after it


def _wait_stopped(p, deadline_s=30.0):
    from tests.algorithms.test_directory_crash import _wait_stopped as wait
    wait(p.pid, deadline_s)


def _problems(spec):
    return check.check(spec)["problems"]


def _free_stalled(spec, node, off, out):
    """In a child: free `off` (another node's) stopping at free.remote; report the outcome."""
    import cxlrt
    r = cxlrt.open(spec, node=node)
    crash.arm("free.remote", "stop")
    try:
        r.free(off)
        out.put("freed")
    except LeaseLost as e:
        out.put(f"LeaseLost: {e}")
    crash.disarm()
    r.close()


@pytest.mark.crash
def test_remote_freer_stalled_past_its_lease_is_fenced(backend):
    r0 = backend.create(nodes=3, lease=LEASE)
    spec = backend.spec()
    r2 = backend.open(2)
    victim_obj = r0.alloc(64)
    others = [r0.alloc(64) for _ in range(3)]
    out = _CTX.Queue()
    p = _CTX.Process(target=_free_stalled, args=(spec, 1, victim_obj, out))
    p.start()
    try:
        _wait_stopped(p)
        for off in others:  # waits out node 1's lease, then takes the lock over
            r2.free(off)
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=30)
    assert p.exitcode == 0
    got = out.get(timeout=5)
    assert got.startswith("LeaseLost"), f"the resumed freer published: {got}"
    assert r0._allocator.drain() == len(others), "frees queued during the stall were lost"
    r2.free(victim_obj)  # not done, so it may be retried (its stale mark notwithstanding)
    assert r0._allocator.drain() == 1
    assert r0.usage()["small_objects"] == 0
    assert _problems(spec) == []
    r2.close()
    r0.close()


def _drain_stalled(spec, node, n, to_parent, from_parent):
    """In a child (the owner): allocate n objects, hand them out, then drain twice,
    the first time stopping at alloc.drain.detach; report both outcomes."""
    import cxlrt
    r = cxlrt.open(spec, node=node)
    to_parent.put([r.alloc(64) for _ in range(n)])
    from_parent.get(timeout=30)  # the first half is queued for us
    crash.arm("alloc.drain.detach", "stop")
    try:
        to_parent.put(f"drained {r._allocator.drain()}")
    except LeaseLost as e:
        to_parent.put(f"LeaseLost: {e}")
    crash.disarm()
    to_parent.put(r._allocator.drain())
    to_parent.put(r.usage()["small_objects"])
    r.close()


@pytest.mark.crash
def test_drainer_stalled_past_its_lease_is_fenced(backend):
    r0 = backend.create(nodes=3, lease=LEASE)
    spec = backend.spec()
    to_parent, from_parent = _CTX.Queue(), _CTX.Queue()
    p = _CTX.Process(target=_drain_stalled, args=(spec, 1, 8, to_parent, from_parent))
    p.start()
    try:
        objs = to_parent.get(timeout=30)
        for off in objs[:4]:
            r0.free(off)
        from_parent.put("go")
        _wait_stopped(p)  # its batch (the first half) is committed, its queue not emptied
        for off in objs[4:]:  # waits out node 1's lease, then takes the lock over
            r0.free(off)
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=30)
    assert p.exitcode == 0
    first = to_parent.get(timeout=5)
    assert first.startswith("LeaseLost"), f"the resumed drainer published: {first}"
    # The next drain applies the committed batch and what was queued during the stall.
    assert to_parent.get(timeout=5) == len(objs)
    assert to_parent.get(timeout=5) == 0
    assert _problems(spec) == []
    r0.close()


def _alloc_large_stalled(spec, node, nbytes, out):
    """In a child: a large alloc stopping between its tails and its head; report it."""
    import cxlrt
    r = cxlrt.open(spec, node=node)
    crash.arm("alloc.large.tails", "stop")
    try:
        out.put(("got", r.alloc(nbytes)))
    except LeaseLost as e:
        out.put(("LeaseLost", str(e)))
    crash.disarm()
    r.close()


@pytest.mark.crash
def test_a_large_alloc_stalled_between_tails_and_head_never_takes_a_run_given_out(backend):
    """Node 0 stops after writing a run's tails, before its head, past its lease. Node 1
    finds no room (the tails hold it), frees those tails as `cxlrt check --repair`
    does (no head covers them) and is given the run. When node 0 resumes it must not
    write its head over node 1's run. A review's reproduction of this had node 0's
    alloc return the run node 1 held."""
    chunk = 64 << 10
    r1 = backend.create(nodes=2, node=1, lease=LEASE, size="4M")
    spec = backend.spec()
    room = r1.usage()["free_bytes"] // chunk
    filler = r1.alloc((room - 6) * chunk)  # six chunks left, at the end
    out = _CTX.Queue()
    p = _CTX.Process(target=_alloc_large_stalled, args=(spec, 0, 6 * chunk, out))
    p.start()
    try:
        _wait_stopped(p)
        with pytest.raises(cxlrt.OutOfMemory):  # waits out node 0's lease first
            r1.alloc(6 * chunk)
        assert r1._allocator.reclaim() == 5
        mine = r1.alloc(6 * chunk)
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=30)
    assert p.exitcode == 0
    what, got = out.get(timeout=5)
    assert what == "LeaseLost", f"the resumed alloc handed out {got:#x}; node 1 holds {mine:#x}"
    assert r1.usage()["large_objects"] == 2
    assert _problems(spec) == []
    r1.free(mine)
    r1.free(filler)
    with cxlrt.open(spec, node=0) as r0:  # settles its owed record: words not its own stay
        r0.free(r0.alloc(6 * chunk))
    assert r1.usage()["free_bytes"] == room * chunk
    assert _problems(spec) == []
    r1.close()
