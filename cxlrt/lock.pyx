# cython: language_level=3
"""Two-tier cross-node locks over the backend contract (see lock.pxd).

Tier 1 is a robust process-shared mutex in node-local memory; tier 2 is either
Lamport's bakery (loads and stores only, each node writing its own line) or a
lock manager that grants round-robin by writing one grant line. Everything
crossing nodes is publish (store, flush, fence) / observe (flush, load).
"""

import os
import threading
import time

from libc.errno cimport ETIMEDOUT
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from cxlrt.backend cimport (CXL_F_DIRECT, CXL_F_NOFLUSH, cxl_load64, cxl_observe, cxl_observe64,
                            cxl_persist, cxl_publish, cxl_region, cxl_store64)
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.layout cimport CXL_NODE_AREA
from cxlrt.includes.intrin cimport (cxl_backoff, cxl_cpu_relax, cxl_fence_release, cxl_fence_sc,
                                    cxl_load64_volatile, cxl_now_ns, cxl_pid,
                                    cxl_store64_volatile, unlikely)
from cxlrt.liveness cimport (Liveness, cxl_live_fenced, cxl_live_remaining_ns,
                             cxl_live_silent_since, cxl_live_verify, cxl_node_gone)
from cxlrt.includes.mutex cimport (cxl_mutex_lock, cxl_mutex_timedlock, cxl_mutex_trylock,
                                   cxl_mutex_unlock, pthread_mutex_t)
from cxlrt.includes.thread cimport cxl_set_timerslack_1ns, cxl_sleep_ns
from cxlrt.includes.intrin cimport CXL_ASSERT
from cxlrt.nodelocal cimport CXL_LOCAL_LOCK_BYTES, NodeLocal, cxl_local_lock
from cxlrt.mapping cimport Mapping
from cxlrt.region cimport Region
from cxlrt.status cimport (CXLRT_E_COHERENCE, CXLRT_E_FENCED, CXLRT_E_LOCKSTATE, CXLRT_E_NOMANAGER,
                           CXLRT_E_TIMEOUT, check_rc)

from cxlrt.errors import LeaseLost, LockTimeout, NoLockManager, RegionError
from cxlrt.status import name_of

cdef extern from "cxl_intrin.h" nogil:
    uint32_t cxl_thread_id()

# How often a waiter re-reads the heartbeat of the node it waits on.
cdef enum:
    DEAD_CHECK_NS = 20000000

# A grant word: (node + 1) << 56 | (manager epoch & 0xFFFF) << 40 | (request & SEQ).
cdef uint64_t GRANT_SEQ_MASK = (<uint64_t>1 << 40) - 1
cdef uint64_t GRANT_EPOCH_MASK = 0xFFFF
# A waiter's accepted word (its line, +40): the grant it took, less the node byte.
cdef uint64_t ACCEPT_MASK = (<uint64_t>1 << 56) - 1

cdef int* _armed = cxl_crash_armed_ptr()


# A manager-mode waiter gives up once no manager has made a pass for this long, or two
# leases if longer (a standby takes a stalled manager over after one lease).
MANAGER_WAIT_S = 3.0

# A lock manager spins (a yield between passes) for this long after each pass that changed
# a grant, then sleeps ~20 us a pass: microsecond handoffs while grants change hands, an
# idle core through long holds and quiet spells.
MANAGER_SPIN_S = 0.002
MANAGER_SPIN_MAX_S = 3600.0  # and no inf: seconds become a 64-bit count of ns
MANAGER_WAIT_MAX_S = 1e6


# --- helpers --------------------------------------------------------------------

cdef inline cxl_local_lock* _slot(cxl_lockctx* L, uint32_t id) noexcept nogil:
    return <cxl_local_lock*>(L.local + id * CXL_LOCAL_LOCK_BYTES)


cdef uint64_t cxl_lock_record(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Offset of lock `id`'s record: header line, node lines, grant line."""
    return L.locks_off + 64 + id * L.rec_bytes


cdef inline uint64_t _line(cxl_lockctx* L, uint32_t id, uint32_t j) noexcept nogil:
    return cxl_lock_record(L, id) + 64 * (1 + j)


cdef inline uint64_t _grant(cxl_lockctx* L, uint32_t id) noexcept nogil:
    return cxl_lock_record(L, id) + 64 * (1 + L.nodes)


cdef int cxl_node_dead(cxl_lockctx* L, uint32_t j) noexcept nogil:
    """1 if node j's holds no longer count (liveness.pxd: dead, detached or never attached)."""
    return cxl_node_gone(L.live, j)


# --- bakery -----------------------------------------------------------------------

cdef int _bakery_withdraw(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Leave the bakery: ticket 0, not choosing, published (a release: store order suffices)."""
    cdef uint64_t me = _line(L, id, L.node)
    cdef int rc = cxl_store64(L.r, me, 0)
    if rc == 0:
        rc = cxl_store64(L.r, me + 8, 0)
    if rc == 0:
        rc = cxl_publish(L.r, me, 64)
    return rc


cdef inline int _bakery_direct(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Uncontended bakery on a coherent direct mapping: 1 if the lock is ours.

    The same doorway as below with plain volatile accesses (flushes are no-ops
    there and the record's range is checked once); any sign of another node
    (choosing, or a smaller ticket) returns 0 with our ticket still published,
    and the caller's general loop takes over the wait.
    """
    cdef const cxl_region* r = L.r
    cdef uint64_t rec = cxl_lock_record(L, id)
    cdef char* base
    cdef char* me
    cdef char* ln
    cdef uint64_t v, mx = 0, ticket
    cdef uint32_t j
    if rec + L.rec_bytes > r.size or r.closed:
        return 0
    base = r.base + rec + 64
    me = base + 64 * L.node
    cxl_store64_volatile(me, 1)
    cxl_fence_sc()  # choosing = 1 before we read any ticket (store -> load)
    for j in range(L.nodes):
        v = cxl_load64_volatile(base + 64 * j + 8)
        if v > mx:
            mx = v
    ticket = mx + 1
    cxl_store64_volatile(me + 8, ticket)
    cxl_fence_release()  # the ticket before choosing drops (TSO keeps store order)
    cxl_store64_volatile(me, 0)
    cxl_fence_sc()  # our ticket before we read the others' (store -> load)
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.acquire.ticket")
    for j in range(L.nodes):
        if j == L.node:
            continue
        ln = base + 64 * j
        if cxl_load64_volatile(ln) != 0:
            return 0
        v = cxl_load64_volatile(ln + 8)
        if v != 0 and (v < ticket or (v == ticket and j < L.node)):
            return 0
    cxl_store64_volatile(me + 32, cxl_load64_volatile(me + 32) + 1)
    return 1


cdef int _bakery_acquire(cxl_lockctx* L, uint32_t id, uint64_t deadline) noexcept nogil:
    """Lamport's bakery over single-writer lines; every read is an observe."""
    cdef const cxl_region* r = L.r
    cdef uint64_t me = _line(L, id, L.node)
    cdef uint64_t ln, v = 0, ticket = 0, mx = 0, acq = 0, spins, next_check
    cdef uint32_t j
    cdef int rc
    if (r.flags & (CXL_F_DIRECT | CXL_F_NOFLUSH)) == (CXL_F_DIRECT | CXL_F_NOFLUSH):
        if _bakery_direct(L, id):
            return 0
        # Contended: our ticket is published; wait for the others below.
        rc = cxl_load64(r, me + 8, &ticket)
        if rc != 0:
            return rc
        return _bakery_wait(L, id, ticket, deadline)
    # choosing = 1 must be visible before we read anyone's ticket.
    rc = cxl_store64(r, me, 1)
    if rc == 0:
        rc = cxl_persist(r, me, 64)
    for j in range(L.nodes):
        if rc != 0:
            break
        if j != L.node:
            rc = cxl_observe64(r, _line(L, id, j) + 8, &v)
            if v > mx:
                mx = v
    ticket = mx + 1
    if rc == 0:
        rc = cxl_store64(r, me + 8, ticket)
    if rc == 0:  # the ticket is published before choosing drops (store-store order)
        rc = cxl_publish(r, me, 64)
    if rc == 0:
        rc = cxl_store64(r, me, 0)
    if rc == 0:  # full: our ticket must be visible before we read the others'
        rc = cxl_persist(r, me, 64)
    if rc != 0:
        _bakery_withdraw(L, id)
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.acquire.ticket")
    return _bakery_wait(L, id, ticket, deadline)


cdef inline int _wait_tick(cxl_lockctx* L, uint32_t j, uint64_t* next_check,
                          uint64_t deadline) noexcept nogil:
    """While waiting on node j: 1 if j is dead, CXLRT_E_TIMEOUT past the deadline, else 0.

    The clock is read only once we actually wait, and j's heartbeat only every
    DEAD_CHECK_NS, so an uncontended wait costs nothing here.
    """
    cdef uint64_t now
    if next_check[0] == 0:
        next_check[0] = cxl_now_ns() + DEAD_CHECK_NS
        return 0
    now = cxl_now_ns()
    if now <= next_check[0]:
        return 0
    if cxl_node_dead(L, j):
        return 1
    next_check[0] = now + DEAD_CHECK_NS
    return CXLRT_E_TIMEOUT if now > deadline else 0


cdef int _bakery_wait(cxl_lockctx* L, uint32_t id, uint64_t ticket,
                      uint64_t deadline) noexcept nogil:
    """Wait until no node is choosing or holds a smaller (ticket, node)."""
    cdef const cxl_region* r = L.r
    cdef uint64_t me = _line(L, id, L.node)
    cdef uint64_t ln, v = 0, acq = 0, spins, next_check
    cdef uint32_t j
    cdef int rc = 0, tick
    for j in range(L.nodes):
        if j == L.node:
            continue
        ln = _line(L, id, j)
        spins = 0
        next_check = 0  # read the clock only once we actually wait
        while True:  # wait while j is choosing
            rc = cxl_observe64(r, ln, &v)
            if rc != 0 or v == 0:
                break
            tick = _wait_tick(L, j, &next_check, deadline)
            if tick == 1:
                break  # j is dead: its ticket no longer counts
            if tick < 0:
                _bakery_withdraw(L, id)
                return tick
            cxl_backoff(&spins)
        while rc == 0:  # wait while j holds a smaller (ticket, node)
            rc = cxl_observe64(r, ln + 8, &v)
            if rc != 0 or v == 0 or v > ticket or (v == ticket and j > L.node):
                break
            tick = _wait_tick(L, j, &next_check, deadline)
            if tick == 1:
                break  # j is dead: its ticket no longer counts
            if tick < 0:
                _bakery_withdraw(L, id)
                return tick
            cxl_backoff(&spins)
        if rc != 0:
            _bakery_withdraw(L, id)
            return rc
    # Our own line, our own statistics: published with the release.
    if cxl_load64(r, me + 32, &acq) == 0:
        cxl_store64(r, me + 32, acq + 1)
    return 0


# --- manager mode ---------------------------------------------------------------------

cdef inline uint64_t _grant_word(uint64_t node, uint64_t epoch, uint64_t seq) noexcept nogil:
    """The grant as ONE 8-byte word: a reader can never see one node's id with another's
    request number or another manager's epoch (several words could tear)."""
    return ((node + 1) << 56) | ((epoch & GRANT_EPOCH_MASK) << 40) | (seq & GRANT_SEQ_MASK)


cdef inline int _claim_epoch(cxl_lockctx* L, uint64_t* epoch) noexcept nogil:
    """Observe the manager claim's epoch (written only by a takeover, under lock 0)."""
    return cxl_observe64(L.r, L.locks_off + 8, epoch)


ctypedef struct cxl_mgr_watch:
    uint64_t claim, epoch, beat   # the manager last seen (claim node + 1, epoch, passes)
    uint64_t ran_ns               # when we last saw it make a pass (or began to wait)
    uint64_t next_ns              # when to look again


cdef int _mgr_watch(cxl_lockctx* L, cxl_mgr_watch* w, uint64_t now) noexcept nogil:
    """CXLRT_E_NOMANAGER once no manager made a pass for L.mgr_wait_ns of our wait.

    A manager-mode lock with no manager (never started, stopped, or its node dead and
    nobody took over) would otherwise keep its waiters for ever. Judged by the
    manager's pass counter in its node area, on our own clock, like any liveness.
    """
    cdef uint64_t c[2]
    cdef uint64_t a[2]
    cdef uint64_t node
    if now < w.next_ns:
        return 0
    w.next_ns = now + 20000000
    if cxl_observe(L.r, L.locks_off, c, 16) == 0 \
            and c[0] != 0 and c[0] <= L.nodes and not cxl_node_gone(L.live, c[0] - 1):
        node = L.nodes_off + (c[0] - 1) * CXL_NODE_AREA + 64  # its mgr_epoch, mgr_beat
        if cxl_observe(L.r, node, a, 16) == 0 and a[0] == c[1]:
            if w.claim == c[0] and w.epoch == c[1] and w.beat != a[1]:
                w.ran_ns = now
            w.claim, w.epoch, w.beat = c[0], c[1], a[1]
    if now - w.ran_ns > L.mgr_wait_ns:
        return CXLRT_E_NOMANAGER
    return 0


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef inline void _grant_backoff(uint64_t* spins) noexcept nogil:
    """A manager-mode waiter's backoff: a few pauses, then yields for a long while, and
    only then sleeps. A spinning manager grants within microseconds, but the holder
    and the manager need the CPU for it; a sleep (2 us asked, ~60 us on a VM) would
    overshoot the grant many times over."""
    spins[0] += 1
    if spins[0] < 8:
        cxl_cpu_relax()
    elif spins[0] < 8192:
        sched_yield()
    else:
        cxl_sleep_ns(50_000)


cdef int _mgr_acquire(cxl_lockctx* L, uint32_t id, uint64_t deadline) noexcept nogil:
    """Publish a request on our line, then wait for a grant of the current manager."""
    cdef const cxl_region* r = L.r
    cdef uint64_t me = _line(L, id, L.node), g = _grant(L, id)
    cdef uint64_t seq = 0, acq = 0, spins = 0, gw = 0, want, ep = 0, now
    cdef cxl_mgr_watch watch
    cdef int rc = cxl_load64(r, me + 16, &seq)  # our own line: no observe needed
    if rc != 0:
        return rc
    seq += 1
    rc = cxl_store64(r, me + 16, seq)
    if rc == 0:
        rc = cxl_persist(r, me, 64)
    if rc != 0:
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.mgr.request")
    _slot(L, id).seq = seq
    memset(&watch, 0, sizeof(watch))
    watch.ran_ns = cxl_now_ns()
    want = ((<uint64_t>L.node + 1) << 56) | (seq & GRANT_SEQ_MASK)
    while True:
        rc = cxl_observe64(r, g, &gw)
        if rc != 0:
            break
        if (gw & ~(GRANT_EPOCH_MASK << 40)) == want:
            # Fencing, Dekker-style against a takeover (claim store, then a scan of
            # the accepted words): we publish what we accept BEFORE we look at the
            # claim, so either the new manager sees our acceptance and adopts our
            # hold, or we see its epoch and refuse a predecessor's grant.
            rc = cxl_store64(r, me + 40, gw & ACCEPT_MASK)
            if rc == 0:
                rc = cxl_persist(r, me, 64)
            if rc == 0:
                rc = _claim_epoch(L, &ep)
            if rc != 0:
                break
            if ((gw >> 40) & GRANT_EPOCH_MASK) == (ep & GRANT_EPOCH_MASK):
                if cxl_load64(r, me + 32, &acq) == 0:
                    cxl_store64(r, me + 32, acq + 1)
                return 0
        if unlikely((spins & 63) == 63):
            now = cxl_now_ns()
            if now > deadline:
                rc = CXLRT_E_TIMEOUT
                break
            rc = _mgr_watch(L, &watch, now)
            if rc != 0:
                break
        _grant_backoff(&spins)
    # Withdraw: releasing the request also releases a grant that raced the timeout.
    cxl_store64(r, me + 24, seq)
    cxl_persist(r, me, 64)
    return rc


cdef int _mgr_release(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """rel_seq = our request: the manager sees it on its next scan and grants on."""
    cdef uint64_t me = _line(L, id, L.node)
    cdef int rc = cxl_store64(L.r, me + 24, _slot(L, id).seq)
    if rc == 0:
        rc = cxl_persist(L.r, me, 64)
    return rc


ctypedef struct cxl_mgr_lock:
    uint32_t last             # node granted last (round robin starts after it)
    uint32_t held             # node our grant names, + 1 (0: no grant of ours stands)
    uint64_t wrote            # grant word we last published
    uint64_t seq              # the request our grant answers
    int adopted               # the takeover scan of this lock is done


cdef int _mgr_publish(cxl_lockctx* L, uint32_t id, uint64_t epoch, uint64_t w,
                      cxl_mgr_lock* st) noexcept nogil:
    """Write grant word w, unless we were superseded (then CXLRT_E_FENCED, nothing written)."""
    cdef uint64_t ep = 0
    cdef int rc = _claim_epoch(L, &ep)
    if rc != 0:
        return rc
    if ep != epoch:
        return CXLRT_E_FENCED
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.mgr.grant")
    rc = cxl_store64(L.r, _grant(L, id), w)
    if rc == CXLRT_E_COHERENCE and _claim_epoch(L, &ep) == 0 and ep == epoch:
        # A superseded manager's one late store made our copy of the line stale (the
        # emulation refuses a store over it): observe, then store again.
        rc = cxl_observe64(L.r, _grant(L, id), &ep)
        if rc == 0:
            rc = cxl_store64(L.r, _grant(L, id), w)
    if rc == 0:
        rc = cxl_persist(L.r, _grant(L, id), 64)  # the grant: one word, one writer an epoch
    if rc != 0 and _claim_epoch(L, &ep) == 0 and ep != epoch:
        # We were stopped between the check and the store and superseded meanwhile; the
        # emulation refuses our store over a line the new manager wrote: fenced.
        return CXLRT_E_FENCED
    st.wrote = w
    st.held = (w >> 56) & 0xFF
    st.seq = w & GRANT_SEQ_MASK
    return rc


cdef int _mgr_line(cxl_lockctx* L, uint32_t id, uint32_t j, uint64_t* v) noexcept nogil:
    """Node j's (req, rel, acquisitions, accepted) as one snapshot; 1 if a request of a
    live node is in flight (req > rel)."""
    cdef uint64_t off = _line(L, id, j) + 16
    if cxl_observe(L.r, off, v, 32) != 0:
        return 0
    return 1 if v[0] > v[1] and not cxl_node_dead(L, j) else 0


cdef int _mgr_grant(cxl_lockctx* L, uint32_t id, uint64_t epoch, cxl_mgr_lock* st,
                    uint32_t j, uint64_t req) noexcept nogil:
    st.last = j
    return _mgr_publish(L, id, epoch, _grant_word(j, epoch, req), st)


cdef int _mgr_adopt(cxl_lockctx* L, uint32_t id, uint64_t epoch, cxl_mgr_lock* st) noexcept nogil:
    """Takeover: find the node that may hold the lock by the waiters' own accepted words,
    never by the grant word, which a superseded manager may still overwrite.

    A hold is an in-flight request whose accepted word names that request. Among such
    words, the newest epoch wins: a manager grants only after its own adoption scan,
    which (the waiter's Dekker order) saw every older acceptance that became a hold, so
    an older acceptance it did not adopt was refused by its waiter.
    """
    cdef uint64_t v[4]
    cdef uint64_t age, best = GRANT_EPOCH_MASK + 1, req = 0
    cdef uint32_t j, who = 0
    for j in range(L.nodes):
        if _mgr_line(L, id, j, v) and v[3] != 0 and (v[3] & GRANT_SEQ_MASK) == (v[0] & GRANT_SEQ_MASK):
            age = (epoch - (v[3] >> 40)) & GRANT_EPOCH_MASK
            if age < best:
                best, who, req = age, j + 1, v[0]
    st.adopted = 1
    if who:
        # Re-issued in our epoch: a holder goes on; a waiter that refused it accepts now.
        return _mgr_grant(L, id, epoch, st, who - 1, req)
    return 0


cdef int _mgr_step(cxl_lockctx* L, uint32_t id, uint64_t epoch, cxl_mgr_lock* st) noexcept nogil:
    """One manager pass over lock `id`: detect release or death, grant round-robin.
    After it, st.held says whether a grant of ours stands (someone holds or waits).

    Who holds is decided from our own last grant and the holder's line; the grant word
    is only re-read to restore it if a superseded manager overwrote it.
    """
    cdef uint64_t v[4]
    cdef uint64_t gw = 0
    cdef uint32_t d, j
    # Observed every pass, also to keep our copy of the line fresh for the store.
    cdef int rc = cxl_observe64(L.r, _grant(L, id), &gw)
    if rc != 0:
        return rc
    if not st.adopted:
        rc = _mgr_adopt(L, id, epoch, st)
        if rc != 0 or st.held:
            return rc
    if st.held:
        j = st.held - 1
        if _mgr_line(L, id, j, v) and (v[0] & GRANT_SEQ_MASK) == st.seq:
            if gw != st.wrote:
                rc = _mgr_publish(L, id, epoch, st.wrote, st)
            return rc
    for d in range(1, L.nodes + 1):
        j = (st.last + d) % L.nodes
        if _mgr_line(L, id, j, v):
            return _mgr_grant(L, id, epoch, st, j, v[0])
    if st.held or st.wrote:
        return _mgr_publish(L, id, epoch, 0, st)
    return 0


cdef int _mgr_passes(cxl_lockctx* L, uint32_t* ids, uint32_t n, uint64_t epoch,
                     cxl_mgr_lock* st, cxl_mgr_pace* pace, uint64_t for_ns) noexcept nogil:
    """Manager passes over locks ids[:n] for for_ns: back to back, with a yield between,
    for pace.spin_ns after the latest pass that changed a grant; ~20 us sleeps otherwise.

    A sleeping manager answers a request one sleep late (a wake-up is tens of us on a
    VM), so one whose grants are changing hands spins: a handoff then costs a few
    cache-line trips. A long hold changes nothing, so the manager sleeps through it,
    and its release is answered one sleep late. spin_ns = 0 never spins.
    """
    cdef uint64_t now = cxl_now_ns(), until = now + for_ns, wrote
    cdef uint32_t k
    cdef int rc = 0
    while rc == 0 and now < until:
        for k in range(n):
            wrote = st[ids[k]].wrote
            rc = _mgr_step(L, ids[k], epoch, &st[ids[k]])
            if rc != 0:
                return rc
            if st[ids[k]].wrote != wrote:
                pace.changed_at = now
        now = cxl_now_ns()
        if pace.spin_ns and now - pace.changed_at < pace.spin_ns:
            # A yield, not pause instructions: with more runnable threads than cores (the
            # holder, waiters and us on two) a spin leaves the holder's release, and so
            # the handoff, waiting for our time slice to end; with a core to spare it
            # returns at once. Measured here: 16 pauses between passes cost 15% of the
            # handoff rate and 60% more uncontended time than none (perf/README.md).
            sched_yield()
            pace.yields += 1
        else:
            cxl_sleep_ns(20000)
            pace.sleeps += 1
    return rc


# --- both tiers ---------------------------------------------------------------------

cdef int _global_reset(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    """Clear whatever a dead holder of our node left in the global tier."""
    if mode == CXL_LOCK_BAKERY:
        return _bakery_withdraw(L, id)
    cdef uint64_t me = _line(L, id, L.node), req = 0
    cdef int rc = cxl_load64(L.r, me + 16, &req)
    if rc == 0:
        rc = cxl_store64(L.r, me + 24, req)
    if rc == 0:
        rc = cxl_persist(L.r, me, 64)
    return rc


cdef int cxl_lock_acquire(cxl_lockctx* L, uint32_t id, uint32_t mode, uint64_t timeout_ns,
                          int* recovered) noexcept nogil:
    """Take lock `id`: the node-local robust mutex, then the global tier."""
    cdef cxl_local_lock* s = _slot(L, id)
    cdef uint64_t deadline = <uint64_t>-1
    cdef int rc
    if timeout_ns < (<uint64_t>1 << 62):
        deadline = cxl_now_ns() + timeout_ns
    rc = cxl_mutex_trylock(&s.m)  # uncontended: no clock read, no timed wait
    if rc < 0:
        rc = cxl_mutex_timedlock(&s.m, timeout_ns if timeout_ns < (<uint64_t>1 << 62)
                                 else <uint64_t>1 << 62)
    if rc == -ETIMEDOUT:
        return CXLRT_E_TIMEOUT
    if rc < 0:
        return rc
    if rc == 1:
        # The previous holder died: its global state is ours to clear (same node).
        s.recovered += 1
        recovered[0] = 1
        _global_reset(L, id, mode)
        s.global_held = 0
    s.holder_pid = <uint32_t>cxl_pid()
    s.holder_tid = cxl_thread_id()
    if unlikely(cxl_live_fenced(L.live)):
        s.holder_pid = 0
        s.holder_tid = 0
        cxl_mutex_unlock(&s.m)
        return CXLRT_E_FENCED
    s.global_held = 1  # before any global write: a crash from here on is swept
    if mode == CXL_LOCK_BAKERY:
        rc = _bakery_acquire(L, id, deadline)
    else:
        rc = _mgr_acquire(L, id, deadline)
    if rc != 0:
        s.global_held = 0
        s.holder_pid = 0
        s.holder_tid = 0
        cxl_mutex_unlock(&s.m)
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.acquire.held")
    return 0


cdef int cxl_lock_release(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    """Leave the global tier (published), then the node-local mutex.

    A process whose node was taken over by another life writes nothing global:
    the new life cleared our lines and may be using them (CXLRT_E_FENCED).
    """
    cdef cxl_local_lock* s = _slot(L, id)
    cdef int rc
    CXL_ASSERT(cxl_lock_held(L, id, True), b"lock released by a thread that does not hold it")
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.release.before")
    if unlikely(cxl_live_fenced(L.live)):
        rc = CXLRT_E_FENCED
    elif mode == CXL_LOCK_BAKERY:
        rc = _bakery_withdraw(L, id)
    else:
        rc = _mgr_release(L, id)
    s.global_held = 0
    s.holder_pid = 0
    s.holder_tid = 0
    cxl_mutex_unlock(&s.m)
    return rc


cdef int cxl_local_enter(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Take only lock `id`'s node-local mutex: serialises this node's processes
    over state that only this node writes (a KV cache's pin counters), with no
    global tier. 0; 1 when the previous holder died holding it (the caller
    repairs what it guards); or a negative errno."""
    cdef cxl_local_lock* s = _slot(L, id)
    cdef int rc = cxl_mutex_trylock(&s.m)
    if rc < 0:
        rc = cxl_mutex_lock(&s.m)
    if rc < 0:
        return rc
    s.holder_pid = <uint32_t>cxl_pid()
    s.holder_tid = cxl_thread_id()
    return rc


cdef bint cxl_lock_held(cxl_lockctx* L, uint32_t id, bint global_tier) noexcept nogil:
    """Whether this thread holds lock `id`'s node-local mutex (and, with global_tier,
    the global tier too): for the debug build's asserts of `pre: lock held`."""
    cdef cxl_local_lock* s = _slot(L, id)
    return (s.holder_pid == <uint32_t>cxl_pid() and s.holder_tid == cxl_thread_id()
            and (not global_tier or s.global_held != 0))


cdef void cxl_local_exit(cxl_lockctx* L, uint32_t id) noexcept nogil:
    cdef cxl_local_lock* s = _slot(L, id)
    CXL_ASSERT(cxl_lock_held(L, id, False),
               b"node-local mutex left by a thread that does not hold it")
    s.holder_pid = 0
    s.holder_tid = 0
    cxl_mutex_unlock(&s.m)


cdef int _recover_dead_holder(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    """If a dead process of our node holds `id`, clear its hold. 1 if it did."""
    cdef cxl_local_lock* s = _slot(L, id)
    cdef int rc = cxl_mutex_trylock(&s.m)
    if rc < 0:
        return 0  # held by a live thread (or busy): nothing to do
    if rc == 1:
        s.recovered += 1
        _global_reset(L, id, mode)
        s.global_held = 0
        s.holder_pid = 0
        s.holder_tid = 0
    cxl_mutex_unlock(&s.m)
    return rc


cdef int cxl_lock_sweep(void* ctx) noexcept nogil:
    """Give back every hold of a dead process of our node (the heartbeat's sweep).

    Node-local only: a trylock of our own robust mutexes, and on EOWNERDEAD the
    dead holder's lines, which our node alone writes. Never waits on another node.
    """
    cdef cxl_lockctx* L = <cxl_lockctx*>ctx
    cdef cxl_local_lock* s
    cdef uint32_t i, mode = 0
    cdef int n = 0
    for i in range(64):
        s = _slot(L, i)
        if s.holder_pid == 0 and s.global_held == 0:
            continue  # nobody of our node is in this lock: nothing can be stale
        if _observe_mode(L, i, &mode) == 0:
            n += _recover_dead_holder(L, i, mode) == 1
    return n


cdef int _observe_mode(cxl_lockctx* L, uint32_t id, uint32_t* mode) noexcept nogil:
    """The mode of lock record `id`, observed; CXLRT_E_LOCKSTATE if it is not a lock."""
    cdef uint64_t w[2]
    cdef int rc = cxl_observe(L.r, cxl_lock_record(L, id), w, 16)
    if rc != 0:
        return rc
    mode[0] = <uint32_t>w[1]  # the low half of the (mode, name_len) word
    if w[0] != CXL_LOCK_READY or (mode[0] != CXL_LOCK_BAKERY and mode[0] != CXL_LOCK_MANAGER):
        return CXLRT_E_LOCKSTATE
    return 0


# --- Python layer -------------------------------------------------------------------


MODES = {"bakery": CXL_LOCK_BAKERY, "manager": CXL_LOCK_MANAGER}
MODE_NAMES = {v: k for k, v in MODES.items()}
META_NAME = "cxlrt.meta"
ALLOC_NAME = "cxlrt.alloc"
NAME_BYTES = 40
MAX_LOCKS = 64


cdef class LockService:
    """Per-Region lock machinery: node-local lock slots and the lock manager.

    Created on first use by :meth:`cxlrt.Region.lock`; closed with the region.
    The heartbeat belongs to the region's Liveness; this service only installs
    the sweep that gives back dead siblings' holds.
    """

    def __init__(self, Region region, Liveness live):
        self.region = region
        self.live = live
        self.local = live.local
        cdef cxl_region* r = region.backend.region()
        self.L.r = r
        self.L.local = <char*>self.local.locks
        self.L.locks_off = region.sections["locks"][0]
        self.L.nodes_off = region.sections["nodes"][0]
        self.L.live = live.ctx()
        self.L.nodes = region.nodes
        self.L.node = region.node
        self.L.rec_bytes = (region.nodes + 2) * 64
        self.L.lease_ns = <uint64_t>region.lease_ms * 1_000_000
        self.lease_s = region.lease_ms / 1000.0
        self.manager_wait = max(MANAGER_WAIT_S, 2 * self.lease_s)
        self.manager_spin = MANAGER_SPIN_S
        self._modes = {}
        self._closed = False
        self._stop = threading.Event()
        self._mgr_thread = None
        self.mgr_epoch = 0
        self.mgr_exit = None
        live.set_sweep(cxl_lock_sweep, &self.L, self)

    def sweep(self):
        """Give back the holds of dead processes of our node now; how many."""
        with nogil:
            n = cxl_lock_sweep(&self.L)
        return n

    @property
    def manager_wait(self):
        """Seconds a manager-mode acquire waits with no lock manager running before it
        raises NoLockManager (default: 3 s or two leases, the longer)."""
        return self.L.mgr_wait_ns / 1e9

    @manager_wait.setter
    def manager_wait(self, double seconds):
        if not 0 < seconds <= MANAGER_WAIT_MAX_S:
            raise ValueError(f"manager_wait must be > 0 and <= {MANAGER_WAIT_MAX_S:g} "
                             f"seconds, got {seconds}")
        self.L.mgr_wait_ns = <uint64_t>(seconds * 1e9)

    @property
    def manager_spin(self):
        """Seconds our lock manager keeps spinning after a pass that changed a grant,
        before it falls back to ~20 us sleeps (default MANAGER_SPIN_S; 0: always sleep).
        Spinning answers in microseconds instead of tens, for a core while busy."""
        return self._spin_ns / 1e9

    @manager_spin.setter
    def manager_spin(self, double seconds):
        if not 0 <= seconds <= MANAGER_SPIN_MAX_S:
            raise ValueError(f"manager_spin must be 0..{MANAGER_SPIN_MAX_S:g} seconds, "
                             f"got {seconds}")
        self._spin_ns = <uint64_t>(seconds * 1e9)

    def _no_manager(self, str name):
        claim = self._claim()
        who = ("no manager was ever started" if not claim[0] else
               f"the last claim is node {claim[0] - 1}'s (epoch {claim[1]}), which is "
               f"{self.live.state(claim[0] - 1) if claim[0] <= self.L.nodes else 'out of range'} "
               "or has stopped granting")
        return NoLockManager(
            f"lock {name!r} is a manager-mode lock and no lock manager made a pass for "
            f"{self.manager_wait:g} s ({who}): start one with `cxlrt lockmgr SPEC` or "
            "cxlrt.open(..., lock_manager=True)")

    @property
    def lease_gaps(self):
        """Times this process was silent for longer than the lease."""
        return self.live.stats()["gaps"]

    # lock table ------------------------------------------------------------------------
    cdef uint64_t _rec(self, uint32_t i):
        return cxl_lock_record(&self.L, i)

    def _read_header(self, uint32_t i):
        return read_header(self.region, i)

    def _write_header(self, uint32_t i, bytes name, uint32_t mode):
        """Create record i (lock 0 held, or formatting); state is published last."""
        r = self.region
        off = self._rec(i)
        body = mode.to_bytes(4, "little") + len(name).to_bytes(4, "little") + name.ljust(48, b"\0")
        r.flush(off, 64)
        r.store(off + 8, body)
        r.persist(off, 64)
        r.store64(off, CXL_LOCK_READY)
        r.persist(off, 64)

    def find(self, str name):
        """(index, mode) of the lock called `name`, or None."""
        for i in range(MAX_LOCKS):
            h = self._read_header(i)
            if h is not None and h[0] == name:
                return i, h[1]
        return None

    def ensure_builtin(self):
        """Locks 0 (meta) and 1 (alloc) exist from format time; check they do."""
        for i, name in ((CXL_LOCK_META, META_NAME), (CXL_LOCK_ALLOC, ALLOC_NAME)):
            h = self._read_header(i)
            if h is None or h[0] != name:
                raise RegionError(f"{self.region.spec}: built-in lock {name!r} is missing; "
                                  "the region is corrupt (run `cxlrt check`)")
            self._modes[i] = h[1]

    def get(self, str name, mode=None):
        """The Lock called `name`, created with `mode` if it does not exist yet."""
        raw = name.encode("utf-8") if isinstance(name, str) else b""
        if not raw or len(raw) > NAME_BYTES:
            raise ValueError(f"lock name must be 1..{NAME_BYTES} bytes of UTF-8, got {name!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"lock mode must be 'bakery' or 'manager', not {mode!r}")
        found = self.find(name)
        if found is None:
            meta = Lock(self, CXL_LOCK_META, META_NAME, self._modes[CXL_LOCK_META])
            with meta:
                found = self.find(name)  # someone may have created it meanwhile
                if found is None:
                    for i in range(2, MAX_LOCKS):
                        if self._read_header(i) is None:
                            self._write_header(i, raw, MODES[mode or "bakery"])
                            found = (i, MODES[mode or "bakery"])
                            break
                    else:
                        raise RegionError(f"{self.region.spec}: all {MAX_LOCKS - 2} lock "
                                          "records are in use")
        i, m = found
        if mode is not None and MODES[mode] != m:
            raise ValueError(f"lock {name!r} exists in {MODE_NAMES[m]!r} mode; its mode is "
                             f"fixed when it is created (asked for {mode!r})")
        self._modes[i] = m
        return Lock(self, i, name, m)

    def builtin(self, uint32_t i):
        return Lock(self, i, META_NAME if i == CXL_LOCK_META else ALLOC_NAME, self._modes[i])

    # manager -----------------------------------------------------------------------------
    def _claim(self):
        """(node + 1, epoch, incarnation, pid) of the manager claim, observed."""
        r = self.region
        r.flush(self.L.locks_off, 64)
        raw = r.load(self.L.locks_off, 32)
        return tuple(int.from_bytes(raw[i:i + 8], "little") for i in (0, 8, 16, 24))

    def _mgr_area(self, uint32_t node):
        """(mgr_epoch, mgr_beat, mgr_pid) published by node's manager, observed."""
        r = self.region
        off = r.node_area(node) + 64
        r.flush(off, 64)
        raw = r.load(off, 24)
        return tuple(int.from_bytes(raw[i:i + 8], "little") for i in (0, 8, 16))

    def _mgr_running(self, claim):
        """True if the claimed manager is running: its node is alive, it still serves the
        claim's epoch and its pass counter moves within a lease (watched on our clock)."""
        holder, epoch = claim[0], claim[1]
        if not holder or holder > self.L.nodes:
            return False
        node = holder - 1
        if self.live.state(node) != "alive":
            return False
        first = self._mgr_area(node)
        if first[0] != epoch:
            return False  # it stopped (cleanly) or never ran under this claim
        deadline = time.monotonic() + self.lease_s
        while time.monotonic() < deadline:
            time.sleep(min(0.01, self.lease_s / 8))
            now = self._mgr_area(node)
            if now[0] != epoch:
                return False
            if now[1] != first[1]:
                return True
        return False

    def start_manager(self):
        """Claim the lock-manager role and grant in a background thread.

        A claimed manager that still runs (its node alive, its passes counting) is
        never superseded; one that stopped or stalled past a lease is. Taking over
        bumps the epoch, which fences every grant the old manager could still write.
        """
        if self._mgr_thread is not None:
            return
        r = self.region
        claim = self._claim()
        if self._mgr_running(claim):
            raise RegionError(f"a lock manager is already running (node {claim[0] - 1}, "
                              f"pid {claim[3]}); only one may write the grant lines")
        with self.builtin(CXL_LOCK_META) as meta:
            now = self._claim()
            if now != claim and self._mgr_running(now):
                raise RegionError(f"a lock manager started meanwhile (node {now[0] - 1}, "
                                  f"pid {now[3]})")
            meta.check()  # a lease lost while we watched: do not write the claim
            epoch = (now[1] + 1) & 0xFFFFFFFFFFFFFFFF or 1
            off = self.L.locks_off
            r.store64(off + 8, epoch)
            r.store64(off + 16, self.live.incarnation)
            r.store64(off + 24, os.getpid())
            r.store64(off, r.node + 1)
            r.persist(off, 64)  # the claim: one line, written only under lock 0
        self.mgr_epoch = epoch
        self.mgr_exit = None
        memset(&self._pace, 0, sizeof(cxl_mgr_pace))
        self._mgr_beat(epoch)
        self._mgr_thread = threading.Thread(target=self._mgr_loop, args=(epoch,), daemon=True,
                                            name="cxlrt-lockmgr")
        self._mgr_thread.start()

    def _mgr_beat(self, uint64_t epoch):
        """Publish our manager's epoch and a new pass count in our own node area."""
        r = self.region
        off = r.node_area(r.node) + 64
        r.store64(off, epoch)
        r.store64(off + 8, (r.load64(off + 8) + 1) & 0xFFFFFFFFFFFFFFFF)
        r.store64(off + 16, os.getpid())
        r.persist(off, 64)

    def _mgr_loop(self, uint64_t epoch):
        cdef cxl_mgr_lock st[64]
        cdef uint32_t ids[64]
        cdef uint32_t n = 0
        cdef int rc = 0
        memset(st, 0, sizeof(st))
        # An idle pass sleeps ~20 us; the default 50 us timer slack would stretch it.
        cxl_set_timerslack_1ns()
        while not self._stop.is_set():
            try:
                if self._claim()[1] != epoch:
                    self.mgr_exit = "superseded by another manager"
                    return
                n = 0
                for i in range(MAX_LOCKS):
                    h = self._read_header(i)
                    if h is not None and h[1] == CXL_LOCK_MANAGER:
                        ids[n] = i
                        n += 1
                self._mgr_beat(epoch)
            except RegionError as e:
                self.mgr_exit = str(e)
                return
            self._pace.spin_ns = self._spin_ns
            with nogil:
                rc = _mgr_passes(&self.L, ids, n, epoch, st, &self._pace, 100_000_000)
            if rc == CXLRT_E_FENCED:
                self.mgr_exit = "superseded by another manager"
                return
            if rc != 0:
                self.mgr_exit = name_of(rc)
                return

    def stop_manager(self):
        """Stop granting; claimants take over at once (our node area says we stopped)."""
        t = self._mgr_thread
        if t is not None:
            self._stop.set()
            t.join()
            self._mgr_thread = None
            if not self.region.closed:
                r = self.region
                off = r.node_area(r.node) + 64
                r.store64(off, 0)
                r.persist(off, 64)
            if not self._closed:
                self._stop = threading.Event()
            self.mgr_epoch = 0

    def manager_info(self):
        """The claimed manager: node, pid, epoch, and whether it is running now."""
        claim = self._claim()
        if not claim[0]:
            return None
        info = {"node": claim[0] - 1, "pid": claim[3], "epoch": claim[1],
                "running": self._mgr_running(claim)}
        if self._mgr_thread is not None:  # ours: how it paces itself (read racily)
            info.update(spin=self._pace.spin_ns / 1e9, yields=self._pace.yields,
                        sleeps=self._pace.sleeps)
        return info

    def node_dead(self, uint32_t j):
        return bool(cxl_node_dead(&self.L, j))

    def close(self):
        if self._closed:
            return
        self.stop_manager()
        self._closed = True
        self._stop.set()
        self.live.set_sweep(NULL, NULL, None)


cdef class Lock:
    """A named cross-node lock (see :meth:`cxlrt.Region.lock`).

    ``with lock:``, ``acquire(timeout=None) -> bool``, ``release()``,
    ``locked()``. Not re-entrant: a thread that already holds it gets
    RuntimeError instead of a deadlock.
    """

    def __init__(self, LockService svc, uint32_t index, str name, uint32_t mode):
        self.svc = svc
        self.index = index
        self.name = name
        self._mode = mode
        self.recovered = False
        self._t0 = 0

    @property
    def mode(self):
        return MODE_NAMES[self._mode]

    def acquire(self, timeout=None):
        """Block until held (True), or until `timeout` seconds pass (False)."""
        cdef cxl_local_lock* s = _slot(&self.svc.L, self.index)
        cdef uint64_t t = <uint64_t>-1 if timeout is None else <uint64_t>(max(0.0, timeout) * 1e9)
        cdef uint64_t t0
        cdef int rc, rec = 0
        if s.holder_tid == cxl_thread_id() and s.holder_pid == <uint32_t>cxl_pid():
            raise RuntimeError(f"lock {self.name!r} is already held by this thread "
                               "(cxlrt locks are not re-entrant)")
        self.svc.region.backend.region()  # raises if the region is closed
        with nogil:
            if cxl_live_remaining_ns(self.svc.L.live) < 0:
                # We were stalled and the beat thread has not run since: before we
                # write as our node, make sure no other life took the node over.
                cxl_live_verify(self.svc.L.live)
            t0 = cxl_now_ns()  # a silence while we wait in the queue counts too
            rc = cxl_lock_acquire(&self.svc.L, self.index, self._mode, t, &rec)
        self.recovered = bool(rec)
        if rc == CXLRT_E_TIMEOUT:
            return False
        if rc == CXLRT_E_NOMANAGER:
            raise self.svc._no_manager(self.name)
        if rc == CXLRT_E_FENCED:
            raise LeaseLost(f"lock {self.name!r}: node {self.svc.L.node} was taken over by "
                            "another process group while this one was silent; this process "
                            "may no longer act as the node")
        self.svc.region._rc(rc, f"acquire {self.name!r}", 0, 0)
        self._t0 = t0
        return True

    def release(self):
        """Release; LeaseLost if this process was silent past its lease at any time since
        its acquire began (other nodes may have held the lock meanwhile)."""
        cdef cxl_local_lock* s = _slot(&self.svc.L, self.index)
        cdef int rc, silent
        if s.holder_tid != cxl_thread_id() or s.holder_pid != <uint32_t>cxl_pid():
            raise RuntimeError(f"lock {self.name!r} is not held by this thread")
        with nogil:
            # Judged before and after we publish the release: a gap that is still
            # open (we just resumed) is visible to our own clock even if the beat
            # thread has not run since, and a stall inside the release counts too.
            silent = cxl_live_silent_since(self.svc.L.live, self._t0)
            rc = cxl_lock_release(&self.svc.L, self.index, self._mode)
            silent = silent or cxl_live_silent_since(self.svc.L.live, self._t0)
        if rc != CXLRT_E_FENCED:
            self.svc.region._rc(rc, f"release {self.name!r}", 0, 0)
        if silent or rc == CXLRT_E_FENCED:
            raise LeaseLost(f"lock {self.name!r}: this process was silent for longer than "
                            f"the {self.svc.lease_s} s lease while holding or waiting for "
                            "it; another node may have held it at the same time")

    def check(self):
        """Seconds of validity left to this hold; LeaseLost if it is already suspect.

        A long critical section calls this before it publishes: if the answer is
        smaller than the time its next write takes, stop. The figure assumes the
        heartbeat keeps beating; a stall after this call is caught by release().
        """
        cdef cxl_local_lock* s = _slot(&self.svc.L, self.index)
        if s.holder_tid != cxl_thread_id() or s.holder_pid != <uint32_t>cxl_pid():
            raise RuntimeError(f"lock {self.name!r} is not held by this thread")
        if cxl_live_silent_since(self.svc.L.live, self._t0):
            raise LeaseLost(f"lock {self.name!r}: this process was silent for longer than "
                            f"the {self.svc.lease_s} s lease since it began to acquire it")
        return max(0.0, cxl_live_remaining_ns(self.svc.L.live) / 1e9)

    def locked(self):
        """True if some node holds (or is taking) the lock right now."""
        r = self.svc.region
        rec = cxl_lock_record(&self.svc.L, self.index)
        if self._mode == CXL_LOCK_MANAGER:
            g = rec + 64 * (1 + self.svc.L.nodes)
            r.flush(g, 64)
            gw = r.load64(g)
            gn, gs = gw >> 56, gw & ((1 << 40) - 1)
            if not gn or gn > self.svc.L.nodes:
                return False
            ln = rec + 64 * gn
            r.flush(ln, 64)
            req, rel = r.load64(ln + 16), r.load64(ln + 24)
            return req > rel and req & ((1 << 40) - 1) == gs
        for j in range(self.svc.L.nodes):
            ln = rec + 64 * (1 + j)
            r.flush(ln, 64)
            if r.load64(ln + 8):
                return True
        return False

    def held_by_me(self):
        cdef cxl_local_lock* s = _slot(&self.svc.L, self.index)
        return s.holder_tid == cxl_thread_id() and s.holder_pid == <uint32_t>cxl_pid()

    def acquisitions(self):
        """Global acquisitions per node, as published on each node's line."""
        r = self.svc.region
        rec = cxl_lock_record(&self.svc.L, self.index)
        out = []
        for j in range(self.svc.L.nodes):
            ln = rec + 64 * (1 + j)
            r.flush(ln, 64)
            out.append(r.load64(ln + 32))
        return out

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()

    def __repr__(self):
        return f"<cxlrt.Lock {self.name!r} #{self.index} {self.mode}>"


def builtin_headers(unsigned long long locks_off, int nodes):
    """(offset, bytes) of the built-in lock headers a new region starts with."""
    out = []
    for i, name in ((CXL_LOCK_META, META_NAME), (CXL_LOCK_ALLOC, ALLOC_NAME)):
        raw = name.encode()
        body = (CXL_LOCK_READY.to_bytes(8, "little") + CXL_LOCK_BAKERY.to_bytes(4, "little")
                + len(raw).to_bytes(4, "little") + raw.ljust(48, b"\0"))
        out.append((locks_off + 64 + i * (nodes + 2) * 64, body))
    return out


def forget_node_lines(region):
    """A new life of our node: withdraw every ticket and request its lines still show,
    and the manager role it ran. No process of this life holds or waits on anything
    yet (the caller holds the node-local flock), and the lines are ours alone."""
    node = region.node
    for i in range(MAX_LOCKS):
        try:
            h = read_header(region, i)
        except RegionError:
            continue  # a corrupt record is `cxlrt check`'s to report
        if h is None:
            continue
        ln = record_offset(region, i) + 64 * (1 + node)
        region.flush(ln, 64)
        if h[1] == CXL_LOCK_BAKERY:
            region.store64(ln, 0)
            region.store64(ln + 8, 0)
        else:
            region.store64(ln + 24, region.load64(ln + 16))
        region.persist(ln, 64)
    off = region.node_area(node) + 64
    region.flush(off, 64)
    region.store64(off, 0)  # mgr_epoch: no manager runs in the new life
    region.persist(off, 64)


def _reset_node_line(LockService svc, uint32_t i, uint32_t mode):
    """Clear this node's line of lock i (repair, running as a dead node). True if busy."""
    r = svc.region
    ln = cxl_lock_record(&svc.L, i) + 64 * (1 + svc.L.node)
    r.flush(ln, 64)
    raw = r.load(ln, 32)
    choosing, number, req, rel = (int.from_bytes(raw[k:k + 8], "little") for k in (0, 8, 16, 24))
    busy = (number or choosing) if mode == CXL_LOCK_BAKERY else req > rel
    cdef int rc
    if busy:
        with nogil:
            rc = _global_reset(&svc.L, i, mode)
        check_rc(rc, "repair")
    return bool(busy)


def record_offset(region, uint32_t i):
    """Offset of lock record i in `region` (no LockService needed)."""
    return region.sections["locks"][0] + 64 + i * (region.nodes + 2) * 64


def read_header(region, uint32_t i):
    """(name, mode) of lock record i, observed, or None if the record is free."""
    off = record_offset(region, i)
    region.flush(off, 64)
    raw = region.load(off, 64)
    state = int.from_bytes(raw[0:8], "little")
    mode = int.from_bytes(raw[8:12], "little")
    n = int.from_bytes(raw[12:16], "little")
    if state != CXL_LOCK_READY:
        return None
    if n > NAME_BYTES or mode not in MODE_NAMES:
        raise RegionError(f"lock record {i} is corrupt (mode {mode}, name length {n})")
    return raw[16:16 + n].decode("utf-8", "replace"), mode
