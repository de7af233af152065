# The lock manager: the global tier of a manager-mode lock (lock.pxd states the
# protocol and its epoch fencing). A waiter publishes a request on its own line; the
# one manager that holds the claim grants round-robin by writing the grant line.
#
# A grant word: (node + 1) << 56 | (manager epoch & 0xFFFF) << 40 | (request & SEQ),
# 0 = none. One 8-byte word, so a reader never sees one node's id with another's
# request number or another manager's epoch (several words could tear).
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.lockctx cimport cxl_lockctx


ctypedef struct cxl_mgr_pace:
    uint64_t spin_ns          # spin this long after a grant changed, then sleep
    uint64_t changed_at       # our clock at the latest pass that changed a grant
    uint64_t yields           # passes followed by a yield (spinning)
    uint64_t sleeps           # passes followed by a ~20 us sleep


ctypedef struct cxl_mgr_lock:
    uint32_t last             # node granted last (round robin starts after it)
    uint32_t held             # node our grant names, + 1 (0: no grant of ours stands)
    uint64_t wrote            # grant word we last published
    uint64_t seq              # the request our grant answers
    int adopted               # the takeover scan of this lock is done


cdef inline uint64_t cxl_grant_seq(uint64_t w) noexcept nogil:
    """The request number a grant word (or a request word) carries."""
    return w & ((<uint64_t>1 << 40) - 1)


cdef inline uint64_t cxl_grant_node1(uint64_t w) noexcept nogil:
    """The node a grant word names, + 1 (0: no grant)."""
    return w >> 56


cdef int cxl_mgr_acquire(cxl_lockctx* L, uint32_t id, uint64_t deadline) noexcept nogil
cdef int cxl_mgr_release(cxl_lockctx* L, uint32_t id) noexcept nogil
cdef int cxl_mgr_withdraw(cxl_lockctx* L, uint32_t id) noexcept nogil
cdef int cxl_mgr_passes(cxl_lockctx* L, uint32_t* ids, uint32_t n, uint64_t epoch,
                        cxl_mgr_lock* st, cxl_mgr_pace* pace, uint64_t for_ns) noexcept nogil
