"""Prefetch into the CXL-HM device's DRAM (``chm:?policy=staging``): HyMCache's
chm_prefetch_object / wait / release, as Region.prefetch / prefetch_wait /
prefetch_release and the CXL_HINT_PREFETCH / WAIT / RELEASE hints.

What must hold: a prefetched page is read from DRAM once it has landed, and a read of
one still landing waits for its modelled SSD read; the clock passes over pinned
frames until they are released; pins are advice, so a holder that dies or stops
loses its pins when they lapse, a scribbled pin table holds nothing, and no pin state
can make a read return other bytes than the page's one copy.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import cxlrt
from cxlrt.emulation import chmside
from tests.nodes import raise_failures, run_procs

from .chmdevice import die_inside

PAGE = 4096
SEED = int(os.environ.get("CXLRT_PREFETCH_SEED", "1234"))


def _open(d, *, policy="staging", dram="256K", extra="", node=0, create=True):
    spec = f"chm:{d}/r?policy={policy}&dram={dram}&page=4K" + (f"&{extra}" if extra else "")
    if create:
        return cxlrt.open(spec, node=node, create=True, size="8M", nodes=4)
    return cxlrt.open(spec, node=node)


def _geo(r, dram="256K"):
    return chmside.geometry(r.size, {"page": PAGE, "dram": chmside.parse_size(dram),
                                     "policy": "staging"})


def _pins(m, geo):
    return np.frombuffer(m, np.uint64, 4 * geo["frames"], geo["pins"]).reshape(-1, 4)


def _written(r, pages):
    off = r.alloc(pages * PAGE, align=PAGE)
    data = os.urandom(pages * PAGE)
    r.dma_write(off, data)
    r.backend.writeback(drop=True)  # on the SSD only
    return off, data


def test_a_prefetch_lands_in_dram_pinned_and_its_release_unpins(region_dir):
    r = _open(region_dir, extra="lat=20000&bw=2")
    off, data = _written(r, 32)
    s0 = r.backend.stats()
    assert r.prefetch(off, len(data)) is True
    assert r.backend.pinned() == (32, 32)
    r.prefetch_wait(off, len(data))
    assert r.dma_read(off, len(data)) == data
    s1 = r.backend.stats()
    assert s1["prefetched"] - s0["prefetched"] == 32
    assert s1["hits"] - s0["hits"] == 32 and s1["direct_reads"] == s0["direct_reads"]
    # one sequential SSD request for the whole run
    assert s1["busy_ns"] - s0["busy_ns"] == 20000 + int(32 * PAGE / 2)
    assert r.prefetch(off, PAGE)  # a second hold on the first page
    assert r.backend.pinned() == (32, 33)
    r.prefetch_release(off, len(data))
    assert r.backend.pinned() == (1, 1)
    r.prefetch_release(off, PAGE)
    r.prefetch_release(off, PAGE)  # one release too many: nothing to give back
    assert r.backend.pinned() == (0, 0)
    r.close()


def test_a_read_of_a_page_still_landing_waits_for_its_modelled_read(region_dir):
    r = _open(region_dir, extra="lat=100000&bw=0.1")  # 0.1 B/ns: 4 KiB in 41 us
    off, data = _written(r, 40)
    model_ns = 100000 + 40 * PAGE / 0.1  # about 1.74 ms for the run
    t0 = time.monotonic_ns()
    assert r.prefetch(off, len(data))
    assert r.dma_read(off + 39 * PAGE, PAGE) == data[39 * PAGE:]  # the last page to land
    assert time.monotonic_ns() - t0 >= model_ns * 0.99
    t0 = time.monotonic_ns()
    assert r.prefetch(off + 2 * PAGE, PAGE)  # in DRAM already: nothing more to wait for
    r.prefetch_wait(off, len(data))
    assert r.dma_read(off, len(data)) == data
    assert time.monotonic_ns() - t0 < 2e9  # a generous bound: no modelled wait is left
    r.prefetch_release(off, len(data))
    r.prefetch_release(off + 2 * PAGE, PAGE)
    r.close()


def test_the_clock_passes_pinned_frames_and_takes_released_ones(region_dir):
    r = _open(region_dir)  # 64 frames
    hot, hdata = _written(r, 16)
    cold = r.alloc(256 * PAGE, align=PAGE)
    assert r.prefetch(hot, len(hdata))
    r.load(cold, 256 * PAGE)  # CPU loads: a scan of 4x DRAM through the cache frames
    s0 = r.backend.stats()
    assert r.dma_read(hot, len(hdata)) == hdata
    assert r.backend.stats()["hits"] - s0["hits"] == 16  # every pinned page stayed
    r.prefetch_release(hot, len(hdata))
    r.load(cold, 256 * PAGE)  # the same scan, now that nothing holds them
    s0 = r.backend.stats()
    assert r.dma_read(hot, len(hdata)) == hdata
    s1 = r.backend.stats()
    assert s1["hits"] == s0["hits"] and s1["direct_reads"] == s0["direct_reads"] + 1
    r.close()


def test_a_prefetch_that_would_leave_the_cpu_path_no_frames_is_refused_whole(region_dir):
    r = _open(region_dir)  # 64 frames, 8 kept unpinned
    a, adata = _written(r, 50)
    b, bdata = _written(r, 10)
    assert r.prefetch(a, len(adata))
    before = r.backend.resident()
    assert r.prefetch(b, len(bdata)) is False
    assert r.backend.resident() == before and r.backend.pinned() == (50, 50)
    assert r.backend.stats()["prefetch_refusals"] == 1
    assert r.dma_read(b, len(bdata)) == bdata  # straight from the SSD
    r.store64(a, 5)  # the CPU path still gets a frame, and writes to a pinned page
    assert r.load64(a) == 5 and r.dma_read(a + 8, PAGE - 8) == adata[8:PAGE]
    r.prefetch_release(a, len(adata))
    r.close()


def test_prefetch_is_advice_only_where_the_device_takes_none(region_dir):
    r = _open(region_dir, policy="lru")
    off = r.alloc(4 * PAGE, align=PAGE)
    assert r.prefetch(off, 4 * PAGE) is False  # the transparent cache takes no advice
    r.prefetch_wait(off, 4 * PAGE)
    r.prefetch_release(off, 4 * PAGE)
    with pytest.raises(ValueError, match="empty range"):
        r.prefetch(off, 0)
    with pytest.raises(cxlrt.OutOfRangeError):
        r.prefetch(r.size - PAGE, 2 * PAGE)
    with pytest.raises(cxlrt.OutOfRangeError):
        r.prefetch_release(2**64 - PAGE, 2 * PAGE)
    r.close()
    for bad in ("pin=5", "pin=x"):
        with pytest.raises(ValueError, match="pin"):
            _open(region_dir, extra=bad)


def _hold_and_wait(spec, off, n, wr):
    r = cxlrt.open(spec, node=1)
    assert r.prefetch(off, n)
    os.write(wr, b"1")
    while True:  # holding, until the parent stops or kills us
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_stopped_holders_pins_lapse(region_dir, sig):
    r = _open(region_dir, extra="pin=200000000")  # pins lapse after 200 ms
    a, adata = _written(r, 50)
    b, bdata = _written(r, 10)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _hold_and_wait(r.spec, a, len(adata), wr)
        finally:
            os._exit(3)
    try:
        assert os.read(rd, 1) == b"1"
        os.kill(pid, sig)
        taken = time.monotonic()
        assert r.prefetch(b, len(bdata)) is False  # the holder's 50 pages are still held
        while time.monotonic() - taken < 0.25:
            time.sleep(0.02)
        assert r.backend.pinned() == (0, 0)  # lapsed: the holder never released them
        assert r.prefetch(b, len(bdata)) is True
        assert r.dma_read(a, len(adata)) == adata and r.dma_read(b, len(bdata)) == bdata
        r.prefetch_release(b, len(bdata))
    finally:
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(rd)
        os.close(wr)
    r.close()


def test_a_scribbled_pin_table_holds_nothing_and_never_stalls_a_read(region_dir):
    r = _open(region_dir)
    off, data = _written(r, 40)
    assert r.prefetch(off, len(data))
    geo = _geo(r)

    def scribble(m, ftab, pmap):  # a holder killed while it wrote the pin table
        p = _pins(m, geo)
        p[:, 0] = 2**63  # landing in 292 years
        p[:, 1] = 2**63  # pinned as long
        p[:, 2] = 7

    die_inside(f"{region_dir}/r.chm", geo, scribble)
    t0 = time.monotonic()
    assert r.dma_read(off, len(data)) == data
    assert time.monotonic() - t0 < 5
    assert r.backend.stats()["repairs"] == 1
    assert r.backend.pinned() == (0, 0)
    b, bdata = _written(r, 50)
    assert r.prefetch(b, len(bdata))  # nothing counts as pinned
    r.prefetch_release(b, len(bdata))
    r.close()


def test_killed_between_publishing_a_prefetched_page_and_its_entry(region_dir):
    """_prefetch maps a run's frames as _publish does: the page map first, then the
    entry naming the page back. A holder killed between leaves a FILL frame the map
    names: the page is read from the SSD, and repair drops the frame."""
    r = _open(region_dir)
    off, data = _written(r, 4)
    pg = off // PAGE
    geo = _geo(r)

    def half_published(m, ftab, pmap):
        ftab[5] = (pg + 1) << 8 | 8  # FILL: its bytes are not yet the page's
        pmap[pg] = 6
        memoryview(m)[geo["data"] + 5 * PAGE:geo["data"] + 6 * PAGE] = b"\xee" * PAGE
        p = _pins(m, geo)
        p[5, :3] = (0, 2**62, 1)

    die_inside(f"{region_dir}/r.chm", geo, half_published)
    assert r.dma_read(off, len(data)) == data
    assert r.backend.stats()["repairs"] == 1
    assert r.prefetch(off, len(data))
    assert r.dma_read(off, len(data)) == data
    r.prefetch_release(off, len(data))
    r.close()


def _shared_prefix(spec, off, n, rounds, seed):
    """One process of one node: prefetch the shared prefix, read it, release it."""
    r = cxlrt.open(spec, node=0)
    rng = np.random.default_rng(seed)
    want = bytes(r.dma_read(off, n))
    for _ in range(rounds):
        k = int(rng.integers(1, n // PAGE + 1)) * PAGE
        took = r.prefetch(off, k)
        assert r.dma_read(off, n) == want
        if took:
            r.prefetch_release(off, k)
    r.close()
    return True


def test_two_processes_of_one_node_prefetch_one_prefix_at_once(region_dir):
    r = _open(region_dir)
    off, data = _written(r, 16)
    spec = r.spec
    raise_failures(run_procs(_shared_prefix, [(spec, off, len(data), 200, SEED + i)
                                              for i in range(2)]))
    assert r.backend.pinned() == (0, 0), f"seed {SEED}"  # every hold was given back
    r.close()


def _writer(spec, offs, rounds, seed):
    """Rewrite whole blocks, each filled with one version byte, in one DMA write."""
    r = cxlrt.open(spec, node=1)
    rng = np.random.default_rng(seed)
    for v in range(1, rounds + 1):
        o = offs[int(rng.integers(len(offs)))]
        r.dma_write(o, bytes([v % 251]) * BLOCK)
    r.close()
    return True


def _prefetching_reader(spec, node, offs, rounds, seed):
    """Prefetch blocks (some overlapping: both halves of neighbours), read, check each
    is whole (one version byte throughout), release."""
    r = cxlrt.open(spec, node=node)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        i = int(rng.integers(len(offs)))
        lo = offs[i] - (BLOCK // 2 if i and rng.integers(2) else 0)
        took = r.prefetch(lo, BLOCK)
        got = r.dma_read(offs[i], BLOCK)
        assert got == got[:1] * BLOCK, f"torn block {i} (seed {seed})"
        if took:
            r.prefetch_release(lo, BLOCK)
    r.close()
    return True


BLOCK = 6 * PAGE


def _call(fn, args):
    return fn(*args)


def test_prefetching_readers_and_a_writer_never_see_a_torn_or_stale_block(region_dir):
    r = _open(region_dir, extra="pin=50000000")
    offs = [r.alloc(BLOCK, align=PAGE) for _ in range(12)]
    for o in offs:
        r.dma_write(o, b"\x00" * BLOCK)
    spec = r.spec
    procs = [(_writer, (spec, offs, 400, SEED))]
    procs += [(_prefetching_reader, (spec, n, offs, 300, SEED + n)) for n in (2, 3)]
    res = raise_failures(run_procs(_call, procs))
    assert all(res), f"seed {SEED}"
    assert r.backend.pinned() == (0, 0), f"seed {SEED}"
    r.close()


# --- device windows and KV hits: every hold given back once, nothing waits for ever --------

SLOW_READS = "bw=0.001&wbw=100"  # reads at 1 MB/s (4 ms a page), writes at once


def _kv(d, extra, n=4):
    r = cxlrt.open(f"chm:{d}/r?policy=staging&dram=1M&page=4K&{extra}", node=0, create=True,
                   size="16M", nodes=4)
    cache = cxlrt.KVCache(r, "staged", block_bytes=32 * 1024, capacity_blocks=16)
    keys = cxlrt.block_hashes(range(16 * n), 16, salt=b"pf")
    blocks = [np.full(32 * 1024, i + 1, np.uint8) for i in range(n)]
    assert cache.store(keys, blocks) == keys
    r.backend.writeback(drop=True)  # on the SSD only: prefetches take their modelled time
    return r, cache, keys, blocks


def _returns(fn, within=10.0):
    """fn() in a thread; True if it returned within `within` seconds (never a hang)."""
    import threading
    done = threading.Event()
    err = []

    def run():
        try:
            fn()
        except BaseException as e:  # reported to the caller
            err.append(e)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    ok = done.wait(within)
    if err:
        raise err[0]
    return ok


@pytest.mark.parametrize("then", ["hit-release", "load", "region-close"])
def test_a_device_window_closed_with_prefetches_in_flight_hangs_nothing(region_dir, then):
    r, cache, keys, blocks = _kv(region_dir, SLOW_READS)  # 34 ms a block
    hit = cache.lookup(keys)
    w = cxlrt.StagingWindow(r, size=4 * 33 * 1024, slots=4, device=True)
    cache.prefetch(hit, w)
    time.sleep(0.05)  # the first is landing, the others queued on the device
    w.close()
    assert r.backend.pinned() == (0, 0)  # the closed window gave its holds back
    if then == "load":
        out = []
        assert _returns(lambda: out.append(cache.load(hit)))
        assert all(np.array_equal(out[0][i], blocks[i]) for i in range(4))
    if then == "region-close":
        cache.close()
        r.close()
    assert _returns(hit.release)
    if then != "region-close":
        cache.close()
        r.close()


def test_releasing_an_in_flight_device_prefetch_does_not_wait_for_it_to_land(region_dir):
    r = _open(region_dir, dram="1M", extra=SLOW_READS)
    objs = [_written(r, 32) for _ in range(4)]  # 131 ms each to land, one after another
    w = cxlrt.StagingWindow(r, size=4 * 32 * PAGE, slots=4, device=True)
    hs = w.prefetch_many([(o, len(d)) for o, d in objs])
    time.sleep(0.02)
    t0 = time.monotonic()
    w.release(hs[-1])  # lands 520 ms from now
    assert time.monotonic() - t0 < 0.25  # its call returned: nothing waits to land
    (o0, d0) = objs[0]
    assert w.wait(hs[0], timeout=30) is True and r.dma_read(o0, len(d0)) == d0
    for h in hs[:-1]:
        w.release(h)
    w.close()
    assert r.backend.pinned() == (0, 0)
    r.close()


def test_a_forked_child_never_gives_back_its_parents_device_holds(region_dir):
    r, cache, keys, _ = _kv(region_dir, "lat=1000")
    hit, hit2 = cache.lookup(keys), cache.lookup(keys)
    assert cache.prefetch(hit) == 4 and cache.prefetch(hit2) == 4
    frames, holds = r.backend.pinned()
    pid = os.fork()
    if pid == 0:
        try:
            hit.release()  # the child's copy: the holds are the parent's
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert r.backend.pinned() == (frames, holds)
    hit.release()
    assert r.backend.pinned() == (frames, holds // 2)  # hit2 still holds every page
    hit2.release()
    assert r.backend.pinned() == (0, 0)
    cache.close()
    r.close()


def test_a_failed_device_prefetch_falls_back_to_a_direct_load(region_dir, monkeypatch):
    from cxlrt.emulation import chm
    monkeypatch.setattr(chm, "LOCK_TIMEOUT_S", 0.3)
    r, cache, keys, blocks = _kv(region_dir, "lat=1000", n=2)
    hit = cache.lookup(keys)
    w = cxlrt.StagingWindow(r, size=2 * 33 * 1024, slots=2, device=True)
    geo = _geo(r, "1M")
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process stopped while it holds the device lock
        try:
            import ctypes

            from cxlrt.mapping import Mapping
            m = Mapping(f"{region_dir}/r.chm", geo["total"])
            buf = (ctypes.c_char * m.size).from_buffer(m)
            ctypes.CDLL(None).pthread_mutex_lock(ctypes.byref(buf, chmside.LOCK_OFFSET))
            os.write(wr, b"1")
            os.kill(os.getpid(), signal.SIGSTOP)
        finally:
            os._exit(0)
    try:
        assert os.read(rd, 1) == b"1"
        cache.prefetch(hit, w)  # the refill thread's prefetch times out on the lock
        time.sleep(1.0)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(rd)
        os.close(wr)
    out = cache.load(hit)  # the device recovers; the load reads the region directly
    assert all(np.array_equal(out[i], blocks[i]) for i in range(2))
    for h in (1, 2):  # both handles were given back by the load
        with pytest.raises(cxlrt.StagingHandleError):
            w.release(h)
    hit.release()
    w.close()
    cache.close()
    r.close()


def test_frames_a_power_cycle_frees_hold_no_pins(region_dir):
    r = _open(region_dir, extra="pin=1000000000000")  # pins would last 1000 s
    a, adata = _written(r, 50)
    b, bdata = _written(r, 20)
    assert r.prefetch(a, len(adata))
    r.backend.writeback(drop=True)
    assert r.backend.pinned() == (0, 0)
    assert r.prefetch(b, len(bdata))  # the dropped frames are free for it
    r.prefetch_release(b, len(bdata))
    r.prefetch_release(a, len(adata))  # nothing of a's is held any more: a no-op
    r.close()


def test_a_child_forked_while_a_device_window_waits_can_close_the_region(region_dir):
    r = _open(region_dir, dram="1M", extra=SLOW_READS)
    objs = [_written(r, 32) for _ in range(4)]
    w = cxlrt.StagingWindow(r, size=4 * 32 * PAGE, slots=4, device=True)
    hs = w.prefetch_many([(o, len(d)) for o, d in objs])
    time.sleep(0.05)  # the refill thread is inside the device, waiting for a landing
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if _returns(r.close, within=15) else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 4: close() waited for the parent's thread
    for h in hs:
        w.release(h)
    w.close()
    assert r.backend.pinned() == (0, 0)
    r.close()


def test_a_prefetch_that_fails_part_way_leaves_no_pins(region_dir):
    r = _open(region_dir, dram="1M", extra="pin=1000000000000")
    off, data = _written(r, 32)
    r.load(off, 8 * PAGE)  # its first 8 pages in cache frames: pinned first by a prefetch
    size = os.path.getsize(f"{region_dir}/r")
    os.truncate(f"{region_dir}/r", off + 16 * PAGE)  # the SSD loses the range's tail
    try:
        with pytest.raises(cxlrt.MediumError):
            r.prefetch(off, len(data))
        assert r.backend.pinned() == (0, 0)  # nobody holds what the failed call pinned
    finally:
        os.truncate(f"{region_dir}/r", size)
    assert r.dma_read(off, 8 * PAGE) == data[:8 * PAGE]
    r.close()
