# cython: language_level=3
"""``emu:`` — CXL shared memory without coherence, emulated over a shared file.

Each node sees the region through its own software cache of 64-byte lines
(kept in a sidecar file ``<path>.emu`` so a node's processes share it). A load
is served from the node's copy until that copy is flushed; a store stays in the
node's copy until it is written back, always as a whole line. Faults are
injected from a seed: spontaneous write-back of recently dirtied lines
(``evict``), flushes whose write-back waits for the next fence (``delay``),
and the latency and bandwidth of a modelled device (``lat``, ``bw``). The
checker (``check=1``) turns protocol violations into ``CoherenceError``. A test
can also make one access fail (``EmuBackend.fail_access``), as a medium does.
"""

cimport cython
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcmp, memcpy

from cxlrt.backend cimport (CXL_CAP_DMA_REGISTRABLE, CXL_CAP_MAPPABLE, CXL_CAP_SHARED_HOSTS,
                            CXL_OPS_ABI, cxl_ops)
from cxlrt.includes.intrin cimport (cxl_atomic_load_relaxed64, cxl_atomic_store_relaxed64,
                                    cxl_copy_out, cxl_fence_full, cxl_spin_ns, cxl_thread_id,
                                    likely, unlikely)
from cxlrt.includes.mutex cimport (cxl_mutex_init_shared, cxl_mutex_lock, cxl_mutex_unlock,
                                   pthread_mutex_t)
from cxlrt.includes.thread cimport cxl_atomic_store_seqcst_fence64
from cxlrt.layout cimport CXL_LINE_SIZE, cxl_line_of, cxl_line_pos, cxl_line_start
from cxlrt.mapping cimport Mapping
from cxlrt.status cimport CXLRT_E_COHERENCE, CXLRT_E_IO, CXLRT_E_UNSUPPORTED

from cxlrt.emulation import sidecar as _sidecar
from cxlrt.emulation.sidecar import if_sidecar


# --- per-set lock -------------------------------------------------------------

cdef inline void _set_lock(emu_ctx* c, uint64_t s) noexcept nogil:
    """Take set s of this node (robust: a holder killed mid-access is recovered)."""
    cdef int rc = cxl_mutex_lock(<pthread_mutex_t*>(c.meta + s * EMU_META_BYTES))
    if unlikely(rc == 1):
        # The dead holder may have left one line half-copied; the line is this
        # node's private copy, so the damage is what a crash mid-store would do.
        c.st.recovered += 1


cdef inline void _set_unlock(emu_ctx* c, uint64_t s) noexcept nogil:
    """Release set s."""
    cxl_mutex_unlock(<pthread_mutex_t*>(c.meta + s * EMU_META_BYTES))


cdef inline uint32_t* _victim(emu_ctx* c, uint64_t s) noexcept nogil:
    return <uint32_t*>(c.meta + s * EMU_META_BYTES + c.victim_off)


# --- lines ----------------------------------------------------------------------

cdef inline uint64_t _rand(emu_ctx* c) noexcept nogil:
    """xorshift64*: cheap, seeded, good enough to pick fault sites."""
    cdef uint64_t x = c.rng
    x ^= x >> 12
    x ^= x << 25
    x ^= x >> 27
    c.rng = x
    return x * <uint64_t>0x2545F4914F6CDD1D


cdef inline int _find(emu_ctx* c, uint64_t s, uint64_t line) noexcept nogil:
    """Way of `line` in set s of this node, or -1. Set lock held."""
    cdef uint64_t want = (line + 1) << 2
    cdef uint64_t* t = c.tags + s * c.ways
    cdef uint32_t w
    for w in range(c.ways):
        if (t[w] & ~(<uint64_t>EMU_STATE_MASK)) == want:
            return <int>w
    return -1


cdef inline void _writeback(emu_ctx* c, uint64_t s, uint32_t w) noexcept nogil:
    """Copy a cached line to the medium, whole, and mark it clean. Set lock held."""
    cdef uint64_t i = s * c.ways + w
    cdef uint64_t line = (c.tags[i] >> 2) - 1
    if unlikely(line >= cxl_line_of(c.size)):
        c.tags[i] = 0  # a scribbled tag names no line of ours: drop it, never write wild
        return
    memcpy(c.medium + cxl_line_start(line), c.data + i * CXL_LINE_SIZE, CXL_LINE_SIZE)
    cxl_spin_ns(c.lat_ns)
    c.tags[i] = (c.tags[i] & ~(<uint64_t>EMU_STATE_MASK)) | EMU_CLEAN


cdef inline int _fill(emu_ctx* c, uint64_t s, uint64_t line) noexcept nogil:
    """Bring `line` into set s, writing back a dirty victim first. Set lock held."""
    cdef uint64_t* t = c.tags + s * c.ways
    cdef uint32_t w
    cdef int way = -1
    for w in range(c.ways):
        if t[w] == 0:
            way = <int>w
            break
    if way < 0:
        way = <int>(_victim(c, s)[0] % c.ways)
        _victim(c, s)[0] = (<uint32_t>way + 1) % c.ways
        if (t[way] & EMU_STATE_MASK) == EMU_DIRTY:
            _writeback(c, s, way)
            c.st.capacity_wb += 1
    memcpy(c.data + (s * c.ways + way) * CXL_LINE_SIZE, c.medium + cxl_line_start(line),
           CXL_LINE_SIZE)
    cxl_spin_ns(c.lat_ns)
    cxl_atomic_store_relaxed64(&t[way], ((line + 1) << 2) | EMU_CLEAN)
    c.st.misses += 1
    return way


cdef inline int _dirty_node(emu_ctx* c, uint64_t line, bint others) noexcept nogil:
    """A node holding `line` dirty, or -1: another node when `others`, else any node
    (this one included). Peeks without their set lock."""
    cdef uint64_t s = line & (c.sets - 1)
    cdef uint64_t want = ((line + 1) << 2) | EMU_DIRTY
    cdef uint32_t n, w
    cdef uint64_t* t
    for n in range(c.nodes):
        if others and n == c.node:
            continue
        t = c.peer_tags[n] + s * c.ways
        for w in range(c.ways):
            if cxl_atomic_load_relaxed64(&t[w]) == want:
                return <int>n
    return -1


cdef inline int _dirty_elsewhere(emu_ctx* c, uint64_t line) noexcept nogil:
    """Another node holding `line` dirty, or -1."""
    return _dirty_node(c, line, True)


cdef inline int _dirty_anywhere(emu_ctx* c, uint64_t line) noexcept nogil:
    """Any node (this one included) holding `line` dirty, or -1."""
    return _dirty_node(c, line, False)


cdef inline int _violation(emu_ctx* c, int kind, uint64_t line, int other) noexcept nogil:
    """Record a checker violation and return the status that reports it."""
    c.v_kind = kind
    c.v_off = cxl_line_start(line)
    c.v_other = other
    c.st.violations += 1
    return CXLRT_E_COHERENCE


cdef inline void _maybe_evict(emu_ctx* c) noexcept nogil:
    """Fault: with probability `evict`, write back and drop a recently dirtied line."""
    cdef uint64_t tag
    if likely(c.evict_threshold == 0) or _rand(c) >= c.evict_threshold or c.recent_pos == 0:
        return
    tag = c.recent[_rand(c) % (c.recent_pos if c.recent_pos < EMU_RECENT else EMU_RECENT)]
    _drop_line(c, tag - 1, &c.st.evictions)


cdef inline void _drop_line(emu_ctx* c, uint64_t line, uint64_t* written) noexcept nogil:
    """Write `line` back if this node holds it dirty (counted in *written), then drop
    it from this node."""
    cdef uint64_t s = line & (c.sets - 1)
    cdef int w
    _set_lock(c, s)
    w = _find(c, s, line)
    if w >= 0:
        if (c.tags[s * c.ways + w] & EMU_STATE_MASK) == EMU_DIRTY:
            _writeback(c, s, <uint32_t>w)
            written[0] += 1
        cxl_atomic_store_relaxed64(&c.tags[s * c.ways + w], 0)
    _set_unlock(c, s)


cdef inline int _flush_line(emu_ctx* c, uint64_t line) noexcept nogil:
    """clflush of one line: write back if dirty, then drop it from this node."""
    _drop_line(c, line, &c.st.writebacks)
    return 0


cdef inline int _drain_locked(emu_ctx* c) noexcept nogil:
    """Complete every delayed flush of this process; pending_lock held."""
    cdef uint32_t i
    for i in range(c.npending):
        _flush_line(c, c.pending[i])
    c.npending = 0
    return 0


cdef inline int _drain(emu_ctx* c) noexcept nogil:
    """Complete every delayed flush of this process (any thread's: early is legal)."""
    cxl_mutex_lock(&c.pending_lock)
    _drain_locked(c)
    cxl_mutex_unlock(&c.pending_lock)
    return 0


# --- ops ------------------------------------------------------------------------

cdef inline int _walk_line(emu_ctx* c, uint64_t off, uint64_t end, uint64_t* line,
                           uint64_t* a, uint64_t* b, uint64_t* s, bint* hit) noexcept nogil:
    """One step of a load or store walk over [off, end): the line `off` lies in, the
    bytes [a, b) of it the walk covers, and its way in this node's cache, with set *s
    locked (the caller unlocks it). A miss fills the line from the medium (*hit False)."""
    cdef int w
    line[0] = cxl_line_of(off)
    a[0] = cxl_line_pos(off)
    b[0] = min(end - cxl_line_start(line[0]), <uint64_t>CXL_LINE_SIZE)
    s[0] = line[0] & (c.sets - 1)
    _set_lock(c, s[0])
    w = _find(c, s[0], line[0])
    hit[0] = w >= 0
    if w < 0:
        w = _fill(c, s[0], line[0])
    return w


# --- injected access failures (EmuBackend.fail_access) ---------------------------

cdef int _fails(emu_ctx* c, uint32_t kind) noexcept nogil:
    """0: go on; 1: fail this access before it does anything; 2: after it is done
    (a write whose completion was lost: it happened, the caller is told it failed)."""
    if not (c.fail_kinds & kind) or cxl_thread_id() != c.fail_tid:
        return 0
    c.fail_in -= 1
    if c.fail_in:
        return 0
    c.st.injected += 1
    if c.fail_more:
        c.fail_more -= 1
        c.fail_in = 1
    return 2 if c.fail_effect else 1


cdef int emu_load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Copy n bytes out of this node's cached lines, filling misses."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef uint64_t end = off + n, line, s, a, b, i
    cdef int w
    cdef bint hit, hit_clean
    cdef char* out = <char*>dst
    cdef int failing = _fails(c, EMU_F_LOAD) if unlikely(c.fail_in) else 0
    if failing == 1:
        return CXLRT_E_IO
    c.st.loads += 1
    while off < end:
        w = _walk_line(c, off, end, &line, &a, &b, &s, &hit)
        hit_clean = hit and (c.tags[s * c.ways + w] & EMU_STATE_MASK) == EMU_CLEAN
        i = (s * c.ways + w) * CXL_LINE_SIZE
        if unlikely(c.check and hit_clean
                    and memcmp(c.data + i + a, c.medium + cxl_line_start(line) + a, b - a) != 0):
            _set_unlock(c, s)
            return _violation(c, EMU_V_STALE_READ, line, -1)
        memcpy(out, c.data + i + a, b - a)
        _set_unlock(c, s)
        out += b - a
        off = cxl_line_start(line) + b
    _maybe_evict(c)
    return CXLRT_E_IO if failing else 0


cdef int emu_store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Copy n bytes into this node's cached lines and mark them dirty."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef uint64_t end = off + n, line, s, a, b, i, old_tag
    cdef int w, other
    cdef bint hit
    cdef const char* inp = <const char*>src
    cdef int failing = _fails(c, EMU_F_STORE) if unlikely(c.fail_in) else 0
    if failing == 1:
        return CXLRT_E_IO
    c.st.stores += 1
    while off < end:
        w = _walk_line(c, off, end, &line, &a, &b, &s, &hit)
        if unlikely(c.check and hit
                    and (c.tags[s * c.ways + w] & EMU_STATE_MASK) == EMU_CLEAN
                    and memcmp(c.data + (s * c.ways + w) * CXL_LINE_SIZE, c.medium + cxl_line_start(line),
                                  CXL_LINE_SIZE) != 0):
            _set_unlock(c, s)
            return _violation(c, EMU_V_STORE_STALE, line, -1)
        i = s * c.ways + w
        old_tag = c.tags[i]
        if (old_tag & EMU_STATE_MASK) != EMU_DIRTY:
            if unlikely(c.check):
                # Mark dirty first, then look at the others (Dekker): of two nodes
                # storing at once, at least one sees the other's mark.
                cxl_atomic_store_seqcst_fence64(&c.tags[i], (old_tag & ~(<uint64_t>EMU_STATE_MASK)) | EMU_DIRTY)
                other = _dirty_elsewhere(c, line)
                if other >= 0:
                    cxl_atomic_store_relaxed64(&c.tags[i], old_tag)
                    _set_unlock(c, s)
                    return _violation(c, EMU_V_DIRTY_TWO, line, other)
            else:
                cxl_atomic_store_relaxed64(&c.tags[i], (old_tag & ~(<uint64_t>EMU_STATE_MASK)) | EMU_DIRTY)
            c.recent[c.recent_pos % EMU_RECENT] = line + 1
            c.recent_pos += 1
        elif unlikely(c.check):
            other = _dirty_elsewhere(c, line)
            if other >= 0:
                _set_unlock(c, s)
                return _violation(c, EMU_V_DIRTY_TWO, line, other)
        memcpy(c.data + i * CXL_LINE_SIZE + a, inp, b - a)
        _set_unlock(c, s)
        inp += b - a
        off = cxl_line_start(line) + b
    _maybe_evict(c)
    return CXLRT_E_IO if failing else 0


cdef int emu_load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    """One 8-byte load; aligned, so it lies in one line and is never torn."""
    return emu_load(ctx, off, out, 8)


cdef int emu_store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    """One 8-byte store; aligned, so it lies in one line and is never torn."""
    return emu_store(ctx, off, &v, 8)


cdef int _emu_words(void* ctx, bint write, uint32_t n, const uint64_t* offs,
                    uint64_t* vals) noexcept nogil:
    """n 8-byte loads or stores, counted as one call: the one request rdma: sends for
    them (perf/round_trips.py counts requests through these counters)."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef uint32_t i, made = 0
    cdef int rc = 0
    for i in range(n):
        rc = emu_store(ctx, offs[i], &vals[i], 8) if write else emu_load(ctx, offs[i], &vals[i], 8)
        made += 1
        if rc != 0:
            break
    if made > 1:  # one request, however many words
        if write:
            c.st.stores -= made - 1
        else:
            c.st.loads -= made - 1
    return rc


cdef int emu_gather64(void* ctx, uint32_t n, const uint64_t* offs, uint64_t* out) noexcept nogil:
    return _emu_words(ctx, False, n, offs, out)


cdef int emu_scatter64(void* ctx, uint32_t n, const uint64_t* offs, const uint64_t* vals) noexcept nogil:
    return _emu_words(ctx, True, n, offs, <uint64_t*>vals)


cdef inline uint64_t _last_line(uint64_t off, uint64_t n) noexcept nogil:
    """The last line of the n > 0 bytes at off (the first is cxl_line_of(off))."""
    return cxl_line_of(off + n - 1)


cdef int emu_flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    """clflush: every line of the range is written back (if dirty) and dropped now."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef uint64_t line = cxl_line_of(off), last
    cdef int failing = _fails(c, EMU_F_FLUSH) if unlikely(c.fail_in) else 0
    if failing == 1:
        return CXLRT_E_IO
    if n == 0:
        return CXLRT_E_IO if failing else 0
    last = _last_line(off, n)
    while line <= last:
        _flush_line(c, line)
        line += 1
    # Orders the write-backs before this thread's next access, as clflush + mfence.
    cxl_fence_full()
    return CXLRT_E_IO if failing else 0


cdef int emu_flush_nodrain(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    """clflushopt: with `delay`, the write-back waits for the next fence."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef uint64_t line = cxl_line_of(off), last
    cdef int failing
    if not c.delay:
        return emu_flush(ctx, off, n)
    failing = _fails(c, EMU_F_FLUSH) if unlikely(c.fail_in) else 0
    if failing == 1:
        return CXLRT_E_IO
    if n == 0:
        return CXLRT_E_IO if failing else 0
    last = _last_line(off, n)
    cxl_mutex_lock(&c.pending_lock)
    while line <= last:
        if c.npending == EMU_PENDING_MAX:
            _drain_locked(c)   # hardware may complete queued flushes early; so may we
        c.pending[c.npending] = line
        c.npending += 1
        c.st.delayed += 1
        line += 1
    cxl_mutex_unlock(&c.pending_lock)
    return CXLRT_E_IO if failing else 0


cdef int emu_fence(void* ctx) noexcept nogil:
    """Drain delayed flushes, then a full CPU fence between processes."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef int failing = _fails(c, EMU_F_FENCE) if unlikely(c.fail_in) else 0
    if failing == 1:
        return CXLRT_E_IO
    _drain(c)
    cxl_fence_full()
    return CXLRT_E_IO if failing else 0


cdef int _dma_over_dirty(emu_ctx* c, uint64_t off, uint64_t n, int kind) noexcept nogil:
    """A DMA bypasses every node's cache: the checker flags a line some node holds dirty."""
    cdef uint64_t line = cxl_line_of(off), last = _last_line(off, n)
    cdef int other
    while line <= last:
        other = _dirty_anywhere(c, line)
        if other >= 0:
            return _violation(c, kind, line, other)
        line += 1
    return 0


cdef int _dma(emu_ctx* c, void* dst, const void* src, uint64_t off, uint64_t n,
             int kind) noexcept nogil:
    """Copy n bytes between the medium (at off) and memory, bypassing every node's
    cache: 0 (nothing done when n is 0), or the checker's `kind` violation when some
    node holds one of the lines dirty. Then the modelled device time."""
    cdef int rc
    cdef int failing = _fails(c, EMU_F_DMA) if unlikely(c.fail_in) else 0
    if failing == 1:
        return CXLRT_E_IO
    if n == 0:
        return CXLRT_E_IO if failing else 0
    if unlikely(c.check):
        rc = _dma_over_dirty(c, off, n, kind)
        if rc != 0:
            return rc
    if kind == EMU_V_DMA_OVER_DIRTY:
        cxl_copy_out(dst, src, n)  # into the medium, as the real backends write it
    else:
        memcpy(dst, src, n)
    _dma_delay(c, n)
    return CXLRT_E_IO if failing else 0


cdef int emu_dma_read(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Read the medium directly; the checker flags lines some node holds dirty."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    return _dma(c, dst, c.medium + off, off, n, EMU_V_DMA_READ_DIRTY)


cdef int emu_dma_write(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Write the medium directly; cached copies elsewhere become stale, not updated."""
    cdef emu_ctx* c = <emu_ctx*>ctx
    cdef int rc = _dma(c, c.medium + off, src, off, n, EMU_V_DMA_OVER_DIRTY)
    if rc == 0 and n != 0:
        # The data must be in the medium before any flag the caller publishes next.
        cxl_fence_full()
    return rc


cdef inline void _dma_delay(emu_ctx* c, uint64_t n) noexcept nogil:
    """Model the device: one latency plus n bytes at the modelled bandwidth."""
    cdef uint64_t ns = c.lat_ns
    if c.bytes_per_ns > 0:
        ns += <uint64_t>(n / c.bytes_per_ns)
    cxl_spin_ns(ns)


cdef cxl_ops EMU_OPS = cxl_ops(
    abi=CXL_OPS_ABI, load=emu_load, store=emu_store, load64=emu_load64, store64=emu_store64, flush=emu_flush,
    flush_nodrain=emu_flush_nodrain, fence=emu_fence, dma_read=emu_dma_read,
    dma_write=emu_dma_write, hint=NULL, gather64=emu_gather64, scatter64=emu_scatter64)


cdef int _unbound_load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return CXLRT_E_UNSUPPORTED


cdef int _unbound_store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return CXLRT_E_UNSUPPORTED


cdef int _unbound_load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    return CXLRT_E_UNSUPPORTED


cdef int _unbound_store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    return CXLRT_E_UNSUPPORTED


cdef int _unbound_flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    return CXLRT_E_UNSUPPORTED


cdef int _unbound_fence(void* ctx) noexcept nogil:
    return CXLRT_E_UNSUPPORTED


# Before bind() only DMA works: the superblock is read and written that way,
# and the caches cannot be sized until the node count is known. The DMA slots are
# EMU_OPS's (they bypass the caches); every cached-view slot refuses.
cdef cxl_ops EMU_UNBOUND_OPS = EMU_OPS
EMU_UNBOUND_OPS.load = _unbound_load
EMU_UNBOUND_OPS.store = _unbound_store
EMU_UNBOUND_OPS.load64 = _unbound_load64
EMU_UNBOUND_OPS.store64 = _unbound_store64
EMU_UNBOUND_OPS.flush = EMU_UNBOUND_OPS.flush_nodrain = _unbound_flush
EMU_UNBOUND_OPS.fence = _unbound_fence
EMU_UNBOUND_OPS.gather64 = EMU_UNBOUND_OPS.scatter64 = NULL  # the refusing load64/store64, each


_VIOLATIONS = {
    EMU_V_DIRTY_TWO: "dirty-in-two-nodes",
    EMU_V_STALE_READ: "stale-read",
    EMU_V_STORE_STALE: "store-to-stale",
    EMU_V_DMA_OVER_DIRTY: "dma-over-dirty",
    EMU_V_DMA_READ_DIRTY: "dma-read-dirty",
}

_instances = {}
_FAIL_KINDS = {"load": EMU_F_LOAD, "store": EMU_F_STORE, "flush": EMU_F_FLUSH,
               "fence": EMU_F_FENCE, "dma": EMU_F_DMA}


@cython.no_gc_clear  # a beat thread may still use the mapping: the GC must not drop it first
cdef class EmuBackend(Backend):
    """The non-coherent emulation of one node's view.

    Parameters
    ----------
    path : str
        The region file; the caches live in ``path + ".emu"``.
    params : dict
        Parsed spec parameters, see :data:`PARAMS`.
    node : int
        This view's node id.
    size : int
        Region bytes (the file's size).
    """

    def __cinit__(self):
        self.c = <emu_ctx*>calloc(1, sizeof(emu_ctx))
        if self.c == NULL:
            raise MemoryError()
        if cxl_mutex_init_shared(&self.c.pending_lock) != 0:
            raise OSError("cannot initialise the delayed-flush lock")

    def __init__(self, str path, dict params, int node, unsigned long long size):
        cdef emu_ctx* c = self.c
        self.scheme = "emu"
        self.path = path
        self.params = dict(params)
        self.mapping = Mapping(path, size)
        self.sidecar_path = path + ".emu"
        c.medium = self.mapping.base
        c.size = size
        c.node = node
        # One stream per (seed, node, how often this process opened that node of
        # that file), so a test replays from its seed whatever ran before it.
        key = (path, node)
        _instances[key] = _instances.get(key, 0) + 1
        c.rng = _sidecar.mix_seed(params["seed"], node, _instances[key])
        c.evict_threshold = _sidecar.probability_threshold(params["evict"])
        c.delay = params["delay"]
        c.check = params["check"]
        c.lat_ns = params["lat"]
        c.bytes_per_ns = params["bw"]
        self.reg.base = self.mapping.base
        self.reg.size = size
        self.reg.caps = CXL_CAP_MAPPABLE | CXL_CAP_DMA_REGISTRABLE | CXL_CAP_SHARED_HOSTS
        self.reg.flags = 0
        self.reg.node = node
        self.reg.ctx = self.c
        self.reg.ops = &EMU_UNBOUND_OPS
        self.reg.closed = 0

    def bind(self, int nodes, unsigned long long uuid, bint fresh):
        """Attach this node's cache in the sidecar, creating or replacing the sidecar.

        Parameters
        ----------
        nodes : int
            Node count from the superblock.
        uuid : int
            The region's format id; a sidecar left by an older format is replaced.
        fresh : bool
            The region was just formatted: always start from empty caches.
        """
        cdef emu_ctx* c = self.c
        cdef char* side
        assert _sidecar.META_BYTES == EMU_META_BYTES
        if c.node >= <uint32_t>nodes:
            raise ValueError(f"node {c.node} >= nodes {nodes}")
        geo = _sidecar.geometry(self.c.size, self.params["cache"], self.params["ways"])
        self.sidecar = _sidecar.attach(self.sidecar_path, nodes=nodes, uuid=uuid,
                                       region_size=self.c.size, geometry=geo, fresh=fresh)
        sets, ways = _sidecar.read_geometry(self.sidecar)
        c.nodes = nodes
        c.sets = sets
        c.ways = ways
        c.peer_tags = <uint64_t**>calloc(nodes, sizeof(uint64_t*))
        if c.peer_tags == NULL:
            raise MemoryError()
        side = self.sidecar.base
        for n in range(nodes):
            offs = _sidecar.node_offsets(n, sets, ways)
            c.peer_tags[n] = <uint64_t*>(side + <size_t>offs["tags"])
        offs = _sidecar.node_offsets(c.node, sets, ways)
        c.meta = side + <size_t>offs["meta"]
        c.victim_off = _sidecar.VICTIM_OFFSET
        c.tags = <uint64_t*>(side + <size_t>offs["tags"])
        c.data = side + <size_t>offs["data"]
        self.reg.ops = &EMU_OPS

    cpdef close(self):
        if self.c != NULL and self.reg.ops == &EMU_OPS and not self.reg.closed:
            _drain(self.c)  # a delayed flush is still a flush the program issued
        self._retire(self.mapping)  # a thread inside an access that reads the retired
                                    # zeros then also reads closed
        if self.sidecar is not None:
            self.sidecar.close()
        # Pointers stay valid (retired mappings, peer_tags) until __dealloc__, so a
        # thread still inside an access finishes harmlessly.

    def __dealloc__(self):
        self.reg.closed = 1
        if self.c != NULL:
            free(self.c.peer_tags)
            free(self.c)
            self.c = NULL

    def view(self, unsigned long long off, unsigned long long n):
        """A window on the medium itself (DMA semantics: it bypasses the caches)."""
        return self.mapping.view(off, n)

    def stats(self):
        """This process's emulation counters (dict of int)."""
        s = self.c.st
        return {"loads": s.loads, "stores": s.stores, "misses": s.misses,
                "writebacks": s.writebacks, "capacity_writebacks": s.capacity_wb,
                "evictions": s.evictions, "delayed_flushes": s.delayed,
                "violations": s.violations, "recovered_locks": s.recovered,
                "injected_failures": s.injected}

    def fail_access(self, unsigned long long after=0, kinds=("store", "flush", "fence"),
                    bint effect=False, unsigned long long times=1):
        """Make one access of the calling thread fail with CXLRT_E_IO, as a medium can
        (an RDMA completion error, a poisoned line): the one after `after` more
        accesses of `kinds` ("load", "store", "flush", "fence", "dma"; a word of a
        gather or scatter counts as one), and with `times` the next times - 1 of them
        too (a failure that outlasts the retries in front of it). With `effect` each
        access is done first and only its answer is lost. Other threads (a beat thread)
        are never failed. Disarmed once the last has fired, or by fail_access(kinds=())."""
        if times < 1:
            raise ValueError(f"fail_access: times={times}; at least one access fails")
        cdef uint32_t bits = 0
        for k in kinds:
            try:
                bits |= _FAIL_KINDS[k]
            except KeyError:
                raise ValueError(f"fail_access: no access kind {k!r}; the kinds are "
                                 + ", ".join(_FAIL_KINDS)) from None
        self.c.fail_in = 0  # disarmed while the rest changes
        self.c.fail_kinds = bits
        self.c.fail_tid = cxl_thread_id()
        self.c.fail_effect = effect
        self.c.fail_more = times - 1
        if bits:
            self.c.fail_in = after + 1

    def fail_pending(self):
        """Whether an armed failure has not fired yet."""
        return self.c.fail_in != 0

    def last_violation(self):
        """The last checker violation as a dict, or None."""
        if self.c.v_kind == EMU_V_NONE:
            return None
        return {"kind": _VIOLATIONS[self.c.v_kind], "offset": self.c.v_off,
                "node": self.c.node, "other": self.c.v_other}


PARAMS = _sidecar.PARAMS


def sidecars(str path):
    """Files beside the region file that belong to it (`cxlrt delete` removes them): the
    sidecar, if the file at its name is one (a region may be named so too)."""
    return if_sidecar(path + ".emu", _sidecar.MAGIC)
