# cython: language_level=3
"""Host-local shared-memory helpers callable from Python (sidecars, node-local tables)."""

from cxlrt.includes.mutex cimport cxl_mutex_init_shared, pthread_mutex_t
from cxlrt.mapping cimport Mapping

MUTEX_BYTES = sizeof(pthread_mutex_t)


def init_robust_mutexes(Mapping m, unsigned long long offset, unsigned long long count,
                        unsigned long long stride):
    """Initialise `count` robust process-shared mutexes at offset + i * stride."""
    cdef unsigned long long i
    cdef int rc
    if stride < sizeof(pthread_mutex_t) or offset + count * stride > m.size:
        raise ValueError("mutex table does not fit the mapping")
    for i in range(count):
        rc = cxl_mutex_init_shared(<pthread_mutex_t*>(m.base + offset + i * stride))
        if rc != 0:
            raise OSError(-rc, "pthread_mutex_init failed")
