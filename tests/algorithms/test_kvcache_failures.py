"""The prefix KV cache under crashes and stalls (issue 9, scenarios 7, 9 and 10).

Every test runs on every backend, the emulation with faults and its checker
included. Writers are real processes: SIGKILLed or SIGSTOPped at named crash
points (cxlrt.crash), or stopped from outside mid-copy, then resumed.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import cxlrt
import cxlrt.crash
import cxlrt.kvcache
import cxlrt.kvinspect
from cxlrt.lock import MAX_LOCKS, LeaseLost
from tests.algorithms.test_kvcache import BB, block_for, chain, filled, open_cache
from tests.nodes import _CTX

LEASE = 0.5        # seconds: short, so that stalls past it are quick to stage
BIG = 32 << 20     # a block whose copy is long enough to be stopped in the middle


# --- helpers ---------------------------------------------------------------------------

def _spawn(fn, *args):
    """Start fn(*args, q) in a forked process; returns (process, its result queue)."""
    q = _CTX.Queue()
    p = _CTX.Process(target=fn, args=(*args, q))
    p.start()
    return p, q


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return "gone"
    return raw[raw.rindex(b")") + 2:].split()[0].decode()


def _live_objects(r) -> int:
    u = r.usage()
    return u["small_objects"] + u["large_objects"]


def _assert_loads(c, key, want: bytes, what: str = "") -> None:
    """Look `key` up and compare every byte of the loaded block with `want`."""
    with c.lookup([key]) as hit:
        assert len(hit) == 1, f"{what}: the key is not in the cache"
        out = c.load(hit)
    got = out[0]
    ref = np.frombuffer(want, np.uint8)
    bad = int(np.count_nonzero(got != ref))
    assert bad == 0, f"{what}: the load returned {bad} bytes that are not the stored block"


def _store_until(c, keys, blocks, deadline_s):
    """store() until every key is in; returns the seconds it took."""
    t0 = time.monotonic()
    left = dict(zip(keys, blocks, strict=True))
    while left:
        got = c.store(list(left), list(left.values()))
        for k in got:
            left.pop(k)
        for k in list(left):  # a key another call stored meanwhile counts too
            with c.lookup([k]) as hit:
                if len(hit):
                    left.pop(k)
        if not left:
            break
        assert time.monotonic() - t0 < deadline_s, \
            f"{len(left)} of {len(keys)} keys were still not storable after {deadline_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


# --- scenario 7: a stalled writer --------------------------------------------------------

def _stalled_writer(spec, node, key, q):
    r = cxlrt.open(spec, node=node)
    c = cxlrt.KVCache(r, "kv", block_bytes=BIG, capacity_blocks=2)
    src = np.full(BIG, 0xAA, np.uint8)
    cxlrt.crash.arm("kv.store.copy", "stop")  # SIGSTOP between two chunks of the copy
    try:
        stored = c.store([key], [src])
        q.put(("stored", stored, ""))
    except Exception as e:  # the answer this test wants: an error, never a silent success
        q.put(("raised", type(e).__name__, str(e), isinstance(e, LeaseLost)))
    finally:
        r.close()


def _stop_mid_copy(r, c, key, pid):
    """Wait until the writer is stopped mid-copy: by its crash point, or by us once a
    quarter of its payload is written. Returns the payload offset."""
    deadline = time.monotonic() + 60
    off = None
    while off is None:
        assert time.monotonic() < deadline, "the writer never claimed its entry"
        off = next((e["offset"] for e in c.entries() if e["key"] == key
                    and e["state"] == "writing"), None)
    quarter = off + 64 + BIG // 4
    while _proc_state(pid) != "T":
        assert time.monotonic() < deadline, "the writer never got a quarter through its copy"
        if r.dma_read(quarter, 8) == b"\xaa" * 8:
            os.kill(pid, signal.SIGSTOP)
            break
    while _proc_state(pid) not in ("T", "gone"):
        time.sleep(0.001)
    assert [e["state"] for e in c.entries() if e["key"] == key] == ["writing"], \
        "the writer finished its copy before it could be stopped"
    return off


@pytest.mark.crash
@pytest.mark.parametrize("case", ["node-alone", "sibling-beats",
                                  pytest.param("no-quarantine", marks=pytest.mark.debug_build)])
def test_a_stalled_writer_never_corrupts_the_block_that_replaced_it(backend, case, keep):
    """Scenario 7: a writer stopped mid-copy past the reclaim bound, its entry taken over
    and the key stored again by another node, then resumed. Its store must fail with a
    clear error, and every load of the key must return exactly the new bytes.

    node-alone: the writer is its node's only process (the node looks dead while it is
    stopped); sibling-beats: another process keeps its node alive; no-quarantine: the
    negative control, the taken payload is freed at once (the broken protocol): the
    resumed writer's bytes must then show up in the new block, and the test see it."""
    r = keep(backend.create(nodes=2, lease=LEASE, size="192M"))
    c = cxlrt.KVCache(r, "kv", block_bytes=BIG, capacity_blocks=2)
    base = _live_objects(r)
    key = c.block_hashes(chain(0, 1))[0]
    if case == "sibling-beats":
        keep(backend.open(1))
    if case == "no-quarantine":
        cxlrt.kvcache._break_quarantine(c)
    p, q = _spawn(_stalled_writer, backend.spec(), 1, key)
    try:
        pid = p.pid  # not through q: a stop could catch the queue's feeder unflushed
        _stop_mid_copy(r, c, key, pid)
        new = np.full(BIG, 0xBB, np.uint8).tobytes()
        # Another node stores the same key again: it must take the stalled claim over
        # (the old code waited four leases of wall clock, and only for a dead node).
        _store_until(c, [key], [new], 8 * LEASE + 10)
        _assert_loads(c, key, new, "before the writer resumed")
        os.kill(pid, signal.SIGCONT)
        if case == "no-quarantine":
            res = q.get(timeout=60)
            p.join(60)
            with pytest.raises(AssertionError, match="not the stored block"):
                _assert_loads(c, key, new, "after a stale writer wrote into freed memory")
            return
        t_end = time.monotonic() + 60
        while p.is_alive() and time.monotonic() < t_end:  # loads while it runs on
            _assert_loads(c, key, new, "while the stale writer ran on")
            p.join(0.01)
        res = q.get(timeout=60)
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(10)
    assert res[0] == "raised", f"the stale writer's store did not fail: {res}"
    assert res[3] and "taken over" in res[2], res
    _assert_loads(c, key, new, "after the stale writer gave up")
    c.recover()
    assert _live_objects(r) == base + len(c.entries()), "a payload leaked"


# --- scenario 9: eviction that cannot fail halfway; dead writers on live nodes -------------

def test_one_eviction_pass_freeing_more_than_a_remote_free_queue_holds(backend, keep):
    """Scenario 9: one eviction pass frees > 504 small payloads of one live node (its
    remote-free queue holds 504). The store must succeed, and once the owner drained,
    every payload that left the cache must be back in the allocator."""
    nblk = 8192  # one pass evicts capacity // 16 = 512 blocks
    r0 = keep(backend.create(nodes=2, size="16M"))
    r1 = keep(backend.open(1))
    c0 = open_cache(r0, block_bytes=64, capacity_blocks=nblk)
    c1 = cxlrt.KVCache(r1, "kv")  # the recorded geometry
    base = _live_objects(r0)
    keys = c1.block_hashes(range(16 * nblk))
    assert c1.store(keys, b"".join(block_for(k, 64) for k in keys)) == keys
    more = c0.block_hashes(chain(1, 1))
    assert c0.store(more, [block_for(more[0], 64)]) == more  # evicts 512 of node 1's
    assert c0.stats()["evictions"] >= 505
    r1._allocator.drain()  # the owner applies the frees queued for it
    c0.recover()           # what could not be queued before is freed now
    r1._allocator.drain()
    assert _live_objects(r0) == base + len(c0.entries()), "evicted payloads leaked"
    _assert_loads(c0, more[0], block_for(more[0], 64))
    _assert_loads(c0, keys[-1], block_for(keys[-1], 64))


def _store_and_get_killed(spec, node, keys, q):
    r = cxlrt.open(spec, node=node)
    c = cxlrt.KVCache(r, "kv", block_bytes=BB, capacity_blocks=16)
    cxlrt.crash.arm("kv.store.copy", "kill")  # SIGKILL between two chunks of the first block
    c.store(keys, [block_for(k) for k in keys])


@pytest.mark.crash
@pytest.mark.parametrize("judge", ["same-host",
                                   pytest.param("other-host", marks=pytest.mark.debug_build)])
def test_a_dead_writer_on_a_live_node_is_reclaimed_by_another_node(backend, judge, keep):
    """Scenario 9: a writer SIGKILLed mid-store while a sibling keeps its node alive.
    Another node must reclaim its WRITING entries within the documented bound:
    at once where it can see the process is gone (same host), within a lease of
    progress standing still where it cannot (another host)."""
    r0 = keep(backend.create(nodes=3, lease=LEASE))
    sibling = keep(backend.open(1))  # node 1 stays alive
    c = open_cache(r0, capacity_blocks=16)
    if judge == "other-host":
        cxlrt.kvcache._as_if_on_another_host(c)
    base = _live_objects(r0)
    keys = c.block_hashes(chain(0, 4))
    p, _ = _spawn(_store_and_get_killed, backend.spec(), 1, keys)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert [e["state"] for e in c.entries()] == ["writing"] * 4
    took = _store_until(c, keys, [block_for(k) for k in keys], 10 * LEASE + 10)
    bound = 1.0 if judge == "same-host" else LEASE + 1.5
    assert took < bound, f"reclaimed after {took:.2f} s (bound {bound} s)"
    for k in keys:
        _assert_loads(c, k, block_for(k))
    if judge == "other-host":
        # Nobody here can see the writer's process, and its node is alive: its
        # payloads stay quarantined until the node's last process detaches.
        c.recover()
        assert c.stats()["quarantined"] == 4
        sibling.close()  # node 1 detached: its writer certainly stopped
    c.recover()  # the dead writer's payloads, quarantined or not, are free again
    assert c.stats()["quarantined"] == 0
    if judge == "other-host":
        sibling = keep(backend.open(1))
    sibling._allocator.drain()  # they came from node 1's heap: it applies our frees
    assert _live_objects(r0) == base + len(c.entries()), "the dead writer's payloads leaked"


@pytest.mark.crash
@pytest.mark.debug_build
def test_a_dead_hosts_quarantine_is_released_after_the_documented_bound(backend, keep):
    """A writer on a host nobody can look up dies mid-store with its whole node: its
    claims are taken over after a lease of standstill and its payloads quarantined;
    they go back to the allocator once its node has been dead for
    QUARANTINE_LEASES leases on the releasing node's clock, not before."""
    r0 = keep(backend.create(nodes=2, lease=LEASE))
    c = open_cache(r0, capacity_blocks=16)
    cxlrt.kvcache._as_if_on_another_host(c)
    base = _live_objects(r0)
    keys = c.block_hashes(chain(0, 4))
    p, _ = _spawn(_store_and_get_killed, backend.spec(), 1, keys)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    _store_until(c, keys, [block_for(k) for k in keys], 10 * LEASE + 10)
    assert c.stats()["quarantined"] == 4
    bound = cxlrt.kvcache.QUARANTINE_LEASES * LEASE
    t0 = time.monotonic()
    while c.stats()["quarantined"]:
        c.recover()  # the first look starts the releasing node's clock
        waited = time.monotonic() - t0
        assert waited < bound + 3, f"still quarantined after {waited:.2f} s (bound {bound} s)"
        if c.stats()["quarantined"]:
            time.sleep(0.05)
    assert waited >= bound - 0.05, f"released after {waited:.2f} s, before the bound {bound} s"
    keep(backend.open(1))._allocator.drain()  # node 1's payloads: it applies our frees
    assert _live_objects(r0) == base + len(c.entries()), "the dead writer's payloads leaked"


# --- scenario 10: pin records given back -------------------------------------------------

def _pin_records(c, node):
    """pids of the records in node `node`'s pin table of cache `c` (0 = free)."""
    from cxlrt.nodelocal import local_dir
    name = next(f for f in os.listdir(local_dir())
                if f.endswith(".pins") and f"-node{node}-" in f)
    with open(os.path.join(local_dir(), name), "rb") as f:
        raw = f.read()
    stride = 64 + (c.slots * 2 + 63) // 64 * 64
    return [int.from_bytes(raw[64 + k * stride:72 + k * stride], "little")
            for k in range((len(raw) - 64) // stride)]


@pytest.mark.parametrize("order", ["cache-first", "region-first", "hit-held"])
def test_reattaching_a_cache_100_times_leaves_no_pin_record(backend, order, keep):
    """Scenario 10: one process opens a region, attaches the cache, pins, closes both,
    100 times. Every cycle works, and no record or pin of it stays behind.

    cache-first: release, close the cache, then the region; region-first: the region
    is closed first (the cache cannot reach its pins any more); hit-held: the cache is
    closed while a hit still pins blocks."""
    r, c, keys = filled(backend, nodes=2, capacity=8, blocks=8)
    keep(r)
    for _ in range(100):
        ri = keep(backend.open(1))
        ci = open_cache(ri, capacity_blocks=8)
        hit = ci.lookup(keys)
        assert len(hit) == 8
        if order == "cache-first":
            hit.release()
            ci.close()
            ri.close()
        elif order == "region-first":
            ri.close()
            ci.close()
            del hit
        else:
            ci.close()
            ri.close()
            hit.release()  # after close: forgotten, not given back twice
    last = keep(backend.open(1))
    open_cache(last, capacity_blocks=8)  # attaching heals what closed regions left
    assert [p for p in _pin_records(c, 1) if p] == [], "pin records stayed behind"
    more = c.block_hashes(chain(1, 8))
    assert c.store(more, [block_for(k) for k in more]) == more  # nothing is still pinned


# --- every kv.* crash point --------------------------------------------------------------

KILL_POINTS = {
    "kv.store.writing": "store",
    "kv.store.copy": "store",
    "kv.store.publish": "store",
    "kv.evict.intent": "store",
    "kv.evict.tombstone": "store",
    "kv.pin": "lookup",
    "kv.pin.raised": "lookup",
    "kv.unpin.lowered": "lookup",
}


def _act_and_die(spec, node, point, op, keys, q):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=8)
    cxlrt.crash.arm(point, "kill")
    if op == "lookup":
        with c.lookup(keys):  # pins, then gives them back
            pass
    else:
        c.store(keys, [block_for(k) for k in keys])
    os._exit(3)  # the point was never reached


@pytest.mark.crash
@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_process_killed_at_a_kv_crash_point_leaves_a_working_cache(backend, point, keep):
    """SIGKILL a process of the node at each kv.* point (a full cache: every store
    evicts). Afterwards other keys store, look up and load exactly; the killed
    process's keys are absent or load exactly, and can be stored again; nothing leaks."""
    assert point in cxlrt.crash.POINTS
    r, c, keys = filled(backend, nodes=2, capacity=8, blocks=8)
    keep(r)
    base = _live_objects(r) - len(c.entries())
    victims = c.block_hashes(chain(1, 2))
    target = keys if KILL_POINTS[point] == "lookup" else victims
    p, _ = _spawn(_act_and_die, backend.spec(), 0, point, KILL_POINTS[point], target)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"exit code {p.exitcode}: {point} was not reached"
    for k in victims + keys:
        with c.lookup([k]) as hit:
            if len(hit):
                assert c.load(hit)[0].tobytes() == block_for(k), "a block changed"
    others = c.block_hashes(chain(2, 2))
    _store_until(c, others, [block_for(k) for k in others], 10)
    for k in others:
        _assert_loads(c, k, block_for(k), "another key")
    _store_until(c, victims, [block_for(k) for k in victims], 10)
    for k in victims:
        _assert_loads(c, k, block_for(k), "the killed process's key, stored again")
    c.recover()
    assert _live_objects(r) == base + len(c.entries()), "a payload leaked"
    assert all(e["state"] == "ready" for e in c.entries())


def _pin_and_die(spec, node, point, nth, keys, q):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=64)
    cxlrt.crash.arm(point, "kill", nth)
    with c.lookup(keys):  # pins, then gives them back
        pass
    os._exit(3)  # the point was never reached


def _delete_from(spec, node, keys, q):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=64)
    q.put(c.delete(keys))
    c.close()
    r.close()


def _lock_slots(r):
    return [r.locks.local.lock_slot(i) for i in range(MAX_LOCKS)]


@pytest.mark.crash
@pytest.mark.parametrize("point,nth,shape", [("kv.pin.raised", 1, "chain"),
                                             ("kv.unpin.lowered", 1, "chain"),
                                             ("kv.unpin.lowered", 2, "two-lines")])
def test_a_sibling_killed_inside_the_pin_mutex_leaves_exact_pins_after_the_sweep(
        backend, point, nth, shape, keep):
    """A process of our node is SIGKILLed holding the pin mutex, between the region's
    pin words and its record of them. The node's heartbeat sweep takes the dead
    holder's mutex before any user of the cache does (the robust mutex then reports
    nothing to whoever takes it next), and marks it. The next taker must still rebuild
    the pin words from the records: afterwards the medium counts no pin at all, and
    the other node can delete every block. Before the fix the sweep's takeover
    swallowed the signal, and the pin the record never counted stayed for the node's
    whole life.

    two-lines: a lookup of [a, b, b], with a's and b's pin words in different lines,
    killed as it lowers its second pin. a's word was lowered and its write-back queued
    but not fenced, which the dead process loses on a medium that delays write-backs:
    the rebuild finds a's word right in the node's view and must write it back anyway."""
    r, c, keys = filled(backend, nodes=2, capacity=64, blocks=8)
    keep(r)
    if shape == "two-lines":
        slot = {e["key"]: e["slot"] for e in c.entries()}
        a = keys[0]
        b = next((k for k in keys if slot[k] // 8 != slot[a] // 8), None)
        assert b is not None, f"all 8 keys' pin words share one line: slots {sorted(slot.values())}"
        keys = [a, b, b]
    recovered = sum(s["recovered"] for s in _lock_slots(r))
    p, _ = _spawn(_pin_and_die, backend.spec(), 0, point, nth, keys)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"exit code {p.exitcode}: {point} was not reached"
    deadline = time.monotonic() + 5
    while True:  # our sweep, unless the heartbeat's is taking the dead holder's mutex
        r.locks.sweep()
        slots = _lock_slots(r)
        if sum(s["recovered"] for s in slots) > recovered or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert sum(s["recovered"] for s in slots) == recovered + 1, "no sweep took the mutex"
    assert [s["repair"] for s in slots].count(True) == 1, "the pin mutex is not marked"
    c.recover()  # rebuilds, then gives back the dead process's record
    assert not any(s["repair"] for s in _lock_slots(r)), "the mark outlived the rebuild"
    r.flush(0, r.size)  # a word left in our node's view would reach the medium later
    (kv,) = cxlrt.inspect(r.spec)["kv_caches"]  # the medium, by DMA; node 1 never pinned
    assert kv["pins"] == 0, "a pin of the killed process stayed in the region"
    p, q = _spawn(_delete_from, backend.spec(), 1, sorted(set(keys)))
    got = q.get(timeout=60)
    p.join(60)
    assert sorted(got) == sorted(set(keys)), "the other node could not delete a block"


def _act_and_stall(spec, node, point, op, keys, q):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=8)
    cxlrt.crash.arm(point, "stop")
    try:
        if op == "lookup":
            with c.lookup(keys) as hit:
                res = ("ok", len(hit), "")
        else:
            res = ("ok", len(c.store(keys, [block_for(k) for k in keys])), "")
    except Exception as e:  # a clear error is an acceptable answer to a stall
        res = ("raised", type(e).__name__, str(e))
    q.put(res)
    try:
        r.close()
    except Exception:  # noqa: BLE001  (a LeaseLost at close says the same again)
        pass


@pytest.mark.crash
@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_a_process_stalled_at_a_kv_crash_point_past_the_lease(backend, point, keep):
    """SIGSTOP a process (its node's only one) at each kv.* point for longer than the
    lease while another node stores other keys and the stalled process's own keys,
    then resume it. It either finishes or fails with LeaseLost/ClaimLost; it never
    writes after its lease ran out: afterwards every key loads exactly or is absent,
    stores work, and nothing leaks."""
    r = keep(backend.create(nodes=2, lease=LEASE))
    c = open_cache(r, capacity_blocks=8)
    keys = c.block_hashes(chain(0, 8))
    assert c.store(keys, [block_for(k) for k in keys]) == keys  # full: every store evicts
    base = _live_objects(r) - len(c.entries())
    victims = c.block_hashes(chain(1, 2))
    op = KILL_POINTS[point]
    target = keys[:2] if op == "lookup" else victims  # a stalled node's pins hold blocks
    p, q = _spawn(_act_and_stall, backend.spec(), 1, point, op, target)
    try:
        deadline = time.monotonic() + 60
        while _proc_state(p.pid) != "T":
            assert p.is_alive(), f"{point} was not reached (exit code {p.exitcode})"
            assert time.monotonic() < deadline, f"{point} was not reached in 60 s"
            time.sleep(0.005)
        others = c.block_hashes(chain(2, 2))
        _store_until(c, others, [block_for(k) for k in others], 10 * LEASE + 10)
        # The stalled process's own keys: its claims, if it made any, are taken over
        # once their progress words stood still for a lease.
        _store_until(c, victims, [block_for(k) for k in victims], 10 * LEASE + 10)
        time.sleep(LEASE)  # stalled for more than a lease in all
        for k in others:
            _assert_loads(c, k, block_for(k), "stored while the other process was stopped")
        os.kill(p.pid, signal.SIGCONT)
        res = q.get(timeout=60)
        p.join(60)
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.join(10)
    assert res[0] == "ok" or res[1] in ("LeaseLost", "ClaimLost"), res
    if res[0] == "raised":  # the lease it names is the region's (was "0 s" below 1 s)
        assert f" {LEASE:g} s lease" in res[2], res
    if point in ("kv.store.copy", "kv.store.publish"):  # its claims were taken over
        assert res[1] == "ClaimLost" and "taken over" in res[2], res
    for k in keys + victims:
        with c.lookup([k]) as hit:
            if len(hit):
                assert c.load(hit)[0].tobytes() == block_for(k), "a block changed"
    for k in others:
        _assert_loads(c, k, block_for(k), "after the stalled process resumed")
    _store_until(c, victims, [block_for(k) for k in victims], 10 * LEASE + 10)
    for k in victims:
        _assert_loads(c, k, block_for(k), "the stalled process's key, stored again")
    c.recover()  # the resumed process exited: what it left behind is given back
    r._allocator.drain()  # frees node 1 queued for node 0's payloads, and the reverse
    keep(backend.open(1))._allocator.drain()
    assert _live_objects(r) == base + len(c.entries()), "a payload leaked"
    assert all(e["state"] == "ready" for e in c.entries())


# --- pins of a node that is gone ---------------------------------------------------------

def _pins_of(r, node):
    """Pins node `node` holds on the region's KV cache, as its pin words say."""
    dir_off = r.sections["directory"][0]
    return cxlrt.kvinspect.describe(r, dir_off)[0]["pins_by_node"][node]


def _delete_until(c, keys, deadline_s):
    """delete() until every key is gone; returns the seconds it took."""
    t0 = time.monotonic()
    left = list(keys)
    while left:
        for k in c.delete(left):
            left.remove(k)
        for k in list(left):  # evicted by someone else meanwhile counts too
            with c.lookup([k]) as hit:
                if not len(hit):
                    left.remove(k)
        if not left:
            break
        assert time.monotonic() - t0 < deadline_s, \
            f"{len(left)} of {len(keys)} pinned keys could not be deleted in {deadline_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def _pin_and_wait(spec, node, keys, q_go, q):
    """Pin `keys` on node `node`; then, per command: die with the pins raised, or load
    the hit and say whether its bytes were the pinned blocks."""
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=8)
    hit = c.lookup(keys)
    q.put(("pinned", len(hit)))
    cmd = q_go.get()
    if cmd == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        out = c.load(hit)
        same = [out[i].tobytes() == block_for(k) for i, k in enumerate(keys)]
        res = ("loaded", same, "")
    except Exception as e:  # the answer a stale hit wants once its blocks are reused
        res = ("raised", type(e).__name__, str(e))
    q.put(res)
    hit.release()
    r.close()


@pytest.mark.crash
@pytest.mark.parametrize("case", ["dead", "detached", "alive"])
def test_pins_of_a_gone_node_do_not_block_eviction(backend, case, keep):
    """A reader pins 4 blocks as its node's only process, then dies (dead: its node's
    counter stands still; detached: a later process of the node leaves it cleanly
    without attaching the cache). Another node must evict and delete those blocks
    within lease + slack; the payloads are quarantined (dead) or freed (detached), the
    counters stay exact, nothing leaks, and when the node attaches the cache again its
    old pin words are gone, not counted twice.

    alive: the negative control, the reader stays alive: its pins hold for good."""
    r = keep(backend.create(nodes=2, lease=LEASE))
    c = open_cache(r, capacity_blocks=8)
    keys = c.block_hashes(chain(0, 8))
    assert c.store(keys, [block_for(k) for k in keys]) == keys
    base = _live_objects(r) - len(c.entries())
    q_go = _CTX.Queue()
    p, q = _spawn(_pin_and_wait, backend.spec(), 1, keys[:4], q_go)
    try:
        assert q.get(timeout=60) == ("pinned", 4)
        assert _pins_of(r, 1) == 4
        if case == "alive":
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3 * LEASE:
                assert c.delete(keys[:4]) == [], "a live node's pinned block was deleted"
                more = c.block_hashes(chain(int(1e3 * (time.monotonic() - t0)) + 10, 2))
                c.store(more, [block_for(k) for k in more])  # evicts around the pins
                time.sleep(0.05)
            with c.lookup(keys[:4]) as hit:
                assert len(hit) == 4
            q_go.put("load")
            res = q.get(timeout=60)
            assert res == ("loaded", [True] * 4, ""), res
            p.join(60)
            assert p.exitcode == 0
            assert c.delete(keys[:4]) == keys[:4]  # released: deletable at once
            return
        q_go.put("die")
        p.join(60)
        assert p.exitcode == -signal.SIGKILL
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
    assert _pins_of(r, 1) == 4, "the dead reader's pins were given back by someone"
    if case == "detached":
        keep(backend.open(1)).close()  # the node's last process leaves cleanly
    took = _delete_until(c, keys[:4], 10 * LEASE + 10)
    bound = 1.0 if case == "detached" else LEASE + 2.0
    assert took < bound, f"deleted after {took:.2f} s (bound {bound} s)"
    # Eviction goes through the same step: a full cache takes new keys in.
    more = c.block_hashes(chain(1, 8))
    _store_until(c, more, [block_for(k) for k in more], 10)
    for k in more:
        _assert_loads(c, k, block_for(k), "stored after the dead reader's blocks left")
    st = c.stats()
    assert st["occupancy"] == len(c.entries()) == 8, st
    assert st["evictions"] >= 8, st
    quarantined = 4 if case == "dead" else 0
    c.recover()  # a detached node's quarantine is released at once
    st = c.stats()
    assert st["quarantined"] == quarantined, c.records()
    if quarantined:
        assert {rec["node"] for rec in c.records()} == {1}, c.records()
    assert _live_objects(r) == base + len(c.entries()) + quarantined, "a payload leaked"
    if case == "dead":
        bound = cxlrt.kvcache.QUARANTINE_LEASES * LEASE
        t0 = time.monotonic()
        while c.stats()["quarantined"]:
            c.recover()
            assert time.monotonic() - t0 < bound + 3, "the dead node's quarantine stayed"
            time.sleep(0.05)
        assert _live_objects(r) == base + len(c.entries()), "a quarantined payload leaked"
    # The node attaches again: its old pins are given back, not counted twice.
    assert _pins_of(r, 1) == 4
    r1 = keep(backend.open(1))
    c1 = open_cache(r1, capacity_blocks=8)
    assert _pins_of(r, 1) == 0, "the node's pins of its earlier process stayed"
    with c1.lookup(more[:4]) as hit:
        assert len(hit) == 4
        assert _pins_of(r, 1) == 4
        assert c.delete(more[:4]) == []
    assert _pins_of(r, 1) == 0
    assert c.delete(more[:4]) == more[:4]
    c1.close()
    assert c.stats()["occupancy"] == len(c.entries()) == 4


@pytest.mark.crash
def test_a_stalled_reader_whose_blocks_were_evicted_and_reused_gets_an_error(backend, keep):
    """A reader, its node's only process, is SIGSTOPped holding a hit past the lease.
    Another node evicts its blocks (the node is dead by its counter), the quarantine
    runs out, and the payload memory is reused for other blocks. Resumed, the reader's
    load of its old hit must raise; it must never return the new blocks' bytes."""
    r = keep(backend.create(nodes=2, lease=LEASE))
    c = open_cache(r, capacity_blocks=8)
    keys = c.block_hashes(chain(0, 8))
    assert c.store(keys, [block_for(k) for k in keys]) == keys
    old = {e["offset"] for e in c.entries() if e["key"] in keys[:2]}
    q_go = _CTX.Queue()
    p, q = _spawn(_pin_and_wait, backend.spec(), 1, keys[:2], q_go)
    try:
        assert q.get(timeout=60) == ("pinned", 2)
        os.kill(p.pid, signal.SIGSTOP)
        while _proc_state(p.pid) != "T":
            time.sleep(0.001)
        took = _delete_until(c, keys[:2], 10 * LEASE + 10)
        assert took < LEASE + 2.0, f"deleted after {took:.2f} s"
        assert c.stats()["quarantined"] == 2
        t0 = time.monotonic()
        while c.stats()["quarantined"]:
            c.recover()
            assert time.monotonic() - t0 < cxlrt.kvcache.QUARANTINE_LEASES * LEASE + 3
            time.sleep(0.05)
        more = c.block_hashes(chain(1, 8))
        _store_until(c, more, [block_for(k) for k in more], 10)
        reused = old & {e["offset"] for e in c.entries()}
        assert reused, "the evicted payloads' memory was not reused (the test proves nothing)"
        assert _proc_state(p.pid) == "T"
        os.kill(p.pid, signal.SIGCONT)
        q_go.put("load")
        res = q.get(timeout=60)
        p.join(60)
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(10)
    assert res[0] == "raised", f"the stale hit loaded: {res}"
    assert res[1] == "LeaseLost" and "evicted" in res[2], res
    for k in more:
        _assert_loads(c, k, block_for(k), "a new block, after the stale reader resumed")
    c.recover()
    assert c.stats()["occupancy"] == len(c.entries()) == 8


def _look_up_across_a_change(spec, node, keys, misses, q_go, q):
    """Make `misses` lookups of absent keys, then look `keys` up, stopped at kv.pin
    (after the pin pass, before the re-check) for the parent to change the entry;
    report the hit, idle (no call of the cache, which would give back a pin left
    for it) until told to go on, then report the cache's counters."""
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=8)
    for i in range(misses):
        c.lookup(c.block_hashes(chain(500 + i, 3))).release()
    cxlrt.crash.arm("kv.pin", "stop")
    hit = c.lookup(keys)
    cxlrt.crash.disarm()
    n = len(hit)
    hit.release()
    q.put(n)
    q_go.get(timeout=120)
    st = c.stats()
    q.put((st["lookups"], st["misses"]))
    q_go.get(timeout=120)
    r.close()


@pytest.mark.crash
@pytest.mark.debug_build
def test_a_lookup_whose_entry_changed_under_its_pin_gives_the_pin_back_and_counts_once(
        backend, keep):
    """A lookup pins a block, the entry changes before the re-check (a delete that
    ignores pins: the broken protocol, as an evictor that read the pins just before
    them would), and the pin mutex is busy at that instant. The lookup misses, and
    its pin comes off before it returns, while the looker then makes no call: a pin
    left for the looker's next call kept the slot pinned for as long as it idled.
    Its counters are published once: putting them back after the pin pass had
    published them counted every pending lookup twice."""
    r, c, keys = filled(backend, nodes=1, capacity=8, blocks=1)
    keep(r)
    before = c.stats()
    q_go = _CTX.Queue()
    p, q = _spawn(_look_up_across_a_change, backend.spec(), 0, keys, 5, q_go)
    try:
        deadline = time.monotonic() + 60
        while _proc_state(p.pid) != "T":
            assert p.is_alive(), f"kv.pin was not reached (exit code {p.exitcode})"
            assert time.monotonic() < deadline, "kv.pin was not reached in 60 s"
            time.sleep(0.005)
        cxlrt.kvcache._break_pin_protocol(c)
        assert c.delete(keys) == keys  # the entry changes under the pin
        with r.lock("kvp:kv"):  # the node's pin mutex, busy while the looker re-checks
            os.kill(p.pid, signal.SIGCONT)
            time.sleep(0.3)
        assert q.get(timeout=60) == 0, "the lookup kept a block whose entry changed"
        assert _pins_of(r, 0) == 0, "the idle looker still pins the changed slot"
        q_go.put(1)
        lookups, misses = q.get(timeout=60)
        assert lookups - before["lookups"] == 6, "a lookup was counted twice"
        assert misses - before["misses"] == 5 * 3 + 1, "a miss was counted twice"
    finally:
        q_go.put(1)
        q_go.put(1)
        p.join(60)
    assert p.exitcode == 0


def _die_holding_the_pin_mutex(spec, node, q):
    r = cxlrt.open(spec, node=node)
    r.lock("kvp:kv").acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _gil_waits(fn):
    """Run fn() while another thread counts how long it waits for the GIL; returns
    (fn's seconds, that thread's longest wait in seconds)."""
    import threading
    gaps, stop = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0)  # lets the GIL go

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.1)
    gaps.clear()
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return took, max(gaps, default=0.0)


def test_the_repair_after_a_dead_pin_mutex_holder_runs_without_the_gil(backend, keep):
    """A short lookup holds the GIL and only tries the pin mutex; a dropped hit
    (its __dealloc__) too. The repair a dead holder leaves (every pin word of the
    node rebuilt from every record: ~0.1 s in a cache of half a million slots) is
    left to a taker without the GIL, so the process's other threads run meanwhile:
    the dropped hit leaves its pins to the cache's next call, and the lookup retries
    without the GIL."""
    r = keep(backend.create(nodes=1, size=256 << 20))
    c = open_cache(r, capacity_blocks=1 << 18, block_bytes=64)
    keys = c.block_hashes(chain(0, 4))
    assert c.store(keys, [bytes(64)] * 4) == keys
    hit = c.lookup(keys)  # our pin record claimed; this hit is dropped below
    p, _ = _spawn(_die_holding_the_pin_mutex, backend.spec(), 0)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL

    def drop():
        nonlocal hit
        del hit

    def look_up():
        with c.lookup(keys) as h:
            assert len(h) == 4

    took_drop, waited_drop = _gil_waits(drop)
    took, waited = _gil_waits(look_up)  # repairs, then gives the dropped hit's pins back
    repair = max(took, took_drop)  # whichever did it
    assert repair > 0.01, f"the repair took {repair * 1e3:.1f} ms: too quick to tell"
    assert waited_drop < repair / 2, (f"dropping a hit took {took_drop * 1e3:.1f} ms, another "
                                      f"thread waited {waited_drop * 1e3:.1f} ms for the GIL")
    assert waited < repair / 2, (f"another thread waited {waited * 1e3:.1f} ms of the "
                                 f"{took * 1e3:.1f} ms lookup for the GIL")
    assert _pins_of(r, 0) == 0, "the dropped hit's pins were not given back"
