# cython: language_level=3
"""Tight nogil loops over the backend contract, for perf/ and `cxlrt bench`.

Each loop returns a value derived from what it did, so a benchmark can check
the result after timing (a loop the compiler could drop would be worthless).
"""

from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from cxlrt.alloc cimport (CXL_NCLASSES, Allocator, cxl_alloc_large, cxl_alloc_small, cxl_free,
                          cxl_size_class)
from cxlrt.backend cimport cxl_fence, cxl_flush, cxl_load64, cxl_region, cxl_store64
from cxlrt.includes.intrin cimport cxl_fence_full, cxl_load64_volatile, cxl_store64_volatile
from cxlrt.includes.mutex cimport cxl_mutex_lock, cxl_mutex_unlock, pthread_mutex_t
from cxlrt.lock cimport Lock, cxl_lock_acquire, cxl_lock_release
from cxlrt.mapping cimport Mapping
from cxlrt.region cimport Region
from cxlrt.status cimport check_rc


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
                rc = cxl_flush(r, off, sizeof(uint64_t))
            if rc == 0:
                rc = cxl_fence(r)
            if rc != 0:
                break
    if rc != 0:
        check_rc(rc, "store_flush_fence")
    return iters


def load_after_flush(Region region, uint64_t off, uint64_t iters):
    """`iters` x (flush of a line, 8-byte load from it); returns the sum of loads."""
    cdef cxl_region* r = _reg(region)
    cdef uint64_t i, v = 0, acc = 0
    cdef int rc = 0
    with nogil:
        for i in range(iters):
            rc = cxl_flush(r, off, sizeof(uint64_t))
            if rc == 0:
                rc = cxl_load64(r, off, &v)
            if rc != 0:
                break
            acc += v
    if rc != 0:
        check_rc(rc, "load_after_flush")
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


def lock_bench(Lock lock, uint64_t iters):
    """`iters` x (acquire, release) of a cross-node lock in one nogil loop; returns iters."""
    cdef uint64_t i
    cdef int rc = 0, rec = 0
    with nogil:
        for i in range(iters):
            rc = cxl_lock_acquire(&lock.svc.L, lock.index, lock._mode, <uint64_t>-1, &rec)
            if rc != 0:
                break
            rc = cxl_lock_release(&lock.svc.L, lock.index, lock._mode)
            if rc != 0:
                break
    check_rc(rc, "lock_bench")
    return iters


def alloc_free_bench(Allocator a, uint64_t nbytes, uint64_t iters):
    """`iters` x (alloc, free) of `nbytes` from the region heap in one nogil loop; returns iters."""
    cdef uint64_t i, off = 0
    cdef uint32_t c = cxl_size_class(nbytes)
    cdef int rc = 0
    with nogil:
        for i in range(iters):
            if c < CXL_NCLASSES:
                rc = cxl_alloc_small(&a.A, c, &off)
            else:
                rc = cxl_alloc_large(&a.A, nbytes, &off)
            if rc != 0:
                break
            rc = cxl_free(&a.A, off)
            if rc != 0:
                break
    if rc != 0:
        a._raise(rc, "alloc_free_bench")
    return iters


def malloc_free_bench(uint64_t nbytes, uint64_t iters):
    """Baseline of alloc_free_bench: `iters` x (malloc, touch, free) from glibc."""
    cdef uint64_t i
    cdef char* p
    with nogil:
        for i in range(iters):
            p = <char*>malloc(nbytes)
            if p == NULL:
                break
            p[0] = 1  # the compiler may not elide the pair
            free(p)
    return iters


def mutex_bench(Mapping m, unsigned long long offset, uint64_t iters):
    """Baseline of lock_bench: `iters` x lock/unlock of the pthread mutex at m.base + offset.

    Initialise it first with cxlrt.shm.init_robust_mutexes (process-shared, robust).
    """
    cdef pthread_mutex_t* mu = <pthread_mutex_t*>(m.base + offset)
    cdef uint64_t i
    cdef int rc = 0
    if offset + sizeof(pthread_mutex_t) > m.size:
        raise ValueError("mutex outside the mapping")
    with nogil:
        for i in range(iters):
            rc = cxl_mutex_lock(mu)
            if rc < 0:
                break
            cxl_mutex_unlock(mu)
    if rc < 0:
        raise OSError(-rc, "pthread_mutex_lock failed")
    return iters
