from cxlrt.backend cimport MappedBackend


cdef class NumaBackend(MappedBackend):
    cdef readonly int numa_node    # where its pages must live
