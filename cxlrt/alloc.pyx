# cython: language_level=3
"""Shared-memory allocator over the backend contract (see alloc.pxd).

Fast path (small objects): the node's robust heap mutex, a bitmap scan of the
current chunk, one store and one persist of a bitmap word; no global lock.
Slow path: find another chunk of ours with room, drain our remote-free queue,
or carve a fresh chunk under the allocator lock. Large objects are chunk runs
allocated first-fit under the allocator lock.
"""

from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport cxl_flush, cxl_load64, cxl_persist, cxl_region, cxl_store64
from cxlrt.includes.mutex cimport cxl_mutex_lock, cxl_mutex_unlock
from cxlrt.lock cimport CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, cxl_lock_acquire, cxl_lock_release
from cxlrt.nodelocal cimport NodeLocal, cxl_local_heap

from cxlrt.errors import (InvalidFreeError, OutOfMemory, OutOfRangeError, RegionError)

cdef extern from *:
    """
    static inline int cxl_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    static inline int cxl_popcount64(unsigned long long x) { return __builtin_popcountll(x); }
    """
    int cxl_ctz64(unsigned long long x) nogil
    int cxl_popcount64(unsigned long long x) nogil


cdef enum:
    CHUNK = 65536
    KIND_SMALL = 1
    KIND_LARGE = 2
    KIND_TAIL = 3
    SMALL_MAGIC = 0x534D4C43
    RFREE_SLOTS = 504
    RFREE_BYTES = 4096
    MAX_CLASS = 16384

cdef uint32_t CLASS_SIZE[9]
cdef uint32_t CLASS_SLOTS[9]
cdef uint32_t CLASS_DATA[9]

CLASSES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _geometry(int cls):
    """(nslots, data_start) of a chunk of `cls`-byte objects: header, bitmap, slots."""
    n = (CHUNK - 64) // cls
    while True:
        bitmap = ((n + 63) // 64) * 8
        start = (64 + bitmap + cls - 1) // cls * cls
        if start + n * cls <= CHUNK:
            return n, start
        n -= 1


for _i, _c in enumerate(CLASSES):
    CLASS_SIZE[_i] = _c
    CLASS_SLOTS[_i], CLASS_DATA[_i] = _geometry(_c)


# --- table words --------------------------------------------------------------------

cdef inline uint64_t _word(uint64_t kind, uint64_t owner, uint64_t low) noexcept nogil:
    return (kind << 62) | ((owner & 0xFF) << 48) | (low & <uint64_t>0xFFFFFFFFULL)


cdef inline uint32_t _kind(uint64_t w) noexcept nogil:
    return <uint32_t>(w >> 62)


cdef inline uint32_t _owner(uint64_t w) noexcept nogil:
    return <uint32_t>((w >> 48) & 0xFF)


cdef inline uint32_t _low(uint64_t w) noexcept nogil:
    return <uint32_t>(w & <uint64_t>0xFFFFFFFFULL)


cdef inline uint64_t _chunk_off(cxl_allocctx* A, uint64_t k) noexcept nogil:
    return A.heap_off + k * CHUNK


cdef inline int _table_observe(cxl_allocctx* A, uint64_t k, uint64_t* w) noexcept nogil:
    """Observe table[k] (another node may have changed it under the lock)."""
    cdef uint64_t off = A.table_off + k * 8
    cdef int rc = cxl_flush(A.r, off, 8)
    if rc == 0:
        rc = cxl_load64(A.r, off, w)
    return rc


cdef inline int _table_set(cxl_allocctx* A, uint64_t k, uint64_t w) noexcept nogil:
    """Write table[k]; the caller holds the allocator lock and publishes."""
    return cxl_store64(A.r, A.table_off + k * 8, w)


# --- small chunks (owner only) ---------------------------------------------------------

cdef int _take_slot(cxl_allocctx* A, uint64_t k, uint32_t c, uint64_t* out) noexcept nogil:
    """Claim a free slot of our chunk k: 0 and *out, or 1 if the chunk is full."""
    cdef uint64_t base = _chunk_off(A, k), w = 0, full
    cdef uint32_t nslots = CLASS_SLOTS[c], words = (nslots + 63) // 64, i, b
    cdef int rc
    for i in range(words):
        rc = cxl_load64(A.r, base + 64 + i * 8, &w)  # our own bitmap: no observe
        if rc != 0:
            return rc
        full = <uint64_t>-1 if (i + 1) * 64 <= nslots else ((<uint64_t>1 << (nslots - i * 64)) - 1)
        if (w & full) != full:
            b = <uint32_t>cxl_ctz64(~w)
            rc = cxl_store64(A.r, base + 64 + i * 8, w | (<uint64_t>1 << b))
            if rc == 0:
                # Publish the bit before the object is handed out: another node
                # validating a free of it must see it allocated.
                rc = cxl_persist(A.r, base + 64 + i * 8, 8)
            if rc == 0:
                out[0] = base + CLASS_DATA[c] + (i * 64 + b) * CLASS_SIZE[c]
            return rc
    return 1


cdef int _chunk_live(cxl_allocctx* A, uint64_t k, uint32_t c, uint64_t* live) noexcept nogil:
    """Count set bits of chunk k's bitmap (observed: used by any node)."""
    cdef uint64_t base = _chunk_off(A, k), w = 0, n = 0
    cdef uint32_t words = (CLASS_SLOTS[c] + 63) // 64, i
    cdef int rc = cxl_flush(A.r, base + 64, words * 8)
    for i in range(words):
        if rc == 0:
            rc = cxl_load64(A.r, base + 64 + i * 8, &w)
            n += cxl_popcount64(w)
    live[0] = n
    return rc


cdef int _clear_slot(cxl_allocctx* A, uint64_t k, uint32_t c, uint64_t slot,
                     uint64_t* left) noexcept nogil:
    """Owner clears a slot's bit (heap mutex held): 0, or CXLRT_E_DOUBLEFREE.

    *left receives the bitmap word after the clear (0 hints the chunk may be empty).
    """
    cdef uint64_t off = _chunk_off(A, k) + 64 + (slot // 64) * 8, w = 0
    cdef uint64_t bit = <uint64_t>1 << (slot % 64)
    cdef int rc = cxl_load64(A.r, off, &w)
    if rc != 0:
        return rc
    if not (w & bit):
        return CXLRT_E_DOUBLEFREE
    rc = cxl_store64(A.r, off, w & ~bit)
    if rc == 0:
        rc = cxl_persist(A.r, off, 8)
    left[0] = w & ~bit
    return rc


cdef int _find_free_run(cxl_allocctx* A, uint64_t n, uint64_t* first) noexcept nogil:
    """First-fit run of n free chunks (allocator lock held): 0, or CXLRT_E_NOMEM."""
    cdef uint64_t k, run = 0, w = 0
    cdef int rc
    for k in range(A.nchunks):
        if k % 8 == 0:
            # Observe one line of the table at a time, as we reach it.
            rc = cxl_flush(A.r, A.table_off + k * 8, 8)
            if rc != 0:
                return rc
        rc = cxl_load64(A.r, A.table_off + k * 8, &w)
        if rc != 0:
            return rc
        if w == 0:
            run += 1
            if run == n:
                first[0] = k + 1 - n
                return 0
        else:
            run = 0
    return CXLRT_E_NOMEM


cdef int _carve(cxl_allocctx* A, uint32_t c, uint64_t* chunk) noexcept nogil:
    """Take a free chunk for class c: table word under the lock, then header + bitmap."""
    cdef uint64_t k = 0, base, i
    cdef int rec = 0
    cdef int rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
    if rc != 0:
        return rc
    rc = _find_free_run(A, 1, &k)
    if rc == 0:
        rc = _table_set(A, k, _word(KIND_SMALL, A.node, c))
    if rc == 0:
        rc = cxl_persist(A.r, A.table_off + k * 8, 8)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    if rc != 0:
        return rc
    base = _chunk_off(A, k)
    # The chunk is ours now: drop any copy of its lines we kept from an earlier
    # life, zero its bitmap and write the header, magic last.
    rc = cxl_flush(A.r, base, 64 + ((CLASS_SLOTS[c] + 63) // 64) * 8)
    if rc != 0:
        return rc
    for i in range(0, (CLASS_SLOTS[c] + 63) // 64):
        rc = cxl_store64(A.r, base + 64 + i * 8, 0)
        if rc != 0:
            return rc
    rc = cxl_store64(A.r, base + 8, (<uint64_t>CLASS_SLOTS[c] << 32) | A.node)
    if rc == 0:
        rc = cxl_store64(A.r, base + 16, CLASS_DATA[c])
    if rc == 0:
        rc = cxl_persist(A.r, base, 64 + ((CLASS_SLOTS[c] + 63) // 64) * 8)
    if rc == 0:
        rc = cxl_store64(A.r, base, (<uint64_t>CLASS_SIZE[c] << 32) | SMALL_MAGIC)
    if rc == 0:
        rc = cxl_persist(A.r, base, 8)
    chunk[0] = k
    return rc


cdef int _release_chunk(cxl_allocctx* A, uint64_t k) noexcept nogil:
    """Give an empty small chunk of ours back to the table (header invalidated first)."""
    cdef int rec = 0
    cdef int rc = cxl_store64(A.r, _chunk_off(A, k), 0)
    if rc == 0:
        rc = cxl_persist(A.r, _chunk_off(A, k), 8)
    if rc != 0:
        return rc
    rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
    if rc != 0:
        return rc
    # Observe the whole line first: its other words belong to other chunks, and a
    # write-back of a stale copy would revert their owners' updates.
    rc = cxl_flush(A.r, A.table_off + k * 8, 8)
    if rc == 0:
        rc = _table_set(A, k, 0)
    if rc == 0:
        rc = cxl_persist(A.r, A.table_off + k * 8, 8)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    return rc


cdef int _drain_locked(cxl_allocctx* A, uint64_t* applied) noexcept nogil:
    """Apply frees other nodes queued for us (heap mutex held; takes the lock)."""
    cdef uint64_t q = A.rfree_off + A.node * RFREE_BYTES, count = 0, i, off = 0, w = 0, k
    cdef uint64_t rel
    cdef uint32_t c
    cdef int rec = 0
    cdef int rc = cxl_flush(A.r, q, 8)
    if rc == 0:
        rc = cxl_load64(A.r, q, &count)
    if rc != 0 or count == 0:
        return rc
    rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
    if rc != 0:
        return rc
    rc = cxl_flush(A.r, q, RFREE_BYTES)  # observe the whole queue under the lock
    if rc == 0:
        rc = cxl_load64(A.r, q, &count)
    if count > RFREE_SLOTS:
        count = RFREE_SLOTS  # corrupt: apply what can be valid, the check reports it
    for i in range(count):
        if rc != 0:
            break
        rc = cxl_load64(A.r, q + 64 + i * 8, &off)
        if rc != 0 or off < A.heap_off:
            continue
        k = (off - A.heap_off) // CHUNK
        if k >= A.nchunks or _table_observe(A, k, &w) != 0:
            continue
        c = _low(w)
        if _kind(w) != KIND_SMALL or _owner(w) != A.node or c >= CXL_NCLASSES:
            continue
        rel = off - _chunk_off(A, k) - CLASS_DATA[c]
        if _clear_slot(A, k, c, rel // CLASS_SIZE[c], &w) == 0:
            applied[0] += 1
    if rc == 0:
        rc = cxl_store64(A.r, q, 0)
    if rc == 0:
        rc = cxl_persist(A.r, q, 8)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    return rc


cdef int cxl_drain(cxl_allocctx* A, uint64_t* applied) noexcept nogil:
    """Take the heap mutex and apply queued remote frees."""
    cdef int rc = cxl_mutex_lock(&A.heap.m)
    if rc < 0:
        return rc
    rc = _drain_locked(A, applied)
    cxl_mutex_unlock(&A.heap.m)
    return rc


cdef int _scan_own(cxl_allocctx* A, uint32_t c, uint64_t skip, uint64_t* found) noexcept nogil:
    """Another chunk of ours for class c with a free slot: 0 and *found, or 1."""
    cdef uint64_t k, w = 0, live = 0
    cdef int rc
    for k in range(A.nchunks):
        if k == skip:
            continue
        rc = _table_observe(A, k, &w)
        if rc != 0:
            return rc
        if w == _word(KIND_SMALL, A.node, c):
            rc = _chunk_live(A, k, c, &live)
            if rc != 0:
                return rc
            if live < CLASS_SLOTS[c]:
                found[0] = k
                return 0
    return 1


cdef int cxl_alloc_small(cxl_allocctx* A, uint32_t c, uint64_t* out) noexcept nogil:
    """Allocate one class-c object for this node."""
    cdef cxl_local_heap* h = A.heap
    cdef uint64_t k = 0, applied = 0
    cdef int rc = cxl_mutex_lock(&h.m)
    if rc < 0:
        return rc
    if rc == 1:
        # A process of ours died holding the heap: the hints may be torn, the
        # region's bitmaps are not (each change is one published word). Rebuild.
        for k in range(16):
            h.current[k] = 0
            h.spare[k] = 0
        h.rebuilds += 1
    rc = 1
    if h.current[c]:
        rc = _take_slot(A, h.current[c] - 1, c, out)
    if rc == 1:  # another chunk of ours with room (maybe after applying remote frees)
        rc = _scan_own(A, c, h.current[c] - 1 if h.current[c] else <uint64_t>-1, &k)
        if rc == 1:
            rc = _drain_locked(A, &applied)
            if rc == 0:
                rc = _scan_own(A, c, <uint64_t>-1, &k) if applied else 1
        if rc == 0:
            if h.spare[c] == k + 1:
                h.spare[c] = 0
            h.current[c] = k + 1
            rc = _take_slot(A, k, c, out)
    if rc == 1 and h.spare[c]:  # the empty chunk we kept
        k = h.spare[c] - 1
        h.spare[c] = 0
        h.current[c] = k + 1
        rc = _take_slot(A, k, c, out)
    if rc == 1:  # a fresh chunk from the table
        rc = _carve(A, c, &k)
        if rc == 0:
            h.current[c] = k + 1
            rc = _take_slot(A, k, c, out)
            if rc == 1:
                rc = CXLRT_E_CORRUPT  # a chunk we just zeroed cannot be full
    cxl_mutex_unlock(&h.m)
    return rc


cdef int cxl_alloc_large(cxl_allocctx* A, uint64_t nbytes, uint64_t* out) noexcept nogil:
    """A run of whole chunks, first fit, under the allocator lock."""
    cdef uint64_t n = (nbytes + CHUNK - 1) // CHUNK, k = 0, i
    cdef int rec = 0
    cdef int rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
    if rc != 0:
        return rc
    rc = _find_free_run(A, n, &k)
    if rc == 0:
        for i in range(1, n):
            rc = _table_set(A, k + i, _word(KIND_TAIL, A.node, k))
            if rc != 0:
                break
    if rc == 0:
        rc = _table_set(A, k, _word(KIND_LARGE, A.node, n))
    if rc == 0:
        rc = cxl_persist(A.r, A.table_off + k * 8, n * 8)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    if rc == 0:
        out[0] = _chunk_off(A, k)
    return rc


cdef int cxl_free(cxl_allocctx* A, uint64_t off) noexcept nogil:
    """Free any node's object: ours directly, others' through their queue, runs under the lock."""
    cdef uint64_t k, w = 0, rel, slot, bw = 0, q, count = 0, i, e = 0, n
    cdef uint32_t c, owner
    cdef int rc, rec = 0
    cdef cxl_local_heap* h = A.heap
    if off < A.heap_off or off >= A.heap_off + A.nchunks * CHUNK:
        return -1001
    k = (off - A.heap_off) // CHUNK
    rc = _table_observe(A, k, &w)
    if rc != 0:
        return rc
    if w == 0 or _kind(w) == KIND_TAIL:
        return CXLRT_E_BADFREE
    if _kind(w) == KIND_LARGE:
        if off != _chunk_off(A, k):
            return CXLRT_E_BADFREE
        rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
        if rc != 0:
            return rc
        rc = _table_observe(A, k, &w)  # again, under the lock: someone may have freed it
        if rc == 0 and _kind(w) != KIND_LARGE:
            rc = CXLRT_E_DOUBLEFREE
        n = _low(w)
        if rc == 0 and (n == 0 or k + n > A.nchunks):
            rc = CXLRT_E_CORRUPT
        if rc == 0:  # observe every line we are about to rewrite (see _release_chunk)
            rc = cxl_flush(A.r, A.table_off + k * 8, n * 8)
        if rc == 0:
            for i in range(n):
                rc = _table_set(A, k + i, 0)
                if rc != 0:
                    break
        if rc == 0:
            rc = cxl_persist(A.r, A.table_off + k * 8, n * 8)
        cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
        return rc
    if _kind(w) != KIND_SMALL:
        return CXLRT_E_CORRUPT
    c = _low(w)
    owner = _owner(w)
    if c >= CXL_NCLASSES or owner >= A.nodes:
        return CXLRT_E_CORRUPT
    if off < _chunk_off(A, k) + CLASS_DATA[c]:
        return CXLRT_E_BADFREE
    rel = off - _chunk_off(A, k) - CLASS_DATA[c]
    if rel % CLASS_SIZE[c] or rel // CLASS_SIZE[c] >= CLASS_SLOTS[c]:
        return CXLRT_E_BADFREE
    slot = rel // CLASS_SIZE[c]
    if owner == A.node:
        rc = cxl_mutex_lock(&h.m)
        if rc < 0:
            return rc
        rc = _clear_slot(A, k, c, slot, &bw)
        if rc == 0 and bw == 0 and h.current[c] != k + 1:
            rc = _maybe_release(A, h, k, c)
        cxl_mutex_unlock(&h.m)
        return rc
    # Another node's object: check it is live, then queue it for its owner.
    q = _chunk_off(A, k) + 64 + (slot // 64) * 8
    rc = cxl_flush(A.r, q, 8)
    if rc == 0:
        rc = cxl_load64(A.r, q, &bw)
    if rc != 0:
        return rc
    if not (bw >> (slot % 64)) & 1:
        return CXLRT_E_DOUBLEFREE
    rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
    if rc != 0:
        return rc
    q = A.rfree_off + owner * RFREE_BYTES
    rc = cxl_flush(A.r, q, RFREE_BYTES)
    if rc == 0:
        rc = cxl_load64(A.r, q, &count)
    if rc == 0 and count >= RFREE_SLOTS:
        rc = CXLRT_E_QFULL
    for i in range(count if rc == 0 else 0):
        if cxl_load64(A.r, q + 64 + i * 8, &e) == 0 and e == off:
            rc = CXLRT_E_DOUBLEFREE  # already queued: freed twice before the owner drained
            break
    if rc == 0:
        rc = cxl_store64(A.r, q + 64 + count * 8, off)
    if rc == 0:  # entry published before the count that makes the owner read it
        rc = cxl_persist(A.r, q + 64 + count * 8, 8)
    if rc == 0:
        rc = cxl_store64(A.r, q, count + 1)
    if rc == 0:
        rc = cxl_persist(A.r, q, 8)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    return rc


cdef int _maybe_release(cxl_allocctx* A, cxl_local_heap* h, uint64_t k, uint32_t c) noexcept nogil:
    """An emptied chunk becomes the class's spare, or goes back to the table."""
    cdef uint64_t live = 0
    cdef int rc = _chunk_live(A, k, c, &live)
    if rc != 0 or live != 0:
        return rc
    if h.spare[c] == 0:
        h.spare[c] = k + 1
        return 0
    if h.spare[c] == k + 1:
        return 0
    return _release_chunk(A, k)


cdef int cxl_trim(cxl_allocctx* A) noexcept nogil:
    """Return this node's empty chunks (current and spare included) to the table."""
    cdef cxl_local_heap* h = A.heap
    cdef uint64_t k, w = 0, live = 0, applied = 0
    cdef uint32_t c
    cdef int rc = cxl_mutex_lock(&h.m)
    if rc < 0:
        return rc
    rc = _drain_locked(A, &applied)
    for k in range(A.nchunks):
        if rc != 0:
            break
        rc = _table_observe(A, k, &w)
        if rc == 0 and _kind(w) == KIND_SMALL and _owner(w) == A.node and _low(w) < CXL_NCLASSES:
            c = _low(w)
            rc = _chunk_live(A, k, c, &live)
            if rc == 0 and live == 0:
                if h.current[c] == k + 1:
                    h.current[c] = 0
                if h.spare[c] == k + 1:
                    h.spare[c] = 0
                rc = _release_chunk(A, k)
    cxl_mutex_unlock(&h.m)
    return rc


# --- Python layer ------------------------------------------------------------------------

_ERRORS = {
    CXLRT_E_NOMEM: (OutOfMemory, "out of memory"),
    CXLRT_E_BADFREE: (InvalidFreeError, "not the start of a live allocation"),
    CXLRT_E_DOUBLEFREE: (InvalidFreeError, "already free (double free)"),
    CXLRT_E_QFULL: (RegionError, "the owner node's remote-free queue is full; is it dead? "
                    "(`cxlrt check --repair --node N`)"),
    CXLRT_E_CORRUPT: (RegionError, "allocator metadata is corrupt (`cxlrt check`)"),
    -1001: (OutOfRangeError, "outside the heap"),
}


cdef class Allocator:
    """Per-Region allocator state; use :meth:`Region.alloc` and friends."""

    cdef cxl_allocctx A
    cdef readonly object region
    cdef object _svc

    def __init__(self, region):
        from cxlrt.lock import LockService
        svc = region.locks
        self._svc = svc
        self.region = region
        self.A.L = _lockctx(svc)
        self.A.r = self.A.L.r
        self.A.heap = (<NodeLocal>svc.local).heap
        alloc_off, _ = region.sections["alloc"]
        self.A.heap_off, heap_len = region.sections["heap"]
        self.A.nchunks = heap_len // CHUNK
        self.A.table_off = alloc_off
        self.A.rfree_off = alloc_off + (self.A.nchunks * 8 + 4095) // 4096 * 4096
        self.A.node = region.node
        self.A.nodes = region.nodes

    def _raise(self, int rc, str what):
        if rc in _ERRORS:
            cls, msg = _ERRORS[rc]
            raise cls(f"{what}: {msg}")
        from cxlrt.lock import _rc
        _rc(rc, what)

    def alloc(self, nbytes, align=64):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"alloc size must be a positive int of bytes, got {nbytes!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 \
                or align & (align - 1) or align > CHUNK:
            raise ValueError(f"align must be a power of two <= {CHUNK}, got {align!r}")
        cdef uint64_t out = 0, n = max(nbytes, align)
        cdef int rc
        cdef uint32_t c = 0
        if n > MAX_CLASS:
            if n > self.A.nchunks * CHUNK:
                raise OutOfMemory(f"alloc({nbytes}): larger than the whole heap "
                                  f"({self.A.nchunks * CHUNK} bytes)")
            with nogil:
                rc = cxl_alloc_large(&self.A, n, &out)
        else:
            while CLASS_SIZE[c] < n:
                c += 1
            with nogil:
                rc = cxl_alloc_small(&self.A, c, &out)
        if rc != 0:
            self._raise(rc, f"alloc({nbytes})")
        return out

    def free(self, off):
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise ValueError(f"free() needs a non-negative int offset, got {off!r}")
        cdef uint64_t o = off
        cdef int rc
        if o >= self.region.size:
            raise OutOfRangeError(f"free({off}): outside the region of {self.region.size} bytes")
        with nogil:
            rc = cxl_free(&self.A, o)
        if rc != 0:
            self._raise(rc, f"free({off})")

    def drain(self):
        """Apply frees other nodes queued for this node (the heartbeat calls this)."""
        cdef uint64_t applied = 0
        cdef int rc
        with nogil:
            rc = cxl_drain(&self.A, &applied)
        if rc != 0:
            self._raise(rc, "drain")
        return applied

    def release_chunk(self, uint64_t k):
        """Return chunk k to the table (repair of an interrupted carve)."""
        cdef int rc
        if k >= self.A.nchunks:
            raise ValueError(f"no chunk {k}")
        with nogil:
            rc = _release_chunk(&self.A, k)
        if rc != 0:
            self._raise(rc, "release_chunk")

    def trim(self):
        cdef int rc
        with nogil:
            rc = cxl_trim(&self.A)
        if rc != 0:
            self._raise(rc, "trim")


cdef cxl_lockctx* _lockctx(object svc) except NULL:
    from cxlrt.lock import _ctx_address
    return <cxl_lockctx*><size_t>_ctx_address(svc)


def table_word(uint64_t w):
    """Decode a chunk-table word: (kind, owner, low)."""
    return _kind(w), _owner(w), _low(w)


def class_geometry():
    """[(size, nslots, data_start)] of every size class."""
    return [(CLASS_SIZE[i], CLASS_SLOTS[i], CLASS_DATA[i]) for i in range(CXL_NCLASSES)]


cdef extern from "<stdlib.h>" nogil:
    void* malloc(size_t n)
    void free "free"(void* p)


def alloc_free_bench(Allocator a, uint64_t nbytes, uint64_t iters):
    """perf/: `iters` x (alloc, free) of `nbytes` in one nogil loop; returns iters."""
    cdef uint64_t i, off = 0, n = nbytes
    cdef uint32_t c = 0
    cdef int rc = 0
    cdef bint small = n <= MAX_CLASS
    if small:
        while CLASS_SIZE[c] < n:
            c += 1
    with nogil:
        for i in range(iters):
            rc = cxl_alloc_small(&a.A, c, &off) if small else cxl_alloc_large(&a.A, n, &off)
            if rc != 0:
                break
            rc = cxl_free(&a.A, off)
            if rc != 0:
                break
    if rc != 0:
        a._raise(rc, "alloc_free_bench")
    return iters


def malloc_free_bench(uint64_t nbytes, uint64_t iters):
    """Baseline for perf/: `iters` x (malloc, touch, free) from glibc in one nogil loop."""
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
