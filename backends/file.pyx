# cython: language_level=3
"""``file:`` — a region in a shared file mapping (tmpfs or any filesystem).

Every process on one host maps the same page-cache pages, so the medium is
coherent: flushes are no-ops and loads/stores are plain volatile accesses.
This is the embedded default for one host and the baseline the emulation is
measured against.
"""

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_DMA_REGISTRABLE, CXL_CAP_MAPPABLE,
                            CXL_F_DIRECT, CXL_F_NOFLUSH, MappedBackend, cxl_ops)
from cxlrt.direct cimport direct_ops_init
from cxlrt.mapping cimport Mapping


cdef cxl_ops FILE_OPS
direct_ops_init(&FILE_OPS)

PARAMS = {}
"""Spec parameters accepted by ``file:`` (none)."""


cdef class FileBackend(MappedBackend):
    """A coherent shared file mapping.

    Parameters
    ----------
    path : str
        The region file (created by :func:`cxlrt.open` with ``create=True``).
    params : dict
        Parsed spec parameters (none are accepted).
    node : int
        This view's node id.
    size : int
        Bytes to map (the file's size).
    """

    def __init__(self, str path, dict params, int node, unsigned long long size):
        self.scheme = "file"
        self.path = path
        self.params = dict(params)
        self._use_mapping(Mapping(path, size),
                          CXL_CAP_COHERENT | CXL_CAP_MAPPABLE | CXL_CAP_DMA_REGISTRABLE,
                          CXL_F_DIRECT | CXL_F_NOFLUSH, node, &FILE_OPS)
