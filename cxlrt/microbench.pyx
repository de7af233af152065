# cython: language_level=3
"""Tight nogil loops over the backend contract, for perf/ and `cxlrt bench`.

Each loop returns a value derived from what it did, so a benchmark can check
the result after timing (a loop the compiler could drop would be worthless).
"""

from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc

from cxlrt.backend cimport cxl_fence, cxl_flush, cxl_load64, cxl_region, cxl_store64
from cxlrt.includes.intrin cimport cxl_fence_full, cxl_load64_volatile, cxl_store64_volatile
from cxlrt.region cimport Region

from cxlrt.errors import RegionError


cdef cxl_region* _reg(Region region) except NULL:
    return region.backend.region()


def store_flush_fence(Region region, uint64_t off, uint64_t iters):
    """`iters` x (8-byte store, flush of its line, fence); returns the last value stored."""
    cdef cxl_region* r = _reg(region)
    cdef uint64_t i
    cdef int rc = 0
    with nogil:
        for i in range(1, iters + 1):
            rc = cxl_store64(r, off, i)
            if rc == 0:
                rc = cxl_flush(r, off, 8)
            if rc == 0:
                rc = cxl_fence(r)
            if rc != 0:
                break
    if rc != 0:
        raise RegionError(f"store_flush_fence: status {rc}")
    return iters


def load_after_flush(Region region, uint64_t off, uint64_t iters):
    """`iters` x (flush of a line, 8-byte load from it); returns the sum of loads."""
    cdef cxl_region* r = _reg(region)
    cdef uint64_t i, v = 0, acc = 0
    cdef int rc = 0
    with nogil:
        for i in range(iters):
            rc = cxl_flush(r, off, 8)
            if rc == 0:
                rc = cxl_load64(r, off, &v)
            if rc != 0:
                break
            acc += v
    if rc != 0:
        raise RegionError(f"load_after_flush: status {rc}")
    return acc


def local_store_fence(uint64_t iters):
    """Baseline: `iters` x (volatile 8-byte store, full fence) on private memory."""
    cdef uint64_t* p = <uint64_t*>malloc(64)
    cdef uint64_t i, v
    if p == NULL:
        raise MemoryError()
    with nogil:
        for i in range(1, iters + 1):
            cxl_store64_volatile(p, i)
            cxl_fence_full()
        v = cxl_load64_volatile(p)
    free(p)
    return v


def local_load(uint64_t iters):
    """Baseline: `iters` x volatile 8-byte load from private memory; returns the sum."""
    cdef uint64_t* p = <uint64_t*>malloc(64)
    cdef uint64_t i, acc = 0
    if p == NULL:
        raise MemoryError()
    p[0] = 3
    with nogil:
        for i in range(iters):
            acc += cxl_load64_volatile(p)
    free(p)
    return acc
