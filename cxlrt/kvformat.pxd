# The KV cache's on-media object: its geometry and layout lines, written once by
# the node that creates the object and checked by every node that attaches it.
# The object map and its invariants are in kvcache.pxd.
from libc.stdint cimport uint64_t

from cxlrt.kvindex cimport kv_index
from cxlrt.layout cimport kv_geometry
from cxlrt.region cimport Region


cdef int kv_attach(Region region, str name, kv_index* K, kv_geometry* G, bint create,
                   block_bytes, capacity) except -1
