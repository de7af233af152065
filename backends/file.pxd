from cxlrt.backend cimport MappedBackend


cdef class FileBackend(MappedBackend):
    pass
