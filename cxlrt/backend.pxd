# cxlrt backend contract: what every algorithm may call, without the GIL.
#
# Invariants (stated once, relied on everywhere):
#  - Offsets are bytes from the region base, 64-bit; 0 is null. Every call
#    range-checks its offset; an out-of-range offset returns CXLRT_E_RANGE and
#    touches nothing.
#  - Status: 0 = success, negative = CXLRT_E_*. No call raises or takes the GIL.
#  - load/store go through THIS node's view; on a non-coherent backend a load may
#    return a stale copy until cxl_flush() of those lines (observe = flush, load),
#    and a store reaches other nodes only after cxl_flush() + cxl_fence()
#    (publish = store, flush, fence). Caches write back whole 64-byte lines.
#  - dma_read/dma_write bypass every node's view (device DMA semantics); a
#    dma_write is complete and visible to all nodes when it returns.
#  - No cross-node read-modify-write exists here, by design (DESIGN.md rule 2).
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.includes.intrin cimport (cxl_fence_full, cxl_fence_release, cxl_fence_sc,
                                    cxl_load64_volatile,
                                    cxl_store64_volatile, likely, unlikely)
from libc.string cimport memcpy

from cxlrt.mapping cimport Mapping
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_RANGE, CXLRT_E_UNSUPPORTED


cdef enum:
    CXL_CAP_COHERENT = 1        # every node sees every store at once: flush is a no-op
    CXL_CAP_MAPPABLE = 2        # base != NULL: views and DMA windows over the medium
    CXL_CAP_PERSISTENT = 4      # contents survive power loss (fsdax, pmem)
    CXL_CAP_DMA_REGISTRABLE = 8  # can be registered for device (CUDA/RDMA) DMA
    CXL_CAP_SHARED_HOSTS = 16   # the medium is reachable from several hosts


cdef enum:
    CXL_F_DIRECT = 1     # loads/stores are plain volatile accesses at base+off
    CXL_F_NOFLUSH = 2    # flush is a no-op (coherent medium)


ctypedef int (*cxl_load_fn)(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil
ctypedef int (*cxl_store_fn)(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil
ctypedef int (*cxl_load64_fn)(void* ctx, uint64_t off, uint64_t* out) noexcept nogil
ctypedef int (*cxl_store64_fn)(void* ctx, uint64_t off, uint64_t v) noexcept nogil
ctypedef int (*cxl_flush_fn)(void* ctx, uint64_t off, uint64_t n) noexcept nogil
ctypedef int (*cxl_fence_fn)(void* ctx) noexcept nogil
ctypedef int (*cxl_dma_read_fn)(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil
ctypedef int (*cxl_dma_write_fn)(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil
ctypedef int (*cxl_hint_fn)(void* ctx, int kind, uint64_t a, uint64_t b) noexcept nogil
ctypedef int (*cxl_gather64_fn)(void* ctx, uint32_t n, const uint64_t* offs,
                                uint64_t* out) noexcept nogil
ctypedef int (*cxl_scatter64_fn)(void* ctx, uint32_t n, const uint64_t* offs,
                                 const uint64_t* vals) noexcept nogil


# The layout of cxl_ops. A table built against another layout (a backend compiled
# against an older cxlrt) refuses to open instead of calling garbage: its first word
# is then a function pointer or NULL, never this number.
# 1: to 2026-12-04; 2: gather64 and scatter64, and this word.
cdef enum:
    CXL_OPS_ABI = 2


ctypedef struct cxl_ops:
    uint64_t abi                # CXL_OPS_ABI: the layout this table was built for
    cxl_load_fn load            # pre: off+n <= size; copies through this node's view
    cxl_store_fn store          # pre: off+n <= size; dirties lines in this node's view
    cxl_load64_fn load64        # pre: off % 8 == 0; one untorn 8-byte load
    cxl_store64_fn store64      # pre: off % 8 == 0; one untorn 8-byte store
    cxl_flush_fn flush          # pre: range checked; write back + drop, complete on return
    cxl_flush_fn flush_nodrain  # pre: range checked; write back + drop, complete at next fence
    cxl_fence_fn fence          # pre: none; orders all earlier accesses and drains flushes
    cxl_dma_read_fn dma_read    # pre: range checked; reads the medium, bypassing views
    cxl_dma_write_fn dma_write  # pre: range checked; writes the medium, bypassing views
    cxl_hint_fn hint            # optional (NULL: none): advice to a device, see CXL_HINT_*
    cxl_gather64_fn gather64    # optional (NULL: load64 each): n words, one request where it can
    cxl_scatter64_fn scatter64  # optional (NULL: store64 each): n words, one request where it can


# Hints: advice a device may act on; never needed for correctness (a backend without
# the slot, or one that ignores a hint, is right, only slower).
cdef enum:
    CXL_HINT_ADMIT = 1    # (bytes, runs): may `bytes` of DMA writes in `runs` pieces go to
    #                       the device's write buffer now? 0 yes, CXL_HINT_REFUSED no. The
    #                       room is not reserved: a write that finds it gone by then goes
    #                       through to the capacity tier (correct, only slower)
    CXL_HINT_DRAIN = 2    # (0, 0): write the write buffer back to the capacity tier now
    CXL_HINT_PREFETCH = 3  # (off, n): stage the range in the device's fast memory ahead of
    #                       DMA reads, held there until released or until the device's pin
    #                       time lapses (a dead requester's hold ends on its own). Returns
    #                       at once: a read of a page still landing waits for it. 0 taken,
    #                       CXL_HINT_REFUSED no room the device can spare (read it directly)
    CXL_HINT_WAIT = 4     # (off, n): wait until the staged pages of the range have landed
    CXL_HINT_RELEASE = 5  # (off, n): the range was consumed: give its hold back
    CXL_HINT_REPEAT = 6   # (off, n): this process's writes to the range may be written
    #                       again if their completion is lost (only its node writes there,
    #                       and a stale value is harmless: the heartbeat). 0 noted,
    #                       CXL_HINT_REFUSED no room to note more
    CXL_HINT_REFUSED = 1  # a hint's positive "no" (not an error)


ctypedef struct cxl_region:
    char* base        # medium mapping when CXL_CAP_MAPPABLE, else NULL
    uint64_t size     # bytes addressable by offsets
    uint32_t caps     # CXL_CAP_* bits
    uint32_t flags    # CXL_F_* fast-path bits, chosen at open()
    uint32_t node     # this view's node id
    uint32_t closed   # set by close(); calls then return CXLRT_E_CLOSED
    const cxl_ops* ops  # backend slots; never NULL once open
    void* ctx         # backend private state, passed to every slot


cdef class Backend:
    cdef cxl_region reg         # the C view handed to algorithms
    cdef readonly str scheme    # registry name ("file", "emu", ...)
    cdef readonly str path      # medium path as given in the spec
    cdef readonly dict params   # validated spec parameters
    cdef object __weakref__

    cdef cxl_region* region(self) except NULL
    cpdef close(self)
    cdef _use_device(self, uint64_t size, uint32_t caps, uint32_t flags, int node,
                     void* ctx, const cxl_ops* ops)
    cdef int _retire(self, Mapping m) except -1


cdef class MappedBackend(Backend):
    cdef readonly Mapping mapping  # the medium, mapped whole; base = mapping.base

    cdef _use_mapping(self, Mapping m, uint32_t caps, uint32_t flags, int node,
                      const cxl_ops* ops)


# --- fast paths ---------------------------------------------------------------
# Budget: one compare and one volatile access on a direct region; one indirect
# call otherwise. Range checks stay on in release builds: offsets come from
# shared memory that another host may have corrupted (DESIGN.md rule 5).

cdef inline int cxl_check_range(const cxl_region* r, uint64_t off, uint64_t n) noexcept nogil:
    """Return 0 if [off, off+n) lies inside the region, else CXLRT_E_RANGE."""
    if unlikely(r.closed):
        return CXLRT_E_CLOSED
    if unlikely(n > r.size or off > r.size - n):
        return CXLRT_E_RANGE
    return 0


cdef inline int cxl_load64(const cxl_region* r, uint64_t off, uint64_t* out) noexcept nogil:
    """Load one aligned 8-byte word through this node's view."""
    if unlikely(r.closed or (off & 7) or r.size < 8 or off > r.size - 8):
        return CXLRT_E_CLOSED if r.closed else CXLRT_E_RANGE
    if likely(r.flags & CXL_F_DIRECT):
        out[0] = cxl_load64_volatile(r.base + off)
        return 0
    return r.ops.load64(r.ctx, off, out)


cdef inline int cxl_store64(const cxl_region* r, uint64_t off, uint64_t v) noexcept nogil:
    """Store one aligned 8-byte word into this node's view (not yet published)."""
    if unlikely(r.closed or (off & 7) or r.size < 8 or off > r.size - 8):
        return CXLRT_E_CLOSED if r.closed else CXLRT_E_RANGE
    if likely(r.flags & CXL_F_DIRECT):
        cxl_store64_volatile(r.base + off, v)
        return 0
    return r.ops.store64(r.ctx, off, v)


cdef inline int _cxl_words_ok(const cxl_region* r, uint32_t n, const uint64_t* offs) noexcept nogil:
    cdef uint32_t i
    if unlikely(r.closed):
        return CXLRT_E_CLOSED
    for i in range(n):
        if unlikely((offs[i] & 7) or r.size < 8 or offs[i] > r.size - 8):
            return CXLRT_E_RANGE
    return 0


cdef inline int cxl_gather64(const cxl_region* r, uint32_t n, const uint64_t* offs,
                             uint64_t* out) noexcept nogil:
    """cxl_load64 of each offs[i] into out[i]. Where the backend has the slot, all n go
    as one request (rdma: up to the queue pair's depth of READs in flight at once, and
    one wait for them all), so an algorithm that knows the words it needs next does not
    pay a round trip for each. Nothing is read unless every offset is in range."""
    cdef uint32_t i
    cdef int rc = _cxl_words_ok(r, n, offs)
    if unlikely(rc != 0) or n == 0:
        return rc
    if r.ops.gather64 != NULL and not (r.flags & CXL_F_DIRECT):
        return r.ops.gather64(r.ctx, n, offs, out)
    for i in range(n):
        rc = cxl_load64(r, offs[i], &out[i])
        if rc != 0:
            return rc
    return 0


cdef inline int cxl_scatter64(const cxl_region* r, uint32_t n, const uint64_t* offs,
                              const uint64_t* vals) noexcept nogil:
    """cxl_store64 of vals[i] at each offs[i], as one request where the backend can; in
    no particular order among themselves (publish them as usual). Nothing is stored
    unless every offset is in range; after a failure any subset may have landed."""
    cdef uint32_t i
    cdef int rc = _cxl_words_ok(r, n, offs)
    if unlikely(rc != 0) or n == 0:
        return rc
    if r.ops.scatter64 != NULL and not (r.flags & CXL_F_DIRECT):
        return r.ops.scatter64(r.ctx, n, offs, vals)
    for i in range(n):
        rc = cxl_store64(r, offs[i], vals[i])
        if rc != 0:
            return rc
    return 0


cdef inline int cxl_load(const cxl_region* r, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Copy n bytes out of this node's view."""
    cdef int rc = cxl_check_range(r, off, n)
    if unlikely(rc != 0):
        return rc
    if likely(r.flags & CXL_F_DIRECT):
        memcpy(dst, r.base + off, n)
        return 0
    return r.ops.load(r.ctx, off, dst, n)


cdef inline int cxl_store(const cxl_region* r, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Copy n bytes into this node's view (not yet published)."""
    cdef int rc = cxl_check_range(r, off, n)
    if unlikely(rc != 0):
        return rc
    if likely(r.flags & CXL_F_DIRECT):
        memcpy(r.base + off, src, n)
        return 0
    return r.ops.store(r.ctx, off, src, n)


cdef inline int _cxl_flush_range(const cxl_region* r, uint64_t off, uint64_t n,
                                 bint drain) noexcept nogil:
    """cxl_flush (drain) or cxl_flush_nodrain: range check, then the slot unless the
    medium is coherent (drain is a constant at every call: the branch folds away)."""
    cdef int rc = cxl_check_range(r, off, n)
    if unlikely(rc != 0):
        return rc
    if r.flags & CXL_F_NOFLUSH:
        return 0
    return r.ops.flush(r.ctx, off, n) if drain else r.ops.flush_nodrain(r.ctx, off, n)


cdef inline int cxl_flush(const cxl_region* r, uint64_t off, uint64_t n) noexcept nogil:
    """Write back and drop the lines of [off, off+n); complete on return."""
    return _cxl_flush_range(r, off, n, True)


cdef inline int cxl_flush_nodrain(const cxl_region* r, uint64_t off, uint64_t n) noexcept nogil:
    """Start writing back [off, off+n); only the next cxl_fence() completes it."""
    return _cxl_flush_range(r, off, n, False)


cdef inline int cxl_fence(const cxl_region* r) noexcept nogil:
    """Full fence: earlier loads, stores and flushes complete before later ones."""
    if unlikely(r.closed):
        return CXLRT_E_CLOSED
    if r.flags & CXL_F_DIRECT:
        if r.flags & CXL_F_NOFLUSH:
            # Coherent memory, no flushes to drain: only store->load order is
            # left to enforce, and a locked RMW does that cheaper than mfence.
            cxl_fence_sc()
            return 0
        # Non-coherent direct mapping: mfence also completes the flushes issued
        # before it (cxl_flush_nodrain); it pairs with the reader's observe.
        cxl_fence_full()
        return 0
    return r.ops.fence(r.ctx)


cdef inline int cxl_hint(const cxl_region* r, int kind, uint64_t a, uint64_t b) noexcept nogil:
    """Give the device a hint (CXL_HINT_*): its answer, or CXLRT_E_UNSUPPORTED where the
    backend takes none."""
    if unlikely(r.closed):
        return CXLRT_E_CLOSED
    if r.ops.hint == NULL:
        return CXLRT_E_UNSUPPORTED
    return r.ops.hint(r.ctx, kind, a, b)


cdef inline int cxl_persist(const cxl_region* r, uint64_t off, uint64_t n) noexcept nogil:
    """Publish: flush [off, off+n) then fence (PMDK persist = flush + drain)."""
    cdef int rc = cxl_flush(r, off, n)
    if unlikely(rc != 0):
        return rc
    return cxl_fence(r)


cdef inline int cxl_publish(const cxl_region* r, uint64_t off, uint64_t n) noexcept nogil:
    """Flush [off, off+n) ordered after every earlier store, but not before later loads.

    Enough when the next thing that matters is another store (a release): on a
    coherent direct mapping it is a compiler barrier on x86 (TSO), on anything
    else a full persist. Use cxl_persist when later loads must see it first.
    """
    if (r.flags & CXL_F_DIRECT) and (r.flags & CXL_F_NOFLUSH) and not r.closed:
        cxl_fence_release()
        return 0
    return cxl_persist(r, off, n)


cdef inline int cxl_observe64(const cxl_region* r, uint64_t off, uint64_t* v) noexcept nogil:
    """Observe a word another node publishes: drop our copy of its line, then load.
    Pairs with the writer's persist (store, flush, fence) of the same line."""
    cdef int rc = cxl_flush(r, off, sizeof(uint64_t))
    if likely(rc == 0):
        rc = cxl_load64(r, off, v)
    return rc


cdef inline int cxl_observe_gather64(const cxl_region* r, uint32_t n, const uint64_t* offs,
                                     uint64_t* out) noexcept nogil:
    """cxl_observe64 of each word: every word's line dropped, then one gather. With the
    words in distinct lines each load follows its own line's flush; a line named twice
    is flushed twice, then loaded twice with no flush between (the second load may hit
    the first's copy), so a caller that needs two observes of one line makes them
    itself."""
    cdef uint32_t i
    cdef int rc = 0
    if not (r.flags & CXL_F_NOFLUSH):
        for i in range(n):
            rc = cxl_flush(r, offs[i], sizeof(uint64_t))
            if rc != 0:
                return rc
    return cxl_gather64(r, n, offs, out)


cdef inline int cxl_observe(const cxl_region* r, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Observe [off, off+n): drop our copy of its lines, then copy it out of our view.
    Not one untorn read: a writer publishing meanwhile may be seen in part."""
    cdef int rc = cxl_flush(r, off, n)
    if likely(rc == 0):
        rc = cxl_load(r, off, dst, n)
    return rc


# --- checked windows -------------------------------------------------------------
# An algorithm that touches many words of one small range (a lock record) checks the
# range once, then moves words through the window. On a coherent direct mapping a
# word is one plain volatile access and a persist one store -> load fence, with no
# per-word check; anything else goes through the ops above. Offsets stay absolute.

ctypedef struct cxl_window:
    const cxl_region* r
    char* plain       # r.base when the region is direct and coherent (CXL_F_DIRECT|NOFLUSH), else NULL


cdef inline int cxl_window_open(cxl_window* w, const cxl_region* r, uint64_t off, uint64_t n) noexcept nogil:
    """Check [off, off+n) once; the window's words may then be used until the region closes."""
    cdef int rc = cxl_check_range(r, off, n)
    w.r = r
    w.plain = NULL
    if rc == 0 and (r.flags & (CXL_F_DIRECT | CXL_F_NOFLUSH)) == (CXL_F_DIRECT | CXL_F_NOFLUSH):
        w.plain = r.base
    return rc


cdef inline int cxl_window_store64(const cxl_window* w, uint64_t off, uint64_t v) noexcept nogil:
    """cxl_store64. pre: [off, off+8) inside the opened range, off % 8 == 0."""
    if likely(w.plain != NULL):
        cxl_store64_volatile(w.plain + off, v)
        return 0
    return cxl_store64(w.r, off, v)


cdef inline int cxl_window_observe64(const cxl_window* w, uint64_t off, uint64_t* v) noexcept nogil:
    """cxl_observe64: a coherent mapping has no stale copy to drop. pre: as above."""
    cdef uint64_t t = 0
    cdef int rc
    if likely(w.plain != NULL):
        v[0] = cxl_load64_volatile(w.plain + off)
        return 0
    rc = cxl_observe64(w.r, off, &t)  # through t: the caller's word stays in a register
    v[0] = t
    return rc


cdef inline int cxl_window_persist(const cxl_window* w, uint64_t off, uint64_t n) noexcept nogil:
    """cxl_persist: on a coherent mapping only the store -> load order is left to enforce."""
    if likely(w.plain != NULL):
        cxl_fence_sc()
        return 0
    return cxl_persist(w.r, off, n)


cdef inline int cxl_window_publish(const cxl_window* w, uint64_t off, uint64_t n) noexcept nogil:
    """cxl_publish: a compiler barrier on a coherent x86 mapping (TSO keeps store order)."""
    if likely(w.plain != NULL):
        cxl_fence_release()
        return 0
    return cxl_publish(w.r, off, n)


cdef inline int cxl_dma_read(const cxl_region* r, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Bulk read of the medium, bypassing every node's view."""
    cdef int rc = cxl_check_range(r, off, n)
    if unlikely(rc != 0):
        return rc
    return r.ops.dma_read(r.ctx, off, dst, n)


cdef inline int cxl_dma_write(const cxl_region* r, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Bulk write of the medium, bypassing every node's view; visible on return."""
    cdef int rc = cxl_check_range(r, off, n)
    if unlikely(rc != 0):
        return rc
    return r.ops.dma_write(r.ctx, off, src, n)
