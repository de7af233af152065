# Lamport's bakery over single-writer lines: the manager-free global tier of a lock
# (lock.pxd states the protocol). Node n writes only its own line (choosing, number);
# every read of another node's line is an observe (flush, load).
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.lockctx cimport cxl_lockctx


cdef int cxl_bakery_acquire(cxl_lockctx* L, uint32_t id, uint64_t deadline) noexcept nogil
cdef int cxl_bakery_release(cxl_lockctx* L, uint32_t id) noexcept nogil
