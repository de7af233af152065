# cython: language_level=3
"""``file:`` — a region in a shared file mapping (tmpfs or any filesystem).

Every process on one host maps the same page-cache pages, so the medium is
coherent: flushes are no-ops and loads/stores are plain volatile accesses.
This is the embedded default for one host and the baseline the emulation is
measured against.
"""

from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_DMA_REGISTRABLE, CXL_CAP_MAPPABLE,
                            CXL_F_DIRECT, CXL_F_NOFLUSH, Backend, cxl_ops)
from cxlrt.includes.intrin cimport (cxl_fence_drain, cxl_fence_full, cxl_load64_volatile,
                                    cxl_store64_volatile)
from cxlrt.mapping cimport Mapping


cdef int _load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Copy out of the shared pages."""
    memcpy(dst, <char*>ctx + off, n)
    return 0


cdef int _store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Copy into the shared pages."""
    memcpy(<char*>ctx + off, src, n)
    return 0


cdef int _load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    """One volatile 8-byte load."""
    out[0] = cxl_load64_volatile(<char*>ctx + off)
    return 0


cdef int _store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    """One volatile 8-byte store."""
    cxl_store64_volatile(<char*>ctx + off, v)
    return 0


cdef int _flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    """Coherent medium: nothing to write back."""
    return 0


cdef int _fence(void* ctx) noexcept nogil:
    """Store-load ordering between processes still needs the CPU fence."""
    cxl_fence_full()
    return 0


cdef int _dma_write(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Bulk copy in; the drain makes it visible before any later flag store."""
    memcpy(<char*>ctx + off, src, n)
    cxl_fence_drain()
    return 0


cdef cxl_ops FILE_OPS
FILE_OPS.load = _load
FILE_OPS.store = _store
FILE_OPS.load64 = _load64
FILE_OPS.store64 = _store64
FILE_OPS.flush = _flush
FILE_OPS.flush_nodrain = _flush
FILE_OPS.fence = _fence
FILE_OPS.dma_read = _load
FILE_OPS.dma_write = _dma_write

PARAMS = {}
"""Spec parameters accepted by ``file:`` (none)."""


cdef class FileBackend(Backend):
    """A coherent shared file mapping.

    Parameters
    ----------
    path : str
        The region file (created by :func:`cxlrt.open` with ``create=True``).
    params : dict
        Parsed spec parameters (none are accepted).
    node : int
        This view's node id.
    size : int
        Bytes to map (the file's size).
    """

    def __init__(self, str path, dict params, int node, unsigned long long size):
        self.scheme = "file"
        self.path = path
        self.params = dict(params)
        self.mapping = Mapping(path, size)
        self.reg.base = self.mapping.base
        self.reg.size = size
        self.reg.caps = CXL_CAP_COHERENT | CXL_CAP_MAPPABLE | CXL_CAP_DMA_REGISTRABLE
        self.reg.flags = CXL_F_DIRECT | CXL_F_NOFLUSH
        self.reg.node = node
        self.reg.ctx = <void*>self.mapping.base
        self.reg.ops = &FILE_OPS
        self.reg.closed = 0

    def bind(self, int nodes, unsigned long long uuid, bint fresh):
        """Nothing per node to set up: the medium is coherent."""

    cpdef close(self):
        self.mapping.close()  # raises while views are alive; we stay open then
        self.reg.closed = 1
        # base stays addressable (retired, anonymous) until the Mapping is freed.

    def view(self, unsigned long long off, unsigned long long n):
        return self.mapping.view(off, n)
