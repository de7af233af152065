# The KV cache's index in C: the hash table of entries, the claim and record
# lines, the counters line, and burying a payload. Every function is `noexcept
# nogil` and returns a status (0, or a CXLRT_E_* / negated errno), so that a store,
# a lookup or an eviction batch runs its whole pass under one release of the GIL.
# The object map and the invariants are in kvcache.pxd; kvcache.pyx is the Python
# API over this, kvwrite.pyx the stores, kvclaim.pyx the judging of writers and the
# records, kvformat.pyx the object's header, kvevict.pyx the eviction pass.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from cxlrt.alloc cimport cxl_allocctx
from cxlrt.backend cimport cxl_region
from cxlrt.kvcache cimport (KV_EVICTING, KV_PAYLOAD_HDR, KV_READY, KV_WRITING, kv_claim, kv_entry,
                            kv_stats)
from cxlrt.kvpins cimport kv_pin_word
from cxlrt.layout cimport kv_counters, kv_header
from cxlrt.lock cimport cxl_lockctx


cdef extern from "cxl_kv.h":
    const uint64_t KV_PIN_WHERE
    const uint64_t KV_PAYLOAD_MAGIC


ctypedef struct kv_index:
    const cxl_region* r
    cxl_lockctx* L                # the cache lock's service (liveness, fencing)
    cxl_allocctx* A               # payloads go back through the allocator's C entry
    uint64_t offset               # the cache object
    uint64_t entries, pins, stats, claims, records  # section offsets (kvcache.pxd)
    uint64_t slots, mask, nrec, nodes, block_bytes
    uint64_t heap_lo, heap_hi     # where a payload may be
    uint64_t hold_t0              # our ns when the current sound hold of the lock began, 0 none
    uint64_t bad_slot             # set with CXLRT_E_KVCORRUPT, for the message
    uint32_t node
    bint ignore_pins              # test hook (debug builds): a broken evictor
    bint no_quarantine            # test hook (debug builds): free taken payloads at once


# --- lines -------------------------------------------------------------------------

cdef inline uint64_t kv_mix(const void* p) noexcept nogil:
    """Check word over the first seven words of a line."""
    cdef const uint64_t* w = <const uint64_t*>p
    cdef uint64_t h = <uint64_t>0x9E3779B97F4A7C15ULL
    cdef int i
    for i in range(7):
        h = (h ^ w[i]) * <uint64_t>0xff51afd7ed558ccdULL
        h ^= h >> 29
    return h | 1  # never 0: an all-zero line is the only line with check 0


cdef inline bint kv_zero(const void* p) noexcept nogil:
    cdef const uint64_t* w = <const uint64_t*>p
    cdef int i
    for i in range(8):
        if w[i] != 0:
            return False
    return True


cdef inline bint kv_line_ok(const void* p) noexcept nogil:
    return (<const uint64_t*>p)[7] == kv_mix(p) or kv_zero(p)


# An entry's meta word is generation << 8 | state, its owner node | pid << 16; a
# claim's tag is kind | node << 8 | pid << 24. These are the only places that know it.

cdef inline uint64_t kv_meta(uint64_t gen, uint32_t state) noexcept nogil:
    return (gen << 8) | state


cdef inline uint32_t kv_state(const kv_entry* e) noexcept nogil:
    return <uint32_t>(e.meta & 0xff)


cdef inline uint64_t kv_gen(const kv_entry* e) noexcept nogil:
    return e.meta >> 8


cdef inline bint kv_same_key(const kv_entry* e, const char* k) noexcept nogil:
    # Two word compares, not memcmp: gcc calls libc's for it, and every probe asks.
    cdef uint64_t w[2]
    memcpy(w, k, sizeof(w))
    return ((e.key[0] ^ w[0]) | (e.key[1] ^ w[1])) == 0


cdef inline void kv_set_key(kv_entry* e, const char* k) noexcept nogil:
    """k: sizeof(e.key) bytes, or NULL for no key (a tombstone's)."""
    if k == NULL:
        memset(<void*>e.key, 0, sizeof(e.key))
    else:
        memcpy(<void*>e.key, k, sizeof(e.key))


cdef inline uint64_t kv_tag(uint32_t kind, uint64_t node, uint64_t pid) noexcept nogil:
    return kind | (node << 8) | (pid << 24)


cdef inline uint64_t kv_retag(uint64_t tag, uint32_t kind) noexcept nogil:
    """The same writer's tag with another kind."""
    return (tag & ~(<uint64_t>0xff)) | kind


cdef inline uint64_t kv_owner(uint64_t node, uint64_t pid) noexcept nogil:
    """An entry's owner word (and a payload header's writer): node | pid << 16."""
    return node | (pid << 16)


cdef inline uint64_t kv_owner_node(uint64_t owner) noexcept nogil:
    return owner & 0xffff


cdef inline uint64_t kv_owner_pid(uint64_t owner) noexcept nogil:
    return (owner >> 16) & <uint64_t>0xffffffffU


cdef inline uint32_t kv_kind(const kv_claim* c) noexcept nogil:
    return <uint32_t>(c.tag & 0xff)


cdef inline uint32_t kv_cnode(const kv_claim* c) noexcept nogil:
    return <uint32_t>((c.tag >> 8) & 0xffff)


cdef inline uint64_t kv_cpid(const kv_claim* c) noexcept nogil:
    return c.tag >> 24


cdef inline uint32_t kv_lowest(uint64_t mask) noexcept nogil:
    """Index of the lowest set bit of a non-zero mask."""
    cdef uint32_t j = 0
    while not (mask >> j) & 1:
        j += 1
    return j


cdef inline bint kv_holds(const kv_entry* e) noexcept nogil:
    """The entry still references its payload (not buried)."""
    cdef uint32_t st = kv_state(e)
    return st == KV_WRITING or st == KV_READY or st == KV_EVICTING


# --- where things are ----------------------------------------------------------------

cdef inline uint64_t kv_entry_at(kv_index* K, uint64_t s) noexcept nogil:
    return K.entries + s * sizeof(kv_entry)


cdef inline uint64_t kv_claim_at(kv_index* K, uint64_t s) noexcept nogil:
    return K.claims + s * sizeof(kv_claim)


cdef inline uint64_t kv_record_at(kv_index* K, uint64_t i) noexcept nogil:
    return K.records + i * sizeof(kv_claim)


cdef inline uint64_t kv_stats_at(kv_index* K, uint64_t node) noexcept nogil:
    return K.stats + node * sizeof(kv_stats)


cdef inline uint64_t kv_pin_at(kv_index* K, uint64_t node, uint64_t s) noexcept nogil:
    return kv_pin_word(K.pins, K.slots, node, s)


cdef inline uint64_t kv_counters_off() noexcept nogil:
    """offsetof(kv_header, counters)."""
    cdef kv_header h
    return <uint64_t>(<char*>&h.counters - <char*>&h)


cdef inline uint64_t kv_counted() noexcept nogil:
    """The bytes of kv_counters in use (up to its reserved words)."""
    cdef kv_counters c
    return <uint64_t>(<char*>&c.reserved - <char*>&c)


# --- the index (kvindex.pyx) ---------------------------------------------------------

cdef inline bint kv_payload_ok(const kv_index* K, const kv_entry* e) noexcept nogil:
    """Whether an entry's payload could be one: its length, alignment and bounds
    (inline: every key of a lookup asks)."""
    return (e.len == KV_PAYLOAD_HDR + K.block_bytes and e.off % 64 == 0
            and e.off >= K.heap_lo and e.off <= K.heap_hi
            and e.len <= K.heap_hi - e.off)


cdef int kv_read(kv_index* K, uint64_t s, kv_entry* e) noexcept nogil
cdef int kv_write(kv_index* K, uint64_t s, kv_entry* e) noexcept nogil
cdef int kv_fenced(kv_index* K) noexcept nogil
cdef int kv_put(kv_index* K, uint64_t at, const void* line) noexcept nogil
cdef int kv_get(kv_index* K, uint64_t at, void* line) noexcept nogil
cdef int kv_probe(kv_index* K, const char* key, uint64_t* slot, kv_entry* e,
                  uint64_t* free_slot) noexcept nogil
cdef int kv_probe_from(kv_index* K, const char* key, uint64_t first, uint64_t* slot,
                       kv_entry* e, uint64_t* free_slot) noexcept nogil
cdef int kv_get_counters(kv_index* K, kv_counters* w) noexcept nogil
cdef int kv_set_counters(kv_index* K, const kv_counters* w) noexcept nogil
cdef int kv_add_occupancy(kv_index* K, long long d, long long nbytes) noexcept nogil
cdef int kv_rec_top(kv_index* K, uint64_t* top) noexcept nogil
cdef int kv_rec_alloc(kv_index* K, long long* out) noexcept nogil
cdef int kv_rec_put(kv_index* K, uint64_t i, kv_claim* c) noexcept nogil
cdef int kv_rec_clear(kv_index* K, uint64_t i) noexcept nogil
cdef int kv_free_payload(kv_index* K, uint64_t off) noexcept nogil
cdef int kv_give_back(kv_index* K, uint64_t i, uint64_t off) noexcept nogil
cdef int kv_complete(kv_index* K, uint64_t i, kv_claim* c) noexcept nogil
cdef int kv_bury(kv_index* K, uint64_t s, kv_entry* e, uint32_t kind, const kv_claim* who,
                 int* buried) noexcept nogil
