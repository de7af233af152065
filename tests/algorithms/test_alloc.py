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
    # but a free that arrived after an owner's last drain waits for its next beat.
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
