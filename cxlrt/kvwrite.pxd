# A KV cache's stores (the writer's side of the claim protocol) and the eviction
# that makes room for them. The protocol: kvwrite.pyx and kvclaim.pyx.
from libc.stdint cimport uint64_t

from cxlrt.kvcache cimport kv_job
from cxlrt.kvclaim cimport Claims
from cxlrt.kvindex cimport kv_index
from cxlrt.kvpins cimport PinTable
from cxlrt.region cimport Region


cdef class Writer:
    cdef kv_index* K                     # the owning cache's index (the cache owns us)
    cdef Claims claims
    cdef Region region
    cdef str name
    cdef object lock                     # the cache lock
    cdef PinTable pt                     # our node's pins: their dead holders, when all is pinned
    cdef uint64_t capacity
    cdef uint64_t tick_ns                # how often a copy moves its progress words
    cdef uint64_t progress               # our writers' progress counter (any change counts)
    cdef uint64_t evicted                # evictions the cache has not counted yet

    cdef int _raise(self, int rc, str what) except -1
    cdef uint64_t alloc_payload(self) except? 0
    cdef object reserve(self, list ks, Py_ssize_t j, list reserved)
    cdef int copy_jobs(self, kv_job* jobs, uint64_t n) noexcept nogil
    cdef int tick(self, kv_job* jobs, uint64_t n, uint64_t prog) noexcept nogil
    cdef uint64_t absent(self, list ks, Py_ssize_t j) except? 0
    cdef uint64_t batch(self, uint64_t need) noexcept
