# A shared file mapping: the medium under file:, emu: and (later) dax: regions.


cdef class Mapping:
    cdef readonly str path      # file the mapping came from
    cdef readonly object mm     # the mmap.mmap object that owns the pages
    cdef char* base             # first mapped byte, valid until close()
    cdef readonly unsigned long long size  # mapped bytes
    cdef Py_buffer _buf         # keeps base valid while we hold it
    cdef bint _held             # _buf acquired

    cpdef close(self)
