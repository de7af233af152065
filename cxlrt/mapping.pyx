# cython: language_level=3
"""Shared read/write file mappings with a stable base pointer."""

import mmap
import os

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer

from cxlrt.errors import RegionClosedError, RegionError


cdef class Mapping:
    """A MAP_SHARED, read/write mapping of ``size`` bytes of ``path``.

    Parameters
    ----------
    path : str
        File to map. It must already be at least ``size`` bytes long.
    size : int
        Bytes to map, from offset 0.
    """

    def __cinit__(self, str path, unsigned long long size):
        self._held = False
        self.path = path
        self.size = size
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        PyObject_GetBuffer(self.mm, &self._buf, PyBUF_WRITABLE)
        self._held = True
        self.base = <char*>self._buf.buf

    cpdef close(self):
        """Unmap. Idempotent; fails (and stays open) while views of it are alive."""
        if not self._held:
            return
        PyBuffer_Release(&self._buf)
        self._held = False
        try:
            self.mm.close()
        except BufferError:
            PyObject_GetBuffer(self.mm, &self._buf, PyBUF_WRITABLE)
            self._held = True
            raise RegionError(
                f"cannot close {self.path!r}: views of the region are still alive; "
                "release them (del the memoryview / numpy array) first") from None
        self.base = NULL

    def view(self, unsigned long long off, unsigned long long n):
        """A writable memoryview of ``[off, off+n)``; the caller checked the range."""
        if not self._held:
            raise RegionClosedError(f"{self.path!r} is closed")
        return memoryview(self.mm)[off:off + n]

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._buf)
            self._held = False
