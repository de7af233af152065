"""DMA reads the CXL-HM device model serves from DRAM outside its lock (a seqlock).

A device serves reads of pages in its DRAM in parallel, so ``chm:`` copies such a read
without its lock and then checks, under the lock, that no frame changed meanwhile
(each frame's gen is bumped before its bytes change or it is reused); a read that
raced a write is done again under the lock. The negative control turns the check off
(a debug-build test hook): the same readers must then see torn blocks.
"""

from __future__ import annotations

import time

import pytest

from cxlrt.emulation import chm
from tests.nodes import raise_failures, run_procs

PAGES = 16
SECONDS = 1.5


def _span(r):
    """The block the test rewrites: 16 pages of the device, every one in its DRAM."""
    page = 4096
    off = r.alloc(PAGES * page, align=page)
    n = PAGES * page
    r.dma_write(off, bytes(n))
    r.load(off, n)  # CPU loads fill the cache frames under either policy
    return off, n


def _rewrite(case, off, n):
    r = case.open(1)
    v, until = 0, time.monotonic() + SECONDS
    while time.monotonic() < until:
        v = v % 250 + 1
        r.dma_write(off, bytes([v]) * n)  # one request: the device applies it whole
    r.close()
    return v


def _read(case, node, off, n, broken):
    r = case.open(node)
    if broken:
        chm._break_seqlock(r.backend)
    reads = torn = 0
    until = time.monotonic() + SECONDS
    while time.monotonic() < until:
        got = r.dma_read(off, n)
        reads += 1
        torn += got.count(got[:1]) != n
    r.close()
    return reads, torn


@pytest.mark.parametrize("broken", [
    False, pytest.param(True, id="check-off", marks=pytest.mark.debug_build)])
def test_a_read_copied_outside_the_device_lock_is_never_torn(backend, chm_only, broken):
    r = backend.create(size="4M", nodes=4)
    off, n = _span(r)
    procs = [(_rewrite, (backend, off, n))] + [(_read, (backend, k, off, n, broken))
                                               for k in (2, 3)]
    writes, *results = raise_failures(run_procs(_call, procs))
    assert writes, "the writer never wrote"
    reads = sum(x[0] for x in results)
    torn = sum(x[1] for x in results)
    assert reads > 100, results
    if broken:
        assert torn > 0, f"{reads} unchecked reads raced a writer and none was torn"
    else:
        assert torn == 0, f"{torn} of {reads} reads were torn"
    r.close()


def _call(fn, args):
    return fn(*args)
