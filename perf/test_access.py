"""Cost of one 8-byte access protocol step, each timed as one nogil loop of N.

Groups:

``store_flush_fence``
    N x (store64, flush of its line, fence): the publish step. Baseline:
    ``local_store_fence`` (volatile store + full fence on private memory).
``load_after_flush``
    N x (flush of a line, load64 from it): the observe step. Baseline:
    ``local_load`` (volatile load from private memory).

Rows: ``file:``, ``emu:`` with every fault and the checker off, and ``emu:``
with ``check=1`` for information. ns/op is per iteration of the loop (the whole
step). Target: ``emu:`` with the checker off under 250 ns/op.
"""

from __future__ import annotations

from functools import partial

import pytest

from cxlrt import microbench

N = 100_000
ROUNDS = 20
WARMUP = 2
VALUE = 7  # what load_after_flush reads back N times
TARGET = {"max_ns_per_op": 250}
CASES = ["local", "file", "emu", "emu-check"]


def _info(case: str, baseline: str) -> dict:
    info = {"ops": N, "target": TARGET if case == "emu" else None}
    if case == "local":
        info["baseline"] = baseline
    return info


def _word(region, off: int) -> int:
    """The 8-byte word at `off` as the medium holds it (bypassing node views)."""
    return int.from_bytes(region.dma_read(off, 8), "little")


@pytest.mark.parametrize("case", CASES)
def test_store_flush_fence(benchmark, describe, regions, case):
    describe("store_flush_fence", case, **_info(case, "local store+fence"))
    if case == "local":
        result = benchmark.pedantic(partial(microbench.local_store_fence, N), rounds=ROUNDS,
                                    warmup_rounds=WARMUP)
        assert result == N  # the last value stored, loaded back
        return
    region = regions(case)
    off = region.heap[0]
    region.dma_write(off, bytes(8))
    result = benchmark.pedantic(partial(microbench.store_flush_fence, region, off, N),
                                rounds=ROUNDS, warmup_rounds=WARMUP)
    assert result == N
    assert _word(region, off) == N  # the last store reached the medium: it was published


@pytest.mark.parametrize("case", CASES)
def test_load_after_flush(benchmark, describe, regions, case):
    describe("load_after_flush", case, **_info(case, "local load"))
    if case == "local":
        result = benchmark.pedantic(partial(microbench.local_load, N), rounds=ROUNDS,
                                    warmup_rounds=WARMUP)
        assert result == 3 * N  # local_load's word holds 3
        return
    region = regions(case)
    off = region.heap[0] + 4096
    region.store64(off, VALUE)
    region.persist(off, 8)
    assert _word(region, off) == VALUE
    result = benchmark.pedantic(partial(microbench.load_after_flush, region, off, N),
                                rounds=ROUNDS, warmup_rounds=WARMUP)
    assert result == VALUE * N  # every load saw the published value
