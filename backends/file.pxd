from cxlrt.backend cimport Backend
from cxlrt.mapping cimport Mapping


cdef class FileBackend(Backend):
    cdef readonly Mapping mapping  # the shared mapping of the region file
