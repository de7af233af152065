# A shared file mapping: the medium under file:, emu: and (later) dax: regions.


cdef class Mapping:
    cdef readonly str path      # file the mapping came from
    cdef char* base             # first mapped byte; stays addressable until dealloc
    cdef readonly unsigned long long size  # mapped bytes
    cdef readonly bint closed   # close() ran: the file is no longer mapped
    cdef Py_ssize_t _exports    # buffers handed out and not yet released
    cdef Py_ssize_t _shape[1]   # for the buffer protocol
    cdef readonly bint kept     # keep(): never unmapped, not even at dealloc

    cpdef close(self)
