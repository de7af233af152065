"""The allocator, written once, on every backend, across processes and nodes."""

from __future__ import annotations

import os
import queue
import random
import signal
import time

import pytest

import cxlrt
from cxlrt import check as cxcheck
from tests.nodes import _CTX, raise_failures, run_procs

SIZES = [8, 64, 100, 500, 1000, 4000, 9000, 16384, 20000, 70000, 300000]


def _pattern(off, size, seed):
    rnd = random.Random(off * 1_000_003 + seed)
    return rnd.randbytes(min(size, 256)) * (size // min(size, 256) + 1)


def _stress(spec, node, seed, rounds, outbox, inbox, nodes):
    """Allocate, fill, verify; hand half of the objects to the next node to free."""
    r = cxlrt.open(spec, node=node)
    rnd = random.Random(seed * 100 + node)
    live = {}
    freed_remote = 0
    peer_done = False
    try:
        for i in range(rounds):
            size = rnd.choice(SIZES)
            off = r.alloc(size)
            data = _pattern(off, size, seed)[:size]
            r.dma_write(off, data)          # payload by DMA, as KV blocks move
            live[off] = (size, data)
            if len(live) > 24 or i == rounds - 1:
                for off in rnd.sample(sorted(live), k=len(live) // 2):
                    size, data = live.pop(off)
                    assert r.dma_read(off, size) == data, f"node {node}: object {off:#x} damaged"
                    if rnd.random() < 0.5:
                        outbox.put((off, size, data))   # another node frees it
                    else:
                        r.free(off)
            try:
                while not peer_done:
                    item = inbox.get_nowait()
                    if item is None:
                        peer_done = True
                        break
                    off, size, data = item
                    assert r.dma_read(off, size) == data, f"node {node}: remote {off:#x} damaged"
                    r.free(off)
                    freed_remote += 1
            except queue.Empty:
                pass
        for off, (size, data) in live.items():
            assert r.dma_read(off, size) == data
            r.free(off)
        outbox.put(None)  # done producing
        while not peer_done:
            item = inbox.get(timeout=60)
            if item is None:
                peer_done = True
                continue
            off, size, data = item
            assert r.dma_read(off, size) == data
            r.free(off)
            freed_remote += 1
        r.trim()
    finally:
        r.close()
    return freed_remote


def test_stress_across_processes_with_cross_node_frees(backend):
    nodes, rounds = 4, 600
    r0 = backend.create(size="64M", nodes=nodes)
    start = r0.usage()
    qs = [_CTX.Queue() for _ in range(nodes)]
    args = [(backend.spec(), n, backend.seed or 5, rounds, qs[(n + 1) % nodes], qs[n], nodes)
            for n in range(nodes)]
    freed_remote = raise_failures(run_procs(_stress, args, timeout=300))
    assert sum(freed_remote) > 0
    # Remote frees land in the owners' queues; the owners drained them before trimming,
    # but a free that arrived after an owner's last drain waits for its next drain.
    for n in range(nodes):
        with cxlrt.open(backend.spec(), node=n) as r:
            r.trim()
    end = r0.usage()
    assert end["live_bytes"] == start["live_bytes"] == 0
    assert end["free_chunks"] == start["free_chunks"]
    report = cxcheck.check(backend.spec())
    assert report["problems"] == [], report["problems"]
    r0.close()


@pytest.fixture
def region(backend):
    r = backend.create(size="4M", nodes=2)
    yield r
    r.close()


def test_objects_never_overlap(region):
    offs = sorted((region.alloc(s), s) for s in [64] * 50 + [1000] * 20 + [70000] * 3)
    for (a, n), (b, _) in zip(offs, offs[1:], strict=False):
        assert a + n <= b, (a, n, b)
    for a, _ in offs:
        region.free(a)
    assert region.usage()["live_bytes"] == 0


@pytest.mark.parametrize("align", [64, 256, 4096, 65536])
def test_alignment(region, align):
    off = region.alloc(10, align=align)
    assert off % align == 0
    region.free(off)


def test_free_of_never_allocated_offset(region):
    with pytest.raises(cxlrt.InvalidFreeError, match="not the start of a live allocation"):
        region.free(region.heap[0] + 5 * 65536)


def test_free_of_interior_pointer(region):
    off = region.alloc(1000)
    with pytest.raises(cxlrt.InvalidFreeError):
        region.free(off + 8)
    big = region.alloc(100000)
    with pytest.raises(cxlrt.InvalidFreeError):
        region.free(big + 65536)
    region.free(off)
    region.free(big)


def test_double_free_own_and_large(region):
    off = region.alloc(64)
    region.free(off)
    with pytest.raises(cxlrt.InvalidFreeError, match="double free"):
        region.free(off)
    big = region.alloc(200000)
    region.free(big)
    with pytest.raises(cxlrt.InvalidFreeError):
        region.free(big)


def test_double_free_from_another_node(backend):
    a = backend.create(size="4M", nodes=2)
    b = backend.open(1)
    off = a.alloc(128)
    b.free(off)  # queued for node 0
    with pytest.raises(cxlrt.InvalidFreeError, match="double free"):
        b.free(off)
    assert a._allocator.drain() == 1
    with pytest.raises(cxlrt.InvalidFreeError):
        b.free(off)
    assert a.usage()["small_objects"] == 0
    a.close()
    b.close()


@pytest.mark.parametrize("off", [-1, 0, 10, 2**40])
def test_free_outside_the_heap(region, off):
    err = ValueError if off < 0 else (cxlrt.OutOfRangeError, cxlrt.InvalidFreeError)
    with pytest.raises(err):
        region.free(off)


@pytest.mark.parametrize("size", [0, -5, 1.5, "10", None])
def test_bad_sizes(region, size):
    with pytest.raises(ValueError, match="positive int"):
        region.alloc(size)


@pytest.mark.parametrize("align", [0, 3, 100, 1 << 17])
def test_bad_alignment(region, align):
    with pytest.raises(ValueError, match="power of two"):
        region.alloc(64, align=align)


def test_out_of_memory_leaves_region_consistent(backend):
    r = backend.create(size="1M", nodes=1)  # a device region is the whole device
    before = r.usage()
    heap = r.heap[1]
    with pytest.raises(cxlrt.OutOfMemory):
        r.alloc(heap + 65536)
    held = []
    for step in (max(65536, heap // 16 // 65536 * 65536), 65536):  # big runs, then the rest
        try:
            while True:
                held.append(r.alloc(step))
        except cxlrt.OutOfMemory:
            pass
    assert held
    with pytest.raises(cxlrt.OutOfMemory):
        r.alloc(64)  # no chunk left to carve
    for off in held:
        r.free(off)
    r.trim()
    assert r.usage() == before
    assert cxcheck.check(backend.spec())["problems"] == []
    r.close()


def _carve_then_die(spec, node):
    r = cxlrt.open(spec, node=node)
    offs = [r.alloc(64) for _ in range(10)] + [r.alloc(4096)]
    for off in offs:
        r.free(off)         # everything freed, but the node keeps its empty chunks cached
    lock = r.lock("held")
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.crash
def test_dead_node_is_reported_and_repaired(backend):
    lease = 0.3
    r0 = backend.create(size="4M", nodes=3, lease=lease)
    start = r0.usage()
    r0.lock("held")
    p = _CTX.Process(target=_carve_then_die, args=(backend.spec(), 2))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    time.sleep(lease * 2)
    report = cxcheck.check(backend.spec())
    text = "\n".join(report["problems"])
    assert report["dead_nodes"] == [2]
    assert "dead node 2 still holds" in text and "held by dead node 2" in text
    done = cxcheck.repair(backend.spec(), 2)
    assert any("released node 2" in a for a in done["actions"])
    time.sleep(lease * 2)
    after = cxcheck.check(backend.spec())
    assert after["problems"] == [], after["problems"]
    assert r0.usage()["free_chunks"] == start["free_chunks"]
    with r0.lock("held"):  # the rack is not blocked
        pass
    r0.close()


def test_repair_refuses_a_live_node(backend):
    r0 = backend.create(size="4M", nodes=2)
    r1 = backend.open(1)
    r1.locks  # noqa: B018  (heartbeat running: node 1 is alive)
    with pytest.raises(cxlrt.RegionError, match="alive"):
        cxcheck.repair(backend.spec(), 1)
    r1.close()
    r0.close()


# --- remote frees: crash-safe, unbounded, never in the heartbeat (issue 9) -----------------
#
# Objects are tagged with `_pattern` over their whole size by DMA, so two live objects
# sharing memory show up as a damaged tag, whichever of them was written last.

def _tag_all(r, offs, seed):
    for off, size in offs:
        r.dma_write(off, _pattern(off, size, seed)[:size])


def _assert_tags(r, offs, seed, who):
    for off, size in offs:
        assert r.dma_read(off, size) == _pattern(off, size, seed)[:size], \
            f"{who}: object {off:#x} ({size} B) was overwritten: allocated twice"


def _assert_disjoint(offs):
    spans = sorted(offs)
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        assert a + n <= b, f"objects {a:#x} (+{n}) and {b:#x} overlap: allocated twice"


def _alloc_tagged(spec, node, counts, seed):
    """Child: allocate `counts` {size: n} objects as `node`, tag them, detach cleanly."""
    with cxlrt.open(spec, node=node) as r:
        offs = [(r.alloc(size), size) for size, n in counts.items() for _ in range(n)]
        _tag_all(r, offs, seed)
    return offs


def _drain_and_die(spec, node, point, nth):
    """Child: arm `point` and drain this node's remote-free queue; SIGKILLed there."""
    from cxlrt import crash
    r = cxlrt.open(spec, node=node)
    crash.arm(point, "kill", nth)
    r.trim()  # applies the queued remote frees first
    os._exit(7)  # not reached when the point was hit


def _next_process(spec, node, live, seed):
    """Child: the node's next process allocates around a replay of the killed drain,
    checking that nothing it was handed is live already."""
    with cxlrt.open(spec, node=node) as r:
        mine = [(r.alloc(size), size) for size in (64, 1000) for _ in range(200)]
        _assert_disjoint(live + mine)
        _tag_all(r, mine, seed)
        r.trim()  # a drain (or a replay of the dead one) after we allocated
        more = [(r.alloc(size), size) for size in (64, 1000) for _ in range(200)]
        _assert_disjoint(live + mine + more)
        _tag_all(r, more, seed)
        _assert_tags(r, live + mine, seed, f"node {node}'s next process")
    return mine + more


def _run_child(fn, *args):
    p = _CTX.Process(target=fn, args=args)
    p.start()
    p.join(120)
    return p.exitcode


@pytest.mark.crash
@pytest.mark.parametrize("replay", ["next-process", "repair"])
@pytest.mark.parametrize("point,nth", [("alloc.drain", 1), ("alloc.drain", 37),
                                       ("alloc.drain", 200), ("alloc.drain.detach", 1)])
def test_drainer_killed_then_replayed_never_allocates_twice(backend, point, nth, replay):
    """Scenario 6 of issue 9: a drainer SIGKILLed mid-drain, then a replay by the node's
    next process (which allocates first) or by `cxlrt check --repair`: no slot is freed
    twice, none that was handed out again is freed, and the figures are exact."""
    lease, seed = 0.5, backend.seed or 11
    r1 = backend.create(size="8M", nodes=2, node=1, lease=lease)  # node 1 frees remotely
    start = r1.usage()
    spec = backend.spec()
    (objs,) = raise_failures(run_procs(_alloc_tagged, [(spec, 0, {64: 300, 1000: 100}, seed)]))
    gone, live = objs[::2], objs[1::2]
    for off, _ in gone:
        r1.free(off)  # 200 remote frees queued for node 0
    assert _run_child(_drain_and_die, spec, 0, point, nth) == -signal.SIGKILL, \
        f"the drainer was not killed at {point}@{nth}"
    if replay == "repair":
        time.sleep(lease * 2.5)  # node 0 is dead now
        cxcheck.repair(spec, 0)
    (mine,) = raise_failures(run_procs(_next_process, [(spec, 0, live, seed)]))
    everything = live + mine
    _assert_disjoint(everything)
    _assert_tags(r1, everything, seed, "after the replay")
    use = r1.usage()
    assert use["small_objects"] == len(everything), (use["small_objects"], len(everything))
    assert use["small_bytes"] == sum(64 if n == 64 else 1024 for _, n in everything)
    reused = {off for off, _ in mine}
    for off, _ in gone:  # freed once already and not handed out again: a double free
        if off not in reused:
            with pytest.raises(cxlrt.InvalidFreeError):
                r1.free(off)
    with cxlrt.open(spec, node=0) as r0:
        for off, _ in everything:
            r0.free(off)
        r0.trim()
    assert r1.usage() == start
    report = cxcheck.check(spec)
    assert report["problems"] == [], report["problems"]
    r1.close()


def test_remote_frees_beyond_any_queue_bound_live_idle_owner(backend):
    """Scenario 9 of issue 9: another node frees 2000 small objects of a live, idle
    owner in one go; no free fails, and once the owner drains all are reusable."""
    r0 = backend.create(size="16M", nodes=2, lease=30.0)  # the owner: alive, idle
    start = r0.usage()
    offs = [r0.alloc(64) for _ in range(1500)] + [r0.alloc(200) for _ in range(500)]
    peak = r0.usage()
    r1 = backend.open(1)
    for off in offs:
        r1.free(off)
    with pytest.raises(cxlrt.InvalidFreeError, match="double free"):
        r1.free(offs[1234])  # queued already
    r0.trim()  # the owner drains (and gives its empty chunks back)
    assert r0.usage() == start
    again = [r0.alloc(64) for _ in range(1500)] + [r0.alloc(200) for _ in range(500)]
    assert r0.usage()["small_chunks"] == peak["small_chunks"]  # reused, nothing leaked
    for off in again:
        r1.free(off)
    r0.trim()
    assert r0.usage() == start
    assert cxcheck.check(backend.spec())["problems"] == []
    r1.close()
    r0.close()


def _alloc_report_and_die(spec, node, n, q):
    r = cxlrt.open(spec, node=node)
    q.put([r.alloc(64) for _ in range(n)])
    time.sleep(0.5)  # let the parent take the list before we vanish
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.crash
def test_remote_frees_beyond_any_queue_bound_dead_owner_repaired(backend):
    """Scenario 9 of issue 9, owner dead: 2000 remote frees succeed, `cxlrt check`
    reports them queued, and `--repair` applies them all."""
    lease = 0.5
    r1 = backend.create(size="16M", nodes=2, node=1, lease=lease)
    start = r1.usage()
    q = _CTX.Queue()
    p = _CTX.Process(target=_alloc_report_and_die, args=(backend.spec(), 0, 2000, q))
    p.start()
    offs = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    for off in offs:
        r1.free(off)
    time.sleep(lease * 2.5)
    text = "\n".join(cxcheck.check(backend.spec())["problems"])
    assert "node 0 is dead with 2000 queued remote frees" in text, text
    done = cxcheck.repair(backend.spec(), 0)
    assert "applied 2000 queued remote frees" in done["actions"], done["actions"]
    assert r1.usage() == start
    report = cxcheck.check(backend.spec())
    assert report["problems"] == [], report["problems"]
    r1.close()


def test_a_slow_allocator_lock_holder_does_not_stop_heartbeats(backend):
    """Scenario 2 of issue 9 (allocator part): node 0 has remote frees queued and holds
    a lock while node 2 sits on the allocator lock for several leases. Node 0's
    heartbeat must not wait for the allocator lock, so node 1 must never judge node 0
    dead and take the lock node 0 still holds."""
    lease = 0.5
    r0 = backend.create(nodes=3, lease=lease)
    r1, r2 = backend.open(1), backend.open(2)
    objs = [r0.alloc(64) for _ in range(8)]
    user = r0.lock("user")
    user.acquire()
    alloc_lock = r2.lock("cxlrt.alloc")
    r1.free(objs[0])       # queued for node 0: applying it needs the allocator lock
    alloc_lock.acquire()   # ... which a slow node now holds
    try:
        got = r1.lock("user").acquire(timeout=4 * lease)
        dead = cxcheck.check(backend.spec())["dead_nodes"]
    finally:
        alloc_lock.release()
    assert not got, "node 1 took a lock live node 0 holds: node 0's heartbeat stalled"
    assert 0 not in dead
    user.release()         # no LeaseLost: node 0 never went silent
    assert getattr(r0.locks, "on_beat", None) is None  # no allocator work in the heartbeat
    for off in objs[1:]:
        r0.free(off)
    r0.trim()
    assert r0.usage()["small_objects"] == 0
    for r in (r2, r1, r0):
        r.close()


def _free_and_die(spec, node, offs, nth):
    from cxlrt import crash
    r = cxlrt.open(spec, node=node)
    crash.arm("free.remote", "kill", nth)
    for off in offs:
        r.free(off)
    os._exit(7)


@pytest.mark.crash
def test_freer_killed_mid_free_then_the_free_is_retried(backend):
    """A remote freer SIGKILLed inside a free leaves nothing half-done that matters:
    the frees before it count, the interrupted one can be retried by any node, and a
    real double free is still refused."""
    lease = 0.5
    r0 = backend.create(nodes=3, lease=lease)
    start = r0.usage()
    offs = [r0.alloc(64) for _ in range(10)]
    assert _run_child(_free_and_die, backend.spec(), 1, offs, 3) == -signal.SIGKILL
    r2 = backend.open(2)
    with pytest.raises(cxlrt.InvalidFreeError, match="double free"):
        r2.free(offs[0])  # the dead freer's first free was queued
    for off in offs[2:]:
        r2.free(off)      # offs[2] is the interrupted one: its retry succeeds
    r0.trim()
    assert r0.usage() == start
    r2.close()
    r0.close()


def test_a_busy_owner_applies_remote_frees_without_being_asked(backend):
    """Queued remote frees are applied on the owner's own allocation and free path,
    not only when it runs out of room or trims."""
    r0 = backend.create(size="8M", nodes=2)
    r1 = backend.open(1)
    offs = [r0.alloc(64) for _ in range(100)]
    for off in offs:
        r1.free(off)
    for _ in range(1000):  # plenty of room in the current chunk: no slow path
        r0.free(r0.alloc(128))
    assert r0.usage()["small_objects"] == 0
    r1.close()
    r0.close()


def _step_and_die(spec, node, point):
    from cxlrt import crash
    r = cxlrt.open(spec, node=node)
    mine = r.alloc(4096 if point == "free.local" else 64)  # 4 KiB: a class with no magazine
    big = r.alloc(200000) if point == "free.large" else None
    more = [r.alloc(64) for _ in range(16)] if point == "free.mag.drop" else []
    for off in more:
        r.free(off)  # a full magazine: the next free gives half of it back
    if point == "alloc.mag":
        r.free(mine)  # cached: the next alloc pops it
    crash.arm(point, "kill", 1)
    if point in ("free.local", "free.mag", "free.mag.drop"):
        r.free(mine)
    elif point == "free.large":
        r.free(big)
    else:
        r.alloc(64 if point in ("alloc.small", "alloc.mag") else 200000)
    os._exit(7)


@pytest.mark.crash
@pytest.mark.parametrize("point", ["alloc.small", "alloc.large.tails", "alloc.large", "free.local",
                                   "free.large", "alloc.mag", "free.mag", "free.mag.drop"])
def test_a_process_killed_mid_step_wedges_nothing(backend, point):
    """Killed holding the heap mutex or the allocator lock: the node's next process
    and the other nodes carry on, and `cxlrt check` finds nothing wrong. An alloc
    killed between its tails and its head, or a free between a run's head and its
    tails, leaves tails that check names as a leak and --repair frees (before, check
    called a free's corruption and nothing freed them). A thread killed in its
    magazine, or while the heap mutex gives a magazine back, leaks at most the one
    object in flight."""
    r1 = backend.create(nodes=2, node=1, lease=0.5)
    spec = backend.spec()
    assert _run_child(_step_and_die, spec, 0, point) == -signal.SIGKILL
    with cxlrt.open(spec, node=0) as r0:
        offs = [r0.alloc(64) for _ in range(10)] + [r0.alloc(200000)]
        for off in offs:
            r0.free(off)
    big = r1.alloc(200000)  # the allocator lock is free again
    r1.free(big)
    report = cxcheck.check(spec)
    if point in ("alloc.large.tails", "free.large"):
        assert [p for p in report["problems"] if "tail of node 0's large run" in p] \
            and all(p.startswith("leak") for p in report["problems"]), report["problems"]
        assert any("tail chunk(s)" in a for a in cxcheck.repair(spec, 0)["actions"])
        report = cxcheck.check(spec)
    assert report["problems"] == [], report["problems"]
    if not point.startswith("alloc.large"):  # a killed alloc's run is its leak (_settle_owed)
        assert r1.usage()["large_chunks"] == 0, "a run nobody holds stayed allocated"
    if ".mag" in point:
        # At most the one object in flight leaks: the magazine the process died with went
        # back when node 0's next process attached, and a give-back cut short was finished.
        use = r1.usage()
        assert use["small_objects"] <= 1 and use["cached_objects"] == 0, use
    r1.close()
