"""How cost grows (issue 12): chain length, process count, block size.

Every group holds one baseline row measured in the same run, and every other row's
rounds are paired with a run of that baseline just before it (conftest.Bench.run):
the ratios are what to read, never the absolute figures of a shared machine.
``extra_info["scaling"]`` names the curve (``lookup``, ``handoffs``, ``store``,
``load``) and ``extra_info["scaling_x"]`` its point; perf/plot_scaling.py draws them.

Groups:

``scaling_lookup_NNN``
    ``with cache.lookup(keys)`` on chains of NNN = 8, 32, 128, 512 blocks (16-byte
    chained keys, every block cached, 64-byte blocks), on ``file:`` and ``emu:``
    (faults and checker off). About 8192 keys per call: 1024 chains of 8 down to
    16 of 512. Baseline: a Python dict of the same keys walked the same way (stop
    at the first miss). Rate = lookups (whole chains) per second.
``scaling_handoffs_NNp``
    NN = 2, 4, 8, 16 forked processes, nodes 0..NN-1 of an NN-node ``file:``
    region, each running ``lock_bench(lock, N)`` on the same lock, released
    together by a barrier; handoffs/s = NN x N / round time (the parent's wall
    clock). Rows: bakery, and manager (granted by a manager thread in this
    process). Baseline: the same number of processes on one robust
    process-shared pthread mutex. N shrinks with the process count so that a
    round stays short on 2 cores. The regions are created with a 60 s lease: 16
    spinning processes on 2 cores can starve a heartbeat past the 2 s default.
``scaling_store_KKKKKKiB`` / ``scaling_load_KKKKKKiB``
    ``cache.store`` (into a cache of twice the blocks, filled first, so every
    timed store evicts; keys hashed beforehand, untimed) and lookup +
    ``cache.load`` into a preallocated array + release, of 32 MiB a call in
    blocks of 64 KiB (512 blocks), 2 MiB (16) and 32 MiB (1), on ``file:`` and
    ``emu:``. Baseline: numpy copying the same blocks between
    preallocated arrays. Ratio = the row's throughput over numpy's.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from _helpers import (
    Group,
    cache_lookups,
    chains,
    dict_lookups,
    lock_worker,
    mutex_worker,
    numpy_copy,
    random_blocks,
)

import cxlrt

DICT = "python dict"
NUMPY = "numpy copy"
MUTEX = "pthread mutex"

# --- lookups ------------------------------------------------------------------------

CHAIN_LENGTHS = [8, 32, 128, 512]
LOOKUP_KEYS = 8192  # keys per call, whatever the chain length
LOOKUP_ROUNDS, LOOKUP_WARMUP = 10, 2


@pytest.mark.parametrize("case", ["dict", "file", "emu"])
@pytest.mark.parametrize("length", CHAIN_LENGTHS)
def test_lookup_rate_by_chain_length(bench, regions, length, case):
    n = LOOKUP_KEYS // length
    bench.describe(f"scaling_lookup_{length:03d}", case, baseline=DICT if case == "dict" else None,
                   ops=n, op="lookup", rate="lookups", scaling="lookup", scaling_x=length)
    ch = chains(n, length, b"scaling")
    d = {k: i for i, keys in enumerate(ch) for k in keys}
    baseline = partial(dict_lookups, d, ch)
    if case == "dict":
        assert bench.run(baseline, rounds=LOOKUP_ROUNDS, warmup=LOOKUP_WARMUP) == n * length
        return
    cache = cxlrt.KVCache(regions(case), f"scaling-lookup-{length}", block_bytes=64,
                          capacity_blocks=n * length)
    for keys in ch:
        assert cache.store(keys, bytes(64 * length)) == keys
    got = bench.run(partial(cache_lookups, cache, ch), rounds=LOOKUP_ROUNDS,
                    warmup=LOOKUP_WARMUP, paired=(DICT, baseline))
    assert got == n * length  # every chain hit in full
    assert cache_lookups(cache, ch[:1]) == length


# --- lock handoffs ------------------------------------------------------------------

PROCS = [2, 4, 8, 16]
# loop length per process and round, by process count: a round lasts about 50-150 ms
# on 2 shared cores, long enough for the processes' loops to overlap (measured: bakery
# 8M handoffs/s at 2 processes, 0.1-0.3M from 4 on; manager about 0.1M down to 35k at
# 16; the mutex 30-55M, mostly re-acquisitions by the process that just released)
HANDOFF_N = {
    "mutex": {2: 500_000, 4: 300_000, 8: 150_000, 16: 80_000},
    "bakery": {2: 200_000, 4: 10_000, 8: 2_500, 16: 800},
    "manager": {2: 4_000, 4: 2_000, 8: 1_000, 16: 300},
}
HANDOFF_ROUNDS, HANDOFF_WARMUP = 7, 1
LEASE_S = 60.0


# Python >= 3.12 warns when forking a process with threads (here: the regions'
# heartbeat and lock-manager threads); the children only attach and run nogil loops.
_FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


@pytest.mark.filterwarnings(_FORK_WARNING)
@pytest.mark.parametrize("case", ["mutex", "bakery", "manager"])
@pytest.mark.parametrize("procs", PROCS)
def test_handoffs_by_process_count(bench, sized_regions, mutex, procs, case):
    n = HANDOFF_N[case][procs]
    nm = HANDOFF_N["mutex"][procs]
    bench.describe(f"scaling_handoffs_{procs:02d}p", case,
                   baseline=MUTEX if case == "mutex" else None, ops=procs * n, rate="handoffs",
                   scaling="handoffs", scaling_x=procs)
    if case == "mutex":
        with Group(partial(mutex_worker, mutex, nm), procs) as group:
            bench.run(group, rounds=HANDOFF_ROUNDS, warmup=HANDOFF_WARMUP)
        group.check(nm)
        bench.extra_info["overlap"] = group.overlap(HANDOFF_ROUNDS)
        return
    manager = case == "manager"
    region = sized_regions(f"lock-{case}-{procs}", "file", size="16M", nodes=procs,
                           lease=LEASE_S, lock_manager=manager)
    lk = region.lock("scaling", mode=case)
    before = lk.acquisitions()
    with (Group(partial(mutex_worker, mutex, nm), procs) as base,
          Group(partial(lock_worker, region.spec, lk.name, n), procs) as group):
        bench.run(group, rounds=HANDOFF_ROUNDS, warmup=HANDOFF_WARMUP,
                  paired=(MUTEX, base, procs * nm))
    group.check(n)
    base.check(nm)
    overlap = group.overlap(HANDOFF_ROUNDS)
    bench.extra_info["overlap"] = overlap
    bench.extra_info["note"] = f"loops overlapped {overlap:.0%} of the round (median)"
    after = lk.acquisitions()
    # every acquisition went through the global tier, once per loop step on every node
    assert [a - b for a, b in zip(after, before, strict=True)] == [group.rounds * n] * procs
    assert lk.acquire(timeout=5.0)  # nobody left it held
    lk.release()


# --- store / load bandwidth -----------------------------------------------------------

KiB, MiB = 1 << 10, 1 << 20
BLOCK_SIZES = [64 * KiB, 2 * MiB, 32 * MiB]
BULK_BYTES = 32 * MiB  # per call, whatever the block size
BULK_ROUNDS, BULK_WARMUP = 15, 2


def _bulk(bench, sized_regions, op: str, block: int, case: str):
    """Describe a bandwidth row; returns (region, blocks, numpy baseline), or None once
    the numpy row itself has run."""
    nblk = BULK_BYTES // block
    bench.describe(f"scaling_{op}_{block // KiB:05d}KiB", case,
                   baseline=NUMPY if case == "numpy" else None, bytes=BULK_BYTES,
                   scaling=op, scaling_x=block)
    src = random_blocks(nblk, block)
    baseline = partial(numpy_copy, src, np.ones((nblk, block), np.uint8))
    if case == "numpy":
        bench.run(baseline, rounds=BULK_ROUNDS, warmup=BULK_WARMUP)
        return None
    # store: 2 x 32 MiB a cache, load: 32 MiB; three block sizes each, plus the index
    region = sized_regions(f"bulk-{case}", case, size="512M", nodes=2)
    return region, src, baseline


@pytest.mark.parametrize("case", ["numpy", "file", "emu"])
@pytest.mark.parametrize("block", BLOCK_SIZES, ids=lambda b: f"{b // KiB}KiB")
def test_store_bandwidth_by_block_size(bench, sized_regions, block, case):
    got = _bulk(bench, sized_regions, "store", block, case)
    if got is None:
        return
    region, src, baseline = got
    nblk = len(src)
    cache = cxlrt.KVCache(region, f"scaling-store-{block}", block_bytes=block,
                          capacity_blocks=2 * nblk)
    # keys for every call, hashed here, untimed: two to fill the cache, then warmup + rounds
    # (one call with --benchmark-disable)
    key_sets = [cxlrt.block_hashes([i] * 16 * nblk, 16, salt=b"scaling-store")
                for i in range(2 + BULK_WARMUP + BULK_ROUNDS)]
    calls = iter(key_sets)
    stored: list[list[bytes]] = []

    def store() -> None:
        stored.append(cache.store(next(calls), src))

    store()
    store()  # the cache is full: every timed store evicts
    bench.run(store, rounds=BULK_ROUNDS, warmup=BULK_WARMUP, paired=(NUMPY, baseline))
    assert stored == key_sets[:len(stored)]  # every call stored every block (evicting)
    assert cache.stats()["evictions"] >= nblk * (len(stored) - 2)
    with cache.lookup(stored[-1]) as hit:
        assert len(hit) == nblk
        assert np.array_equal(cache.load(hit), np.stack(src))


@pytest.mark.parametrize("case", ["numpy", "file", "emu"])
@pytest.mark.parametrize("block", BLOCK_SIZES, ids=lambda b: f"{b // KiB}KiB")
def test_load_bandwidth_by_block_size(bench, sized_regions, block, case):
    got = _bulk(bench, sized_regions, "load", block, case)
    if got is None:
        return
    region, src, baseline = got
    nblk = len(src)
    cache = cxlrt.KVCache(region, f"scaling-load-{block}", block_bytes=block,
                          capacity_blocks=nblk)
    keys = cxlrt.block_hashes(range(16 * nblk), 16, salt=b"scaling-load")
    assert cache.store(keys, src) == keys
    out = np.zeros((nblk, block), np.uint8)

    def load() -> None:
        with cache.lookup(keys) as hit:
            cache.load(hit, out)

    bench.run(load, rounds=BULK_ROUNDS, warmup=BULK_WARMUP, paired=(NUMPY, baseline))
    assert np.array_equal(out, np.stack(src))
