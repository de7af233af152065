"""Prefetch into the device's own memory (HyMCache's chm_prefetch_object), on every backend.

A backend whose device takes prefetch hints (chm: under policy=staging) holds the
objects in its DRAM for any process to read; every other backend says so plainly:
Region.prefetch is False, a device window is a clear error, KVCache.prefetch(hit)
takes nothing. Either way every byte a load returns is the stored one.
"""

from __future__ import annotations

import numpy as np
import pytest

import cxlrt
from cxlrt.staging import StagingWindow
from tests.nodes import raise_failures, run_procs

from .test_staging import _kv, _objects, churning, prefetching_reader

KIB = 1024


def _takes_hints(backend) -> bool:
    return backend.name == "chm-staging"


def test_a_device_window_stages_in_issue_order_or_is_refused_plainly(backend):
    r = backend.create(size="8M")
    objs = _objects(r, [1, 5 * KIB, 16 * KIB + 7, 40 * KIB, 3 * KIB] * 3, 21)
    off, data = objs[2]
    assert r.prefetch(off, len(data)) is _takes_hints(backend)
    r.prefetch_wait(off, len(data))
    assert r.dma_read(off, len(data)) == data
    r.prefetch_release(off, len(data))
    if not _takes_hints(backend):
        with pytest.raises(ValueError, match="takes no prefetch hints"):
            StagingWindow(r, size="64K", device=True)
        r.close()
        return
    with StagingWindow(r, size=96 * KIB, slots=3, device=True) as w:
        assert w.device
        hs = w.prefetch_many([(o, len(d)) for o, d in objs])
        for h, (o, d) in zip(hs, objs, strict=True):
            ready = [w.ready(x) for x in reversed(hs) if x >= h]
            assert ready == sorted(ready), ready[::-1]
            assert w.wait(h, timeout=30) is True  # held in device DRAM
            assert r.dma_read(o, len(d)) == d
            w.release(h)
        with pytest.raises(cxlrt.StagingHandleError):
            w.release(hs[0])
        with pytest.raises(cxlrt.StagingError, match="larger than the window"):
            w.prefetch(off, 97 * KIB)
        st = w.stats()
        assert st["staged"] == 0 and st["bytes_in_use"] == 0 and st["refused"] == 0
        assert st["copied"] == sum(len(d) for _, d in objs)
        assert 0 < st["peak_bytes"] <= 96 * KIB
    assert r.backend.pinned() == (0, 0)  # every hold given back
    r.close()


def test_a_device_with_no_room_refuses_and_the_read_is_still_right(backend):
    if not _takes_hints(backend):
        r = backend.create(size="4M")
        (off, data), = _objects(r, [64 * KIB], 3)
        assert r.prefetch(off, len(data)) is False
        r.close()
        return
    r = backend.create(size="8M")
    big = _objects(r, [160 * KIB, 40 * KIB], 4)
    (boff, bdata), (soff, sdata) = big
    r.backend.writeback(drop=True)  # nothing in DRAM (the write buffer took the last writes)
    assert r.prefetch(boff, len(bdata))  # 40 of the 48 cache frames less the reserve
    assert not r.prefetch(soff, len(sdata))  # would leave the CPU path no frames
    assert r.backend.stats()["prefetch_refusals"] >= 1
    with StagingWindow(r, size=64 * KIB, slots=2, device=True) as w:
        h = w.prefetch(soff, len(sdata))
        assert w.wait(h, timeout=30) is False  # refused: read it from the SSD
        assert r.dma_read(soff, len(sdata)) == sdata
        w.release(h)
        assert w.stats()["refused"] == 1
    r.prefetch_release(boff, len(bdata))
    assert r.prefetch(soff, len(sdata))
    r.prefetch_release(soff, len(sdata))
    assert r.backend.pinned() == (0, 0)
    r.close()


@pytest.mark.parametrize("how", ["window", "device"])
def test_a_device_prefetched_hit_loads_the_stored_blocks(backend, how):
    r = backend.create(size="16M")
    cache, keys, blocks = _kv(r, 6)
    if how == "window" and not _takes_hints(backend):
        with pytest.raises(ValueError, match="takes no prefetch hints"):
            StagingWindow(r, size="128K", device=True)
        cache.close()
        r.close()
        return
    w = StagingWindow(r, size=3 * 33 * KIB, slots=3, device=True) if how == "window" else None
    with cache.lookup(keys) as hit:
        took = cache.prefetch(hit, w)
        assert took == (6 if w is not None else 6 * _takes_hints(backend))
        out = cache.load(hit)
        assert all(np.array_equal(out[i], blocks[i]) for i in range(6))
    with cache.lookup(keys) as hit:  # released with nothing loaded: the holds go too
        cache.prefetch(hit, w, start=2)
    if _takes_hints(backend):
        assert r.backend.pinned() == (0, 0)
    if w is not None:
        assert w.stats()["bytes_in_use"] == 0
        w.close()
    cache.close()
    r.close()


def test_device_prefetching_readers_never_see_another_writers_bytes(backend):
    """Readers on three nodes prefetch into the device (two through windows, one with
    none) and load, while node 0 keeps storing new blocks into a cache too small for
    all of them: a payload reused under a device prefetch is caught, never loaded."""
    r = backend.create(size="16M", nodes=4)
    cache, keys, _ = _kv(r, 6, cap=24)
    got = churning(cache, lambda: raise_failures(run_procs(
        prefetching_reader,
        [(backend, n, keys, 10, "device" if _takes_hints(backend) and n != 3 else "none")
         for n in (1, 2, 3)])))
    assert all(g > 0 for g in got), got
    if _takes_hints(backend):
        # Windows gave their holds back; a reader with none released its hits.
        assert r.backend.pinned() == (0, 0)
    cache.close()
    r.close()


def test_a_kv_manager_hands_out_device_windows_within_its_budget(backend):
    from cxlrt.kvmanager import KVManager
    r = backend.create(size="8M")
    objs = _objects(r, [20 * KIB] * 4, 13)
    m = KVManager(r, budget="96K", per_request="64K", slots=2, device=True)
    if not _takes_hints(backend):
        with pytest.raises(ValueError, match="takes no prefetch hints"):
            m.open("a")
        assert m.stats()["in_use"] == 0  # nothing counted for a window never made
        r.close()
        return
    with m.request("a") as a, m.request("b") as b:
        assert a.device and (a.size, b.size) == (64 * KIB, 32 * KIB)
        assert m.open("c") is None  # spent: load directly
        for w in (a, b):
            hs = w.prefetch_many([(o, len(d)) for o, d in objs])
            for h, (o, d) in zip(hs, objs, strict=True):
                assert w.wait(h, timeout=30) is True
                assert r.dma_read(o, len(d)) == d
                w.release(h)
    assert m.stats()["in_use"] == 0 and r.backend.pinned() == (0, 0)
    with pytest.raises(ValueError, match="device must be True or False"):
        KVManager(r, device="yes")
    r.close()
