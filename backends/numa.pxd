from cxlrt.backend cimport Backend
from cxlrt.mapping cimport Mapping


cdef class NumaBackend(Backend):
    cdef readonly Mapping mapping  # the shared mapping, bound to one NUMA node
    cdef readonly int numa_node    # where its pages must live
