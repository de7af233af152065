# Who writes a KV cache's payloads, and how a payload that leaves its entry goes
# back to the allocator: the claims of writers, judged by any lock holder, and the
# record lines that finish evictions, takeovers and quarantines across crashes.
# Judging and settling run with the cache lock held; ident() and fill() need no
# lock, nor do rec_top() and rec_get() as inspection reads them. The protocol is in
# kvclaim.pyx's docstring, the lines in kvcache.pxd, the C steps in kvindex.pxd.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.kvcache cimport kv_claim, kv_entry
from cxlrt.kvindex cimport kv_index
from cxlrt.region cimport Region


cdef int kv_raise(Region region, str name, const kv_index* K, int rc, str what) except -1


cdef class Claims:
    cdef kv_index* K                     # the owning cache's index (the cache owns us)
    cdef Region region
    cdef str name
    cdef uint64_t lease_ns
    cdef bint foreign                    # test hook (debug builds): writers on unseen hosts
    # this process as a claim names it (ident() recomputes them after a fork)
    cdef uint64_t id_tag, id_inc, id_start, id_where, id_owner
    cdef int id_pid
    cdef dict _seen                      # (slot, epoch) -> (progress, our ns when it last moved)
    cdef dict _doomed                    # (record, off, epoch) -> our ns since its node is gone

    cdef int io(self, int rc, str what) except -1
    cdef int shrink(self) except -1
    cdef int ident(self) except -1
    cdef void fill(self, kv_claim* c, uint64_t s, uint64_t gen, uint64_t off) noexcept nogil
    cdef int claim_of(self, uint64_t s, const kv_entry* e, kv_claim* c) except -1
    cdef int judge(self, uint64_t s, kv_entry* e, kv_claim* c) except -1
    cdef uint32_t take_kind(self, int verdict) noexcept
    cdef int bury(self, uint64_t s, kv_entry* e, uint32_t kind, const kv_claim* who,
                  str what) except -1
    cdef int bury_unrecorded(self, uint64_t s, kv_entry* e) except -1
    cdef int settle(self) except -1
    cdef int ack(self, uint64_t off, uint64_t gen) except -1
    cdef uint64_t rec_top(self) except? 0xffffffffffffffff
    cdef int rec_get(self, uint64_t i, kv_claim* c) except -1
    cdef int free_payload(self, uint64_t off) except -1
    cdef tuple _key(self, uint64_t s, uint64_t gen)
    cdef bint _is_me(self, const kv_claim* c) noexcept
    cdef uint64_t _node_inc(self, uint32_t node) except? 0xffffffffffffffff
    cdef bint _released(self, uint64_t i, const kv_claim* c) except -1
    cdef bint _pins_released(self, object key, const kv_claim* c) except -1
    cdef bint _dead_long_enough(self, object key) except -1
    cdef int _wipe_header(self, uint64_t off) except -1
