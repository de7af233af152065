# cython: language_level=3
"""Shared-memory allocator over the backend contract (see alloc.pxd).

Fast path (small objects): the node's robust heap mutex, a bitmap scan of the
current chunk, one store and one persist of a bitmap word; no global lock.
Slow path: find another chunk of ours with room, drain our remote-free queue,
or carve a fresh chunk under the allocator lock. Large objects are chunk runs
allocated first-fit under the allocator lock.

Remote frees (an object of another node): the freer writes a link line into the
object (next, PENDING mark) and pushes it on the owner's queue under the allocator
lock, so the queue has no bound and a free never fails for lack of room. The owner
drains in two steps: under the allocator lock it commits the whole list as a batch
to its journal line (jword = cxl_rfree_jword(seq, first object)) and empties the queue; then,
under its heap mutex only, it marks each object APPLIED and clears its bit. Every
step is idempotent on replay: a drainer killed anywhere leaves the journal set, and
the next holder of the node's heap mutex finishes it before it allocates anything
(a dead holder resets the size-class hints, so every allocation after it takes the
slow path, which finishes the journal first). Nothing the batch freed can have been
handed out again meanwhile, so a replay never frees a live object. Nothing here
runs in the heartbeat: the owner drains on its allocation slow path, every
PEEK_EVERY heap-mutex sections of its own allocs and frees, in trim(), drain() and
`cxlrt check --repair`.
"""

from libc.errno cimport ESRCH, errno
from libc.stdint cimport uint32_t, uint64_t
from posix.signal cimport kill
from posix.types cimport pid_t

from cxlrt.backend cimport (cxl_flush, cxl_load, cxl_load64, cxl_observe64, cxl_persist,
                            cxl_publish, cxl_region, cxl_store, cxl_store64)
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport (cxl_atomic_load_acquire32, cxl_ctz64, cxl_fence_release,
                                    cxl_now_ns, cxl_pid, cxl_popcount64, cxl_thread_id,
                                    likely, unlikely)
from cxlrt.includes.intrin cimport CXL_ASSERT, CXL_ASSERT2, CXLRT_DEBUG
from cxlrt.includes.thread cimport cxl_atomic_load_acquire64, cxl_sleep_ns
from cxlrt.layout cimport (CXL_CHUNK, CXL_CK_LARGE, CXL_CK_SMALL, CXL_CK_TAIL, CXL_LINE_SIZE,
                           CXL_LINE_WORDS, CXL_OFF_MASK, CXL_RFREE_APPLIED, CXL_RFREE_PENDING, CXL_SMALL_MAGIC,
                           cxl_bitmap_bit, cxl_bitmap_mask, cxl_bitmap_word, cxl_bitmap_words,
                           cxl_chunk_word_off, cxl_line_aligned, cxl_line_first_word,
                           cxl_link_batch_off, cxl_link_mark_off,
                           cxl_link_next_off, cxl_rfree_jseq, cxl_rfree_jword,
                           cxl_rfree_queue, cxl_rfree_queue_off, cxl_rfree_queues_rel,
                           cxl_rq_count_off, cxl_rq_head_off, cxl_rq_jcount_off,
                           cxl_rq_jword_off, cxl_rq_seq_off, cxl_small_bitmap_bytes,
                           cxl_small_bitmap_off, cxl_small_data_off, cxl_small_header,
                           cxl_small_magic_off, cxl_small_owner_off)
# table words (layout.pxd documents their fields)
from cxlrt.layout cimport (cxl_ck_kind as _kind, cxl_ck_low as _low, cxl_ck_owner as _owner,
                           cxl_ck_word as _word)
from cxlrt.liveness cimport (cxl_live, cxl_live_fenced, cxl_live_remaining_ns,
                             cxl_live_silent_since, cxl_live_t0, cxl_live_verify)
from cxlrt.lock cimport (CXL_HELD_HEAP, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, LockService,
                         cxl_local_mutex_enter, cxl_local_mutex_exit, cxl_lock_acquire,
                         cxl_lock_release)
from cxlrt.lock cimport cxl_lock_held
from cxlrt.nodelocal cimport (CXL_LOCAL_MAG_BYTES, CXL_LOCAL_MAGS, CXL_MAG_CLASSES,
                              CXL_MAG_SLOTS, NodeLocal, cxl_local_heap, cxl_local_mag)
from cxlrt.status cimport (CXLRT_E_BADFREE, CXLRT_E_CORRUPT, CXLRT_E_DOUBLEFREE, CXLRT_E_FENCED,
                           CXLRT_E_NOMEM, CXLRT_E_RANGE, CXLRT_E_SUSPECT, check_rc)

import os

from cxlrt.errors import OutOfMemory, OutOfRangeError, RegionError


cdef extern from "cxl_mag.h" nogil:
    void* cxl_mag_find(uint64_t owner, int pid, uint64_t* tok)
    void cxl_mag_remember(uint64_t owner, int pid, void* rec, uint64_t tok)
    void cxl_mag_forget(uint64_t owner)
    int cxl_thread_gone(int pid, int tid)
    uint64_t cxl_pidns_now()
    uint64_t cxl_mag_process_token(uint64_t seed)
    uint64_t cxl_mag_next_claim()
    void cxl_compiler_barrier()



cdef enum:
    CHUNK = CXL_CHUNK
    CLASS_SHIFT0 = 6          # CLASSES[c] == 1 << (CLASS_SHIFT0 + c)
    SEQ_MASK = 0xFFFF         # a queue's seq, mod 2**16 (cxl_rfree_queue)
    PEEK_EVERY = 256          # heap-mutex sections between two looks at our own queue
    RELEASE_HINTS = 32        # chunks a drain may find emptied and give back
    AWAIT_SLICE_NS = 200000   # polling period while we wait for our own first beat after a stall
    CLEAR_TRIES = 3           # writes of a freed run whose medium failed (_clear_run)
    CARVE_TRIES = 3           # writes of a fresh chunk's header whose medium failed (_carve)
    TAG_WORD = 56             # a cached object's tag: past the link words a remote free writes

# Crash points (cxlrt.crash): one load and one predictable branch when unarmed.
cdef int* _armed = cxl_crash_armed_ptr()

cdef uint32_t CLASS_SIZE[9]
cdef uint32_t CLASS_SLOTS[9]
cdef uint32_t CLASS_DATA[9]

CLASSES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _geometry(int cls):
    """(nslots, data_start) of a chunk of `cls`-byte objects: header, bitmap, slots."""
    n = (CHUNK - sizeof(cxl_small_header)) // cls
    while True:
        bitmap = cxl_small_bitmap_bytes(n)
        start = (sizeof(cxl_small_header) + bitmap + cls - 1) // cls * cls
        if start + n * cls <= CHUNK:
            return n, start
        n -= 1


assert all(_c == 1 << (CLASS_SHIFT0 + _i) for _i, _c in enumerate(CLASSES))
for _i, _c in enumerate(CLASSES):
    CLASS_SIZE[_i] = _c
    CLASS_SLOTS[_i], CLASS_DATA[_i] = _geometry(_c)


# --- table words --------------------------------------------------------------------

cdef inline uint64_t _chunk_off(cxl_allocctx* A, uint64_t k) noexcept nogil:
    return A.heap_off + k * CHUNK


cdef inline int _table_observe(cxl_allocctx* A, uint64_t k, uint64_t* w) noexcept nogil:
    """Observe table[k] (another node may have changed it under the lock)."""
    return cxl_observe64(A.r, cxl_chunk_word_off(A.table_off, k), w)


cdef inline int _table_set(cxl_allocctx* A, uint64_t k, uint64_t w) noexcept nogil:
    """Write table[k]; the caller holds the allocator lock and publishes."""
    CXL_ASSERT(cxl_lock_held(A.L, CXL_LOCK_ALLOC, True), b"table word written without the lock")
    CXL_ASSERT(k < A.nchunks, b"table word written past the end of the table")
    return cxl_store64(A.r, cxl_chunk_word_off(A.table_off, k), w)


cdef int _table_fill(cxl_allocctx* A, uint64_t k, uint64_t n, uint64_t w) noexcept nogil:
    """Write w to table[k, k+n) in order (as _table_set: lock held, unpublished).

    Whole lines go as one 64-byte store of constant size (a variable-size copy
    compiles to a rep movs that costs more than the words themselves). Words of one
    line may land in any order; each line lands before what is stored after it."""
    cdef uint64_t line[CXL_LINE_WORDS]
    cdef uint64_t j
    cdef int rc = 0
    CXL_ASSERT(k + n <= A.nchunks, b"table run written past the end of the table")
    for j in range(CXL_LINE_WORDS):
        line[j] = w
    while n > 0 and rc == 0:
        if cxl_line_first_word(k) == k and n >= CXL_LINE_WORDS:
            rc = cxl_store(A.r, cxl_chunk_word_off(A.table_off, k), line, sizeof(line))
            cxl_fence_release()  # a plain copy: keep it before the stores that follow
            k += CXL_LINE_WORDS
            n -= CXL_LINE_WORDS
        else:
            rc = _table_set(A, k, w)
            k += 1
            n -= 1
    return rc


# --- small chunks (owner only) ---------------------------------------------------------

cdef int _take_slot(cxl_allocctx* A, uint64_t k, uint32_t c, uint64_t* out) noexcept nogil:
    """Claim a free slot of our chunk k: 0 and *out, or 1 if the chunk is full."""
    cdef uint64_t base = _chunk_off(A, k), w = 0, full
    cdef uint32_t nslots = CLASS_SLOTS[c], words = cxl_bitmap_words(nslots), i, b
    cdef int rc
    for i in range(words):
        rc = cxl_load64(A.r, cxl_small_bitmap_off(base, i), &w)  # our own bitmap: no observe
        if rc != 0:
            return rc
        full = (<uint64_t>-1 if cxl_bitmap_bit(i + 1, 0) <= nslots
                else cxl_bitmap_mask(nslots - cxl_bitmap_bit(i, 0)) - 1)
        if (w & full) != full:
            b = <uint32_t>cxl_ctz64(~w)
            CXL_ASSERT(cxl_bitmap_bit(i, b) < nslots, b"bitmap hands out a slot past the chunk's last")
            rc = cxl_store64(A.r, cxl_small_bitmap_off(base, i), w | cxl_bitmap_mask(b))
            if rc == 0:
                # Publish the bit before the object is handed out: another node
                # validating a free of it must see it allocated. The hand-out is a
                # store, so ordering before later stores is enough (cxl_publish).
                rc = cxl_publish(A.r, cxl_small_bitmap_off(base, i), sizeof(uint64_t))
            if rc == 0:
                out[0] = base + CLASS_DATA[c] + cxl_bitmap_bit(i, b) * CLASS_SIZE[c]
                if unlikely(_armed[0]):
                    cxl_crash_hit(b"alloc.small")
            return rc
    return 1


cdef int _chunk_live(cxl_allocctx* A, uint64_t k, uint32_t c, uint64_t* live) noexcept nogil:
    """Count set bits of chunk k's bitmap (observed: used by any node)."""
    cdef uint64_t base = _chunk_off(A, k), w = 0, n = 0
    cdef uint32_t words = cxl_bitmap_words(CLASS_SLOTS[c]), i
    cdef int rc = cxl_flush(A.r, cxl_small_bitmap_off(base, 0),
                            cxl_small_bitmap_bytes(CLASS_SLOTS[c]))
    for i in range(words):
        if rc == 0:
            rc = cxl_load64(A.r, cxl_small_bitmap_off(base, i), &w)
            n += cxl_popcount64(w)
    live[0] = n
    return rc


cdef int _clear_slot(cxl_allocctx* A, uint64_t k, uint32_t c, uint64_t slot,
                     uint64_t* left) noexcept nogil:
    """Owner clears a slot's bit (heap mutex held): 0, or CXLRT_E_DOUBLEFREE.

    *left receives the bitmap word after the clear (0 hints the chunk may be empty).
    """
    cdef uint64_t off = cxl_small_bitmap_off(_chunk_off(A, k), cxl_bitmap_word(slot)), w = 0
    cdef uint64_t bit = cxl_bitmap_mask(slot)
    cdef int rc
    CXL_ASSERT(c < CXL_NCLASSES, b"clearing a slot of no size class")
    CXL_ASSERT(slot < CLASS_SLOTS[c], b"clearing a slot past the chunk's last")
    rc = cxl_load64(A.r, off, &w)
    if rc != 0:
        return rc
    if not (w & bit):
        return CXLRT_E_DOUBLEFREE
    rc = cxl_store64(A.r, off, w & ~bit)
    if rc == 0:
        rc = cxl_publish(A.r, off, sizeof(uint64_t))  # before the heap mutex's release store
    left[0] = w & ~bit
    return rc


cdef int _table_line(cxl_allocctx* A, uint64_t b, uint64_t* line) noexcept nogil:
    """Observe the table line whose first word is b, and read it whole into line (each
    load of one word pays its own checks); a short last line reads only its words."""
    cdef uint64_t j, m = min(<uint64_t>CXL_LINE_WORDS, A.nchunks - b)
    cdef int rc = cxl_flush(A.r, cxl_chunk_word_off(A.table_off, b), m * sizeof(uint64_t))
    if rc == 0 and m == CXL_LINE_WORDS:
        return cxl_load(A.r, cxl_chunk_word_off(A.table_off, b), line,
                        CXL_LINE_WORDS * sizeof(uint64_t))
    j = 0
    while rc == 0 and j < m:
        rc = cxl_load64(A.r, cxl_chunk_word_off(A.table_off, b + j), &line[j])
        j += 1
    return rc


cdef int _find_free_run(cxl_allocctx* A, uint64_t n, uint64_t* first) noexcept nogil:
    """First-fit run of n free chunks (allocator lock held): 0, or CXLRT_E_NOMEM.

    A large object's head word gives its length, so the walk steps over its tails
    without reading them: one table line per large object instead of one per 8 of
    its chunks (a 2 MiB block spans 33). Only words read as 0 count towards a run:
    a head whose length was corrupted can cost a fit, never an overlap.
    """
    cdef uint64_t k = 0, b, at = <uint64_t>-1, run = 0, w
    cdef uint64_t line[CXL_LINE_WORDS]
    cdef int rc = 0
    CXL_ASSERT(cxl_lock_held(A.L, CXL_LOCK_ALLOC, True), b"free run sought without the lock")
    while k < A.nchunks:
        b = cxl_line_first_word(k)
        if b != at:
            rc = _table_line(A, b, line)
            if rc != 0:
                return rc
            at = b
        w = line[k - b]
        if w == 0:
            run += 1
            if run == n:
                first[0] = k + 1 - n
                return 0
            k += 1
        else:
            run = 0
            k += _low(w) if _kind(w) == CXL_CK_LARGE and _low(w) > 1 else 1
    return CXLRT_E_NOMEM


cdef inline bint _table_ok(cxl_allocctx* A) noexcept nogil:
    """Debug level 2: walk the whole chunk table (allocator lock held). Every word is
    free, a small chunk of a real class and node, or a large head whose run lies in the
    table and whose every other chunk is a tail naming it. A tail no head covers is
    allowed: a free killed between the head and its tails leaves one (a leak `cxlrt
    check` reports)."""
    cdef uint64_t k = 0, j, w = 0, t = 0
    while k < A.nchunks:
        if _table_observe(A, k, &w) != 0:
            return False
        if _kind(w) == CXL_CK_SMALL and (_low(w) >= CXL_NCLASSES or _owner(w) >= A.nodes):
            return False
        if _kind(w) == CXL_CK_LARGE:
            if _low(w) == 0 or k + _low(w) > A.nchunks or _owner(w) >= A.nodes:
                return False
            for j in range(1, _low(w)):
                if _table_observe(A, k + j, &t) != 0 or t != _word(CXL_CK_TAIL, _owner(w), k):
                    return False
            k += _low(w)
        else:
            k += 1
    return True


cdef inline void _walk_locked(cxl_allocctx* A, int rc) noexcept nogil:
    """Debug level 2, right before a release of the allocator lock after a change."""
    if CXLRT_DEBUG >= 2 and rc == 0:
        CXL_ASSERT2(_table_ok(A), b"chunk table inconsistent after a change under the lock")


# --- the allocator lock, fenced --------------------------------------------------------
#
# Nothing stops a holder from stalling (SIGSTOP, a VM pause) past the lease: others then
# judge its node dead and take the lock over, and what it read under the lock is stale.
# So before every write under the lock the holder asks its own clock whether it was
# silent past the lease since it began to acquire, and stops with CXLRT_E_FENCED,
# having written nothing more, if so. What is left is the few stores between that
# question and the publish; a silence found just after a publish is reported
# (CXLRT_E_SUSPECT) so the caller does not take the operation as acknowledged.

cdef void _await_beat(cxl_allocctx* A) noexcept nogil:
    """We were silent past the lease and our beat thread has not beaten since: wait for
    it (at most a lease), so that the hold we are about to take starts after the
    silence instead of being fenced at once. Waits on our own thread, never on a peer."""
    cdef cxl_live* V = A.L.live
    cdef uint64_t last = cxl_atomic_load_acquire64(&V.last_beat)
    cdef uint64_t end = cxl_now_ns() + V.lease_ns
    while cxl_live_remaining_ns(V) < 0 and cxl_atomic_load_acquire64(&V.last_beat) == last \
            and not cxl_live_fenced(V) and cxl_now_ns() < end:
        cxl_sleep_ns(AWAIT_SLICE_NS)


cdef int _alloc_lock(cxl_allocctx* A, uint64_t* t0) noexcept nogil:
    """Take the allocator lock; *t0 is our clock when we began to ask (a silence while we
    wait counts: another node may have taken the lock from us in the queue)."""
    cdef int rec = 0, rc
    cdef uint64_t last = cxl_atomic_load_acquire64(&A.L.live.last_beat)
    t0[0] = cxl_live_t0(A.L.live)  # a coarse clock read when we beat on time
    if unlikely((last != 0 and last + A.L.live.lease_ns < t0[0]) or cxl_live_fenced(A.L.live)):
        # Stalled and the beat thread has not run since: before we write as our node,
        # learn whether another life of it took over (the acquire then refuses), and
        # let our node be seen alive again before we compete for the lock.
        cxl_live_verify(A.L.live)
        _await_beat(A)
        t0[0] = cxl_now_ns()
    rc = cxl_lock_acquire(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, <uint64_t>-1, &rec)
    if rc == 0 and unlikely(A.heap.owed_n != 0):
        _settle_owed(A, t0[0])  # what fails stays owed; cxl_alloc_large insists
    return rc


cdef inline int _fence(cxl_allocctx* A, uint64_t t0) noexcept nogil:
    """CXLRT_E_FENCED if we were silent past the lease since t0 (so the lock may have
    had another holder), else 0. One clock read and two loads: slow path only."""
    return CXLRT_E_FENCED if cxl_live_silent_since(A.L.live, t0) else 0


cdef inline int _published(cxl_allocctx* A, uint64_t t0, int rc) noexcept nogil:
    """rc of a publish just made under the lock, or CXLRT_E_SUSPECT if we were silent
    past the lease during it (asked before the release: a stall there is harmless)."""
    if rc == 0 and cxl_live_silent_since(A.L.live, t0):
        return CXLRT_E_SUSPECT
    return rc


cdef inline uint64_t _magic(uint32_t c) noexcept nogil:
    """The magic word of a formatted class-c chunk: magic, then size_class."""
    return (<uint64_t>CLASS_SIZE[c] << 32) | CXL_SMALL_MAGIC


cdef int _carve(cxl_allocctx* A, uint32_t c, uint64_t* chunk) noexcept nogil:
    """Take a free chunk for class c: table word under the lock, then header + bitmap."""
    cdef uint64_t k = 0, t0 = 0
    cdef int tries
    cdef int rc = _alloc_lock(A, &t0)
    if rc != 0:
        return rc
    rc = _find_free_run(A, 1, &k)
    if rc == 0:
        rc = _fence(A, t0)  # k was free when we looked: only if the lock stayed ours
    if rc == 0:
        rc = _table_set(A, k, _word(CXL_CK_SMALL, A.node, c))
    if rc == 0:
        rc = cxl_persist(A.r, cxl_chunk_word_off(A.table_off, k), sizeof(uint64_t))
    _walk_locked(A, rc)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    if rc != 0:
        return rc
    # The chunk is ours and no slot of it was handed out, so where the medium fails a
    # write of its header, the whole header is written again (until another life has
    # our node). One that still fails stays ours without its magic: no alloc takes a
    # slot from it (_scan_own), and `cxlrt check --repair` gives it back.
    rc = _format(A, k, c)
    for tries in range(CARVE_TRIES - 1):
        if rc == 0:
            break
        if cxl_live_fenced(A.L.live):
            rc = CXLRT_E_FENCED
            break
        rc = _format(A, k, c)
    chunk[0] = k
    return rc


cdef int _format(cxl_allocctx* A, uint64_t k, uint32_t c) noexcept nogil:
    """Write the header and bitmap of our fresh class-c chunk k, magic last."""
    cdef uint64_t base = _chunk_off(A, k), i, hdr_bitmap
    cdef int rc
    # Drop any copy of its lines we kept from an earlier life, zero its bitmap and
    # write the header, magic last.
    hdr_bitmap = sizeof(cxl_small_header) + cxl_small_bitmap_bytes(CLASS_SLOTS[c])
    rc = cxl_flush(A.r, base, hdr_bitmap)
    if rc != 0:
        return rc
    for i in range(cxl_bitmap_words(CLASS_SLOTS[c])):
        rc = cxl_store64(A.r, cxl_small_bitmap_off(base, i), 0)
        if rc != 0:
            return rc
    # owner, then nslots; data_start, then reserved0 (zero)
    rc = cxl_store64(A.r, cxl_small_owner_off(base), (<uint64_t>CLASS_SLOTS[c] << 32) | A.node)
    if rc == 0:
        rc = cxl_store64(A.r, cxl_small_data_off(base), CLASS_DATA[c])
    if rc == 0:
        rc = cxl_persist(A.r, base, hdr_bitmap)
    if rc == 0:
        # magic, then size_class
        rc = cxl_store64(A.r, cxl_small_magic_off(base), _magic(c))
    if rc == 0:
        rc = cxl_persist(A.r, cxl_small_magic_off(base), sizeof(uint64_t))
    return rc


cdef int _release_chunk(cxl_allocctx* A, uint64_t k) noexcept nogil:
    """Give an empty small chunk of ours back to the table (header invalidated first).

    CXLRT_E_FENCED leaves the chunk ours and intact: the header is invalidated only
    once the lock is known to be ours, so a fenced-out release changes nothing.
    """
    cdef uint64_t t0 = 0
    cdef int rc = _alloc_lock(A, &t0)
    if rc != 0:
        return rc
    # Observe the whole line first: its other words belong to other chunks, and a
    # write-back of a stale copy would revert their owners' updates.
    rc = cxl_flush(A.r, cxl_chunk_word_off(A.table_off, k), sizeof(uint64_t))
    if rc == 0:
        rc = _fence(A, t0)
    if rc == 0:
        rc = cxl_store64(A.r, _chunk_off(A, k), 0)
    if rc == 0:
        # Before the table frees it: a crash in between leaves a chunk of ours that was
        # never carved, which `cxlrt check --repair` gives back.
        rc = cxl_persist(A.r, _chunk_off(A, k), sizeof(uint64_t))
    if rc == 0:
        rc = _table_set(A, k, 0)
    if rc == 0:
        rc = cxl_persist(A.r, cxl_chunk_word_off(A.table_off, k), sizeof(uint64_t))
    _walk_locked(A, rc)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    return rc


# --- remote-free queues ----------------------------------------------------------------

cdef inline uint64_t _queue(cxl_allocctx* A, uint32_t node) noexcept nogil:
    return cxl_rfree_queue_off(A.rfree_off, node)


cdef inline bint _objlike(cxl_allocctx* A, uint64_t x) noexcept nogil:
    """x could be a small object: inside the heap and line-aligned (below 2**48)."""
    return x >= A.heap_off and x < A.heap_off + A.nchunks * CHUNK and cxl_line_aligned(x)


cdef int _slot_of(cxl_allocctx* A, uint64_t x, uint64_t* k, uint32_t* c,
                  uint64_t* slot) noexcept nogil:
    """Locate x as a slot of one of our small chunks: 0, 1 if it is none, or an error."""
    cdef uint64_t w = 0, rel
    cdef int rc
    if not _objlike(A, x):
        return 1
    k[0] = (x - A.heap_off) // CHUNK
    rc = _table_observe(A, k[0], &w)
    if rc != 0:
        return rc
    c[0] = _low(w)
    if _kind(w) != CXL_CK_SMALL or _owner(w) != A.node or c[0] >= CXL_NCLASSES \
            or x < _chunk_off(A, k[0]) + CLASS_DATA[c[0]]:
        return 1
    rel = x - _chunk_off(A, k[0]) - CLASS_DATA[c[0]]
    if rel % CLASS_SIZE[c[0]] or rel // CLASS_SIZE[c[0]] >= CLASS_SLOTS[c[0]]:
        return 1
    slot[0] = rel // CLASS_SIZE[c[0]]
    return 0


cdef int _observe3(cxl_allocctx* A, uint64_t off, uint64_t nflush, uint64_t o0, uint64_t* w0,
                   uint64_t o1, uint64_t* w1, uint64_t o2, uint64_t* w2) noexcept nogil:
    """Drop our copy of `nflush` bytes at off, then load the words at o0, o1 and o2."""
    cdef int rc = cxl_flush(A.r, off, nflush)
    if rc == 0:
        rc = cxl_load64(A.r, o0, w0)
    if rc == 0:
        rc = cxl_load64(A.r, o1, w1)
    if rc == 0:
        rc = cxl_load64(A.r, o2, w2)
    return rc


cdef inline int _q_observe(cxl_allocctx* A, uint64_t q, uint64_t* head, uint64_t* count,
                           uint64_t* seq, uint64_t* jword) noexcept nogil:
    """Observe both lines of queue q: line 0's head, count and seq, and the owner's
    journal word."""
    cdef int rc = _observe3(A, q, 2 * CXL_LINE_SIZE, cxl_rq_head_off(q), head,
                            cxl_rq_count_off(q), count, cxl_rq_seq_off(q), seq)
    if rc == 0:
        rc = cxl_load64(A.r, cxl_rq_jword_off(q), jword)
    return rc


cdef inline int _link_read(cxl_allocctx* A, uint64_t x, uint64_t* nxt, uint64_t* mark,
                           uint64_t* batch) noexcept nogil:
    """Observe the link line of a remote-freed object x (its first line, cxl_rfree_link)."""
    return _observe3(A, x, CXL_LINE_SIZE, cxl_link_next_off(x), nxt, cxl_link_mark_off(x), mark,
                     cxl_link_batch_off(x), batch)


cdef int _q_write(cxl_allocctx* A, uint64_t q, uint64_t head, uint64_t count,
                  uint64_t seq) noexcept nogil:
    """Publish line 0 of queue q (allocator lock held).

    Count, then head, then seq: a line written back early holds a prefix of the
    stores, so a crash leaves at worst a count one too high (a push) or a queue
    half emptied that _q_settle empties again (a detach).
    """
    cdef int rc
    CXL_ASSERT(cxl_lock_held(A.L, CXL_LOCK_ALLOC, True), b"queue line written without the lock")
    CXL_ASSERT((q - A.rfree_off) % sizeof(cxl_rfree_queue) == 0,
               b"not a remote-free queue's line 0")
    CXL_ASSERT(q < _queue(A, A.nodes), b"a remote-free queue past the last node's")
    rc = cxl_store64(A.r, cxl_rq_count_off(q), count)
    if rc == 0:
        rc = cxl_store64(A.r, cxl_rq_head_off(q), head)
    if rc == 0:
        rc = cxl_store64(A.r, cxl_rq_seq_off(q), seq)
    if rc == 0:
        rc = cxl_persist(A.r, cxl_rq_head_off(q), CXL_LINE_SIZE)
    return rc


cdef int _q_settle(cxl_allocctx* A, uint64_t q, uint64_t t0, uint64_t* head,
                   uint64_t* count, uint64_t* seq, uint64_t* jword) noexcept nogil:
    """Allocator lock held since t0: observe queue q and finish a detach its owner died in.

    A drain commits its batch to the owner's journal line (seq + 1) before it empties
    the queue line. If the journal's seq is not the queue's, the owner stopped in
    between: the list in the queue is the journal's now, so the queue is empty (we
    write it so; idempotent, and fenced like every write under the lock). A head that
    cannot be an object is corrupt: the queue restarts empty rather than have the
    owner follow it. *jword receives the journal word.
    """
    cdef uint64_t jw = 0
    # Observe the queue line (head, count, seq) and the owner's journal line.
    cdef int rc = _q_observe(A, q, head, count, seq, &jw)
    jword[0] = jw
    if rc != 0:
        return rc
    seq[0] &= SEQ_MASK
    if cxl_rfree_jseq(jw) != seq[0]:
        seq[0] = cxl_rfree_jseq(jw)
    elif head[0] == 0 or _objlike(A, head[0]):
        return 0
    head[0] = 0
    count[0] = 0
    rc = _fence(A, t0)
    if rc == 0:
        rc = _q_write(A, q, 0, 0, seq[0])
    return rc


cdef int _q_recheck(cxl_allocctx* A, uint64_t q, uint64_t t0, uint64_t head, uint64_t count,
                    uint64_t seq, uint64_t jw) noexcept nogil:
    """Right before we publish line 0 of queue q: 0 if it still holds (head, count, seq)
    and the journal the batch seq of jw, as we left them, and we were not silent past
    the lease since t0; else CXLRT_E_FENCED. Either failure means the lock may have had
    another holder while we worked, who pushed or drained since: our values are stale.
    Only the journal's seq is compared: its owner closes a batch (clears the offset)
    under its heap mutex alone, but commits one (a new seq) only under the lock."""
    cdef uint64_t h = 0, n = 0, s = 0, j = 0
    # Observe both lines again (pairs with the other holder's _q_write and commit).
    cdef int rc = _q_observe(A, q, &h, &n, &s, &j)
    if rc != 0:
        return rc
    if h != head or n != count or (s & SEQ_MASK) != seq or cxl_rfree_jseq(j) != cxl_rfree_jseq(jw):
        return CXLRT_E_FENCED
    return _fence(A, t0)


cdef inline bint _loops(uint64_t x, uint64_t* tortoise, uint64_t* power,
                        uint64_t* lam) noexcept nogil:
    """Brent's cycle check, one call per list step to x != 0 (tortoise starts at the
    list's first object, power at 1, lam at 0): True once x comes round again.

    A list only loops in a corrupted region; this keeps every walk linear in the
    list's length instead of running up to max_objects steps.
    """
    if x == tortoise[0]:
        return True
    if power[0] == lam[0]:
        tortoise[0] = x
        power[0] *= 2
        lam[0] = 0
    lam[0] += 1
    return False


cdef bint _on_list(cxl_allocctx* A, uint64_t e, uint64_t x) noexcept nogil:
    """Whether x is on the list that starts at e (a bad link or a loop ends the walk)."""
    cdef uint64_t n = 0, nxt = 0, tortoise = e, power = 1, lam = 0
    while e != 0 and n < A.max_objects:
        if e == x:
            return True
        if not _objlike(A, e) or cxl_observe64(A.r, cxl_link_next_off(e), &nxt) != 0 \
                or (nxt != 0 and _loops(nxt, &tortoise, &power, &lam)):
            return False
        e = nxt
        n += 1
    return False


cdef bint _queued(cxl_allocctx* A, uint64_t q, uint64_t head, uint64_t x) noexcept nogil:
    """x carries a PENDING mark (allocator lock held): is it on the owner's queue, or in
    the batch the owner is applying? A freer killed between marking x and publishing
    it leaves the mark on an object that is on neither: freeing it again is a retry.
    Walks only on a mark, so only double frees and retries pay for it."""
    cdef uint64_t jw = 0
    if _on_list(A, head, x):
        return True
    if cxl_observe64(A.r, cxl_rq_jword_off(q), &jw) != 0:
        return True  # cannot tell: refuse rather than link x into two lists
    return _on_list(A, jw & CXL_OFF_MASK, x)


cdef int _free_remote(cxl_allocctx* A, uint64_t off, uint32_t owner, uint64_t k,
                      uint32_t c, uint64_t slot) noexcept nogil:
    """Queue another node's object for its owner; never fails for lack of room.

    CXLRT_E_FENCED: we stalled past the lease holding the lock and published nothing
    (the object is still allocated: the free did not happen and may be retried).
    CXLRT_E_SUSPECT: the stall came during the publish; the free may have happened.
    """
    cdef uint64_t q, bm, bw = 0, head = 0, count = 0, seq = 0, nxt = 0, mark = 0, batch = 0
    cdef uint64_t t0 = 0, jw = 0, tag = 0
    cdef int rc
    bm = cxl_small_bitmap_off(_chunk_off(A, k), cxl_bitmap_word(slot))  # the owner's: still live?
    rc = cxl_flush(A.r, bm, sizeof(uint64_t))
    if rc == 0:
        rc = cxl_load64(A.r, bm, &bw)
    if rc != 0:
        return rc
    if not bw & cxl_bitmap_mask(slot):
        return CXLRT_E_DOUBLEFREE
    rc = _alloc_lock(A, &t0)
    if rc != 0:
        return rc
    q = _queue(A, owner)
    rc = _q_settle(A, q, t0, &head, &count, &seq, &jw)
    if rc == 0:
        rc = _link_read(A, off, &nxt, &mark, &batch)
    if rc == 0 and mark == (CXL_RFREE_PENDING ^ off) and _queued(A, q, head, off):
        rc = CXLRT_E_DOUBLEFREE  # queued already: freed twice before the owner drained
    if rc == 0 and c < CXL_MAG_CLASSES:
        rc = cxl_load64(A.r, off + TAG_WORD, &tag)  # in the line _link_read observed
        if rc == 0 and tag == _mag_tag(A, off):
            rc = CXLRT_E_DOUBLEFREE  # freed by its owner already, and cached in a magazine
    if rc == 0:
        # The object is ours (the freer's) until it is on the list: link it and publish
        # the link, then the head that makes the owner follow it. A crash in between
        # leaves at most a stale PENDING mark, which _queued tells from a queued object.
        rc = cxl_store64(A.r, cxl_link_next_off(off), head)
        if rc == 0:
            rc = cxl_store64(A.r, cxl_link_batch_off(off), 0)
        if rc == 0:
            rc = cxl_store64(A.r, cxl_link_mark_off(off), CXL_RFREE_PENDING ^ off)
        if rc == 0:
            rc = cxl_persist(A.r, off, CXL_LINE_SIZE)
    if rc == 0 and unlikely(_armed[0]):
        cxl_crash_hit(b"free.remote")
    if rc == 0:
        # Written from what we read under the lock: only if that is still the line.
        # A fenced-out freer leaves a stale PENDING mark on an object on no list,
        # which _queued tells from a queued one, so a retry of the free is accepted.
        rc = _q_recheck(A, q, t0, head, count, seq, jw)
    if rc == 0:
        rc = _published(A, t0, _q_write(A, q, off, count + 1, seq))
    _walk_locked(A, rc)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    return rc


cdef int _journal_pending(cxl_allocctx* A, bint* pending) noexcept nogil:
    """Whether our journal holds a batch not yet applied to the end."""
    cdef uint64_t q = _queue(A, A.node), jw = 0
    cdef int rc = cxl_flush(A.r, cxl_rq_jword_off(q), sizeof(uint64_t))
    if rc == 0:
        rc = cxl_load64(A.r, cxl_rq_jword_off(q), &jw)
    pending[0] = (jw & CXL_OFF_MASK) != 0
    return rc


cdef int _journal_apply(cxl_allocctx* A, uint64_t* applied) noexcept nogil:
    """Apply the batch in our journal, if any, then close the journal (heap mutex held).

    Idempotent: each object is marked APPLIED (with the batch's seq) before its bit is
    cleared, and a replay walks the batch again from its start, clearing only bits
    still set. No slot of ours is handed out between a crash in here and the replay
    (after a dead heap-mutex holder every allocation finishes the journal first), so a
    bit still set is one this batch has to clear, and the objects' link lines are
    intact. A link that leads out of our chunks, or to an object another batch applied
    (a list a stalled freer re-published), ends the walk: what follows leaks rather
    than being freed twice. Chunks the batch emptied go back only once it is closed.
    """
    cdef cxl_local_heap* h = A.heap
    cdef uint64_t q = _queue(A, A.node), jw = 0, x, js, nxt = 0, mark = 0, batch = 0
    cdef uint64_t k = 0, slot = 0, left = 0, n = 0, tortoise = 0, power = 1, lam = 0
    cdef uint64_t empty_k[RELEASE_HINTS]
    cdef uint32_t empty_c[RELEASE_HINTS]
    cdef uint32_t c = 0, nempty = 0, j
    # Observe even our own line: another process of this node may have written it.
    cdef int rc = cxl_flush(A.r, cxl_rq_jword_off(q), sizeof(uint64_t))
    if rc == 0:
        rc = cxl_load64(A.r, cxl_rq_jword_off(q), &jw)
    if rc != 0 or (jw & CXL_OFF_MASK) == 0:
        return rc
    x = jw & CXL_OFF_MASK
    js = cxl_rfree_jseq(jw)
    tortoise = x
    while x != 0 and n < A.max_objects:
        rc = _slot_of(A, x, &k, &c, &slot)
        if rc == 0:
            rc = _link_read(A, x, &nxt, &mark, &batch)
        if rc != 0:
            break
        if mark == (CXL_RFREE_PENDING ^ x):
            # The batch first, then the mark: a prefix of the two stores still reads
            # PENDING, which a replay applies again.
            rc = cxl_store64(A.r, cxl_link_batch_off(x), js)
            if rc == 0:
                rc = cxl_store64(A.r, cxl_link_mark_off(x), CXL_RFREE_APPLIED ^ x)
            if rc == 0:
                rc = cxl_persist(A.r, x, CXL_LINE_SIZE)  # and drops our copy of the line
            if rc != 0:
                break
        elif mark != (CXL_RFREE_APPLIED ^ x) or batch != js:
            rc = 1  # not a list of this batch
            break
        if _mag_holds(A, c, x):
            rc = CXLRT_E_DOUBLEFREE  # freed here too, and cached: the cache keeps it
        else:
            rc = _clear_slot(A, k, c, slot, &left)
        if rc == 0:
            applied[0] += 1
            if left == 0 and nempty < RELEASE_HINTS:
                for j in range(nempty):
                    if empty_k[j] == k:
                        break
                else:
                    empty_k[nempty] = k
                    empty_c[nempty] = c
                    nempty += 1
        elif rc == CXLRT_E_DOUBLEFREE:
            rc = 0  # cleared before a crash (this is the replay), or freed twice
        else:
            break
        if unlikely(_armed[0]):
            cxl_crash_hit(b"alloc.drain")
        if nxt != 0 and _loops(nxt, &tortoise, &power, &lam):
            break  # every object on the loop has been applied once: stop there
        x = nxt
        n += 1
    if rc < 0:
        return rc  # an access failed: the journal stays for the next try
    rc = cxl_store64(A.r, cxl_rq_jcount_off(q), 0)
    if rc == 0:
        rc = cxl_store64(A.r, cxl_rq_jword_off(q), cxl_rfree_jword(js, 0))  # closed: seq kept
    if rc == 0:
        rc = cxl_persist(A.r, cxl_rq_jword_off(q), CXL_LINE_SIZE)
    for j in range(nempty):
        if rc != 0:
            break
        if h.current[empty_c[j]] != empty_k[j] + 1:
            rc = _kept(A, _maybe_release(A, h, empty_k[j], empty_c[j]))
    return rc


cdef int _drain_locked(cxl_allocctx* A, uint64_t* applied) noexcept nogil:
    """Apply the frees other nodes queued for us (heap mutex held).

    First a batch a killed drainer of ours left (its replay). Then, under the allocator
    lock: commit the queue's list to our journal as batch seq + 1, and only then empty
    the queue. Then apply the batch without the lock: the lock is held for a few line
    writes, however long the list.

    A drainer that stalled past the lease under the lock (CXLRT_E_FENCED) stops before
    the write it would have made from stale values: before the commit, nothing
    changed; after it, the queue line still names the list and the journal holds it
    as a batch whose seq is ahead of the queue's, which is the state of a drainer
    killed there: whoever takes the lock next empties the queue (_q_settle), and our
    next drain applies the batch. Frees pushed meanwhile stay on the queue.
    """
    cdef uint64_t q = _queue(A, A.node), head = 0, count = 0, seq = 0, js, jw = 0, t0 = 0
    cdef int rc = _journal_apply(A, applied)
    if rc == 0:
        rc = cxl_flush(A.r, cxl_rq_head_off(q), CXL_LINE_SIZE)  # peek without the lock
    if rc == 0:
        rc = cxl_load64(A.r, cxl_rq_head_off(q), &head)
    if rc != 0 or head == 0:
        return rc
    rc = _alloc_lock(A, &t0)
    if rc != 0:
        return rc
    rc = _q_settle(A, q, t0, &head, &count, &seq, &jw)
    if rc == 0 and head != 0:
        js = (seq + 1) & SEQ_MASK
        rc = _fence(A, t0)  # the list we observed is the whole queue only if so
        if rc == 0:
            rc = cxl_store64(A.r, cxl_rq_jcount_off(q), count)
        if rc == 0:
            rc = cxl_store64(A.r, cxl_rq_jword_off(q), cxl_rfree_jword(js, head))
        if rc == 0:
            # the commit: the list is the batch's now
            rc = cxl_persist(A.r, cxl_rq_jword_off(q), CXL_LINE_SIZE)
        if rc == 0 and unlikely(_armed[0]):
            cxl_crash_hit(b"alloc.drain.detach")
        if rc == 0:
            # Emptying the queue drops whatever was pushed since we observed it: only
            # if nothing was (the line is as we saw it) and the lock stayed ours.
            rc = _q_recheck(A, q, t0, head, count, seq, cxl_rfree_jword(js, head))
        if rc == 0:
            rc = _published(A, t0, _q_write(A, q, 0, 0, js))
    _walk_locked(A, rc)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    if rc == 0:
        rc = _journal_apply(A, applied)
    return rc


cdef void _peek_drain(cxl_allocctx* A) noexcept nogil:
    """Look at our queue and drain it if it holds anything (heap mutex held).

    Called every PEEK_EVERY allocs and frees of ours, so a busy node applies remote
    frees without running out of room first. A failure is left for the slow path
    to report: the alloc or free that got us here has succeeded.
    """
    cdef uint64_t q = _queue(A, A.node), head = 0, applied = 0
    if cxl_observe64(A.r, cxl_rq_head_off(q), &head) == 0 and head:
        _drain_locked(A, &applied)


cdef int _heap_lock(cxl_allocctx* A, uint64_t* applied) noexcept nogil:
    """Take the node's heap mutex: 0, or an error (then it is not held).

    After a holder that died, rebuild the size-class hints (all cleared: each class
    then takes the slow path once, which finishes our journal before it scans for
    room) and finish a drain it left half done.
    """
    cdef cxl_local_heap* h = A.heap
    cdef uint32_t i
    cdef int rc = cxl_local_mutex_enter(A.L, &h.m, CXL_HELD_HEAP, <uint64_t>-1, True)
    if rc == 0:
        return 0
    if rc < 0:
        return rc
    # A process of ours died holding the heap: the hints may be torn, the region's
    # bitmaps are not (each change is one published word).
    for i in range(16):
        h.current[i] = 0
        h.spare[i] = 0
    h.rebuilds += 1
    _mag_recover(A)
    rc = _journal_apply(A, applied)
    if rc != 0:
        cxl_local_mutex_exit(A.L, &h.m, CXL_HELD_HEAP)
    return rc


cdef int cxl_drain(cxl_allocctx* A, uint64_t* applied) noexcept nogil:
    """Take the heap mutex and apply queued remote frees."""
    cdef int rc = _heap_lock(A, applied)
    if rc != 0:
        return rc
    rc = _drain_locked(A, applied)
    cxl_local_mutex_exit(A.L, &A.heap.m, CXL_HELD_HEAP)
    return rc


# --- magazines (per-thread caches of freed small objects; see alloc.pxd) ------------------
#
# A record's count moves only after its slots: a push writes the slot, then raises the
# count; a pop lowers the count, then hands the slot out; a give-back (_mag_drop) notes
# what it drops in the heap, lowers the count, then clears the bit. A thread killed
# anywhere leaves at most its one object in flight unaccounted (a leak, as at
# alloc.small), never an object both cached and free.

cdef inline cxl_local_mag* _mag_at(cxl_allocctx* A, uint32_t i) noexcept nogil:
    return <cxl_local_mag*>(<char*>A.mags + <size_t>i * CXL_LOCAL_MAG_BYTES)


cdef inline cxl_local_mag* _mag_mine(cxl_allocctx* A) noexcept nogil:
    """This thread's record for this Allocator, or NULL (none yet, none to be had, or
    magazines off). `1` marks a claim that found no free record: not asked again. A
    record given back since (its claim token changed) is no longer ours."""
    cdef uint64_t tok = 0
    cdef void* p
    if A.mag_owner == 0:
        return NULL
    p = cxl_mag_find(A.mag_owner, cxl_pid(), &tok)
    if p == NULL or p == <void*>1 or (<cxl_local_mag*>p).ctok != tok:
        return NULL
    return <cxl_local_mag*>p


cdef inline uint64_t _mag_process() noexcept nogil:
    return cxl_mag_process_token(cxl_now_ns())


cdef inline uint64_t _mag_tag(cxl_allocctx* A, uint64_t x) noexcept nogil:
    return A.tag_key ^ x


cdef inline bint _mag_closing(cxl_allocctx* A) noexcept nogil:
    return cxl_atomic_load_acquire32(&A.L.closing) != 0


cdef bint _mag_dead(cxl_local_mag* m, uint64_t ns) noexcept nogil:
    """The record's thread surely runs no more, asked from pid namespace `ns` (read
    now: a process moved into another one meanwhile asks there). Asked only of
    records of that namespace: elsewhere a pid names another process, and a live
    owner's record given back would have its objects handed out twice; there it
    stays, a leak."""
    return m.pid != 0 and ns != 0 and m.pidns == ns \
        and cxl_thread_gone(<int>m.pid, <int>m.tid) != 0


cdef void _mag_free_record(cxl_local_mag* m) noexcept nogil:
    m.ctok = 0
    cxl_compiler_barrier()
    m.pid = 0


cdef bint _mag_holds(cxl_allocctx* A, uint32_t c, uint64_t x,
                     uint32_t skip=CXL_LOCAL_MAGS) noexcept nogil:
    """x is cached in some thread's record but `skip` (heap mutex held): a free of it is
    a double free, and a give-back of it a torn record's."""
    cdef cxl_local_mag* m
    cdef uint32_t i, j, n
    if c >= CXL_MAG_CLASSES:
        return False
    for i in range(CXL_LOCAL_MAGS):
        m = _mag_at(A, i)
        if m.pid == 0 or i == skip:
            continue
        n = m.n[c] if m.n[c] <= CXL_MAG_SLOTS else CXL_MAG_SLOTS
        for j in range(n):
            if m.slot[c][j] == x:
                return True
    return False


cdef inline int _mag_untag(cxl_allocctx* A, uint64_t x) noexcept nogil:
    """Clear a cached object's tag, published, before it is handed out or given back (a
    tag left on a live object makes other nodes refuse its free). Any copy of the
    line goes first: storing into a stale one would write its other words back stale."""
    cdef int rc = cxl_flush(A.r, x + TAG_WORD, sizeof(uint64_t))
    if rc == 0:
        rc = cxl_store64(A.r, x + TAG_WORD, 0)
    if rc == 0:
        rc = cxl_publish(A.r, x + TAG_WORD, sizeof(uint64_t))
    return rc


cdef int _mag_give(cxl_allocctx* A, uint64_t x, uint32_t c, uint32_t ri,
                   bint* kept) noexcept nogil:
    """Give a dropped object back to its bitmap (heap mutex held): its tag, then its bit.

    Only while x is a slot of ours of class c that still carries its tag: an object is
    tagged from its push until its pop or give-back clears the tag, so a tag says no
    one was handed x since it was cached (a note or record of an earlier life, a torn
    record, a replay after the bit went: each leaves x alone, a leak at worst). On a
    failure, *kept says whether x may still be cached as it was (tag and bit set).
    Another record that lists x keeps it: only a torn record (ri) could say so too."""
    cdef uint64_t k = 0, slot = 0, left = 0, w = 0, tag = 0
    cdef uint32_t cc = 0
    cdef int rc = _slot_of(A, x, &k, &cc, &slot)
    kept[0] = False
    if rc == 1 or (rc == 0 and cc != c):
        return 0
    if rc == 0:
        rc = cxl_observe64(A.r, x + TAG_WORD, &tag)
    if rc != 0:
        kept[0] = True
        return rc
    if tag != _mag_tag(A, x) or _mag_holds(A, c, x, ri):
        return 0  # not cached as record ri said, or cached by another record now
    rc = _mag_untag(A, x)
    if rc != 0:
        kept[0] = True  # a tag that may be gone: a later give-back then leaves x alone
        return rc
    rc = _clear_slot(A, k, c, slot, &left)
    if rc == CXLRT_E_DOUBLEFREE:
        return 0
    if rc != 0:
        return rc  # untagged: never cached again, whatever the bit (a leak at worst)
    if left == 0 and A.heap.current[c] != k + 1:
        _kept(A, _maybe_release(A, A.heap, k, c))  # the drop is done either way
    return 0


cdef int _mag_drop(cxl_allocctx* A, uint32_t ri, uint32_t c) noexcept nogil:
    """Give back the top object of record ri's class c (heap mutex held, the record's
    thread not pushing or popping): noted in the heap, the count lowered, then
    _mag_give, then the note cleared. On a failure that may have left it as it was,
    the object stays cached and the error is returned."""
    cdef cxl_local_heap* h = A.heap
    cdef cxl_local_mag* m = _mag_at(A, ri)
    cdef uint32_t i = m.n[c] - 1
    cdef uint64_t x = m.slot[c][i]
    cdef bint kept = False
    cdef int rc
    h.drop_rec = ri
    h.drop_c = c
    h.drop_i = i
    cxl_compiler_barrier()
    h.drop_x = x
    cxl_compiler_barrier()
    m.n[c] = i
    cxl_compiler_barrier()
    if unlikely(_armed[0]):
        cxl_crash_hit(b"free.mag.drop")
    rc = _mag_give(A, x, c, ri, &kept)
    if kept:
        m.n[c] = i + 1  # still cached as it was (the slot was never overwritten)
    cxl_compiler_barrier()
    h.drop_x = 0
    return rc


cdef int _mag_flush(cxl_allocctx* A, uint32_t ri, uint32_t keep) noexcept nogil:
    """Give back all but `keep` objects of each class of record ri (heap mutex held)."""
    cdef cxl_local_mag* m = _mag_at(A, ri)
    cdef uint32_t c
    cdef int rc
    for c in range(CXL_MAG_CLASSES):
        if m.n[c] > CXL_MAG_SLOTS:
            m.n[c] = 0  # torn: which slots are cached is unknown; a leak, never a guess
        while m.n[c] > keep:
            rc = _mag_drop(A, ri, c)
            if rc != 0:
                return rc
    return 0


cdef int _mag_flush_class(cxl_allocctx* A, uint32_t ri, uint32_t c, uint32_t keep) noexcept nogil:
    """Give back all but `keep` of record ri's class-c objects (heap mutex held)."""
    cdef int rc
    while _mag_at(A, ri).n[c] > keep:
        rc = _mag_drop(A, ri, c)
        if rc != 0:
            return rc
    return 0


cdef void _mag_recover(cxl_allocctx* A) noexcept nogil:
    """Finish a give-back a dead heap-mutex holder left half done (heap mutex held).
    A new life forgets the note (another life may have used the slot since); within a
    life nothing was allocated since the holder died, and _mag_give still asks the
    object's tag."""
    cdef cxl_local_heap* h = A.heap
    cdef cxl_local_mag* m
    cdef uint64_t x = h.drop_x
    cdef bint kept = False
    if x == 0:
        return
    if h.drop_rec < CXL_LOCAL_MAGS and h.drop_c < CXL_MAG_CLASSES and h.drop_i < CXL_MAG_SLOTS:
        m = _mag_at(A, h.drop_rec)
        if m.n[h.drop_c] > h.drop_i and m.slot[h.drop_c][h.drop_i] == x:
            m.n[h.drop_c] = h.drop_i
        _mag_give(A, x, h.drop_c, h.drop_rec, &kept)
        if kept:
            m = _mag_at(A, h.drop_rec)
            if m.n[h.drop_c] == h.drop_i:
                m.n[h.drop_c] = h.drop_i + 1  # cached as it was: back in its record
    h.drop_x = 0


cdef uint64_t _mag_sweep(cxl_allocctx* A) noexcept nogil:
    """Give back the records of threads that are gone (heap mutex held); how many."""
    cdef cxl_local_mag* m
    cdef uint32_t i
    cdef uint64_t n = 0, ns = cxl_pidns_now()
    for i in range(CXL_LOCAL_MAGS):
        m = _mag_at(A, i)
        if _mag_dead(m, ns) and _mag_flush(A, i, 0) == 0:
            _mag_free_record(m)
            n += 1
    return n


cdef cxl_local_mag* _mag_claim(cxl_allocctx* A) noexcept nogil:
    """This thread's record, claimed now if it has none (heap mutex held); NULL when
    every record is a live thread's (the thread then goes without)."""
    cdef cxl_local_mag* m = _mag_mine(A)
    cdef uint32_t i, c, pid = <uint32_t>cxl_pid(), tid = cxl_thread_id()
    cdef uint64_t tok = 0, ptok
    cdef int free_i = -1
    if m != NULL or A.mag_owner == 0:
        return m
    if cxl_mag_find(A.mag_owner, cxl_pid(), &tok) == <void*>1:
        return NULL
    ptok = _mag_process()
    for i in range(CXL_LOCAL_MAGS):
        m = _mag_at(A, i)
        if m.pid == pid and m.ptok == ptok and m.tid == tid and m.owner == A.mag_owner:
            free_i = i  # ours already (our cache of it was evicted)
            break
    if free_i < 0:
        # A new thread: what threads that are gone kept goes back first (a pool's
        # threads come and go; each claim costs a liveness question per record).
        _mag_sweep(A)
        for i in range(CXL_LOCAL_MAGS):
            if _mag_at(A, i).pid == 0:
                free_i = i
                break
    if free_i < 0:
        cxl_mag_remember(A.mag_owner, cxl_pid(), <void*>1, 0)
        return NULL
    m = _mag_at(A, free_i)
    if m.pid == 0:
        m.tid = tid
        m.pidns = cxl_pidns_now()
        m.owner = A.mag_owner
        m.ptok = ptok
        m.ctok = (ptok ^ (cxl_mag_next_claim() * <uint64_t>0xBF58476D1CE4E5B9)) | 1
        for c in range(8):
            m.n[c] = 0
        cxl_compiler_barrier()
        m.pid = pid  # last: a record is claimed only once it says whose it is
    cxl_mag_remember(A.mag_owner, cxl_pid(), m, m.ctok)
    return m


cdef inline uint32_t _mag_index(cxl_allocctx* A, cxl_local_mag* m) noexcept nogil:
    return <uint32_t>((<char*>m - <char*>A.mags) // CXL_LOCAL_MAG_BYTES)


cdef inline int _mag_push(cxl_allocctx* A, cxl_local_mag* m, uint32_t c, uint64_t x) noexcept nogil:
    """Cache our freed object x (its bit still set; room checked by the caller; its tag
    line observed, so no stale copy of it is stored into): the tag, published (its
    line must not be left dirty here for a remote free of it to be written over
    later), then the slot, then the count. Always 0: the free has happened."""
    cdef uint32_t i = m.n[c]
    # The caller observed the line. A failed store or publish still caches x: the
    # line may be dirty here, which is safe only on an object nobody else writes,
    # and x must not leave with a tag on it. Its free has happened.
    cdef int tries = 0
    if cxl_store64(A.r, x + TAG_WORD, _mag_tag(A, x)) == 0 \
            and unlikely(cxl_publish(A.r, x + TAG_WORD, sizeof(uint64_t)) != 0):
        # Retried: an unpublished tag is one other nodes cannot see (a second free of
        # x from there would be queued), on a line left dirty here.
        while tries < CLEAR_TRIES and cxl_publish(A.r, x + TAG_WORD, sizeof(uint64_t)) != 0:
            tries += 1
    m.slot[c][i] = x
    cxl_compiler_barrier()
    if unlikely(_armed[0]):
        cxl_crash_hit(b"free.mag")
    m.n[c] = i + 1
    return 0


cdef inline int _mag_pop(cxl_allocctx* A, cxl_local_mag* m, uint32_t c, uint64_t* out) noexcept nogil:
    """Hand out our newest cached object of class c (the caller saw one): the count
    lowered, then the tag cleared and published; a failure puts it back."""
    cdef uint32_t i = m.n[c] - 1
    cdef uint64_t x = m.slot[c][i]
    cdef int rc
    m.n[c] = i
    cxl_compiler_barrier()
    if unlikely(_armed[0]):
        cxl_crash_hit(b"alloc.mag")
    rc = _mag_untag(A, x)
    if rc != 0:
        m.n[c] = i + 1
        return rc
    out[0] = x
    return 0


cdef int cxl_mag_sweep(cxl_allocctx* A, uint64_t* swept) noexcept nogil:
    """Take the heap mutex and give back the records of threads that are gone."""
    cdef uint64_t applied = 0
    cdef int rc = _heap_lock(A, &applied)
    if rc != 0:
        return rc
    swept[0] = _mag_sweep(A)
    cxl_local_mutex_exit(A.L, &A.heap.m, CXL_HELD_HEAP)
    return 0


cdef int cxl_mag_close(cxl_allocctx* A) noexcept nogil:
    """Give back this thread's record of this Allocator, and those of our threads that
    are gone (Region.close). Our other threads' records stay theirs: one of them may be
    inside a push or a pop right now, and a record given back under it could be
    claimed by another process and written by both. Each goes back once its thread
    is gone (a sweep: the next claim, trim or attach of the node), or with this
    process. From now on no thread of ours caches for this Allocator."""
    cdef uint64_t applied = 0, owner = A.mag_owner, ptok
    cdef cxl_local_mag* m
    cdef uint32_t i, pid = <uint32_t>cxl_pid(), tid = cxl_thread_id()
    cdef int rc, first = 0
    if owner == 0:
        return 0
    A.mag_owner = 0
    cxl_mag_forget(owner)
    rc = _heap_lock(A, &applied)
    if rc != 0:
        return rc
    ptok = _mag_process()
    for i in range(CXL_LOCAL_MAGS):
        m = _mag_at(A, i)
        if m.pid == pid and m.ptok == ptok and m.owner == owner \
                and (m.tid == tid or cxl_thread_gone(<int>pid, <int>m.tid)):
            rc = _mag_flush(A, i, 0)
            if rc == 0:
                _mag_free_record(m)
            elif first == 0:
                first = rc
    cxl_local_mutex_exit(A.L, &A.heap.m, CXL_HELD_HEAP)
    return first


cdef int _scan_own(cxl_allocctx* A, uint32_t c, uint64_t skip, uint64_t* found) noexcept nogil:
    """Another chunk of ours for class c with a free slot: 0 and *found, or 1."""
    cdef uint64_t k, w = 0, live = 0, m = 0
    cdef int rc
    for k in range(A.nchunks):
        if k == skip:
            continue
        rc = _table_observe(A, k, &w)
        if rc != 0:
            return rc
        if w == _word(CXL_CK_SMALL, A.node, c):
            rc = cxl_observe64(A.r, cxl_small_magic_off(_chunk_off(A, k)), &m)
            if rc != 0:
                return rc
            if m != _magic(c):
                continue  # a carve cut short (never formatted): a leak, never a slot
            rc = _chunk_live(A, k, c, &live)
            if rc != 0:
                return rc
            if live < CLASS_SLOTS[c]:
                found[0] = k
                return 0
    return 1


cdef int _alloc_slow(cxl_allocctx* A, uint32_t c, uint64_t* out) noexcept nogil:
    """Class c has no current chunk with room (heap mutex held): finish our journal,
    then another chunk of ours with room (after applying remote frees if none has),
    our spare, or a fresh chunk from the table."""
    cdef cxl_local_heap* h = A.heap
    cdef uint64_t k = 0, applied = 0
    cdef int rc = _journal_apply(A, &applied)  # before any slot of ours is reused
    if rc != 0:
        return rc
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
    return rc


cdef int cxl_alloc_small(cxl_allocctx* A, uint32_t c, uint64_t* out) noexcept nogil:
    """Allocate one class-c object for this node.

    Budget: from this thread's magazine, no lock: a pop and one published store of
    the object's tag word. Otherwise the heap mutex, then one load, one store and
    one persist of a bitmap word; no global lock, no flush of anything else (a look
    at our remote-free queue, one observed line, every PEEK_EVERY calls, which also
    pass over the magazine).
    """
    cdef cxl_local_heap* h = A.heap
    cdef cxl_local_mag* m
    cdef uint64_t applied = 0
    cdef int rc
    if c < CXL_MAG_CLASSES:
        m = _mag_mine(A)
        if m != NULL and m.n[c] > 0 and ((A.ticks + 1) & (PEEK_EVERY - 1)) != 0 \
                and not _mag_closing(A):
            A.ticks += 1
            return _mag_pop(A, m, c, out)
    rc = _heap_lock(A, &applied)
    if rc != 0:
        return rc
    CXL_ASSERT(c < CXL_NCLASSES, b"no such size class")
    CXL_ASSERT(h.current[c] <= A.nchunks, b"a class hint past the chunk table")
    rc = 1
    if c < CXL_MAG_CLASSES:
        m = _mag_claim(A)
        if m != NULL and m.n[c] > 0:
            rc = _mag_pop(A, m, c, out)
    if rc == 1 and h.current[c]:
        rc = _take_slot(A, h.current[c] - 1, c, out)
    if unlikely(rc == 1):
        rc = _alloc_slow(A, c, out)
    if rc == 0:
        CXL_ASSERT(_objlike(A, out[0]), b"a small object outside the heap or not line-aligned")
        CXL_ASSERT((out[0] - A.heap_off) % CLASS_SIZE[c] == 0, b"not aligned to its class size")
    A.ticks += 1
    if unlikely((A.ticks & (PEEK_EVERY - 1)) == 0) and rc == 0:
        _peek_drain(A)
    cxl_local_mutex_exit(A.L, &h.m, CXL_HELD_HEAP)
    return rc


cdef int _clear_run(cxl_allocctx* A, uint64_t k, uint64_t n, uint64_t t0,
                    bint* left) noexcept nogil:
    """Give the run of n chunks at k back to the table (allocator lock held since t0,
    fence checked, its lines observed). The head first, published alone: a process
    killed after it leaves orphan tails (a leak that check reports and _reclaim_tails
    frees), never a short run, and no line of the run dirty. The stores are
    idempotent, so where the medium fails one it is written again, but only while the
    lock is still ours: a failing access can outlast the lease, and then the run may
    be another node's.

    Once the head is gone the free has happened: no later free can reach the run, and
    its chunk may be handed out again. So from there on a failure is no error of the
    free's (0, or CXLRT_E_SUSPECT if the lock may have passed on); *left says the
    tails may remain, for the caller to reclaim under a hold of its own."""
    cdef int rc = 1, tries = 0
    left[0] = False
    while rc != 0 and tries < CLEAR_TRIES:
        if tries and _fence(A, t0) != 0:
            # The failed store may have landed, and then the chunk may be another's
            # by now: a retried free could free that. Not acknowledged, not undone.
            return CXLRT_E_SUSPECT
        tries += 1
        rc = _table_set(A, k, 0)
        if rc == 0:
            rc = cxl_publish(A.r, cxl_chunk_word_off(A.table_off, k), sizeof(uint64_t))
    if rc != 0:
        return rc
    left[0] = n > 1
    if unlikely(_armed[0]):
        cxl_crash_hit(b"free.large")
    rc = 1
    tries = 0
    while rc != 0 and tries < CLEAR_TRIES and n > 1:
        if _fence(A, t0) != 0:
            # The lock may have passed on, and with the head gone a repair under it
            # may take our tails back and hand them out: leave them to it.
            return CXLRT_E_SUSPECT
        tries += 1
        rc = _table_fill(A, k + 1, n - 1, 0)
        if rc == 0:
            rc = cxl_persist(A.r, cxl_chunk_word_off(A.table_off, k + 1),
                             (n - 1) * sizeof(uint64_t))
        if rc == 0:
            left[0] = False
    return 0


cdef int _clear_line_words(cxl_allocctx* A, uint64_t b, uint32_t mask, uint64_t t0) noexcept nogil:
    """Zero the words of table line b that `mask` names (bit i: word b + i), then publish
    them, right after one fence check: a stall between two lines leaves none of ours
    dirty to be written back, stale, under another node's hold."""
    cdef uint64_t i, lo = CXL_LINE_WORDS, hi = 0
    cdef int prc, rc = _fence(A, t0)
    i = 0
    while rc == 0 and i < CXL_LINE_WORDS:
        if mask >> i & 1:
            rc = _table_set(A, b + i, 0)
            lo = min(lo, i)
            hi = i
        i += 1
    if lo <= hi:  # what landed in our view goes out even if a later store failed
        prc = _published(A, t0, cxl_persist(A.r, cxl_chunk_word_off(A.table_off, b + lo),
                                            (hi + 1 - lo) * sizeof(uint64_t)))
        if rc == 0:
            rc = prc
    return rc


cdef int _reclaim_tails(cxl_allocctx* A, uint64_t t0, uint64_t first, uint64_t end_k,
                        uint64_t want, uint64_t* cleared) noexcept nogil:
    """Free the tail words of [first, end_k) that no head covers, or only those equal to
    `want` when it is not 0 (allocator lock held since t0).

    A large alloc writes its tails before its head, and a large free clears its head
    before its tails, each under the lock. So under the lock a tail that no head
    covers was left by a step cut short (a kill, or a medium failing past its
    retries); no free can reach it, and nothing else would ever give it back. Words
    inside a head's run are the run's, right or wrong (`cxlrt check` reports a wrong
    tail), and are left alone, as _find_free_run steps over them. A head before
    `first` cannot cover a tail of the range without covering `first`, which the
    caller knows to be no tail of such a run. 0, or an error; *cleared counts the
    words freed."""
    cdef uint64_t k = first, b, w, end = 0
    cdef uint64_t line[CXL_LINE_WORDS]
    cdef uint32_t mask, got
    cdef int rc = 0
    cleared[0] = 0
    while k < end_k and rc == 0:
        b = cxl_line_first_word(k)
        rc = _table_line(A, b, line)
        mask = 0
        got = 0
        while rc == 0 and k < end_k and cxl_line_first_word(k) == b:
            w = line[k - b]
            if _kind(w) == CXL_CK_LARGE:
                end = max(end, k + _low(w))
            elif _kind(w) == CXL_CK_TAIL and k >= end and (want == 0 or w == want):
                mask |= 1u << (k - b)
                got += 1
            k += 1
        if rc == 0 and mask:
            rc = _clear_line_words(A, b, mask, t0)
            if rc == 0:
                cleared[0] += got
    return rc


cdef int cxl_reclaim(cxl_allocctx* A, uint64_t first, uint64_t end_k, uint64_t want,
                     uint64_t* cleared) noexcept nogil:
    """Take the allocator lock (which settles what our node owes, _alloc_lock) and free
    the tails _reclaim_tails finds in [first, end_k)."""
    cdef uint64_t t0 = 0
    cdef int rc = _alloc_lock(A, &t0)
    cleared[0] = 0
    if rc != 0:
        return rc
    if first < end_k:
        rc = _reclaim_tails(A, t0, first, end_k, want, cleared)
    _walk_locked(A, rc)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    return rc


cdef uint64_t _token = 0
cdef int _token_pid = 0


cdef uint64_t _process_token() noexcept nogil:
    """A number that names this process among those a pid could name: drawn from the
    clock when the pid changes (a fork), so a process that reuses a dead one's pid,
    or has its pid in another namespace, has another. Called under the allocator lock
    only, whose node-local mutex keeps our own threads out of each other's draw."""
    global _token, _token_pid
    if _token_pid != cxl_pid():
        _token = (cxl_now_ns() * <uint64_t>0x9E3779B97F4A7C15) ^ <uint64_t>cxl_pid()
        if _token == 0:
            _token = 1
        _token_pid = cxl_pid()
    return _token


cdef int _settle_owed(cxl_allocctx* A, uint64_t t0) noexcept nogil:
    """Give back the run our node's large alloc wrote and did not hand out (allocator
    lock held since t0): its head, then its tails, each only where the table still
    holds that alloc's word, a table line at a time (_clear_line_words). Only our node
    writes words that name it, and each of its processes settles before it allocates
    a run, so a word that matches is that alloc's; a word another node wrote over a
    chunk already given back does not match. Idempotent: a process killed part-way
    leaves it owed for the next. 0, or an error (then it stays owed).

    Not a record whose writer died: it may have died between a store and its
    publish, and its lines, dirty in this host's cache, are written back whenever
    they are, stale, maybe over a run another node has been given since the lease
    broke its hold. Words read back from there are not that alloc's to clear. Such a
    record is dropped, and the run is the leak a kill there always left."""
    cdef cxl_local_heap* h = A.heap
    cdef uint64_t k = h.owed_k, n = h.owed_n, i, w = 0, want, b
    cdef uint32_t mask
    cdef int rc
    if h.owed_tok != _process_token() and (h.owed_pid == <uint32_t>cxl_pid() or (
            kill(<pid_t>h.owed_pid, 0) != 0 and errno == ESRCH)):
        h.owed_n = 0  # its writer is gone: our pid is not its process, or no process is
        return 0
    if k >= A.nchunks or n > A.nchunks - k:
        h.owed_n = 0  # a torn record: not ours to trust (a leak check reports)
        return CXLRT_E_CORRUPT
    rc = cxl_flush(A.r, cxl_chunk_word_off(A.table_off, k), n * sizeof(uint64_t))
    i = 0
    while rc == 0 and i < n:
        b = cxl_line_first_word(k + i)
        mask = 0
        while rc == 0 and i < n and cxl_line_first_word(k + i) == b:
            want = _word(CXL_CK_LARGE, A.node, n) if i == 0 else _word(CXL_CK_TAIL, A.node, k)
            rc = cxl_load64(A.r, cxl_chunk_word_off(A.table_off, k + i), &w)
            if rc == 0 and w == want:
                mask |= 1u << (k + i - b)
            i += 1
        if rc == 0 and mask:  # the head's line first: never a short run
            rc = _clear_line_words(A, b, mask, t0)
    if rc == 0:
        h.owed_n = 0
    return rc


cdef int cxl_alloc_large(cxl_allocctx* A, uint64_t nbytes, uint64_t* out) noexcept nogil:
    """A run of whole chunks, first fit, under the allocator lock."""
    cdef uint64_t n = (nbytes + CHUNK - 1) // CHUNK, k = 0, t0 = 0, cleared = 0
    cdef int rc = _alloc_lock(A, &t0)
    if rc != 0:
        return rc
    CXL_ASSERT(n >= 1, b"a large allocation of no chunk")
    if unlikely(A.heap.owed_n != 0):
        rc = _settle_owed(A, t0)  # a run of ours whose words match would be taken for it
    if rc == 0:
        rc = _find_free_run(A, n, &k)
    if rc == 0:
        CXL_ASSERT(k + n <= A.nchunks, b"a free run past the end of the table")
    if rc == 0:
        rc = _fence(A, t0)  # the run was free when we looked: only if the lock stayed ours
        if rc == 0:
            # Owed until the caller has it: a kill or a failed access from here on
            # leaves the run for the next holder of ours to give back.
            A.heap.owed_k = k
            A.heap.owed_pid = <uint32_t>cxl_pid()
            A.heap.owed_tok = _process_token()
            A.heap.owed_n = n
            cxl_fence_release()  # the record before any table store
            rc = _table_fill(A, k + 1, n - 1, _word(CXL_CK_TAIL, A.node, k))
            if rc == 0 and n > 1:  # the tails alone first: a kill then leaves no line dirty
                rc = cxl_persist(A.r, cxl_chunk_word_off(A.table_off, k + 1),
                                 (n - 1) * sizeof(uint64_t))
                if rc == 0 and unlikely(_armed[0]):
                    cxl_crash_hit(b"alloc.large.tails")
            if rc == 0:
                # Silent since the tails? A repair under another hold may have taken
                # them back and handed the run out: no head of ours over it.
                rc = _fence(A, t0)
            if rc == 0:
                rc = _table_set(A, k, _word(CXL_CK_LARGE, A.node, n))
            if rc == 0:
                rc = _published(A, t0, cxl_persist(A.r, cxl_chunk_word_off(A.table_off, k),
                                                   sizeof(uint64_t)))
                if rc == 0 and unlikely(_armed[0]):
                    cxl_crash_hit(b"alloc.large")
            if rc == 0:
                A.heap.owed_n = 0
            elif _fence(A, t0) == 0:
                # The medium failed part-way (a write may have landed): the caller gets
                # no object, so the run goes back now; what fails stays owed.
                _settle_owed(A, t0)
    _walk_locked(A, rc)
    cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
    if rc == 0:
        out[0] = _chunk_off(A, k)
    elif unlikely(A.heap.owed_n != 0) and rc != CXLRT_E_NOMEM:
        # Fenced, or the medium failed past the give-back: under a hold of our own
        # again the run goes back now (_alloc_lock settles it), not whenever this
        # node next takes the lock. If this fails too, that next hold does it.
        cxl_reclaim(A, 0, 0, 0, &cleared)
    return rc


cdef int cxl_free(cxl_allocctx* A, uint64_t off) noexcept nogil:
    """Free any node's object: ours into this thread's magazine or directly, others'
    through their queue, runs under the lock."""
    cdef uint64_t k, w = 0, rel, slot, bw = 0, n, applied = 0, t0 = 0, tag = 0
    cdef cxl_local_mag* m
    cdef uint32_t c, owner
    cdef int rc
    cdef bint left = False
    cdef cxl_local_heap* h = A.heap
    if off < A.heap_off or off >= A.heap_off + A.nchunks * CHUNK:
        return CXLRT_E_RANGE
    k = (off - A.heap_off) // CHUNK
    rc = _table_observe(A, k, &w)
    if rc != 0:
        return rc
    if w == 0 or _kind(w) == CXL_CK_TAIL:
        return CXLRT_E_BADFREE
    if _kind(w) == CXL_CK_LARGE:
        if off != _chunk_off(A, k):
            return CXLRT_E_BADFREE
        rc = _alloc_lock(A, &t0)
        if rc != 0:
            return rc
        rc = _table_observe(A, k, &w)  # again, under the lock: someone may have freed it
        if rc == 0 and _kind(w) != CXL_CK_LARGE:
            rc = CXLRT_E_DOUBLEFREE
        n = _low(w)
        if rc == 0 and (n == 0 or k + n > A.nchunks):
            rc = CXLRT_E_CORRUPT
        if rc == 0:  # observe every line we are about to rewrite (see _release_chunk)
            rc = cxl_flush(A.r, cxl_chunk_word_off(A.table_off, k), n * sizeof(uint64_t))
        if rc == 0:
            rc = _fence(A, t0)
        if rc == 0:
            rc = _published(A, t0, _clear_run(A, k, n, t0, &left))
        _walk_locked(A, rc)
        cxl_lock_release(A.L, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY)
        if left:
            # The tails were left without their head (a silence or the medium): under
            # a hold of our own again they go back now, those of this run only (words
            # elsewhere are not ours to judge). If this fails too, they are a leak
            # that `cxlrt check` names and --repair frees.
            cxl_reclaim(A, k, k + n, _word(CXL_CK_TAIL, _owner(w), k), &slot)
        return rc
    if _kind(w) != CXL_CK_SMALL:
        return CXLRT_E_CORRUPT
    c = _low(w)
    owner = _owner(w)
    if c >= CXL_NCLASSES or owner >= A.nodes:
        return CXLRT_E_CORRUPT
    if off < _chunk_off(A, k) + CLASS_DATA[c]:
        return CXLRT_E_BADFREE
    rel = off - _chunk_off(A, k) - CLASS_DATA[c]
    slot = rel >> (CLASS_SHIFT0 + c)  # sizes are 64 << c: no divide on the free path
    if (rel & (CLASS_SIZE[c] - 1)) or slot >= CLASS_SLOTS[c]:
        return CXLRT_E_BADFREE
    if owner != A.node:
        return _free_remote(A, off, owner, k, c, slot)
    if c < CXL_MAG_CLASSES:
        m = _mag_mine(A)
        if m != NULL and m.n[c] < CXL_MAG_SLOTS and ((A.ticks + 1) & (PEEK_EVERY - 1)) != 0 \
                and not _mag_closing(A):
            # Our own bitmap and our own tag: loads, nothing to observe. A tag says it
            # may be cached already: only a look under the heap mutex tells.
            rc = cxl_load64(A.r, cxl_small_bitmap_off(_chunk_off(A, k), cxl_bitmap_word(slot)), &bw)
            if rc == 0:
                rc = cxl_observe64(A.r, off + TAG_WORD, &tag)
            if rc != 0:
                return rc
            if not (bw & cxl_bitmap_mask(slot)):
                return CXLRT_E_DOUBLEFREE
            if likely(tag != _mag_tag(A, off)):
                A.ticks += 1
                return _mag_push(A, m, c, off)
    rc = _heap_lock(A, &applied)
    if rc != 0:
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"free.local")
    m = _mag_claim(A) if c < CXL_MAG_CLASSES else NULL
    rc = cxl_observe64(A.r, off + TAG_WORD, &tag) if c < CXL_MAG_CLASSES else 0
    if rc == 0 and c < CXL_MAG_CLASSES and tag == _mag_tag(A, off) and _mag_holds(A, c, off):
        rc = CXLRT_E_DOUBLEFREE
    elif rc == 0 and m != NULL:
        rc = cxl_load64(A.r, cxl_small_bitmap_off(_chunk_off(A, k), cxl_bitmap_word(slot)), &bw)
        if rc == 0 and not (bw & cxl_bitmap_mask(slot)):
            rc = CXLRT_E_DOUBLEFREE
        if rc == 0 and m.n[c] >= CXL_MAG_SLOTS:
            rc = _mag_flush_class(A, _mag_index(A, m), c, CXL_MAG_SLOTS // 2)
        if rc == 0:
            rc = _mag_push(A, m, c, off)
    elif rc == 0:
        if c < CXL_MAG_CLASSES and tag == _mag_tag(A, off):
            rc = _mag_untag(A, off)  # a stray tag (a push cut short): not onto the bitmap
        if rc == 0:
            rc = _clear_slot(A, k, c, slot, &bw)
        if rc == 0 and bw == 0 and h.current[c] != k + 1:
            rc = _kept(A, _maybe_release(A, h, k, c))
    A.ticks += 1
    if unlikely((A.ticks & (PEEK_EVERY - 1)) == 0) and rc == 0:
        _peek_drain(A)
    cxl_local_mutex_exit(A.L, &h.m, CXL_HELD_HEAP)
    return rc


cdef inline int _kept(cxl_allocctx* A, int rc) noexcept nogil:
    """rc of giving back a chunk that a free or a drain just emptied: a release fenced
    out by our own silence is no failure of theirs (their frees are done, on our own
    bitmaps; the chunk stays ours, intact, for a later trim), and reporting one would
    invite a retry of a free already done. Unless another life took our node over."""
    if rc == CXLRT_E_FENCED and not cxl_live_fenced(A.L.live):
        return 0
    return rc


cdef int _maybe_release(cxl_allocctx* A, cxl_local_heap* h, uint64_t k, uint32_t c) noexcept nogil:
    """An emptied chunk becomes the class's spare, or goes back to the table.

    Not while our journal holds a batch: its replay reads the batch's objects, so
    their chunks stay ours until it is closed.
    """
    cdef uint64_t live = 0
    cdef bint pending = False
    cdef int rc = _chunk_live(A, k, c, &live)
    if rc != 0 or live != 0:
        return rc
    if h.spare[c] == 0:
        h.spare[c] = k + 1
        return 0
    if h.spare[c] == k + 1:
        return 0
    rc = _journal_pending(A, &pending)
    if rc != 0 or pending:
        return rc
    return _release_chunk(A, k)


cdef int cxl_trim(cxl_allocctx* A) noexcept nogil:
    """Give back this thread's magazine and those of threads that are gone, apply
    queued remote frees, then return this node's empty chunks (current and spare
    included) to the table."""
    cdef cxl_local_heap* h = A.heap
    cdef uint64_t k, w = 0, live = 0, applied = 0
    cdef uint32_t c
    cdef cxl_local_mag* m = _mag_mine(A)
    cdef int rc = _heap_lock(A, &applied)
    if rc != 0:
        return rc
    _mag_sweep(A)
    rc = _mag_flush(A, _mag_index(A, m), 0) if m != NULL else 0
    if rc == 0:
        rc = _drain_locked(A, &applied)  # closes our journal, or fails before any release
    for k in range(A.nchunks):
        if rc != 0:
            break
        rc = _table_observe(A, k, &w)
        if rc == 0 and _kind(w) == CXL_CK_SMALL and _owner(w) == A.node and _low(w) < CXL_NCLASSES:
            c = _low(w)
            rc = _chunk_live(A, k, c, &live)
            if rc == 0 and live == 0:
                if h.current[c] == k + 1:
                    h.current[c] = 0
                if h.spare[c] == k + 1:
                    h.spare[c] = 0
                rc = _release_chunk(A, k)
    cxl_local_mutex_exit(A.L, &h.m, CXL_HELD_HEAP)
    return rc


# --- Python layer ------------------------------------------------------------------------

cdef uint64_t _owners = 0


cdef uint64_t _next_owner():
    """A magazine owner id never used before in this process (under the GIL)."""
    global _owners
    _owners += 1
    return _owners


def _magazines_on():
    """$CXLRT_MAGAZINES=0 turns the per-thread caches off (a baseline, or a bisection)."""
    v = os.environ.get("CXLRT_MAGAZINES", "1").strip().lower()
    if v in ("1", "on", "yes", "true", ""):
        return True
    if v in ("0", "off", "no", "false"):
        return False
    raise ValueError(f"CXLRT_MAGAZINES={v!r}: use 1 or 0")


# What the allocator can add to a status's meaning (status.pyx picks the exception).
_DETAIL = {
    CXLRT_E_RANGE: "outside the heap",
    CXLRT_E_FENCED: ("this process was silent for longer than the lease while it held the "
                     "allocator lock (or its node was taken over), so another node may have "
                     "held the lock since; it stopped before writing from what it had read: "
                     "not done (a free may be retried)"),
    CXLRT_E_SUSPECT: ("this process was silent for longer than the lease while it published "
                      "under the allocator lock; the write may have overlapped another node's "
                      "hold: not acknowledged, and it may have taken effect (do not retry a "
                      "free; `cxlrt check` tells what the heap holds)"),
}


cdef class Allocator:
    """Per-Region allocator state; use :meth:`Region.alloc` and friends."""

    def __init__(self, region):
        cdef LockService svc = region.locks
        self._svc = svc
        self.region = region
        self.A.L = &svc.L
        self.A.r = self.A.L.r
        self.A.heap = (<NodeLocal>svc.local).heap
        alloc_off, _ = region.sections["alloc"]
        self.A.heap_off, heap_len = region.sections["heap"]
        self.A.nchunks = heap_len // CHUNK
        self.A.table_off = alloc_off
        self.A.rfree_off = alloc_off + cxl_rfree_queues_rel(self.A.nchunks)
        self.A.node = region.node
        self.A.nodes = region.nodes
        self.A.max_objects = self.A.nchunks * CLASS_SLOTS[0]
        self.A.ticks = 0
        self.A.mags = (<NodeLocal>svc.local).mags
        # The same for every node of the region: a remote free reads the tag too.
        self.A.tag_key = ((region.uuid * 0x9E3779B97F4A7C15) ^ 0x6D6167617A696E65) \
            & 0xFFFFFFFFFFFFFFFF | 1
        self.A.mag_owner = _next_owner() if _magazines_on() else 0
        if self.A.heap_off + self.A.nchunks * CHUNK > CXL_OFF_MASK:
            raise RegionError(f"{region.spec}: a heap past 2**48 bytes does not fit the "
                              "remote-free journal's offsets")
        # Nothing is hooked into the heartbeat: a drain may wait for the allocator lock,
        # and a heartbeat must never wait on another node (DESIGN.md, failure model).
        # Magazines of this node's threads that are gone go back now (a process
        # killed with objects cached), before this process allocates.
        self.swept_at_attach = self.sweep()

    def sweep(self):
        """Give back the magazines of this node's threads that are gone (a process killed
        with freed objects cached); returns how many. Attaching, trim() and
        `cxlrt check --repair` do it."""
        cdef uint64_t swept = 0
        cdef int rc
        with nogil:
            rc = cxl_mag_sweep(&self.A, &swept)
        if rc != 0:
            self._raise(rc, "sweep")
        return swept

    def close(self):
        """Give back this Allocator's magazines (Region.close, before the locks close).
        Idempotent; other threads must be done allocating."""
        cdef int rc
        with nogil:
            rc = cxl_mag_close(&self.A)
        if rc != 0:
            self._raise(rc, "close")

    @property
    def magazines(self):
        """Whether this Allocator caches freed small objects per thread."""
        return self.A.mag_owner != 0

    def _raise(self, int rc, str what):
        check_rc(rc, what, _DETAIL.get(rc))

    def alloc(self, nbytes, align=64):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"alloc size must be a positive int of bytes, got {nbytes!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 \
                or align & (align - 1) or align > CHUNK:
            raise ValueError(f"align must be a power of two <= {CHUNK}, got {align!r}")
        cdef uint64_t out = 0, n = max(nbytes, align)
        cdef int rc
        cdef uint32_t c = cxl_size_class(n)
        if c == CXL_NCLASSES:
            if n > self.A.nchunks * CHUNK:
                raise OutOfMemory(f"alloc({nbytes}): larger than the whole heap "
                                  f"({self.A.nchunks * CHUNK} bytes)")
            with nogil:
                rc = cxl_alloc_large(&self.A, n, &out)
        else:
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
        """Apply frees other nodes queued for this node; returns how many.

        Also finishes a drain a killed process of this node left half done. The
        allocator drains by itself on its slow path and every few hundred allocs
        and frees; call this (or :meth:`trim`) on a node that has gone idle.
        """
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

    def reclaim(self):
        """Free chunk-table tail words whose large head is gone (left by a large alloc or
        free cut short, which `cxlrt check` reports as a leak); returns how many.
        `cxlrt check --repair` calls it. A free that leaves its own run's tails
        frees them by itself; nothing else sweeps the table: a tail that looks
        orphaned may also be a dead process's stale line written back late, and
        that is for a person to look at first."""
        cdef uint64_t cleared = 0
        cdef int rc
        with nogil:
            rc = cxl_reclaim(&self.A, 0, self.A.nchunks, 0, &cleared)
        if rc != 0:
            self._raise(rc, "reclaim")
        return cleared

    def trim(self):
        """Apply queued remote frees, then give this node's empty chunks back."""
        cdef int rc
        with nogil:
            rc = cxl_trim(&self.A)
        if rc != 0:
            self._raise(rc, "trim")


def table_word(uint64_t w):
    """Decode a chunk-table word: (kind, owner, low)."""
    return _kind(w), _owner(w), _low(w)


def table_word_pack(uint64_t kind, uint64_t owner, uint64_t low):
    """Encode a chunk-table word (the inverse of table_word)."""
    return _word(kind, owner, low)


def class_geometry():
    """[(size, nslots, data_start)] of every size class."""
    return [(CLASS_SIZE[i], CLASS_SLOTS[i], CLASS_DATA[i]) for i in range(CXL_NCLASSES)]
