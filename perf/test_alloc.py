"""Region allocator: alloc/free pairs against glibc malloc/free.

One group per size, ``alloc_free_64B`` and ``alloc_free_4KiB`` (small size
classes: node-local chunks, no global lock) and ``alloc_free_2MiB`` (large: a
run of 64 KiB chunks taken and given back under the region's global lock).
Rows: ``alloc_free_bench(region._allocator, nbytes, N)``, N x (alloc, free) in
one nogil loop on node 0 of a 64 MiB region, on ``file:`` and, for
information, ``emu:`` (every fault and the checker off). Baseline:
``malloc_free_bench(nbytes, N)``, N x (malloc, touch one byte, free) from glibc
in the same loop shape. Each row's rounds are paired with a baseline run just
before it; ns/op is per alloc+free pair, and ratios compare time per pair (the
emu rows loop fewer times). For information, no target.
"""

from __future__ import annotations

from functools import partial

import pytest

from cxlrt import microbench

ROUNDS = 20
WARMUP = 2
MALLOC_BASELINE = "glibc malloc"
SIZES = {"64B": 64, "4KiB": 4096, "2MiB": 2 << 20}
# ops per call, by (size, case): a round takes about 2-25 ms
N = {"64B": {"malloc": 100_000, "file": 100_000, "emu": 20_000},
     "4KiB": {"malloc": 100_000, "file": 100_000, "emu": 20_000},
     "2MiB": {"malloc": 20_000, "file": 20_000, "emu": 2_000}}


@pytest.mark.parametrize("case", ["malloc", "file", "emu"])
@pytest.mark.parametrize("size", list(SIZES))
def test_alloc_free(bench, small_regions, size, case):
    nbytes, n = SIZES[size], N[size][case]
    bench.describe(f"alloc_free_{size}", case,
                   baseline=MALLOC_BASELINE if case == "malloc" else None, ops=n, op="pair")
    baseline = partial(microbench.malloc_free_bench, nbytes, N[size]["malloc"])
    if case == "malloc":
        assert bench.run(baseline, rounds=ROUNDS, warmup=WARMUP) == n
        return
    region = small_regions(case)
    start = region.usage()["live_bytes"]
    result = bench.run(partial(microbench.alloc_free_bench, region._allocator, nbytes, n),
                       rounds=ROUNDS, warmup=WARMUP,
                       paired=(MALLOC_BASELINE, baseline, N[size]["malloc"]))
    assert result == n
    assert region.usage()["live_bytes"] == start  # every object was freed
    off = region.alloc(nbytes)  # and the allocator still works
    region.free(off)
    assert region.usage()["live_bytes"] == start
