# cython: language_level=3
"""Base class of every backend; the C contract is in backend.pxd."""

cimport cython
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.includes.intrin cimport CXL_NT_MIN, CXLRT_DEBUG, cxl_nt_enabled
from cxlrt.mapping cimport Mapping

from cxlrt.errors import RegionClosedError, RegionError

# This build's debug level (cxlrt/includes/debug.h): 0 release, 1 asserts and test
# hooks, 2 also expensive walks. Tests that need the hooks skip unless it is >= 1.
DEBUG = CXLRT_DEBUG


def copy_mode() -> dict:
    """How dma_write copies large blocks in this process (cxlrt/includes/cxl_copy.h):
    non-temporal stores of `nt_width` bytes (32 with AVX, else 16) from `nt_min`
    bytes up, unless CXLRT_NT_STORES was set before the first copy: to 0 (memcpy,
    width 0) or to sse2 (16-byte stores on any x86-64). Other CPUs copy with memcpy."""
    cdef int mode = cxl_nt_enabled()
    return {"nt_stores": mode != 0, "nt_min": CXL_NT_MIN, "nt_width": (0, 16, 32)[mode]}


cdef class Backend:
    """A medium plus this node's view of it, exposed to algorithms as a ``cxl_region``.

    Subclasses fill ``self.reg`` in their constructor and release their
    resources in ``close()``, which must be idempotent.
    """

    cdef cxl_region* region(self) except NULL:
        """The C view for algorithms; raises once closed, or if the backend's ops
        table was built for another layout of the contract."""
        if self.reg.closed or self.reg.ops == NULL:
            raise RegionClosedError(f"{self.scheme}:{self.path} is closed")
        if self.reg.ops.abi != CXL_OPS_ABI:
            raise RegionError(
                f"backend {type(self).__qualname__} ({self.scheme}:) fills a cxl_ops table "
                f"of another layout than this cxlrt's (its abi word is "
                f"{self.reg.ops.abi:#x}, not {CXL_OPS_ABI}): rebuild it against this "
                "cxlrt, and set `abi = CXL_OPS_ABI` in its table")
        return &self.reg

    cpdef close(self):
        """Stop every later call through the region (idempotent)."""
        self.reg.closed = 1

    cdef _use_device(self, uint64_t size, uint32_t caps, uint32_t flags, int node,
                     void* ctx, const cxl_ops* ops):
        """Open the view of a medium reached only through `ops` (no mapping: base NULL)."""
        self.reg.base = NULL
        self.reg.size = size
        self.reg.caps = caps
        self.reg.flags = flags
        self.reg.node = node
        self.reg.ctx = ctx
        self.reg.ops = ops
        self.reg.closed = 0

    cdef int _retire(self, Mapping m) except -1:
        """Close the region and retire its mapping `m` (idempotent; raises, and stays
        open, while views of `m` are alive). Closed before the retire: code that
        reads words through base without the contract's checks (a lock waiter's
        window) and sees the retired zeros then also sees closed, and does not take
        zeros for a free lock."""
        if m is not None and not m.closed:
            if m._exports:
                m.close()  # raises while views are alive
            self.reg.closed = 1
            m.close()
        self.reg.closed = 1
        return 0

    @property
    def caps(self):
        """``CXL_CAP_*`` bits of this backend (see :mod:`cxlrt.caps`)."""
        return self.reg.caps

    @property
    def node(self):
        return self.reg.node

    @property
    def size(self):
        return self.reg.size

    def stats(self):
        """Backend counters (dict); empty for backends that keep none."""
        return {}

    def last_violation(self):
        """Details of the last checker violation, or None (emulation only)."""
        return None

    def view(self, unsigned long long off, unsigned long long n):
        """A memoryview over the medium (DMA window); mappable backends override."""
        from cxlrt.errors import UnsupportedError
        raise UnsupportedError(f"{self.scheme}: backend has no mappable memory")

    def __dealloc__(self):
        self.reg.closed = 1


@cython.no_gc_clear  # a beat thread may still use the mapping: the GC must not drop it first
cdef class MappedBackend(Backend):
    """A backend whose medium is one plain mapping and whose ctx is its base pointer
    (file:, numa:, dax:): the shared setup, close and view."""

    cdef _use_mapping(self, Mapping m, uint32_t caps, uint32_t flags, int node,
                      const cxl_ops* ops):
        self.mapping = m
        self.reg.base = m.base
        self.reg.size = m.size
        self.reg.caps = caps
        self.reg.flags = flags
        self.reg.node = node
        self.reg.ctx = <void*>m.base
        self.reg.ops = ops
        self.reg.closed = 0

    def bind(self, int nodes, unsigned long long uuid, bint fresh):
        """Nothing per node: every node sees the mapped medium directly."""

    cpdef close(self):
        self._retire(self.mapping)
        # base stays addressable (retired, anonymous) until the Mapping is freed.

    def view(self, unsigned long long off, unsigned long long n):
        return self.mapping.view(off, n)
