# cython: language_level=3
"""Shared read/write file mappings with a stable base pointer.

close() never leaves a dangling address: it atomically replaces the file pages
with private anonymous ones (MAP_FIXED), so a copy still running in another
thread without the GIL writes into harmless memory instead of faulting. The
address range itself is released only when the object is freed, when no code
can hold the pointer any more.
"""

import os

from libc.errno cimport errno
from posix.mman cimport (MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_PRIVATE, MAP_SHARED,
                         PROT_READ, PROT_WRITE, mmap, munmap)

from cxlrt.errors import RegionClosedError, RegionError

cdef extern from "<sys/mman.h>" nogil:
    int MAP_NORESERVE


cdef class Mapping:
    """A MAP_SHARED, read/write mapping of ``size`` bytes of ``path``.

    Parameters
    ----------
    path : str
        File (or device) to map; it must hold at least ``size`` bytes.
    size : int
        Bytes to map, from offset 0; must be > 0.
    flags : int, optional
        mmap flags instead of MAP_SHARED (e.g. MAP_SHARED_VALIDATE | MAP_SYNC).
    """

    def __cinit__(self, str path, unsigned long long size, int flags=0):
        self.path = path
        self.size = size
        self.base = NULL
        self.closed = True
        if size == 0:
            raise ValueError(f"cannot map 0 bytes of {path!r}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        cdef void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, flags or MAP_SHARED, fd, 0)
        cdef int err = errno
        os.close(fd)
        if p == MAP_FAILED:
            raise OSError(err, f"cannot map {size} bytes of {path!r}: {os.strerror(err)}")
        self.base = <char*>p
        self.closed = False

    def __getbuffer__(self, Py_buffer* buf, int flags):
        if self.closed:
            raise RegionClosedError(f"{self.path!r} is closed")
        self._shape[0] = <Py_ssize_t>self.size
        buf.buf = self.base
        buf.obj = self
        buf.len = <Py_ssize_t>self.size
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = self._shape
        buf.strides = NULL
        buf.suboffsets = NULL
        buf.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer* buf):
        self._exports -= 1

    cpdef close(self):
        """Stop sharing the file. Idempotent; refuses while views are alive."""
        cdef void* p
        if self.closed:
            return
        if self._exports:
            raise RegionError(
                f"cannot close {self.path!r}: {self._exports} view(s) of the region are still "
                "alive; release them (del the memoryview / numpy array) first")
        p = mmap(self.base, self.size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0)
        if p == MAP_FAILED:  # cannot happen for a range we own; never leave it dangling
            raise OSError("cannot retire the mapping of " + repr(self.path))
        self.closed = True

    def view(self, unsigned long long off, unsigned long long n):
        """A writable memoryview of ``[off, off+n)``; the caller checked the range."""
        if self.closed:
            raise RegionClosedError(f"{self.path!r} is closed")
        return memoryview(self)[off:off + n]

    def keep(self):
        """Never unmap (a file of robust mutexes: the kernel marks a dead holder's
        mutex through this address, so it must stay the file's until the process
        exits)."""
        self.kept = True

    def __dealloc__(self):
        if self.base != NULL and not self.kept:
            munmap(self.base, self.size)
            self.base = NULL
