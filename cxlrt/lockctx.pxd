# What both lock algorithms (bakery.pxd, lockmgr.pxd) and the service (lock.pxd)
# share: the lock context, its record addressing and the node-local slot of a lock.
# Declarations and one-line inline accessors only; no module of its own.
#
# Invariants (lock.pxd states the protocol): node n writes only its own line of a
# record; every address comes from layout.pxd's accessors, never from arithmetic here.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.layout cimport (CXL_MAX_LOCKS, cxl_lock_grant_off, cxl_lock_line_off,
                           cxl_lock_record_off)
from cxlrt.liveness cimport cxl_live, cxl_node_gone
from cxlrt.nodelocal cimport CXL_LOCAL_LOCK_BYTES, cxl_local_lock


cdef enum:
    CXL_LOCK_READY = 1
    CXL_LOCK_BAKERY = 1
    CXL_LOCK_MANAGER = 2
    CXL_LOCK_META = 0      # lock 0 guards the lock table and the directory
    CXL_LOCK_ALLOC = 1     # lock 1 guards the chunk table and remote-free queues
    CXL_DEAD_CHECK_NS = 20000000  # how often a waiter re-reads the heartbeat it waits on
    CXL_HELD_HEAP = CXL_MAX_LOCKS  # held[] index of the node heap's mutex (the allocator)
    CXL_HELD_SLOTS = CXL_MAX_LOCKS + 1


ctypedef struct cxl_lockctx:
    const cxl_region* r
    char* local               # node-local lock slots (CXL_LOCAL_LOCK_BYTES apart)
    uint64_t locks_off        # locks section: claim line, then records
    uint64_t nodes_off        # node areas
    cxl_live* live            # liveness: node states, our own silence
    uint64_t lease_ns
    uint64_t mgr_wait_ns      # a manager-mode waiter gives up once no manager ran this long
    uint32_t nodes
    uint32_t node
    int* armed                # crash.pxd's process-wide flag: a crash point is armed
    uint32_t closing          # Region.close() has begun: waiters leave (CXLRT_E_CLOSED)
    uint32_t held[CXL_HELD_SLOTS]  # which thread of ours holds each (0: none), this service only


cdef inline cxl_local_lock* cxl_lock_slot(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Lock `id`'s node-local slot: the robust mutex and this node's hold state."""
    return <cxl_local_lock*>(L.local + id * CXL_LOCAL_LOCK_BYTES)


cdef inline uint64_t cxl_lock_record(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Offset of lock `id`'s record: header line, node lines, grant line."""
    return cxl_lock_record_off(L.locks_off, L.nodes, id)


cdef inline uint64_t cxl_lock_line(cxl_lockctx* L, uint32_t id, uint32_t j) noexcept nogil:
    """Offset of node j's line of lock `id`."""
    return cxl_lock_line_off(cxl_lock_record(L, id), j)


cdef inline uint64_t cxl_lock_grant(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Offset of lock `id`'s grant line (manager mode)."""
    return cxl_lock_grant_off(cxl_lock_record(L, id), L.nodes)


cdef inline int cxl_node_dead(cxl_lockctx* L, uint32_t j) noexcept nogil:
    """1 if node j's holds no longer count (liveness.pxd: dead, detached or never attached)."""
    return cxl_node_gone(L.live, j)

