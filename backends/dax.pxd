from cxlrt.backend cimport MappedBackend


cdef class DaxBackend(MappedBackend):
    cdef readonly str mode         # "devdax" or "fsdax"
    cdef readonly bint map_sync    # fsdax: MAP_SYNC was granted (stores are persistent)
