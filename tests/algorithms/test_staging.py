"""The staging window (issue 13): ordered prefetch into bounded memory, on every backend."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import cxlrt
from cxlrt.staging import StagingWindow
from tests.nodes import raise_failures, run_procs

KIB = 1024


def _objects(r, sizes, seed):
    """Write one object of each size into the heap by DMA; returns [(off, bytes)]."""
    rng = np.random.default_rng(seed)
    out, off = [], r.heap[0]
    for n in sizes:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        r.dma_write(off, data)
        out.append((off, data))
        off += (n + 63) // 64 * 64
    return out


def test_objects_come_back_whole_in_issue_order(backend):
    r = backend.create(size="16M")
    objs = _objects(r, [1, 63, 4 * KIB, 16 * KIB + 5, 300 * KIB, 1 << 20, 3 * KIB] * 3, 1)
    with StagingWindow(r, size="1M", slots=3) as w:
        hs = w.prefetch_many([(o, len(d)) for o, d in objs])
        assert hs == sorted(hs) and len(set(hs)) == len(hs)
        for h, (_, data) in zip(hs, objs, strict=True):
            # Completion is in issue order: whatever is ready is a prefix of the handles.
            # Asked newest first, because the refill thread runs on while we ask: once a
            # handle is seen ready every older one already is, and stays so until released.
            ready = [w.ready(x) for x in reversed(hs) if x >= h]
            assert ready == sorted(ready), ready[::-1]
            v = w.wait(h, timeout=30)
            assert v.tobytes() == data
            del v
            w.release(h)
        st = w.stats()
        assert st["staged"] == 0 and st["bytes_in_use"] == 0 and st["queued"] == 0
        assert st["copied"] == sum(len(d) for _, d in objs)
        assert 0 < st["peak_bytes"] <= 1 << 20
    r.close()


def test_bad_handles_and_objects_are_clear_errors(backend):
    r = backend.create()
    (off, data), = _objects(r, [8 * KIB], 2)
    w = StagingWindow(r, size="64K", slots=2)
    with pytest.raises(cxlrt.StagingError, match="larger than the window"):
        w.prefetch(off, 64 * KIB + 1)
    with pytest.raises(cxlrt.StagingError, match="empty object"):
        w.prefetch(off, 0)
    with pytest.raises(cxlrt.OutOfRangeError):
        w.prefetch(r.size - 8, 64)
    # A bad object in a batch issues nothing of the batch.
    with pytest.raises(cxlrt.StagingError):
        w.prefetch_many([(off, 64), (off, 1 << 20)])
    assert w.stats()["queued"] == 0
    with pytest.raises(cxlrt.StagingHandleError, match="never issued"):
        w.wait(1)
    h = w.prefetch(off, len(data))
    for bad in (0, h + 1, 2**64 - 1):
        with pytest.raises(cxlrt.StagingHandleError, match="never issued"):
            w.wait(bad)
        with pytest.raises(cxlrt.StagingHandleError, match="never issued"):
            w.release(bad)
    assert bytes(w.wait(h, timeout=30)) == data
    w.release(h)
    with pytest.raises(cxlrt.StagingHandleError, match="was released"):
        w.wait(h)
    with pytest.raises(cxlrt.StagingHandleError, match="was released"):
        w.release(h)  # twice
    with pytest.raises(ValueError):
        w.wait(h, timeout=-1)
    w.close()
    with pytest.raises(cxlrt.RegionClosedError):
        w.prefetch(off, 64)
    r.close()
    with pytest.raises(ValueError):
        StagingWindow(backend.create(), size=0)


def test_a_live_view_blocks_its_release_and_its_bytes_stay_put(backend):
    r = backend.create()
    objs = _objects(r, [4 * KIB] * 4, 3)
    w = StagingWindow(r, size="8K", slots=2)
    h1, h2, h3, h4 = w.prefetch_many([(o, len(d)) for o, d in objs])
    v1 = w.wait(h1, timeout=30)
    with pytest.raises(BufferError, match="still alive"):
        w.release(h1)
    with pytest.raises(TypeError):
        v1[0] = 1  # read-only
    arr = np.frombuffer(v1, np.uint8)  # a second view of the same bytes
    del v1
    with pytest.raises(BufferError):
        w.release(h1)
    assert arr.tobytes() == objs[0][1]
    del arr
    w.release(h1)
    for h, (_, data) in zip((h2, h3, h4), objs[1:], strict=True):
        assert bytes(w.wait(h, timeout=30)) == data
        w.release(h)
    w.close()
    r.close()


def test_a_release_makes_room_at_once_and_a_self_deadlock_is_an_error(backend):
    r = backend.create()
    objs = _objects(r, [16 * KIB] * 3, 4)
    w = StagingWindow(r, size="32K", slots=4)
    h1, h2, h3 = w.prefetch_many([(o, len(d)) for o, d in objs])
    v1, v2 = w.wait(h1, timeout=30), w.wait(h2, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(cxlrt.StagingStalled, match="only after a release"):
        w.wait(h3)  # no timeout: it would never end
    assert time.monotonic() - t0 < 5
    with pytest.raises(cxlrt.StagingTimeout):
        w.wait(h3, timeout=0.05)  # with a timeout, another thread's release may come
    del v1
    w.release(h1)  # room for h3 right away, in the bytes h1 had
    assert bytes(w.wait(h3, timeout=30)) == objs[2][1]
    assert w.stats()["peak_bytes"] == 32 * KIB
    del v2
    w.close()
    r.close()


def test_releasing_the_handle_the_window_stalls_on_unstalls_it(backend):
    """A queued handle released while the refill thread waits for room for it: the
    next one fits, and a wait on it must not be told it can never be staged."""
    r = backend.create()
    objs = _objects(r, [16 * KIB, 32 * KIB, KIB], 14)
    w = StagingWindow(r, size="32K", slots=4)
    for _ in range(100):
        h1, h2, h3 = w.prefetch_many([(o, len(d)) for o, d in objs])
        v1 = w.wait(h1, timeout=30)  # held: h2 (32 KiB) cannot fit
        w.release(h2)
        assert bytes(w.wait(h3)) == objs[2][1]  # no timeout: a stall verdict would raise
        w.release(h3)
        del v1
        w.release(h1)
    w.close()
    r.close()


def test_a_wait_with_a_timeout_takes_another_threads_release(backend):
    r = backend.create()
    objs = _objects(r, [32 * KIB, 32 * KIB], 15)
    w = StagingWindow(r, size="32K", slots=2)
    h1, h2 = w.prefetch_many([(o, len(d)) for o, d in objs])
    v1 = w.wait(h1, timeout=30)

    def consumer_done():
        time.sleep(0.05)
        v1.release()
        w.release(h1)

    t = threading.Thread(target=consumer_done)
    t.start()
    assert bytes(w.wait(h2, timeout=30)) == objs[1][1]
    t.join()
    for forever in (float("inf"), 1e19):  # no deadline, yet a timeout: a release may come
        held = w.wait(h2, timeout=30)
        h = w.prefetch(objs[0][0], len(objs[0][1]))

        def later(v=held, h_=h2):
            time.sleep(0.05)
            v.release()
            w.release(h_)

        t = threading.Thread(target=later)
        t.start()
        del held
        assert bytes(w.wait(h, timeout=forever)) == objs[0][1]
        t.join()
        h2 = h
    with pytest.raises(ValueError, match="timeout"):
        w.wait(h, timeout=float("nan"))
    w.close()
    r.close()


def test_closing_from_two_threads_during_a_copy(backend, emu_only):
    """Region.close() from one thread while the window closes from another, with a
    copy in flight: both return only after the refill thread stopped reading."""
    r = cxlrt.open(backend.spec("bw=0.5"), node=0, create=True, size="16M", nodes=1)
    (off, data), = _objects(r, [4 << 20], 16)
    for _ in range(5):
        w = StagingWindow(r, size="4M", slots=1)
        w.prefetch(off, len(data))  # ~8 ms of modelled device time
        time.sleep(0.001)
        t = threading.Thread(target=w.close)
        t.start()
        w.close()
        t.join()
    w = StagingWindow(r, size="4M", slots=1)
    w.prefetch(off, len(data))
    time.sleep(0.001)
    t = threading.Thread(target=w.close)
    t.start()
    r.close()  # closes the window too, and unmaps only after the join
    t.join()
    assert w.closed and r.closed


def test_a_slow_copy_times_out_and_then_completes(backend, emu_only):
    # The emulated device moves 0.05 bytes/ns (50 MB/s): a 2 MiB object takes ~40 ms.
    r = cxlrt.open(backend.spec("bw=0.05"), node=0, create=True, size="8M", nodes=1)
    (off, data), = _objects(r, [2 << 20], 9)
    w = StagingWindow(r, size="2M", slots=1)
    h = w.prefetch(off, len(data))
    with pytest.raises(cxlrt.StagingTimeout, match="not staged within 0.001 s"):
        w.wait(h, timeout=0.001)
    assert bytes(w.wait(h, timeout=30)) == data
    w.close()
    r.close()


def test_releasing_queued_and_in_flight_handles_loses_nothing_else(backend):
    r = backend.create(size="16M")
    objs = _objects(r, [1 << 20] * 8, 5)
    w = StagingWindow(r, size="2M", slots=2)
    hs = w.prefetch_many([(o, len(d)) for o, d in objs])
    for h in hs[1::2]:  # never consumed: queued ones are skipped, a copy stops
        w.release(h)
    for h, (_, data) in list(zip(hs, objs, strict=True))[0::2]:
        assert bytes(w.wait(h, timeout=30)) == data
        w.release(h)
    st = w.stats()
    assert st["staged"] == 0 and st["bytes_in_use"] == 0
    w.close()
    r.close()


def _one_waited(backend, n, seed):
    """A region holding one object of n bytes, and a window that staged it:
    (region, window, handle, view, bytes)."""
    r = backend.create()
    (off, data), = _objects(r, [n], seed)
    w = StagingWindow(r, size=2 * n, slots=2)
    h = w.prefetch(off, len(data))
    return r, w, h, w.wait(h, timeout=30), data


def test_region_close_closes_its_windows_first(backend):
    r, w, h, v, data = _one_waited(backend, 4 * KIB, 6)
    r.close()
    assert w.closed
    assert v.tobytes() == data  # a view taken before the close stays readable
    with pytest.raises(cxlrt.RegionClosedError):
        w.wait(h)
    with pytest.raises(cxlrt.RegionClosedError):
        StagingWindow(r)


def test_window_bytes_never_exceed_the_limit_under_concurrency(backend):
    """A consumer thread waits and releases while a sampler watches the counters and
    the main thread keeps issuing objects of mixed sizes."""
    r = backend.create(size="24M")
    rng = np.random.default_rng(7)
    sizes = [int(x) for x in rng.integers(1, 200 * KIB, 120)]
    objs = _objects(r, sizes, 7)
    size = 512 * KIB
    w = StagingWindow(r, size=size, slots=5)
    seen, errors = [], []
    issued: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            st = w.stats()
            seen.append((st["bytes_in_use"], st["staged"]))

    def consume():
        try:
            i = 0
            while i < len(objs):
                if i >= len(issued):
                    time.sleep(0.0005)
                    continue
                v = w.wait(issued[i], timeout=60)
                if v.tobytes() != objs[i][1]:
                    errors.append(f"object {i} came back wrong")
                del v
                w.release(issued[i])
                i += 1
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=sample), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    for k in range(0, len(objs), 7):
        issued.extend(w.prefetch_many([(o, len(d)) for o, d in objs[k:k + 7]]))
    threads[1].join(timeout=120)
    stop.set()
    threads[0].join(timeout=10)
    assert not errors, errors
    assert seen and max(b for b, _ in seen) <= size and max(s for _, s in seen) <= 5
    assert w.stats()["peak_bytes"] <= size
    w.close()
    r.close()


def _node_reads(case, node, objs, rounds):
    """One process of one node: its own window over the shared region."""
    r = case.open(node)
    with StagingWindow(r, size=256 * KIB, slots=3) as w:
        for k in range(rounds):
            order = objs[k % len(objs):] + objs[:k % len(objs)]
            hs = w.prefetch_many([(o, len(d)) for o, d in order])
            for h, (_, data) in zip(hs, order, strict=True):
                v = w.wait(h, timeout=60)
                assert v.tobytes() == data, f"node {node} round {k}"
                del v
                w.release(h)
            assert w.stats()["peak_bytes"] <= 256 * KIB
    r.close()
    return node


def test_several_nodes_stage_the_same_objects_at_once(backend):
    r = backend.create(size="8M", nodes=4)
    objs = _objects(r, [100 * KIB, 7, 64 * KIB, 128 * KIB, 5 * KIB], 8)
    got = raise_failures(run_procs(_node_reads, [(backend, n, objs, 6) for n in (1, 2, 3)]))
    assert got == [1, 2, 3]
    r.close()


def test_staging_bytes_no_node_published_is_caught(backend, emu_only):
    """The broken protocol: a writer stores an object into its own view and never
    publishes it, and a window stages it by DMA. The emulation's checker catches it."""
    if backend.faulty:
        pytest.skip("random evictions may write the line back before the DMA")
    r = cxlrt.open(backend.spec("check=1"), node=0, create=True, size="4M", nodes=2)
    off = r.heap[0]
    r.store(off, b"x" * 4096)  # in node 0's cache only
    w = StagingWindow(r, size="64K", slots=1)
    h = w.prefetch(off, 4096)
    with pytest.raises(cxlrt.CoherenceError):
        w.wait(h, timeout=30)
    w.release(h)  # a failed handle holds no room, but is released like any other
    r.persist(off, 4096)  # the fixed protocol: publish, then stage
    h = w.prefetch(off, 4096)
    assert bytes(w.wait(h, timeout=30)) == b"x" * 4096
    w.close()
    r.close()


def _use_inherited(w, h):
    """In a forked child: every call on the parent's window is a clear error, and
    dropping it (with a view of it alive) neither hangs nor crashes."""
    msgs = []
    for call in (lambda: w.prefetch(w.region.heap[0], 64), lambda: w.wait(h),
                 lambda: w.release(h), w.stats, lambda: w.ready(h)):
        try:
            call()
        except cxlrt.StagingError as e:
            msgs.append(str(e))
    w.close()
    return msgs


def test_a_window_does_not_survive_fork(backend):
    r, w, h, v, data = _one_waited(backend, 64 * KIB, 10)
    msgs, = raise_failures(run_procs(_use_inherited, [(w, h)]))
    assert len(msgs) == 5 and all("does not survive fork" in m for m in msgs), msgs
    assert v.tobytes() == data  # the parent's window is untouched
    del v
    w.release(h)
    w.close()
    r.close()


# --- the KV cache over a window (HyMCache's request-level prefetch) ---------------------

def _kv(r, n, bb=32 * KIB, cap=64, salt=b"stage"):
    cache = cxlrt.KVCache(r, "staged", block_bytes=bb, capacity_blocks=cap)
    keys = cxlrt.block_hashes(range(16 * n), 16, salt=salt)
    blocks = [_block(k, bb) for k in keys]
    assert cache.store(keys, blocks) == keys
    return cache, keys, blocks


def _block(key: bytes, bb: int) -> np.ndarray:
    """Bytes derived from the key, so every process can check a load."""
    return np.frombuffer((key * (bb // len(key) + 1))[:bb], np.uint8)


def test_a_prefetched_hit_loads_the_stored_blocks(backend):
    r = backend.create(size="16M")
    cache, keys, blocks = _kv(r, 12)
    w = StagingWindow(r, size=4 * 32 * KIB, slots=4)
    with cache.lookup(keys) as hit:
        cache.prefetch(hit, w)
        out = cache.load(hit)
        assert all(np.array_equal(out[i], blocks[i]) for i in range(12))
        assert w.stats()["copied"] == 12 * 32 * KIB  # every block came through the window
        assert w.stats()["bytes_in_use"] == 0
        with pytest.raises(ValueError, match="prefetched already"):
            cache.prefetch(hit, w)
        again = cache.load(hit, start=3)  # nothing staged any more: the direct path
        assert np.array_equal(again[0], blocks[3])
    with cache.lookup(keys) as hit:  # one block at a time, as an engine consumes them
        cache.prefetch(hit, w)
        for i in range(12):
            assert np.array_equal(cache.load(hit, start=i, stop=i + 1)[0], blocks[i])
        assert w.stats()["copied"] == 2 * 12 * 32 * KIB
    other = cxlrt.open(f"file:{backend.root}/other", node=0, create=True, size="4M", nodes=1)
    with cache.lookup(keys) as hit, pytest.raises(ValueError, match="this cache's region"):
        cache.prefetch(hit, StagingWindow(other, size="1M"))
    other.close()
    with cache.lookup(keys) as hit, pytest.raises(TypeError):
        cache.prefetch(hit, object())
    w.close()
    cache.close()
    r.close()


def test_releasing_a_prefetched_hit_releases_what_load_left(backend):
    r = backend.create(size="16M")
    cache, keys, blocks = _kv(r, 8, cap=8)
    w = StagingWindow(r, size=2 * 32 * KIB, slots=2)
    hit = cache.lookup(keys)
    cache.prefetch(hit, w)
    out = cache.load(hit, start=6)  # blocks 0-5 were staged (or queued), never consumed
    assert np.array_equal(out[1], blocks[7])
    hit.release()
    st = w.stats()
    assert st["staged"] == 0 and st["bytes_in_use"] == 0 and st["queued"] == 0
    # Unpinned: a store of new blocks may evict all of them.
    new = cxlrt.block_hashes(range(10**6, 10**6 + 16 * 8), 16, salt=b"stage")
    assert cache.store(new, [_block(k, 32 * KIB) for k in new]) == new
    with cache.lookup(keys) as hit:
        assert len(hit) == 0
    w.close()
    cache.close()
    r.close()


def test_a_hit_whose_window_is_held_by_another_loads_directly(backend):
    """Two hits share a window; the first holds it full and unconsumed. The second's
    load cannot be staged before a release nobody will make: it reads the region
    directly instead of failing or hanging, and still checks every block."""
    r = backend.create(size="16M")
    cache, keys, blocks = _kv(r, 6)
    w = StagingWindow(r, size=2 * 32 * KIB, slots=2)
    first, second = cache.lookup(keys[:3]), cache.lookup(keys)
    cache.prefetch(first, w)
    cache.prefetch(second, w)
    out = cache.load(second)
    assert all(np.array_equal(out[i], blocks[i]) for i in range(6))
    assert np.array_equal(cache.load(first)[2], blocks[2])
    first.release()
    second.release()
    st = w.stats()
    assert st["staged"] == 0 and st["queued"] == 0 and st["bytes_in_use"] == 0
    w.close()
    cache.close()
    r.close()


def churning(cache, work):
    """work() while this process keeps storing new blocks into `cache`, evicting
    whatever is not pinned; its result."""
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            ks = cxlrt.block_hashes(range(10**7 + i, 10**7 + i + 16 * 4), 16, salt=b"stage")
            cache.store(ks, [_block(k, 32 * KIB) for k in ks])
            i += 16 * 4

    t = threading.Thread(target=churn)
    t.start()
    try:
        return work()
    finally:
        stop.set()
        t.join(timeout=60)


def prefetching_reader(case, node, keys, rounds, where="host"):
    """Look up, prefetch, load, check every byte. `where` the blocks are staged: "host"
    (a window in this process), "device" (a device window), "none" (the device itself,
    no window)."""
    r = case.open(node)
    cache = cxlrt.KVCache(r, "staged", block_bytes=32 * KIB, capacity_blocks=24)
    w = (StagingWindow(r, size=3 * 33 * KIB, slots=3, device=where == "device")
         if where != "none" else None)
    loaded = 0
    for _ in range(rounds):
        with cache.lookup(keys) as hit:
            cache.prefetch(hit, w)
            out = cache.load(hit)
            for i in range(len(hit)):
                assert np.array_equal(out[i], _block(keys[i], 32 * KIB)), f"block {i}"
            loaded += len(hit)
            short = len(hit) < len(keys)
        if short:  # evicted meanwhile: put the chain back, as an engine would
            cache.store(keys, [_block(k, 32 * KIB) for k in keys])
    if w is not None:
        w.close()
    cache.close()
    r.close()
    return loaded


def test_prefetching_readers_never_see_another_writers_bytes(backend):
    """Readers on three nodes prefetch and load while node 0 keeps storing new blocks
    into a cache too small for all of them, evicting whatever is not pinned."""
    r = backend.create(size="16M", nodes=4)
    cache, keys, _ = _kv(r, 10, cap=24)
    got = churning(cache, lambda: raise_failures(run_procs(
        prefetching_reader, [(backend, n, keys, 15) for n in (1, 2, 3)])))
    assert all(g > 0 for g in got), got  # every reader loaded blocks through its window
    cache.close()
    r.close()


# --- the KV manager: per-request windows within a budget ----------------------------------

def test_the_kv_manager_divides_its_budget_and_never_stalls(backend):
    from cxlrt.kvmanager import KVManager
    r = backend.create(size="8M")
    objs = _objects(r, [96 * KIB] * 4, 11)
    m = KVManager(r, budget="1M", per_request="384K", slots=4)  # min_window: 96 KiB
    a, b, c = m.open("a"), m.open("b"), m.open("c")
    assert (a.size, b.size, c.size) == (384 * KIB, 384 * KIB, 256 * KIB)  # c: what was left
    assert m.open("d") is None  # nothing left: load directly, do not wait
    assert m.stats() == {"budget": 1 << 20, "in_use": 1 << 20, "open": 3, "opened": 3,
                         "shrunk": 1, "refused": 1}
    with pytest.raises(ValueError, match="already has a window"):
        m.open("a")
    m.close("b")
    with pytest.raises(KeyError):
        m.close("b")
    assert b.closed
    with m.request("d") as d:  # b's bytes came back
        assert d.size == 384 * KIB
        hs = d.prefetch_many([(o, len(x)) for o, x in objs])
        for h, (_, data) in zip(hs, objs, strict=True):
            assert bytes(d.wait(h, timeout=30)) == data
            d.release(h)
    assert d.closed and m.stats()["in_use"] == 640 * KIB
    for bad in ({"budget": 0}, {"per_request": -1}, {"slots": 0}, {"per_request": True},
                {"slots": (1 << 16) + 1},
                {"budget": "1M", "min_window": "2M"}):
        with pytest.raises(ValueError):
            KVManager(r, **bad)
    r.close()  # closes the windows still open; the manager only forgets them
    assert a.closed and c.closed
    m.close_all()
    assert m.stats()["in_use"] == 0 and m.stats()["open"] == 0


def test_kv_manager_windows_stay_within_the_budget_under_concurrency(backend):
    from cxlrt.kvmanager import KVManager
    r = backend.create(size="8M")
    (off, data), = _objects(r, [64 * KIB], 12)
    m = KVManager(r, budget="512K", per_request="192K", slots=2)
    errors, over = [], []

    def client(k):
        try:
            for i in range(30):
                with m.request((k, i)) as w:
                    st = m.stats()
                    if st["in_use"] > st["budget"]:
                        over.append(st)
                    if w is not None:
                        h = w.prefetch(off, len(data))
                        if bytes(w.wait(h, timeout=30)) != data:
                            errors.append((k, i))
                        w.release(h)
        except Exception as e:
            errors.append(repr(e))

    ts = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors and not over, (errors, over)
    st = m.stats()
    assert st["opened"] + st["refused"] == 180 and st["in_use"] == 0 and st["open"] == 0
    r.close()
