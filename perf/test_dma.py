"""Bulk DMA: dma_write and dma_read of 64 MiB against numpy copying the same bytes.

Each group (``dma_write``, ``dma_read``) has a baseline ``np.copyto`` between two
preallocated, already-touched arrays; the region rows copy between the same kind
of array and the region, ``dma_write(off, src)`` and ``dma_read_into(off, dst)``,
so nothing allocates inside the timing.

Target: ``file:`` reaches at least 0.90x numpy's throughput. ``emu:`` (checker
off) is measured for information: its DMA is the same memcpy on the medium.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

NBYTES = 64 << 20
ROUNDS = 10
WARMUP = 2  # the first copies fault the destination's pages in; not what we time
DMA_OFF = 1 << 20  # bytes into the heap; test_access.py uses the first lines
TARGET = {"min_ratio": 0.90}
CASES = ["numpy", "file", "emu"]


@pytest.fixture(scope="module")
def src() -> np.ndarray:
    return np.random.default_rng(20261130).integers(0, 256, NBYTES, dtype=np.uint8)


def _touched() -> np.ndarray:
    """A destination whose pages are already faulted in (np.zeros' would not be)."""
    return np.full(NBYTES, 0xA5, dtype=np.uint8)


def _info(case: str) -> dict:
    info = {"bytes": NBYTES, "target": TARGET if case == "file" else None}
    if case == "numpy":
        info["baseline"] = "numpy copy"
    return info


@pytest.mark.parametrize("case", CASES)
def test_dma_write(benchmark, describe, regions, src, case):
    describe("dma_write", case, **_info(case))
    if case == "numpy":
        dst = _touched()
        benchmark.pedantic(partial(np.copyto, dst, src), rounds=ROUNDS, warmup_rounds=WARMUP)
    else:
        region = regions(case)
        off = region.heap[0] + DMA_OFF
        region.dma_write(off, np.zeros(NBYTES, dtype=np.uint8))  # so the check means something
        benchmark.pedantic(partial(region.dma_write, off, src), rounds=ROUNDS,
                           warmup_rounds=WARMUP)
        dst = _touched()
        region.dma_read_into(off, dst)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("case", CASES)
def test_dma_read(benchmark, describe, regions, src, case):
    describe("dma_read", case, **_info(case))
    dst = _touched()
    if case == "numpy":
        benchmark.pedantic(partial(np.copyto, dst, src), rounds=ROUNDS, warmup_rounds=WARMUP)
    else:
        region = regions(case)
        off = region.heap[0] + DMA_OFF
        region.dma_write(off, src)
        benchmark.pedantic(partial(region.dma_read_into, off, dst), rounds=ROUNDS,
                           warmup_rounds=WARMUP)
    assert np.array_equal(dst, src)
