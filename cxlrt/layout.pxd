# On-media structures of a region. Sized types and offsets only, never pointers:
# every host maps the region at a different address.
#
# Region map (layout version 1):
#   [0, 4096)                 superblock page (cxl_superblock at 0)
#   [4096, 4096 + nodes_area) per-node areas, CXL_NODE_AREA bytes each,
#                             written only by their node
#   [heap_off, size)          heap (allocator, directory, index: later versions)
# The magic is published last at format time, so a half-formatted region never
# looks valid.
from libc.stdint cimport uint32_t, uint64_t


cdef enum:
    CXL_LAYOUT_VERSION = 1
    CXL_LINE_SIZE = 64
    CXL_SB_PAGE = 4096
    CXL_MAX_SECTIONS = 8
    CXL_MAX_NODES = 64
    CXL_NODE_AREA = 256       # four lines per node
    CXL_MIN_HEAP = 65536
    CXL_SEC_NODES = 0
    CXL_SEC_HEAP = 1
    CXL_NSECTIONS_V1 = 2


ctypedef struct cxl_section:
    uint64_t off              # from the region start; 0 = absent
    uint64_t size             # bytes


ctypedef struct cxl_superblock:
    uint64_t magic            # CXL_MAGIC once formatting is complete, else 0
    uint32_t version          # CXL_LAYOUT_VERSION
    uint32_t line_size        # 64: the unit of write-back and of single-writer lines
    uint64_t size             # region bytes; the medium must be exactly this big
    uint32_t nodes            # node ids are 0 .. nodes-1
    uint32_t nsections        # used entries of sections[]
    uint64_t uuid             # random per format; tells a reformatted region apart
    uint64_t created_ns       # wall clock at format (CLOCK_REALTIME, ns)
    cxl_section sections[8]   # indexed by CXL_SEC_*
    uint64_t checksum         # FNV-1a 64 of every byte before this field


ctypedef struct cxl_node_area:
    uint64_t pid              # last process that attached as this node
    uint64_t heartbeat_ns     # wall clock of its last heartbeat (ns), 0 = never
    uint64_t attaches         # attaches seen by this node's writer (informational)
    uint64_t host_id          # hash of the attaching host's name
    uint64_t reserved[28]     # pads to CXL_NODE_AREA; later versions use it
