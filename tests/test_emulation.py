"""The emulation is not secretly coherent: broken protocols must fail under it.

These are the negative controls of the memory model (STYLE.md rule 23): each
drops one flush, observe or fence from a correct protocol and checks that the
emulation loses the update or its checker raises CoherenceError.
"""

from __future__ import annotations

import pytest

import cxlrt
from tests.nodes import host_lock, run_procs


def test_unpublished_store_is_invisible_to_other_nodes(backend, emu_only):
    a = backend.create(nodes=2)
    b = backend.open(1)
    off = a.heap[0]
    a.store64(off, 5)  # no flush: stays in node 0's cache unless a fault evicts it
    b.flush(off, 8)
    seen = b.load64(off)
    assert seen in (0, 5)
    if not a.stats()["evictions"]:
        assert seen == 0  # only an injected write-back may publish it early
    assert a.load64(off) == 5
    a.close()
    b.close()


def test_stale_copy_until_observe(region_dir):
    spec = f"emu:{region_dir}/r"
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    b = cxlrt.open(spec, node=1)
    off = a.heap[0]
    assert b.load64(off) == 0  # b now caches the line
    a.store64(off, 9)
    a.persist(off, 8)
    assert b.load64(off) == 0  # served from b's stale copy: no coherence
    b.flush(off, 8)
    assert b.load64(off) == 9
    a.close()
    b.close()


def test_checker_catches_a_read_without_observe(region_dir):
    spec = f"emu:{region_dir}/r?check=1"
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    b = cxlrt.open(spec, node=1)
    off = a.heap[0] + 128
    b.load64(off)
    a.store64(off, 9)
    a.persist(off, 8)
    with pytest.raises(cxlrt.CoherenceError, match="stale-read") as e:
        b.load64(off)
    assert (e.value.kind, e.value.offset, e.value.node) == ("stale-read", off, 1)
    a.close()
    b.close()


@pytest.mark.parametrize("check", [0, 1])
def test_two_nodes_writing_one_line_lose_an_update(region_dir, check):
    spec = f"emu:{region_dir}/r?check={check}"
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    b = cxlrt.open(spec, node=1)
    off = a.heap[0]
    a.store64(off, 1)          # bytes 0..7 of the line
    if check:
        with pytest.raises(cxlrt.CoherenceError, match="dirty-in-two-nodes") as e:
            b.store64(off + 8, 2)
        assert (e.value.node, e.value.other, e.value.offset) == (1, 0, off)
    else:
        b.store64(off + 8, 2)  # bytes 8..15 of the same line
        a.persist(off, 64)
        b.persist(off, 64)     # b's whole-line write-back carries a stale bytes 0..7
        got = a.dma_read(off, 16)
        assert got != (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
        assert got[:8] == bytes(8), "node 0's update should have been lost"
    a.close()
    b.close()


def test_flush_without_fence_is_not_published_under_delay(region_dir):
    spec = f"emu:{region_dir}/r?delay=1"
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    b = cxlrt.open(spec, node=1)
    off = a.heap[0]
    a.store64(off, 3)
    a.flush(off, 8, drain=False)  # clflushopt: queued, not complete
    b.flush(off, 8)
    assert b.load64(off) == 0
    a.fence()                     # completes the queued write-back
    b.flush(off, 8)
    assert b.load64(off) == 3
    assert a.stats()["delayed_flushes"] == 1
    a.close()
    b.close()


def test_evictions_make_unflushed_data_visible_early(region_dir):
    spec = f"emu:{region_dir}/r?evict=1&seed=3"
    # A long lease: the heartbeat (which persists the node area) stays quiet meanwhile.
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=1, lease=600)
    off = a.heap[0]
    flushed = a.stats()["writebacks"]  # the attach published the node area
    for i in range(1, 51):  # never flushed; evict=1 writes dirty lines back anyway
        a.store64(off, i)
    seen = int.from_bytes(a.dma_read(off, 8), "little")
    assert 1 <= seen <= 50
    assert a.stats()["evictions"] >= 1
    assert a.stats()["writebacks"] == flushed  # nothing was flushed on purpose
    a.close()


def test_capacity_victims_are_written_back(region_dir):
    spec = f"emu:{region_dir}/r?cache=4K&ways=2"
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=1)
    base = a.heap[0]
    for i in range(256):  # 16 KiB of lines through a 4 KiB cache
        a.store64(base + i * 64, i + 1)
    assert a.stats()["capacity_writebacks"] > 0
    evicted = [int.from_bytes(a.dma_read(base + i * 64, 8), "little") for i in range(64)]
    assert evicted == list(range(1, 65))  # the oldest lines reached the medium whole
    a.close()


def _unprotected_counter(spec, node, lockfile, iters, observe_publish):
    r = cxlrt.open(spec, node=node)
    off = r.heap[0]
    try:
        for _ in range(iters):
            with host_lock(lockfile):
                if observe_publish:
                    r.flush(off, 8)
                v = r.load64(off)
                r.store64(off, v + 1)
                if observe_publish:
                    r.persist(off, 8)
    except cxlrt.CoherenceError as e:
        return e
    finally:
        st = r.stats()
        r.close()
    return st


def test_counter_without_flush_loses_updates_or_is_caught(backend, emu_only):
    """The broken protocol: mutual exclusion, but no observe and no publish."""
    nodes, iters = 3, 300
    r0 = backend.create(nodes=nodes)
    lock = backend.path + ".lock"
    res = run_procs(_unprotected_counter,
                    [(backend.spec(), n, lock, iters, False) for n in range(nodes)])
    caught = [e for e in res if isinstance(e, cxlrt.CoherenceError)]
    assert not [e for e in res if isinstance(e, BaseException) and e not in caught]
    final = backend.medium_word(r0.heap[0])  # the bytes the medium holds, unchecked
    seed = backend.seed
    assert caught or final < nodes * iters, (
        f"broken protocol went unnoticed on {backend.name} (seed {seed}): final={final}")
    if "check=1" in backend.params:
        assert caught, f"the checker missed the broken protocol (seed {seed})"
        assert caught[0].kind in ("dirty-in-two-nodes", "stale-read", "store-to-stale")
    r0.close()


def test_same_counter_with_observe_and_publish_is_exact(backend, emu_only):
    nodes, iters = 3, 300
    r0 = backend.create(nodes=nodes)
    lock = backend.path + ".lock"
    res = run_procs(_unprotected_counter,
                    [(backend.spec(), n, lock, iters, True) for n in range(nodes)])
    assert all(isinstance(s, dict) for s in res), res
    assert int.from_bytes(r0.dma_read(r0.heap[0], 8), "little") == nodes * iters
    r0.close()


def test_dma_over_a_dirty_line_is_caught(region_dir):
    spec = f"emu:{region_dir}/r?check=1"
    a = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    b = cxlrt.open(spec, node=1)
    off = a.heap[0]
    a.store64(off, 1)
    with pytest.raises(cxlrt.CoherenceError, match="dma-over-dirty"):
        b.dma_write(off, b"x" * 64)
    a.persist(off, 8)
    b.dma_write(off, b"x" * 64)  # published first: fine
    a.close()
    b.close()
