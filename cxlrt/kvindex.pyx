# The KV cache's index: entries, claim and record lines, counters, burying a
# payload. Declarations and the kv_index context: kvindex.pxd.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset

from cxlrt.alloc cimport cxl_free
from cxlrt.backend cimport cxl_flush, cxl_observe, cxl_persist, cxl_store
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport CXL_ASSERT, cxl_backoff, unlikely
from cxlrt.kvcache cimport (KV_EMPTY, KV_EVICTING, KV_PAYLOAD_HDR, KV_REC_DEFERRED, KV_REC_QUARANTINE,
                            KV_REC_TAKE, KV_TOMBSTONE, kv_claim, kv_entry)
from cxlrt.layout cimport CXL_LINE_SIZE, kv_counters
from cxlrt.liveness cimport cxl_live_silent_since
from cxlrt.status cimport (CXLRT_E_BADFREE, CXLRT_E_DOUBLEFREE, CXLRT_E_FENCED, CXLRT_E_IO,
                           CXLRT_E_KVCORRUPT, CXLRT_E_SUSPECT)

cdef int* _armed = cxl_crash_armed_ptr()


cdef int kv_read(kv_index* K, uint64_t s, kv_entry* e) noexcept nogil:
    """Observe entry `s` as one consistent line (a torn copy is read again)."""
    cdef uint64_t at = kv_entry_at(K, s), spins = 0
    cdef int rc, tries
    for tries in range(1000):
        rc = cxl_observe(K.r, at, e, CXL_LINE_SIZE)
        if rc != 0:
            return rc
        if kv_line_ok(e):
            return 0
        cxl_backoff(&spins)
    K.bad_slot = s
    return CXLRT_E_KVCORRUPT


cdef int kv_write(kv_index* K, uint64_t s, kv_entry* e) noexcept nogil:
    """Replace entry `s` (cache lock held) and publish it."""
    CXL_ASSERT(s < K.slots, b"an entry past the table")
    CXL_ASSERT(kv_state(e) <= KV_EVICTING, b"an entry state that does not exist")
    e.check = kv_mix(e)
    return kv_put(K, kv_entry_at(K, s), e)


cdef int kv_fenced(kv_index* K) noexcept nogil:
    """1 if we were silent past the lease since our hold of the cache lock began:
    another node may hold it now, so we must not write (checked before every
    write under the lock; lookups and loads never ask)."""
    return K.hold_t0 != 0 and cxl_live_silent_since(K.L.live, K.hold_t0)


cdef int kv_put(kv_index* K, uint64_t at, const void* line) noexcept nogil:
    """Publish one whole line (cache lock held: we are its only writer)."""
    cdef int rc
    CXL_ASSERT(K.hold_t0 != 0, b"a cache line written outside a hold of the cache lock")
    if kv_fenced(K):
        return CXLRT_E_FENCED
    rc = cxl_flush(K.r, at, CXL_LINE_SIZE)  # drop a stale copy before writing the line
    if rc == 0:
        rc = cxl_store(K.r, at, line, CXL_LINE_SIZE)
    if rc == 0:
        rc = cxl_persist(K.r, at, CXL_LINE_SIZE)
    return rc


cdef int kv_get(kv_index* K, uint64_t at, void* line) noexcept nogil:
    """Observe one line (drop our copy, then load)."""
    cdef int rc = cxl_observe(K.r, at, line, CXL_LINE_SIZE)
    return rc


cdef int kv_probe(kv_index* K, const char* key, uint64_t* slot, kv_entry* e,
                  uint64_t* free_slot) noexcept nogil:
    """Find `key`: 1 with its slot and entry, or 0 (absent) with the slot an
    insert would take (the first tombstone, else the empty slot ending the run)
    in free_slot (-1 when the table is full). Negative: an error."""
    return kv_probe_from(K, key, 0, slot, e, free_slot)


cdef int kv_probe_from(kv_index* K, const char* key, uint64_t first, uint64_t* slot,
                       kv_entry* e, uint64_t* free_slot) noexcept nogil:
    """kv_probe whose walk starts `first` slots past the key's home: for a caller that
    has looked at the slots before it itself (free_slot then says only of the rest)."""
    cdef uint64_t h, s, i
    cdef uint32_t st
    cdef int rc
    memcpy(&h, key, 8)
    free_slot[0] = <uint64_t>-1
    for i in range(first, K.slots):
        s = (h + i) & K.mask
        rc = kv_read(K, s, e)
        if rc != 0:
            return rc
        st = kv_state(e)
        if st == KV_EMPTY:
            if free_slot[0] == <uint64_t>-1:
                free_slot[0] = s
            return 0
        if st == KV_TOMBSTONE:
            if free_slot[0] == <uint64_t>-1:
                free_slot[0] = s
            continue
        if st > KV_EVICTING:
            K.bad_slot = s
            return CXLRT_E_KVCORRUPT
        if kv_same_key(e, key):
            slot[0] = s
            return 1
    return 0


cdef int kv_get_counters(kv_index* K, kv_counters* w) noexcept nogil:
    cdef int rc = cxl_observe(K.r, K.offset + kv_counters_off(), w, kv_counted())
    return rc


cdef int kv_set_counters(kv_index* K, const kv_counters* w) noexcept nogil:
    cdef uint64_t at = K.offset + kv_counters_off()
    cdef int rc
    if kv_fenced(K):
        return CXLRT_E_FENCED
    rc = cxl_store(K.r, at, w, kv_counted())
    if rc == 0:
        rc = cxl_persist(K.r, at, sizeof(kv_counters))
    return rc


cdef int kv_add_occupancy(kv_index* K, long long d, long long nbytes) noexcept nogil:
    cdef kv_counters w
    cdef int rc = kv_get_counters(K, &w)
    if rc != 0:
        return rc
    w.occupancy = <uint64_t>max(0, <long long>w.occupancy + d)
    w.payload_bytes = <uint64_t>max(0, <long long>w.payload_bytes + nbytes)
    return kv_set_counters(K, &w)


cdef int kv_rec_top(kv_index* K, uint64_t* top) noexcept nogil:
    """How many record lines to scan: the high-water mark."""
    cdef kv_counters w
    cdef int rc = kv_get_counters(K, &w)
    top[0] = min(w.records, K.nrec) if rc == 0 else 0
    return rc


cdef int kv_rec_alloc(kv_index* K, long long* out) noexcept nogil:
    """A free record line in out, or -1 when every one is in use."""
    cdef kv_claim c
    cdef kv_counters w
    cdef uint64_t i
    cdef int rc = kv_get_counters(K, &w)
    out[0] = -1
    if rc != 0:
        return rc
    for i in range(min(w.records, K.nrec)):
        rc = kv_get(K, kv_record_at(K, i), &c)
        if rc != 0:
            return rc
        if kv_zero(&c):
            out[0] = <long long>i
            return 0
    if w.records >= K.nrec:
        return 0
    w.records += 1  # published before the record: a scan may see a free line, never miss one
    rc = kv_set_counters(K, &w)
    if rc == 0:
        out[0] = <long long>(w.records - 1)
    return rc


cdef int kv_rec_put(kv_index* K, uint64_t i, kv_claim* c) noexcept nogil:
    c.check = kv_mix(c)
    return kv_put(K, kv_record_at(K, i), c)


cdef int kv_rec_clear(kv_index* K, uint64_t i) noexcept nogil:
    """Free record i, and lower the high-water mark past free lines at the top."""
    cdef kv_claim c
    cdef kv_counters w
    cdef uint64_t top
    cdef int rc
    memset(&c, 0, sizeof(c))
    rc = kv_put(K, kv_record_at(K, i), &c)
    if rc == 0:
        rc = kv_get_counters(K, &w)
    if rc != 0:
        return rc
    top = min(w.records, K.nrec)
    if i + 1 != top:
        return 0
    while top > 0:
        rc = kv_get(K, kv_record_at(K, top - 1), &c)
        if rc != 0:
            return rc
        if not kv_zero(&c):
            break
        top -= 1
    w.records = top
    return kv_set_counters(K, &w)


cdef int kv_free_payload(kv_index* K, uint64_t off) noexcept nogil:
    """free() a payload nobody references; a failure leaves a DEFERRED record."""
    cdef kv_claim c
    cdef long long i
    cdef int rc
    if kv_fenced(K):
        return CXLRT_E_FENCED
    rc = cxl_free(K.A, off)
    if rc == 0 or rc == CXLRT_E_BADFREE or rc == CXLRT_E_DOUBLEFREE:
        return 0  # given back, or not a live object (already free): nothing to do
    if rc == CXLRT_E_IO or rc == CXLRT_E_SUSPECT:
        # The free may have happened (a write that landed but whose answer was lost,
        # a publish after our silence): the payload may be another block's by the time
        # a retry ran, and the retry would free it under that block. It leaks instead
        # (`cxlrt check` reports it), as after a crash here.
        return rc
    # a free that wrote nothing (the allocator lock timed out, or fenced us): retry later
    rc = kv_rec_alloc(K, &i)
    if rc != 0 or i < 0:
        return rc  # no line to remember it in: this payload leaks (a full table)
    memset(&c, 0, sizeof(c))
    c.tag = KV_REC_DEFERRED
    c.off = off
    return kv_rec_put(K, <uint64_t>i, &c)


cdef int kv_give_back(kv_index* K, uint64_t i, uint64_t off) noexcept nogil:
    """Free the payload record i names. The record goes first: a crash between
    the two leaks the payload, never frees it twice."""
    cdef int rc = kv_rec_clear(K, i)
    if rc != 0:
        return rc
    return kv_free_payload(K, off)


cdef int kv_complete(kv_index* K, uint64_t i, kv_claim* c) noexcept nogil:
    """Finish record i once its entry no longer holds the payload."""
    if kv_kind(c) == KV_REC_TAKE:
        c.tag = kv_retag(c.tag, KV_REC_QUARANTINE)
        return kv_rec_put(K, i, c)
    return kv_give_back(K, i, c.off)


cdef int kv_bury(kv_index* K, uint64_t s, kv_entry* e, uint32_t kind, const kv_claim* who,
                 int* buried) noexcept nogil:
    """Take entry s's payload out of the index (cache lock held): a record, the
    tombstone (generation + 1: the claim's epoch is over), then the payload is
    freed (KV_REC_EVICT) or quarantined (KV_REC_TAKE). `buried` gets 0 when no
    record line is free (nothing changed), 1 when buried. The occupancy counter
    is the caller's (a batch updates it once)."""
    cdef kv_claim c
    cdef long long i
    cdef int rc
    CXL_ASSERT(kv_holds(e), b"burying an entry that holds no payload")
    buried[0] = 0
    rc = kv_rec_alloc(K, &i)
    if rc != 0 or i < 0:
        return rc
    if who != NULL:
        memcpy(&c, who, sizeof(c))
    else:
        memset(&c, 0, sizeof(c))
    c.tag = kv_retag(c.tag, kind)
    c.off = e.off
    c.epoch = kv_gen(e)
    c.slot = s
    rc = kv_rec_put(K, <uint64_t>i, &c)
    if rc != 0:
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"kv.evict.intent")
    kv_set_key(e, NULL)
    e.meta = kv_meta(kv_gen(e) + 1, KV_TOMBSTONE)
    e.off = e.len = e.owner = 0
    rc = kv_write(K, s, e)
    if rc != 0:
        return rc
    buried[0] = 1
    if unlikely(_armed[0]):
        cxl_crash_hit(b"kv.evict.tombstone")
    # From the tombstone on, nothing fails but the backend: the record finishes
    # the job for the next lock holder if we die here.
    return kv_complete(K, <uint64_t>i, &c)
