# The KV cache's eviction pass (cache lock held): one scan of the table, then a
# bounded batch of LRU victims, each marked EVICTING, fenced against the readers'
# pins, and buried; all under one release of the GIL.
from libc.stdint cimport uint64_t

from cxlrt.kvindex cimport kv_index


ctypedef struct kv_cand:       # an eviction candidate (process memory only)
    uint64_t rec                # last use, ms (an LRU hint)
    uint64_t slot


cdef int kv_cand_cmp(const void* a, const void* b) noexcept nogil
cdef int kv_pinned(kv_index* K, uint64_t s, uint64_t* recency_ms, uint64_t* gone) noexcept nogil
cdef int kv_evict_ready(kv_index* K, uint64_t s, int* freed) noexcept nogil
cdef int kv_evict_batch(kv_index* K, const kv_cand* cands, uint64_t nc, uint64_t want,
                        uint64_t* freed) noexcept nogil
cdef int kv_scan(kv_index* K, kv_cand* cands, uint64_t k, uint64_t* nc, uint64_t* writing,
                 uint64_t* nw, uint64_t* used) noexcept nogil
cdef int kv_sweep(kv_index* K) noexcept nogil
