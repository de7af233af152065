# The KV cache's eviction pass. Declarations: kvevict.pxd; the protocol it keeps
# (EVICTING, fence, read every node's pin): kvcache.pxd.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset

from cxlrt.backend cimport cxl_observe64
from cxlrt.includes.intrin cimport CXLRT_TEST_HOOK
from cxlrt.kvcache cimport (KV_EMPTY, KV_EVICTING, KV_READY, KV_REC_EVICT, KV_REC_TAKE,
                            KV_TOMBSTONE, KV_WRITING, kv_claim, kv_entry)
from cxlrt.kvindex cimport (KV_PIN_WHERE, kv_add_occupancy, kv_bury, kv_gen, kv_lowest,
                            kv_meta, kv_payload_ok, kv_pin_at, kv_read, kv_state, kv_tag,
                            kv_write)
from cxlrt.kvpins cimport KV_PIN_MAX
from cxlrt.liveness cimport CXL_LIVE_ALIVE, CXL_LIVE_MAX_NODES, cxl_node_state
from cxlrt.status cimport CXLRT_E_KVCORRUPT


cdef inline bint _cand_after(const kv_cand* a, const kv_cand* b) noexcept nogil:
    return a.rec > b.rec or (a.rec == b.rec and a.slot > b.slot)


cdef int kv_cand_cmp(const void* a, const void* b) noexcept nogil:
    if _cand_after(<const kv_cand*>a, <const kv_cand*>b):
        return 1
    if _cand_after(<const kv_cand*>b, <const kv_cand*>a):
        return -1
    return 0


cdef void _heap_up(kv_cand* h, uint64_t i) noexcept nogil:
    """Restore the max-heap (most recent at h[0]) after h[i] was appended."""
    cdef kv_cand t
    cdef uint64_t p
    while i > 0:
        p = (i - 1) // 2
        if not _cand_after(&h[i], &h[p]):
            return
        t = h[i]; h[i] = h[p]; h[p] = t
        i = p


cdef void _heap_down(kv_cand* h, uint64_t n) noexcept nogil:
    """Restore the max-heap of n after h[0] was replaced by an older candidate."""
    cdef kv_cand t
    cdef uint64_t i = 0, c
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _cand_after(&h[c + 1], &h[c]):
            c += 1
        if not _cand_after(&h[c], &h[i]):
            return
        t = h[i]; h[i] = h[c]; h[c] = t
        i = c


cdef int kv_pinned(kv_index* K, uint64_t s, uint64_t* recency_ms, uint64_t* gone) noexcept nogil:
    """1 if a node whose pins count pins slot s, else 0; recency_ms gets the latest
    use. Pins count while their node is alive (ours always): a non-zero pin word
    of a node the liveness module judges detached, dead or never attached is void,
    and `gone` gets the mask of those nodes (eviction slow path only: the node
    state is read only for a non-zero pin word of another node)."""
    cdef uint64_t j, w = 0, at
    cdef int rc, pinned = 0
    gone[0] = 0
    for j in range(K.nodes):
        at = kv_pin_at(K, j, s)
        rc = cxl_observe64(K.r, at, &w)
        if rc != 0:
            return rc
        if w & KV_PIN_MAX:
            if (j == K.node or j >= CXL_LIVE_MAX_NODES
                    or cxl_node_state(K.L.live, <uint32_t>j) == CXL_LIVE_ALIVE):
                pinned = 1
            else:
                gone[0] |= <uint64_t>1 << j
        if (w >> 16) > recency_ms[0]:
            recency_ms[0] = w >> 16
    return pinned


cdef int kv_evict_ready(kv_index* K, uint64_t s, int* freed) noexcept nogil:
    """Evict the ready block in slot s unless a reader pins it (cache lock held):
    freed gets 1 when it went. The occupancy counter is the caller's."""
    cdef kv_entry e
    cdef kv_claim c
    cdef uint64_t rec = 0, gen, gone = 0
    cdef int rc
    freed[0] = 0
    rc = kv_read(K, s, &e)
    if rc != 0:
        return rc
    if kv_state(&e) != KV_READY and kv_state(&e) != KV_EVICTING:
        return 0
    gen = kv_gen(&e)
    e.meta = kv_meta(gen, KV_EVICTING)
    rc = kv_write(K, s, &e)  # ends with a full fence: then read the pins
    if rc != 0:
        return rc
    rc = kv_pinned(K, s, &rec, &gone)
    if rc < 0:
        return rc
    if rc == 1 and not CXLRT_TEST_HOOK(K.ignore_pins):
        e.meta = kv_meta(gen, KV_READY)  # a reader pinned it meanwhile: it stays
        return kv_write(K, s, &e)
    if not kv_payload_ok(K, &e):
        K.bad_slot = s
        return CXLRT_E_KVCORRUPT
    if gone and not CXLRT_TEST_HOOK(K.ignore_pins) and not CXLRT_TEST_HOOK(
            K.no_quarantine):
        # Pins of nodes judged gone: a stalled one may resume and read through
        # them, so the payload is quarantined under their names, not freed.
        memset(&c, 0, sizeof(c))
        c.tag = kv_tag(0, kv_lowest(gone), 0)
        c.start = gone
        c.where = KV_PIN_WHERE
        return kv_bury(K, s, &e, KV_REC_TAKE, &c, freed)
    # no record line free: it stays (EVICTING reads as a miss)
    return kv_bury(K, s, &e, KV_REC_EVICT, NULL, freed)


cdef int kv_evict_batch(kv_index* K, const kv_cand* cands, uint64_t nc, uint64_t want,
                        uint64_t* freed) noexcept nogil:
    """Evict up to `want` of the candidates, oldest first, under one release of
    the GIL (cache lock held); then one occupancy update for all of them."""
    cdef uint64_t i
    cdef int rc = 0, one
    freed[0] = 0
    for i in range(nc):
        if freed[0] >= want:
            break
        rc = kv_evict_ready(K, cands[i].slot, &one)
        freed[0] += <uint64_t>one
        if rc != 0:
            break
    if freed[0]:  # also after a failure: those before it are buried
        one = kv_add_occupancy(K, -<long long>freed[0], -<long long>(freed[0] * K.block_bytes))
        if rc == 0:
            rc = one
    return rc


cdef int kv_scan(kv_index* K, kv_cand* cands, uint64_t k, uint64_t* nc, uint64_t* writing,
                 uint64_t* nw, uint64_t* used) noexcept nogil:
    """One pass over the table (cache lock held): count the live entries, list
    the WRITING slots, and keep the `k` least recently used unpinned ready
    blocks in `cands` (a max-heap on recency while it fills: O(slots log k)).
    Budget: one line observe per slot, plus the pin words of a ready one."""
    cdef kv_entry e
    cdef uint64_t s, rec, gone
    cdef uint32_t st
    cdef int rc
    nc[0] = nw[0] = used[0] = 0
    for s in range(K.slots):
        rc = kv_read(K, s, &e)
        if rc != 0:
            return rc
        st = kv_state(&e)
        if st == KV_WRITING or st == KV_READY or st == KV_EVICTING:
            used[0] += 1
        if st == KV_WRITING:
            writing[nw[0]] = s
            nw[0] += 1
            continue
        if (st != KV_READY and st != KV_EVICTING) or k == 0:
            continue
        rec = e.stamp_ns // 1000000  # an LRU hint: clocks of hosts may disagree
        rc = kv_pinned(K, s, &rec, &gone)
        if rc < 0:
            return rc
        if rc == 1 and not CXLRT_TEST_HOOK(K.ignore_pins):
            continue
        if nc[0] < k:
            cands[nc[0]].rec = rec
            cands[nc[0]].slot = s
            nc[0] += 1
            _heap_up(cands, nc[0] - 1)
        elif rec < cands[0].rec or (rec == cands[0].rec and s < cands[0].slot):
            cands[0].rec = rec
            cands[0].slot = s
            _heap_down(cands, k)
    return 0


cdef int kv_sweep(kv_index* K) noexcept nogil:
    """Empty every tombstone that no probe for a present key walks through.

    A probe for a present key walks from its home slot to its entry; a tombstone
    outside every such walk only lengthens misses (which run on to an empty slot),
    so it may be empty itself. Lock-free readers stay right: no present key's walk
    changes. One walk down the table from an empty slot, each slot observed once,
    with `cover` the lowest (unwrapped) slot that a live entry above reaches down
    to; without an empty slot, two laps (the first only gathers `cover`).
    """
    cdef kv_entry e
    cdef uint64_t n = K.slots, start = 0, top, k, laps, u, s, h, cover, never
    cdef uint32_t st
    cdef int rc = 0
    while start < n:  # an empty slot to start below: no walk crosses it
        rc = kv_read(K, start, &e)
        if rc != 0:
            return rc
        if kv_state(&e) == KV_EMPTY:
            break
        start += 1
    laps = 1 if start < n else 2
    if start == n:
        start = 0
    top = start + 3 * n  # unwrapped: u - (a walk's length) stays positive
    never = <uint64_t>-1
    cover = never
    for k in range(1, laps * n):
        u = top - k
        s = u & K.mask
        rc = kv_read(K, s, &e)
        if rc != 0:
            return rc
        st = kv_state(&e)
        if st == KV_EMPTY:
            cover = never
        elif st == KV_TOMBSTONE:
            if u < cover and k >= (laps - 1) * n:
                e.meta = kv_meta(kv_gen(&e), KV_EMPTY)
                rc = kv_write(K, s, &e)
                if rc != 0:
                    return rc
                cover = never
        elif st <= KV_EVICTING:
            memcpy(&h, <const void*>e.key, 8)
            cover = min(cover, u - ((s - h) & K.mask))
        else:
            cover = 0  # a line we cannot read as an entry: keep everything below
    return 0
