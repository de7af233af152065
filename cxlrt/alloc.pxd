# Region allocator: a global chunk table (written under lock 1) plus per-node
# small-object chunks whose slot bitmaps only their owner node writes.
#
# Invariants:
#  - table[k] is 0 (free) or names the chunk's kind and owner; it changes only
#    under the allocator lock, and is published before the chunk is used.
#  - A small chunk's header and bitmap are written only by its owner node, under
#    that node's robust heap mutex; other nodes free into the owner's remote-free
#    queue (under the allocator lock) and the owner applies them.
#  - The remote-free queue is a list linked through the freed objects themselves, so
#    a free never fails for lack of room. The owner applies it in batches: it commits
#    a batch to its journal line, empties the queue, then clears the bits; a drainer
#    killed anywhere is replayed under the heap mutex before that node allocates again.
#  - A thread keeps up to CXL_MAG_SLOTS freed objects per small class in its magazine,
#    a record in the node-local file, bits still set, and allocates from it first
#    with no lock. Only it pushes and pops; a record is given back (bits cleared,
#    count lowered first) under the heap mutex by its thread, by Allocator.close, or
#    by anyone of the node once its thread is surely gone (Allocator.close gives back
#    only its own thread's and gone threads' records). A cached object carries a
#    published tag word (derived from the region and its offset, so every node can
#    tell it): a later free of it by our node looks in every record instead of
#    caching it twice, and another node's is refused rather than queued. Two frees of
#    one object at the same moment are an application race the tag cannot order.
#  - Large objects are runs of whole chunks; any node frees them under the lock.
#  - Every write under the allocator lock is fenced: the holder first asks its own
#    clock whether it was silent past the lease since it began to acquire (then
#    another node may hold the lock) and, on a queue line, whether the line still
#    holds what it read; if either fails it writes nothing more (CXLRT_E_FENCED).
#    A silence found only after a queue or table publish is CXLRT_E_SUSPECT.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.lock cimport LockService, cxl_lockctx
from cxlrt.nodelocal cimport cxl_local_heap, cxl_local_mag


cdef enum:
    CXL_NCLASSES = 9          # 64 B .. 16 KiB
    CXL_CLASS_MIN = 64        # class c holds CXL_CLASS_MIN << c bytes


ctypedef struct cxl_allocctx:
    cxl_lockctx* L
    const cxl_region* r
    cxl_local_heap* heap
    uint64_t table_off        # chunk table
    uint64_t rfree_off        # node 0's remote-free queue; 4096 bytes a node
    uint64_t heap_off         # chunk 0
    uint64_t nchunks
    uint64_t max_objects      # bound on any walk of a remote-free list (cycle guard)
    uint32_t node
    uint32_t nodes
    uint32_t ticks            # this process's allocs and frees, for periodic queue peeks
    cxl_local_mag* mags       # the node's magazine records (node-local file)
    uint64_t mag_owner        # this Allocator's id in its process; 0: no magazines
    uint64_t tag_key          # a cached object's tag word is tag_key ^ its offset (any node's)


cdef int cxl_alloc_small(cxl_allocctx* A, uint32_t c, uint64_t* out) noexcept nogil
cdef int cxl_alloc_large(cxl_allocctx* A, uint64_t nbytes, uint64_t* out) noexcept nogil
cdef int cxl_free(cxl_allocctx* A, uint64_t off) noexcept nogil


cdef inline uint32_t cxl_size_class(uint64_t n) noexcept nogil:
    """The smallest class that holds n bytes; CXL_NCLASSES when n needs whole chunks."""
    cdef uint32_t c = 0
    while c < CXL_NCLASSES and (<uint64_t>CXL_CLASS_MIN << c) < n:
        c += 1
    return c


cdef inline int cxl_alloc(cxl_allocctx* A, uint64_t n, uint64_t* out) noexcept nogil:
    """n bytes, 64-aligned: a slot of the smallest class that holds them, else a run
    of whole chunks. 0, or CXLRT_E_NOMEM when there is no room (or a lock status)."""
    cdef uint32_t c = cxl_size_class(n)
    if c == CXL_NCLASSES:
        return cxl_alloc_large(A, n, out)
    return cxl_alloc_small(A, c, out)


# Declared here for the benchmarks (microbench.pyx), which loop over the C calls.
cdef class Allocator:
    cdef cxl_allocctx A
    cdef readonly object region
    cdef LockService _svc               # keeps A.L alive
    cdef readonly unsigned long long swept_at_attach  # magazines of gone threads given back
