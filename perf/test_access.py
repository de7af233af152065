"""Cost of one 8-byte access protocol step, each timed as one nogil loop of N.

Groups:

``store_flush_fence``
    N x (store64, flush of its line, fence): the publish step. Baseline:
    ``local_store_fence`` (volatile store + full fence on private memory).
``load_after_flush``
    N x (flush of a line, load64 from it): the observe step. Baseline:
    ``local_load`` (volatile load from private memory).

Rows: ``file:``, ``emu:`` with every fault and the checker off, and ``emu:``
with ``check=1`` for information; each of their rounds is paired with a
baseline loop run just before it. ns/op is per loop iteration (the whole step).
Target: ``emu:`` with the checker off under 250 ns/op.
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

STORE_BASELINE = ("local store+fence", partial(microbench.local_store_fence, N))
LOAD_BASELINE = ("local load", partial(microbench.local_load, N))


def _describe(bench, group: str, case: str, baseline: tuple) -> None:
    bench.describe(group, case, baseline=baseline[0] if case == "local" else None,
                   ops=N, target=TARGET if case == "emu" else None)


def _word(region, off: int) -> int:
    """The 8-byte word at `off` as the medium holds it (bypassing node views)."""
    return int.from_bytes(region.dma_read(off, 8), "little")


@pytest.mark.parametrize("case", CASES)
def test_store_flush_fence(bench, regions, case):
    _describe(bench, "store_flush_fence", case, STORE_BASELINE)
    if case == "local":
        result = bench.run(STORE_BASELINE[1], rounds=ROUNDS, warmup=WARMUP)
        assert result == N  # the last value stored, loaded back
        return
    region = regions(case)
    off = region.heap[0]
    region.dma_write(off, bytes(8))
    result = bench.run(partial(microbench.store_flush_fence, region, off, N), rounds=ROUNDS,
                       warmup=WARMUP, paired=STORE_BASELINE)
    assert result == N
    assert _word(region, off) == N  # the last store reached the medium: it was published


@pytest.mark.parametrize("case", CASES)
def test_load_after_flush(bench, regions, case):
    _describe(bench, "load_after_flush", case, LOAD_BASELINE)
    if case == "local":
        result = bench.run(LOAD_BASELINE[1], rounds=ROUNDS, warmup=WARMUP)
        assert result == 3 * N  # local_load's word holds 3
        return
    region = regions(case)
    off = region.heap[0] + 4096
    region.store64(off, VALUE)
    region.persist(off, 8)
    assert _word(region, off) == VALUE
    result = bench.run(partial(microbench.load_after_flush, region, off, N), rounds=ROUNDS,
                       warmup=WARMUP, paired=LOAD_BASELINE)
    assert result == VALUE * N  # every load saw the published value
