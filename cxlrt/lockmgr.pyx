# cython: language_level=3
"""The lock manager over the backend contract (see lockmgr.pxd and lock.pxd).

The waiter's side (request, accept, release) and the manager's passes (adopt on
takeover, detect release or death, grant round-robin), fenced by the claim's epoch.
"""

from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from cxlrt.backend cimport (cxl_load64, cxl_observe, cxl_observe64, cxl_persist, cxl_region,
                            cxl_store64)
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport (cxl_atomic_load_acquire32, cxl_cpu_relax, cxl_now_ns,
                                    unlikely)
from cxlrt.includes.thread cimport cxl_sleep_ns
from cxlrt.layout cimport (CXL_LINE_SIZE, cxl_claim_epoch, cxl_ln_accepted, cxl_ln_acq, cxl_ln_rel,
                           cxl_ln_req, cxl_lock_node_line, cxl_mgr_area_off, cxl_mgr_beat,
                           cxl_mgr_claim)
from cxlrt.liveness cimport cxl_live_fenced, cxl_node_gone
from cxlrt.lockctx cimport (CXL_DEAD_CHECK_NS, cxl_lock_grant, cxl_lock_line,
                            cxl_lock_slot, cxl_lockctx, cxl_node_dead)
from cxlrt.status cimport (CXLRT_E_CLOSED, CXLRT_E_COHERENCE, CXLRT_E_FENCED, CXLRT_E_NOMANAGER,
                          CXLRT_E_TIMEOUT)

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef uint64_t GRANT_EPOCH_MASK = 0xFFFF
# A waiter's accepted word (its line's `accepted`): the grant it took, less the node byte.
cdef uint64_t ACCEPT_MASK = (<uint64_t>1 << 56) - 1

cdef int* _armed = cxl_crash_armed_ptr()
cdef int WITHDRAW_TRIES = 3


cdef inline uint64_t _grant_word(uint64_t node, uint64_t epoch, uint64_t seq) noexcept nogil:
    """The grant as ONE 8-byte word (lockmgr.pxd)."""
    return ((node + 1) << 56) | ((epoch & GRANT_EPOCH_MASK) << 40) | cxl_grant_seq(seq)


cdef inline int _claim_epoch(cxl_lockctx* L, uint64_t* epoch) noexcept nogil:
    """Observe the manager claim's epoch (written only by a takeover, under lock 0)."""
    return cxl_observe64(L.r, cxl_claim_epoch(L.locks_off), epoch)


# --- the waiter's side ------------------------------------------------------------------

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
    cdef cxl_mgr_claim c
    cdef uint64_t m, beat = 0
    cdef uint64_t mw[3]  # the manager's words: mgr_epoch, then beat and pid (layout.pxd)
    if now < w.next_ns:
        return 0
    w.next_ns = now + CXL_DEAD_CHECK_NS
    if cxl_observe(L.r, L.locks_off, &c, sizeof(c)) == 0 \
            and c.node_plus1 != 0 and c.node_plus1 <= L.nodes \
            and not cxl_node_gone(L.live, c.node_plus1 - 1):
        m = cxl_mgr_area_off(L.nodes_off, c.node_plus1 - 1)
        # One observe of both words: a second load could hit a copy that the line's
        # write-back made stale in between (the emulation's checker says so).
        if cxl_observe(L.r, m, mw, sizeof(mw)) == 0 and mw[0] == c.epoch:
            beat = mw[(cxl_mgr_beat(m) - m) // sizeof(uint64_t)]
            if w.claim == c.node_plus1 and w.epoch == c.epoch and w.beat != beat:
                w.ran_ns = now
            w.claim, w.epoch, w.beat = c.node_plus1, c.epoch, beat
    if now - w.ran_ns > L.mgr_wait_ns:
        return CXLRT_E_NOMANAGER
    return 0


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


cdef int cxl_mgr_acquire(cxl_lockctx* L, uint32_t id, uint64_t deadline) noexcept nogil:
    """Publish a request on our line, then wait for a grant of the current manager."""
    cdef const cxl_region* r = L.r
    cdef uint64_t me = cxl_lock_line(L, id, L.node), g = cxl_lock_grant(L, id)
    cdef uint64_t seq = 0, acq = 0, spins = 0, gw = 0, want, ep = 0, now
    cdef cxl_mgr_watch watch
    cdef int rc = cxl_load64(r, cxl_ln_req(me), &seq)  # our own line: no observe needed
    if rc != 0:
        return rc
    seq += 1
    rc = cxl_store64(r, cxl_ln_req(me), seq)
    if rc == 0:
        rc = cxl_persist(r, me, CXL_LINE_SIZE)
    if rc != 0:
        # The request may have landed (in our view, to be written back later, or on
        # the medium with its answer lost): the manager would grant it to nobody.
        _withdraw(L, id)
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.mgr.request")
    cxl_lock_slot(L, id).seq = seq
    memset(&watch, 0, sizeof(watch))
    watch.ran_ns = cxl_now_ns()
    want = _grant_word(L.node, 0, seq)
    while True:
        rc = cxl_observe64(r, g, &gw)
        if rc != 0:
            break
        if (gw & ~(GRANT_EPOCH_MASK << 40)) == want:
            # Fencing, Dekker-style against a takeover (claim store, then a scan of
            # the accepted words): we publish what we accept BEFORE we look at the
            # claim, so either the new manager sees our acceptance and adopts our
            # hold, or we see its epoch and refuse a predecessor's grant.
            rc = cxl_store64(r, cxl_ln_accepted(me), gw & ACCEPT_MASK)
            if rc == 0:
                rc = cxl_persist(r, me, CXL_LINE_SIZE)
            if rc == 0:
                rc = _claim_epoch(L, &ep)
            if rc != 0:
                break
            if ((gw >> 40) & GRANT_EPOCH_MASK) == (ep & GRANT_EPOCH_MASK):
                # Our own line, our own statistics: published with the release.
                if cxl_load64(r, cxl_ln_acq(me), &acq) == 0:
                    cxl_store64(r, cxl_ln_acq(me), acq + 1)
                return 0
        if unlikely((spins & 63) == 63):
            if cxl_atomic_load_acquire32(&L.closing):  # leave while the mapping lives
                rc = CXLRT_E_CLOSED
                break
            now = cxl_now_ns()
            if now > deadline:
                rc = CXLRT_E_TIMEOUT
                break
            rc = _mgr_watch(L, &watch, now)
            if rc != 0:
                break
        _grant_backoff(&spins)
    # Withdraw: releasing the request also releases a grant that raced the timeout.
    _withdraw(L, id)
    return rc


cdef void _withdraw(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """cxl_mgr_withdraw, said again where the medium fails (its stores are idempotent):
    a request left on our line is granted to nobody and holds every other node back
    for as long as our node lives. Not once another life has our node (its line)."""
    cdef int tries
    for tries in range(WITHDRAW_TRIES):
        if cxl_live_fenced(L.live) or cxl_mgr_withdraw(L, id) == 0:
            return


cdef int cxl_mgr_release(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """rel_seq = our request: the manager sees it on its next scan and grants on."""
    cdef uint64_t me = cxl_lock_line(L, id, L.node)
    cdef int rc = cxl_store64(L.r, cxl_ln_rel(me), cxl_lock_slot(L, id).seq)
    if rc == 0:
        rc = cxl_persist(L.r, me, CXL_LINE_SIZE)
    return rc


cdef int cxl_mgr_withdraw(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """rel_seq = req_seq on our line: whatever request we made is released (a timeout,
    or a dead holder of our node that left one)."""
    cdef uint64_t me = cxl_lock_line(L, id, L.node), req = 0
    cdef int rc = cxl_load64(L.r, cxl_ln_req(me), &req)
    if rc == 0:
        rc = cxl_store64(L.r, cxl_ln_rel(me), req)
    if rc == 0:
        rc = cxl_persist(L.r, me, CXL_LINE_SIZE)
    return rc


# --- the manager's side ----------------------------------------------------------------

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
    rc = cxl_store64(L.r, cxl_lock_grant(L, id), w)
    if rc == CXLRT_E_COHERENCE and _claim_epoch(L, &ep) == 0 and ep == epoch:
        # A superseded manager's one late store made our copy of the line stale (the
        # emulation refuses a store over it): observe, then store again.
        rc = cxl_observe64(L.r, cxl_lock_grant(L, id), &ep)
        if rc == 0:
            rc = cxl_store64(L.r, cxl_lock_grant(L, id), w)
    if rc == 0:
        rc = cxl_persist(L.r, cxl_lock_grant(L, id), CXL_LINE_SIZE)  # the grant: one word, one writer an epoch
    if rc != 0 and _claim_epoch(L, &ep) == 0 and ep != epoch:
        # We were stopped between the check and the store and superseded meanwhile; the
        # emulation refuses our store over a line the new manager wrote: fenced.
        return CXLRT_E_FENCED
    st.wrote = w
    st.held = <uint32_t>cxl_grant_node1(w)
    st.seq = cxl_grant_seq(w)
    return rc


cdef int _mgr_line(cxl_lockctx* L, uint32_t id, uint32_t j, cxl_lock_node_line* v) noexcept nogil:
    """Node j's line as one snapshot; 1 if a request of a live node is in flight
    (req_seq > rel_seq)."""
    if cxl_observe(L.r, cxl_lock_line(L, id, j), v, sizeof(v[0])) != 0:
        return 0
    return 1 if v.req_seq > v.rel_seq and not cxl_node_dead(L, j) else 0


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
    cdef cxl_lock_node_line v
    cdef uint64_t age, best = GRANT_EPOCH_MASK + 1, req = 0
    cdef uint32_t j, who = 0
    for j in range(L.nodes):
        if _mgr_line(L, id, j, &v) and v.accepted != 0 \
                and cxl_grant_seq(v.accepted) == cxl_grant_seq(v.req_seq):
            age = (epoch - (v.accepted >> 40)) & GRANT_EPOCH_MASK
            if age < best:
                best, who, req = age, j + 1, v.req_seq
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
    cdef cxl_lock_node_line v
    cdef uint64_t gw = 0
    cdef uint32_t d, j
    # Observed every pass, also to keep our copy of the line fresh for the store.
    cdef int rc = cxl_observe64(L.r, cxl_lock_grant(L, id), &gw)
    if rc != 0:
        return rc
    if not st.adopted:
        rc = _mgr_adopt(L, id, epoch, st)
        if rc != 0 or st.held:
            return rc
    if st.held:
        j = st.held - 1
        if _mgr_line(L, id, j, &v) and cxl_grant_seq(v.req_seq) == st.seq:
            if gw != st.wrote:
                rc = _mgr_publish(L, id, epoch, st.wrote, st)
            return rc
    for d in range(1, L.nodes + 1):
        j = (st.last + d) % L.nodes
        if _mgr_line(L, id, j, &v):
            return _mgr_grant(L, id, epoch, st, j, v.req_seq)
    if st.held or st.wrote:
        return _mgr_publish(L, id, epoch, 0, st)
    return 0


cdef int cxl_mgr_passes(cxl_lockctx* L, uint32_t* ids, uint32_t n, uint64_t epoch,
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
