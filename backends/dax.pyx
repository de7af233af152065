# cython: language_level=3
"""``dax:`` — a DAX device or file: CXL memory mapped straight into the process.

``dax:/dev/dax0.0`` maps a devdax character device with its required alignment;
``dax:/mnt/pmem/rack0`` maps a file on a DAX filesystem (fsdax), with MAP_SYNC
where the filesystem supports it. The memory may be shared with other hosts, so
the backend is non-coherent: loads and stores are direct volatile accesses, but
flush is a real clflush of every line (publish/observe), and fence is mfence.
"""

import os
import stat as _stat

from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from cxlrt.backend cimport (CXL_CAP_DMA_REGISTRABLE, CXL_CAP_MAPPABLE, CXL_CAP_PERSISTENT,
                            CXL_CAP_SHARED_HOSTS, CXL_F_DIRECT, MappedBackend, cxl_ops)
from cxlrt.direct cimport direct_ops_init
from cxlrt.includes.intrin cimport (cxl_copy_out, cxl_fence_drain, cxl_fence_full,
                                    cxl_flush_range, cxl_flushopt_range)
from cxlrt.mapping cimport Mapping

from cxlrt.errors import RegionError, RegionSizeError

cdef extern from "<sys/mman.h>" nogil:
    int MAP_SHARED
    int MAP_SHARED_VALIDATE
    int MAP_SYNC


def _parse_sync(text):
    t = text.strip().lower()
    if t not in ("auto", "require", "off"):
        raise ValueError("expected auto, require or off")
    return t


PARAMS = {
    "sync": (_parse_sync, "auto",
             "fsdax: MAP_SYNC 'auto' (use when supported), 'require' or 'off'"),
}
"""Spec parameters accepted by ``dax:``."""


def _devdax_sysfs(path):
    st = os.stat(path)
    return f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _read_int(path, default=None):
    try:
        with open(path) as f:
            return int(f.read().strip(), 0)
    except (FileNotFoundError, ValueError):
        return default


def describe(str path):
    """("devdax" | "fsdax", medium bytes, required alignment) of a DAX path."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"dax:{path}: no such device or file") from None
    if _stat.S_ISCHR(st.st_mode):
        sysfs = _devdax_sysfs(path)
        size = _read_int(f"{sysfs}/size")
        if size is None or not os.path.exists(f"{sysfs}/subsystem"):
            raise RegionError(f"dax:{path} is a character device but not a devdax device "
                              f"({sysfs}/size is missing)")
        sub = os.path.basename(os.path.realpath(f"{sysfs}/subsystem"))
        if sub != "dax":
            raise RegionError(f"dax:{path} is a {sub!r} character device, not a devdax device")
        align = _read_int(f"{sysfs}/align", 2 << 20)
        return "devdax", size, align
    if _stat.S_ISREG(st.st_mode):
        return "fsdax", st.st_size, 4096
    raise RegionError(f"dax:{path} is neither a devdax character device nor a regular file")


def medium_size(str path):
    """Bytes the medium offers (device size for devdax, file size for fsdax)."""
    return describe(path)[1]


def is_device(str path):
    """True for devdax: the medium exists and is never created or truncated."""
    try:
        return _stat.S_ISCHR(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


# --- ops: direct, non-coherent ------------------------------------------------------

cdef int _flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    """clflush every line: written back and invalidated before we return (publish/observe)."""
    cxl_flush_range(<char*>ctx + off, n)
    return 0


cdef int _flush_nodrain(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    """clflushopt (clflush where not compiled in): completed by the next fence."""
    cxl_flushopt_range(<char*>ctx + off, n)
    return 0


cdef int _fence(void* ctx) noexcept nogil:
    """mfence: drains queued flushes and orders stores before later loads."""
    cxl_fence_full()
    return 0


cdef int _dma_read(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    """Bulk read: drop our cached copies first, so we read what the device holds."""
    cxl_flush_range(<char*>ctx + off, n)
    memcpy(dst, <char*>ctx + off, n)
    return 0


cdef int _dma_write(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    """Bulk write, then write the lines back so other hosts see it on return. The
    non-temporal body already went to the device; the flush still covers its ragged
    ends, which went through the cache."""
    cxl_copy_out(<char*>ctx + off, src, n)
    cxl_flush_range(<char*>ctx + off, n)
    cxl_fence_drain()
    return 0


cdef cxl_ops DAX_OPS
direct_ops_init(&DAX_OPS)  # direct loads and stores; the rest is non-coherent:
DAX_OPS.flush = _flush
DAX_OPS.flush_nodrain = _flush_nodrain
DAX_OPS.fence = _fence
DAX_OPS.dma_read = _dma_read
DAX_OPS.dma_write = _dma_write


cdef class DaxBackend(MappedBackend):
    """A devdax device or fsdax file, mapped directly; non-coherent across hosts."""

    def __init__(self, str path, dict params, int node, unsigned long long size):
        mode, medium, align = describe(path)
        if size > medium:
            raise RegionSizeError(f"dax:{path}: the {mode} medium holds {medium} bytes, "
                                  f"smaller than the {size}-byte region")
        if size % align:
            raise RegionSizeError(f"dax:{path}: region size {size} is not a multiple of the "
                                  f"device alignment {align} bytes")
        self.scheme = "dax"
        self.path = path
        self.params = dict(params)
        self.mode = mode
        self.map_sync = False
        m = None
        if mode == "fsdax" and params["sync"] != "off":
            try:
                m = Mapping(path, size, MAP_SHARED_VALIDATE | MAP_SYNC)
                self.map_sync = True
            except OSError as e:
                if params["sync"] == "require":
                    raise RegionError(f"dax:{path}: MAP_SYNC refused ({e.strerror}): the file "
                                      "is not on a DAX filesystem") from None
        caps = CXL_CAP_MAPPABLE | CXL_CAP_DMA_REGISTRABLE | CXL_CAP_SHARED_HOSTS
        if self.map_sync:
            caps |= CXL_CAP_PERSISTENT  # MAP_SYNC: a flushed store is durable
        # Direct volatile loads and stores, but flushes are real: not CXL_F_NOFLUSH.
        self._use_mapping(m if m is not None else Mapping(path, size), caps, CXL_F_DIRECT,
                          node, &DAX_OPS)

    def stats(self):
        return {"mode": self.mode, "map_sync": self.map_sync}
