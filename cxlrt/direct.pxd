# The cxl_ops slots of a plainly mapped medium, written once for every backend
# whose `ctx` is its base pointer (file:, numa:, dax:). Declared inline here so
# each backend module takes their addresses for its own ops table, which it fills
# with direct_ops_init (and then overrides what its medium does differently).
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

from cxlrt.backend cimport CXL_OPS_ABI, cxl_ops
from cxlrt.includes.intrin cimport (cxl_copy_out, cxl_fence_drain, cxl_fence_full,
                                    cxl_load64_volatile, cxl_store64_volatile)


cdef inline int direct_load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Copy out of the mapping."""
    memcpy(dst, <char*>ctx + off, n)
    return 0


cdef inline int direct_store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Copy into the mapping."""
    memcpy(<char*>ctx + off, src, n)
    return 0


cdef inline int direct_load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    """One volatile 8-byte load."""
    out[0] = cxl_load64_volatile(<char*>ctx + off)
    return 0


cdef inline int direct_store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    """One volatile 8-byte store."""
    cxl_store64_volatile(<char*>ctx + off, v)
    return 0


cdef inline int direct_noflush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    """A coherent medium has nothing to write back."""
    return 0


cdef inline int direct_fence(void* ctx) noexcept nogil:
    """Store-load ordering between processes still needs the CPU fence."""
    cxl_fence_full()
    return 0


cdef inline int direct_dma_write(void* ctx, uint64_t off, const void* src,
                                 uint64_t n) noexcept nogil:
    """Bulk copy in (non-temporal when large: nobody here reads it back); the drain
    orders it before any later flag store."""
    cxl_copy_out(<char*>ctx + off, src, n)
    cxl_fence_drain()
    return 0


cdef inline void direct_ops_init(cxl_ops* ops) noexcept nogil:
    """Fill every slot of `ops` for a coherent mapping (file:, numa:): direct loads and
    stores, no write-back, a real fence. A non-coherent medium (dax:) then replaces
    flush, flush_nodrain, fence and the DMA slots with its own."""
    memset(ops, 0, sizeof(cxl_ops))  # a slot the literal misses is NULL (Cython only warns)
    ops[0] = cxl_ops(abi=CXL_OPS_ABI, load=direct_load, store=direct_store, load64=direct_load64,
                     store64=direct_store64, flush=direct_noflush, flush_nodrain=direct_noflush,
                     fence=direct_fence, dma_read=direct_load, dma_write=direct_dma_write,
                     hint=NULL, gather64=NULL, scatter64=NULL)
