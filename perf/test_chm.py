"""HyMCache's observation 1 at one point: reading a prefix 4x the device's DRAM.

``chm_read_4x_dram``
    64 KV blocks of 1 MiB (4x the 16 MiB of device DRAM) in a ``chm:`` device whose
    SSD takes 20 us a request and reads at 4 GB/s (perf/conftest.py SPECS). Each
    round reads the whole prefix through the runtime as an engine would: lookup,
    ``prefetch`` into a 4-block StagingWindow, ``load``. Baseline: the device under
    ``lru``, its DRAM a transparent page cache, so every 64 KiB page of the scan is a
    miss of its own. Row: the same device and runtime under ``staging``, where each
    block is one sequential SSD request that fills nothing. Target: 2x. A second row
    stages in the device's DRAM instead (``StagingWindow(device=True)``, HyMCache's
    design: each block and its header one sequential request, read from DRAM). The
    whole per-turn curve, with writes between turns, is ``perf/chm_turns.py``.
"""

from __future__ import annotations

import numpy as np

import cxlrt

MIB = 1 << 20
NBLK = 64
ROUNDS = 5
WARMUP = 1
LRU = "lru device"


def _prefix(sized_regions, kind, device=False):
    region = sized_regions(f"chm-{kind}", f"chm-{kind}", size="192M", nodes=1)
    cache = cxlrt.KVCache(region, "perf-chm", block_bytes=MIB, capacity_blocks=NBLK)
    keys = cxlrt.block_hashes(range(16 * NBLK), 16, salt=b"chm")
    src = np.random.default_rng(5).integers(0, 256, (NBLK, MIB), dtype=np.uint8)
    if not cache.lookup(keys):
        assert cache.store(keys, list(src)) == keys
    # A device window stages each block with its header: a device page more per slot.
    window = cxlrt.StagingWindow(region, size=4 * (MIB + (64 << 10 if device else 0)), slots=4,
                                 device=device)
    out = np.zeros((NBLK, MIB), np.uint8)

    def read() -> None:
        with cache.lookup(keys) as hit:
            cache.prefetch(hit, window)
            cache.load(hit, out)

    return cache, window, read, out, src


def test_read_a_prefix_four_times_dram(bench, sized_regions):
    bench.describe("chm_read_4x_dram", "lru", baseline=LRU, bytes=NBLK * MIB)
    cache, window, read, out, src = _prefix(sized_regions, "lru")
    bench.run(read, rounds=ROUNDS, warmup=WARMUP)
    assert np.array_equal(out, src)
    window.close()
    cache.close()


def test_read_a_prefix_four_times_dram_staged(bench, sized_regions):
    bench.describe("chm_read_4x_dram", "staging", bytes=NBLK * MIB,
                   target={"min_ratio": 2.0})
    lru = _prefix(sized_regions, "lru")
    cache, window, read, out, src = _prefix(sized_regions, "staging")
    bench.run(read, rounds=ROUNDS, warmup=WARMUP, paired=(LRU, lru[2]))
    assert np.array_equal(out, src) and np.array_equal(lru[3], lru[4])
    assert window.stats()["peak_bytes"] <= 4 * MIB
    for c in (cache, lru[0]):
        c.close()
    window.close()
    lru[1].close()


def test_read_a_prefix_four_times_dram_staged_in_device_dram(bench, sized_regions):
    bench.describe("chm_read_4x_dram", "staging, device window", bytes=NBLK * MIB,
                   target={"min_ratio": 2.0})
    lru = _prefix(sized_regions, "lru")
    cache, window, read, out, src = _prefix(sized_regions, "staging", device=True)
    bench.run(read, rounds=ROUNDS, warmup=WARMUP, paired=(LRU, lru[2]))
    assert np.array_equal(out, src) and np.array_equal(lru[3], lru[4])
    st = window.stats()
    assert st["refused"] == 0 and st["copied"] >= NBLK * MIB  # every block was held in DRAM
    assert cache.region.backend.pinned() == (0, 0)
    for c in (cache, lru[0]):
        c.close()
    window.close()
    lru[1].close()
