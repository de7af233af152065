# Two-tier cross-node lock (TraCT): a robust node-local mutex, then a global tier
# over single-writer lines (Lamport's bakery, or a lock manager's grant line).
#
# Invariants:
#  - Node n writes only its own line of each lock record; the grant line is
#    written only by the one lock manager that holds the manager claim.
#  - The global tier is entered only by the holder of the node-local mutex, so
#    at most one thread per node competes and a node's line has one writer.
#  - A node that liveness.pxd judges gone (dead, detached, never attached) holds
#    nothing: waiters skip its line, and the manager revokes its grant. A dead
#    process inside a live node is recovered by that node's other processes
#    through the robust mutex (the heartbeat's sweep, an acquire, or a detach).
#  - Manager mode is fenced by epochs: the claim line names the manager and its
#    epoch and is written only under lock 0 by a takeover; a grant word carries
#    the epoch's low 16 bits. A waiter publishes the grant it accepts on its own
#    line (accepted), then holds only if the claim still carries that epoch. A manager
#    re-checks its epoch before every grant and stops for good once superseded.
#    A new manager learns who may hold from those accepted words, never from the
#    grant word (a superseded manager can still overwrite it once), and restores
#    its own grant word if a stale one lands over it.
#  - A holder learns at release (LeaseLost) that it was silent past the lease at
#    any time since it began to acquire; Lock.check() asks the same mid-hold.
#
# The algorithms live in bakery.pxd (inline, compiled into this module) and
# lockmgr.pyx, their shared context and record addressing in lockctx.pxd; this
# module ties them to the node-local tier.
# Every name below stays cimportable from cxlrt.lock.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.liveness cimport Liveness, cxl_live
from cxlrt.includes.mutex cimport pthread_mutex_t
from cxlrt.lockctx cimport (CXL_HELD_HEAP, CXL_LOCK_ALLOC, CXL_LOCK_BAKERY, CXL_LOCK_MANAGER,
                            CXL_LOCK_META, CXL_LOCK_READY, cxl_lock_record, cxl_lockctx,
                            cxl_node_dead)
from cxlrt.lockmgr cimport cxl_mgr_pace
from cxlrt.nodelocal cimport NodeLocal
from cxlrt.region cimport Region


cdef int cxl_local_mutex_enter(cxl_lockctx* L, pthread_mutex_t* m, uint32_t idx,
                               uint64_t deadline, bint mark) noexcept nogil
cdef void cxl_local_mutex_exit(cxl_lockctx* L, pthread_mutex_t* m, uint32_t idx) noexcept nogil
cdef int cxl_lock_acquire(cxl_lockctx* L, uint32_t id, uint32_t mode, uint64_t timeout_ns,
                          int* recovered) noexcept nogil
cdef int cxl_lock_release(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil
cdef int cxl_lock_sweep(void* ctx) noexcept nogil
cdef int cxl_local_enter(cxl_lockctx* L, uint32_t id) noexcept nogil
cdef int cxl_local_try_enter(cxl_lockctx* L, uint32_t id) noexcept nogil
cdef void cxl_local_exit(cxl_lockctx* L, uint32_t id) noexcept nogil
cdef void cxl_local_needs_repair(cxl_lockctx* L, uint32_t id, bint yes) noexcept nogil
cdef bint cxl_lock_held(cxl_lockctx* L, uint32_t id, bint global_tier) noexcept nogil


# Declared here so that the allocator, the KV cache and its pin table take the lock
# context from a typed service (cimport), and keep the service alive while they use it.
cdef class LockService:
    cdef cxl_lockctx L
    cdef readonly Region region
    cdef readonly NodeLocal local
    cdef readonly Liveness live
    cdef readonly double lease_s
    cdef object _stop
    cdef object _mgr_thread
    cdef readonly uint64_t mgr_epoch     # epoch of the manager we run, 0 = none
    cdef readonly object mgr_exit        # why our manager stopped (None while running)
    cdef dict _modes
    cdef bint _closed
    cdef uint64_t _spin_ns               # our manager spins this long after a grant changed
    cdef cxl_mgr_pace _pace              # its pacing state and counts (manager thread only)

    cdef uint64_t _rec(self, uint32_t i)


cdef class Lock:
    cdef readonly LockService svc
    cdef readonly uint32_t index
    cdef readonly str name
    cdef uint32_t _mode
    cdef readonly bint recovered   # the last acquire took over from a dead holder
    cdef uint64_t _t0              # our monotonic ns when the current hold's acquire began

    cdef int _release(self, bint may_blame_host) except -1
