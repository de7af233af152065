from cxlrt.backend cimport Backend
from cxlrt.mapping cimport Mapping


cdef class DaxBackend(Backend):
    cdef readonly Mapping mapping  # the device or file mapping
    cdef readonly str mode         # "devdax" or "fsdax"
    cdef readonly bint map_sync    # fsdax: MAP_SYNC was granted (stores are persistent)
