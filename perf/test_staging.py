"""Loads through a StagingWindow against direct loads, from a slow capacity tier.

``kv_load_staged_<bw>GBps``
    16 x 2 MiB KV blocks in an ``emu:`` region whose DMA runs at a modelled 2 or
    8 GB/s (the emulated device spins for the transfer time). An engine consumes
    each block as it loads it: here ``np.sqrt`` and a sum over the block as float32,
    about 0.28 ms for 2 MiB on the 2-vCPU EPYC, standing in for a copy to the GPU or
    a layer's attention. Baseline: lookup, then per block
    ``cache.load(hit, out, start=i, stop=i+1)`` and the consumer, one after the
    other. Row: the same after ``cache.prefetch(hit, window)`` with a window of 4
    blocks, so the refill thread reads block i+1 from the device while the caller
    consumes block i. The ratio is throughput against the direct loads; at best
    (device + consume) / max(device, copy + consume) per block.
"""

from __future__ import annotations

import numpy as np
import pytest

import cxlrt

BB = 2 << 20
NBLK = 16
ROUNDS = 10
WARMUP = 1
DIRECT = "direct load"


@pytest.mark.parametrize("bw", [2, 8])
@pytest.mark.parametrize("case", ["direct", "staged"])
def test_load_through_a_staging_window(bench, sized_regions, case, bw):
    bench.describe(f"kv_load_staged_{bw}GBps", case, baseline=DIRECT if case == "direct" else None,
                   bytes=NBLK * BB, target={"min_ratio": 1.0} if case == "staged" else None)
    region = sized_regions(f"staging-{bw}", f"emu-{bw}GBps", size="96M", nodes=1)
    cache = cxlrt.KVCache(region, "perf-staging", block_bytes=BB, capacity_blocks=NBLK)
    keys = cxlrt.block_hashes(range(16 * NBLK), 16, salt=b"staging")
    rng = np.random.default_rng(13)
    src = rng.integers(0, 256, (NBLK, BB), dtype=np.uint8)
    if not cache.lookup(keys):  # the region is shared by both rows: store once
        assert cache.store(keys, list(src)) == keys
    out = np.zeros((NBLK, BB), np.uint8)
    floats = out.view(np.float32)

    def consume(hit) -> None:
        for i in range(NBLK):
            cache.load(hit, out[i:i + 1], start=i, stop=i + 1)
            with np.errstate(all="ignore"):  # random bytes: some are NaN or negative
                np.sqrt(floats[i]).sum()

    def direct() -> None:
        with cache.lookup(keys) as hit:
            consume(hit)

    if case == "direct":
        bench.run(direct, rounds=ROUNDS, warmup=WARMUP)
    else:
        window = cxlrt.StagingWindow(region, size=4 * BB, slots=4)

        def staged() -> None:
            with cache.lookup(keys) as hit:
                cache.prefetch(hit, window)
                consume(hit)

        bench.run(staged, rounds=ROUNDS, warmup=WARMUP, paired=(DIRECT, direct))
        assert window.stats()["peak_bytes"] <= 4 * BB
        window.close()
    assert np.array_equal(out, src)
    cache.close()
