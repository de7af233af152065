from libc.stdint cimport uint64_t

from cxlrt.backend cimport Backend, cxl_region


cdef class Region:
    cdef readonly Backend backend  # the medium and this node's view of it
    cdef cxl_region* r             # backend.reg, valid until close()
    cdef readonly int nodes        # node count from the superblock
    cdef readonly uint64_t uuid    # format id from the superblock
    cdef readonly str spec         # the spec this region was opened with
    cdef readonly dict sections    # name -> (offset, size)
    cdef int _busy                 # bulk copies in flight without the GIL
    cdef readonly unsigned int lease_ms  # a node silent this long is presumed dead
    cdef object _locks             # LockService, created on first use
    cdef object _heap              # Allocator, created on first use
    cdef object _dir               # Directory, created on first use
    cdef object _live              # Liveness: our membership of the node (None: observer)
    cdef object _closing           # WeakSet: dependents closed before the mapping goes

    cdef _dma_read(self, uint64_t off, char* p, uint64_t n)
    cdef int _hint(self, int kind, uint64_t a, uint64_t b) noexcept
    cdef int _need_range(self, uint64_t off, uint64_t n, str op) except -1
    cdef _close(self, bint held_ok)
    cdef bint _cut_off(self)

    cdef int _rc(self, int rc, str op, uint64_t off, uint64_t n, str detail=*) except -1
    cdef tuple _what(self, int rc, str op, uint64_t off, uint64_t n)
