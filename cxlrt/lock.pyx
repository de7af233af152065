# cython: language_level=3
"""Two-tier cross-node locks over the backend contract (see lock.pxd).

Tier 1 is a robust process-shared mutex in node-local memory; tier 2 is either
Lamport's bakery (bakery.pxd: loads and stores only, each node writing its own line)
or a lock manager that grants round-robin by writing one grant line (lockmgr.pyx).
This module holds the entry points that take both tiers, the recovery of a dead
holder of our node, and the Python layer (LockService, Lock, the lock table).
"""

import os
import threading
import time

from libc.errno cimport EBUSY, ETIMEDOUT
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy, memset

from cxlrt.backend cimport cxl_observe, cxl_region
from cxlrt.bakery cimport cxl_bakery_acquire, cxl_bakery_release
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport (CXL_ASSERT, cxl_atomic_load_acquire32,
                                    cxl_atomic_store_release32, cxl_fence_sc, cxl_now_ns,
                                    cxl_pid, unlikely)
from cxlrt.includes.mutex cimport (cxl_mutex_timedlock, cxl_mutex_trylock, cxl_mutex_unlock,
                                   pthread_mutex_t)
from cxlrt.includes.thread cimport cxl_set_timerslack_1ns
from cxlrt.layout cimport (CXL_LINE_SIZE, CXL_LOCK_NAME, CXL_MAX_LOCKS, cxl_ln_acq,
                           cxl_ln_choosing, cxl_ln_number, cxl_ln_rel, cxl_ln_req,
                           cxl_lock_grant_off, cxl_lock_header, cxl_lock_line_off,
                           cxl_lock_node_line, cxl_lock_record_off, cxl_mgr_area_off,
                           cxl_mgr_beat, cxl_mgr_claim, cxl_mgr_pid)
from cxlrt.liveness cimport (Liveness, cxl_live_fenced, cxl_live_remaining_ns,
                             cxl_live_silent_since, cxl_live_verify)
from cxlrt.lockctx cimport CXL_HELD_SLOTS, cxl_lock_line, cxl_lock_slot
from cxlrt.lockmgr cimport (cxl_grant_node1, cxl_grant_seq, cxl_mgr_acquire, cxl_mgr_lock,
                            cxl_mgr_passes, cxl_mgr_release, cxl_mgr_withdraw)
from cxlrt.nodelocal cimport NodeLocal, cxl_local_lock
from cxlrt.region cimport Region
from cxlrt.status cimport (CXLRT_E_CLOSED, CXLRT_E_FENCED, CXLRT_E_LOCKSTATE, CXLRT_E_NOMANAGER,
                           CXLRT_E_TIMEOUT,
                           check_rc)

from cxlrt.errors import LeaseLost, LockTimeout, NoLockManager, RegionError
from cxlrt.status import name_of

cdef extern from "cxl_intrin.h" nogil:
    uint32_t cxl_thread_id()

cdef int* _armed = cxl_crash_armed_ptr()

# A waiter for the node-local mutex looks up this often to see whether its region is
# closing (the holder may be another process of the node, which our close cannot wake).
cdef uint64_t LOCAL_SLICE_NS = 20_000_000

# Tries of a bakery release whose medium access failed (cxl_lock_release).
cdef int RELEASE_TRIES = 3


# A manager-mode waiter gives up once no manager has made a pass for this long, or two
# leases if longer (a standby takes a stalled manager over after one lease).
MANAGER_WAIT_S = 3.0

# A lock manager spins (a yield between passes) for this long after each pass that changed
# a grant, then sleeps ~20 us a pass: microsecond handoffs while grants change hands, an
# idle core through long holds and quiet spells.
MANAGER_SPIN_S = 0.002
MANAGER_SPIN_MAX_S = 3600.0  # and no inf: seconds become a 64-bit count of ns
MANAGER_WAIT_MAX_S = 1e6


# --- both tiers ---------------------------------------------------------------------

cdef int _global_reset(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    """Clear whatever a dead holder of our node left in the global tier."""
    if mode == CXL_LOCK_BAKERY:
        return cxl_bakery_release(L, id)
    return cxl_mgr_withdraw(L, id)


cdef int cxl_local_mutex_enter(cxl_lockctx* L, pthread_mutex_t* m, uint32_t idx,
                               uint64_t deadline, bint mark) noexcept nogil:
    """Take a node-local mutex of this service's mapping (lock slot idx's, or the
    node heap's at CXL_HELD_HEAP) for this thread: 0; 1 when the previous holder
    died; or an error (CXLRT_E_CLOSED once Region.close() has begun), and then
    nothing is held. The wait is sliced, so a close makes it leave even when the
    holder is another process of the node. `mark`: record this thread in L.held now
    (a two-tier lock does so only once its global tier is held too: a waiter there
    holds nothing a closer should wait for). The mapping itself outlives close() for
    as long as a user of it does (NodeLocal.close), so a section that ends after a
    close lets go of the real mutex."""
    cdef uint64_t now, left
    cdef int rc
    if unlikely(cxl_atomic_load_acquire32(&L.closing)):
        return CXLRT_E_CLOSED
    rc = cxl_mutex_trylock(m)  # uncontended: no clock read, no timed wait
    while rc < 0:
        if rc != -EBUSY and rc != -ETIMEDOUT:
            break
        if unlikely(cxl_atomic_load_acquire32(&L.closing)):
            rc = CXLRT_E_CLOSED
            break
        now = cxl_now_ns()
        if now >= deadline:
            rc = CXLRT_E_TIMEOUT
            break
        left = deadline - now
        rc = cxl_mutex_timedlock(m, left if left < LOCAL_SLICE_NS else LOCAL_SLICE_NS)
    if rc >= 0 and mark:
        L.held[idx] = cxl_thread_id()
    return rc


cdef void cxl_local_mutex_exit(cxl_lockctx* L, pthread_mutex_t* m, uint32_t idx) noexcept nogil:
    L.held[idx] = 0
    cxl_mutex_unlock(m)


cdef int cxl_lock_acquire(cxl_lockctx* L, uint32_t id, uint32_t mode, uint64_t timeout_ns,
                          int* recovered) noexcept nogil:
    """Take lock `id`: the node-local robust mutex, then the global tier."""
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    cdef uint64_t deadline = <uint64_t>-1
    cdef int rc
    if timeout_ns < (<uint64_t>1 << 62):
        deadline = cxl_now_ns() + timeout_ns
    rc = cxl_local_mutex_enter(L, &s.m, id, deadline, False)
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
    s.repair = 0  # a two-tier lock's holder repairs nothing: a sweep's mark is moot
    if unlikely(cxl_live_fenced(L.live)):
        s.holder_pid = 0
        s.holder_tid = 0
        cxl_local_mutex_exit(L, &s.m, id)
        return CXLRT_E_FENCED
    s.global_held = 1  # before any global write: a crash from here on is swept
    if unlikely(cxl_atomic_load_acquire32(&L.closing)):
        rc = CXLRT_E_CLOSED
    elif mode == CXL_LOCK_BAKERY:
        rc = cxl_bakery_acquire(L, id, deadline)
    else:
        rc = cxl_mgr_acquire(L, id, deadline)
    if rc != 0:
        # The acquire withdrew what it published (a timeout, a close, a failure), but a
        # medium that kept failing may have left it on our line (the ticket or the
        # request): the sweep withdraws again, as for a release that could not land
        # (idempotent, so also where the withdrawal landed). Not once fenced.
        s.global_held = 0 if rc == CXLRT_E_FENCED else 1
        s.holder_pid = 0
        s.holder_tid = 0
        cxl_local_mutex_exit(L, &s.m, id)
        return rc
    L.held[id] = cxl_thread_id()
    cxl_fence_sc()  # held, then closing; Region.close() stores closing, then reads held
    if unlikely(cxl_atomic_load_acquire32(&L.closing)):
        L.held[id] = 0  # a hold that would outlive the close: given back at once
        rc = _leave(L, id, mode)
        s.global_held = 0 if rc == 0 else 1  # not landed: the close's sweep says it again
        s.holder_pid = 0
        s.holder_tid = 0
        cxl_local_mutex_exit(L, &s.m, id)
        return CXLRT_E_CLOSED
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.acquire.held")
    return 0


cdef inline int _leave(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    return cxl_bakery_release(L, id) if mode == CXL_LOCK_BAKERY else cxl_mgr_release(L, id)


cdef int cxl_lock_release(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    """Leave the global tier (published), then the node-local mutex.

    A process whose node was taken over by another life writes nothing global:
    the new life cleared our lines and may be using them (CXLRT_E_FENCED).
    """
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    cdef int rc
    CXL_ASSERT(cxl_lock_held(L, id, True), b"lock released by a thread that does not hold it")
    if unlikely(_armed[0]):
        cxl_crash_hit(b"lock.release.before")
    if unlikely(cxl_live_fenced(L.live)):
        rc = CXLRT_E_FENCED
    else:
        # Leaving is idempotent stores to our own line (a ticket and `choosing`, or
        # rel_seq): where the medium fails one, say again. A ticket or a request left
        # behind would hold every other node back for as long as our node lives. Not
        # once another life has our node: the line is its now (a failing access can
        # outlast the lease).
        rc = _leave(L, id, mode)
        for _ in range(RELEASE_TRIES - 1):
            if rc == 0:
                break
            if cxl_live_fenced(L.live):
                rc = CXLRT_E_FENCED
                break
            rc = _leave(L, id, mode)
    # Still failing: our line may still show the hold. global_held stays set, so the
    # heartbeat's sweep says the leave again, under the node-local mutex, until it lands.
    s.global_held = 1 if rc != 0 and rc != CXLRT_E_FENCED else 0
    s.holder_pid = 0
    s.holder_tid = 0
    cxl_local_mutex_exit(L, &s.m, id)
    return rc


cdef inline int _local_took(cxl_local_lock* s, int rc) noexcept nogil:
    # The dead holder's mark stays until a taker has repaired: the sweep may have
    # taken EOWNERDEAD first, and a taker whose repair failed lets the mutex go.
    if rc == 1:
        s.repair = 1
    if rc >= 0:
        s.holder_pid = <uint32_t>cxl_pid()
        s.holder_tid = cxl_thread_id()
        if s.repair:
            rc = 1
    return rc


cdef void cxl_local_needs_repair(cxl_lockctx* L, uint32_t id, bint yes) noexcept nogil:
    """Whether what lock `id`'s node-local mutex guards needs its next taker to repair
    it (mutex held): no once the taker has, yes when a holder's update failed
    part-way."""
    CXL_ASSERT(cxl_lock_held(L, id, False), b"repair marked by a thread that does not hold it")
    cxl_lock_slot(L, id).repair = yes


cdef int cxl_local_enter(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Take only lock `id`'s node-local mutex: serialises this node's processes
    over state that only this node writes (a KV cache's pin counters), with no
    global tier. 0; 1 when a holder died holding it and nobody has repaired what
    it guards since (the caller repairs it, then calls cxl_local_needs_repair); or a
    negative error (CXLRT_E_CLOSED once the region is closing)."""
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    return _local_took(s, cxl_local_mutex_enter(L, &s.m, id, <uint64_t>-1, True))


cdef int cxl_local_try_enter(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """cxl_local_enter if the mutex is free this instant, without waiting: -EBUSY
    when another thread (or this one) holds it."""
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    cdef int rc = CXLRT_E_CLOSED if cxl_atomic_load_acquire32(&L.closing) \
        else cxl_mutex_trylock(&s.m)
    if rc >= 0:
        L.held[id] = cxl_thread_id()
    return _local_took(s, rc)


cdef bint cxl_lock_held(cxl_lockctx* L, uint32_t id, bint global_tier) noexcept nogil:
    """Whether this thread holds lock `id`'s node-local mutex (and, with global_tier,
    the global tier too): for the debug build's asserts of `pre: lock held`."""
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    return (s.holder_pid == <uint32_t>cxl_pid() and s.holder_tid == cxl_thread_id()
            and (not global_tier or s.global_held != 0))


cdef void cxl_local_exit(cxl_lockctx* L, uint32_t id) noexcept nogil:
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    CXL_ASSERT(cxl_lock_held(L, id, False),
               b"node-local mutex left by a thread that does not hold it")
    s.holder_pid = 0
    s.holder_tid = 0
    cxl_local_mutex_exit(L, &s.m, id)


cdef int _recover_dead_holder(cxl_lockctx* L, uint32_t id, uint32_t mode) noexcept nogil:
    """If a dead process of our node holds `id`, clear its hold. 1 if it did. A leave
    that could not land (global_held with no holder) is said again."""
    cdef cxl_local_lock* s = cxl_lock_slot(L, id)
    cdef int rc = cxl_mutex_trylock(&s.m)
    if rc < 0:
        return 0  # held by a live thread (or busy): nothing to do
    if rc == 1:
        s.repair = 1  # a node-local-only lock's guarded state: its next taker repairs
        s.recovered += 1
        s.holder_pid = 0
        s.holder_tid = 0
        s.global_held = 1  # whatever it published is ours to clear: below, or a later beat
    # Only while our last beat is within the lease: a node whose beats fail may have been
    # taken over by a new life on another host (whose node-local mutex is not ours to
    # exclude), and clearing our line then clears its hold. The flag stays till then.
    if s.holder_pid == 0 and s.global_held and cxl_live_remaining_ns(L.live) > 0:
        if _global_reset(L, id, mode) == 0:
            s.global_held = 0
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
    for i in range(<uint32_t>CXL_MAX_LOCKS):
        s = cxl_lock_slot(L, i)
        if s.holder_pid == 0 and s.global_held == 0:
            continue  # nobody of our node is in this lock: nothing can be stale
        if _observe_mode(L, i, &mode) == 0:
            n += _recover_dead_holder(L, i, mode) == 1
    return n


cdef int _observe_mode(cxl_lockctx* L, uint32_t id, uint32_t* mode) noexcept nogil:
    """The mode of lock record `id`, observed; CXLRT_E_LOCKSTATE if it is not a lock."""
    cdef cxl_lock_header h
    cdef int rc = cxl_observe(L.r, cxl_lock_record(L, id), &h, sizeof(h))
    if rc != 0:
        return rc
    mode[0] = h.mode
    if h.state != CXL_LOCK_READY or (h.mode != CXL_LOCK_BAKERY and h.mode != CXL_LOCK_MANAGER):
        return CXLRT_E_LOCKSTATE
    return 0


# --- Python layer -------------------------------------------------------------------


MODES = {"bakery": CXL_LOCK_BAKERY, "manager": CXL_LOCK_MANAGER}
MODE_NAMES = {v: k for k, v in MODES.items()}
META_NAME = "cxlrt.meta"
ALLOC_NAME = "cxlrt.alloc"
NAME_BYTES = CXL_LOCK_NAME
MAX_LOCKS = CXL_MAX_LOCKS


cdef bytes _header_bytes(bytes name, uint32_t mode, uint64_t state):
    """A lock record's header line: `state`, `mode`, the name (at most CXL_LOCK_NAME)."""
    cdef cxl_lock_header h
    if len(name) > CXL_LOCK_NAME:
        raise ValueError(f"a lock name is at most {CXL_LOCK_NAME} bytes, got {len(name)}")
    memset(&h, 0, sizeof(h))
    h.state, h.mode, h.name_len = state, mode, len(name)
    memcpy(h.name, <const char*>name, len(name))
    return (<char*>&h)[:sizeof(h)]


cdef int _observe_into(region, uint64_t off, void* dst, size_t n) except -1:
    """Observe n bytes at `off` of a Region into the struct at dst (flush, then load)."""
    region.flush(off, n)
    cdef bytes raw = region.load(off, n)
    memcpy(dst, <const char*>raw, n)
    return 0


# _mgr_area and lockmgr's watch observe the manager's words as one 3-word run.
assert cxl_mgr_beat(0) < 3 * sizeof(uint64_t) and cxl_mgr_pid(0) < 3 * sizeof(uint64_t)


cdef uint64_t _mgr_words(region, uint32_t node) except? 0:
    """Offset of node `node`'s manager words (mgr_epoch, mgr_beat, mgr_pid)."""
    region.node_area(node)  # checks the node id
    return cxl_mgr_area_off(region.sections["nodes"][0], node)


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
        self.L.lease_ns = <uint64_t>region.lease_ms * 1_000_000
        self.L.armed = _armed
        self.lease_s = region.lease_ms / 1000.0
        self.manager_wait = max(MANAGER_WAIT_S, 2 * self.lease_s)
        self.manager_spin = MANAGER_SPIN_S
        self._modes = {}
        self._closed = False
        self._stop = threading.Event()
        self._mgr_thread = None
        self.mgr_epoch = 0
        self.mgr_exit = None
        self.L.closing = 0
        memset(self.L.held, 0, sizeof(self.L.held))
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
        r.flush(off, CXL_LINE_SIZE)
        r.store(off, _header_bytes(name, mode, 0))
        r.persist(off, CXL_LINE_SIZE)
        r.store64(off, CXL_LOCK_READY)
        r.persist(off, CXL_LINE_SIZE)

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
        cdef cxl_mgr_claim c
        _observe_into(self.region, self.L.locks_off, &c, sizeof(c))
        return c.node_plus1, c.epoch, c.incarnation, c.pid

    def _mgr_area(self, uint32_t node):
        """(mgr_epoch, mgr_beat, mgr_pid) published by node's manager, observed."""
        cdef uint64_t mw[3]  # mgr_epoch, then beat and pid (layout.pxd)
        cdef uint64_t m = _mgr_words(self.region, node)
        _observe_into(self.region, m, mw, sizeof(mw))  # one observe: one consistent copy
        return (mw[0], mw[(cxl_mgr_beat(m) - m) // sizeof(uint64_t)],
                mw[(cxl_mgr_pid(m) - m) // sizeof(uint64_t)])

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
        cdef cxl_mgr_claim c
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
            memset(&c, 0, sizeof(c))
            c.node_plus1, c.epoch, c.incarnation, c.pid = r.node + 1, epoch, self.live.incarnation, os.getpid()
            r.store(self.L.locks_off, (<char*>&c)[:sizeof(c)])
            r.persist(self.L.locks_off, sizeof(c))  # the claim: one line, written only under lock 0
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
        m = _mgr_words(r, r.node)
        r.store64(m, epoch)
        r.store64(cxl_mgr_beat(m), (r.load64(cxl_mgr_beat(m)) + 1) & 0xFFFFFFFFFFFFFFFF)
        r.store64(cxl_mgr_pid(m), os.getpid())
        r.persist(m, CXL_LINE_SIZE)

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
                rc = cxl_mgr_passes(&self.L, ids, n, epoch, st, &self._pace, 100_000_000)
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
                m = _mgr_words(r, r.node)
                r.store64(m, 0)  # mgr_epoch: we run no manager
                r.persist(m, CXL_LINE_SIZE)
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

    # Region.close() ------------------------------------------------------------------

    def _held(self, bint by_this_thread):
        """[(index, tid)] of this service's node-local mutexes held by a live thread of
        this process (by this thread only, if asked). Holds through another Region of
        the node are that Region's business; a thread that exited holding one holds
        nothing (its robust mutex goes to the next taker as recovered)."""
        cdef uint32_t tid = cxl_thread_id(), t, i
        out = []
        for i in range(CXL_HELD_SLOTS):
            t = cxl_atomic_load_acquire32(&self.L.held[i])
            if t == 0 or (by_this_thread and t != tid):
                continue
            if t != tid and not os.path.exists(f"/proc/self/task/{t}"):
                continue
            out.append((i, t))
        return out

    def _names(self, held):
        out = []
        for i, _ in held:
            if i == CXL_HELD_HEAP:
                out.append("the node heap (an allocation)")
                continue
            try:
                hdr = self._read_header(i)
            except Exception:  # a name for the message only
                hdr = None
            out.append(repr(hdr[0]) if hdr else f"#{i}")
        return ", ".join(out)

    def check_close(self):
        """Refuse Region.close(), before it changes anything, while the calling thread
        holds a lock: its hold would outlive the region (only the owner can let a
        pthread mutex go), keeping the lock from this node's other processes."""
        held = self._held(True)
        if held:
            raise RegionError(f"{self.region.spec}: close(): lock {self._names(held)} is held "
                              "by this thread; release it first")

    def begin_close(self, double wait_s):
        """Region.close(), before any mapping goes: no acquire succeeds from here on
        (waiters give up with RegionClosedError; one that got in meanwhile gives its
        hold back), and other threads' holds are waited for, up to `wait_s`. A hold
        that outlasts that outlives the close: its release then fails, and its line
        in the region stays until this node detaches or takes the lock again."""
        cxl_atomic_store_release32(&self.L.closing, 1)
        cxl_fence_sc()  # closing, then held; an acquirer stores held, then reads closing
        deadline = time.monotonic() + wait_s
        me = cxl_thread_id()  # our own hold (close on an exception's way out) ends with us
        while any(t != me for _, t in self._held(False)) and time.monotonic() < deadline:
            time.sleep(0.001)

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
        cdef cxl_local_lock* s = cxl_lock_slot(&self.svc.L, self.index)
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
        self._release(True)

    cdef int _release(self, bint may_blame_host) except -1:
        cdef cxl_local_lock* s = cxl_lock_slot(&self.svc.L, self.index)
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
            raise self._lost("while holding or waiting for it; another node may have held it "
                             "at the same time", may_blame_host)
        return 0

    def _lost(self, when, bint may_blame_host=True):
        """LeaseLost for a silence since our acquire began; `host_stall` says whether the
        OS alone made it (Liveness.host_stalled). Not said over an error of the section's
        own (`with` whose body raised): that error may be the code's, stall or not."""
        why, host = self.svc.live._silence(self._t0, may_blame_host)
        e = LeaseLost(f"lock {self.name!r}: this process was silent for longer than the "
                      f"{self.svc.lease_s} s lease {when} ({why})")
        e.host_stall = host
        return e

    def check(self):
        """Seconds of validity left to this hold; LeaseLost if it is already suspect.

        A long critical section calls this before it publishes: if the answer is
        smaller than the time its next write takes, stop. The figure assumes the
        heartbeat keeps beating; a stall after this call is caught by release().
        """
        cdef cxl_local_lock* s = cxl_lock_slot(&self.svc.L, self.index)
        if s.holder_tid != cxl_thread_id() or s.holder_pid != <uint32_t>cxl_pid():
            raise RuntimeError(f"lock {self.name!r} is not held by this thread")
        if cxl_live_silent_since(self.svc.L.live, self._t0):
            raise self._lost("since it began to acquire it")
        return max(0.0, cxl_live_remaining_ns(self.svc.L.live) / 1e9)

    def locked(self):
        """True if some node holds (or is taking) the lock right now."""
        r = self.svc.region
        cdef uint32_t nodes = self.svc.L.nodes, j
        cdef uint64_t rec = cxl_lock_record(&self.svc.L, self.index), g, gw, ln
        if self._mode == CXL_LOCK_MANAGER:
            g = cxl_lock_grant_off(rec, nodes)
            r.flush(g, CXL_LINE_SIZE)
            gw = r.load64(g)
            if not cxl_grant_node1(gw) or cxl_grant_node1(gw) > nodes:
                return False
            ln = cxl_lock_line_off(rec, <uint32_t>cxl_grant_node1(gw) - 1)
            r.flush(ln, CXL_LINE_SIZE)
            req, rel = r.load64(cxl_ln_req(ln)), r.load64(cxl_ln_rel(ln))
            return req > rel and cxl_grant_seq(req) == cxl_grant_seq(gw)
        for j in range(nodes):
            ln = cxl_lock_line_off(rec, j)
            r.flush(ln, CXL_LINE_SIZE)
            if r.load64(cxl_ln_number(ln)):
                return True
        return False

    def held_by_me(self):
        cdef cxl_local_lock* s = cxl_lock_slot(&self.svc.L, self.index)
        return s.holder_tid == cxl_thread_id() and s.holder_pid == <uint32_t>cxl_pid()

    def acquisitions(self):
        """Global acquisitions per node, as published on each node's line."""
        r = self.svc.region
        cdef uint32_t j
        cdef uint64_t ln
        out = []
        for j in range(self.svc.L.nodes):
            ln = cxl_lock_line(&self.svc.L, self.index, j)
            r.flush(ln, CXL_LINE_SIZE)
            out.append(r.load64(cxl_ln_acq(ln)))
        return out

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._release(exc_type is None)

    def __repr__(self):
        return f"<cxlrt.Lock {self.name!r} #{self.index} {self.mode}>"


def builtin_headers(unsigned long long locks_off, int nodes):
    """(offset, bytes) of the built-in lock headers a new region starts with."""
    return [(cxl_lock_record_off(locks_off, nodes, i),
             _header_bytes(name.encode(), CXL_LOCK_BAKERY, CXL_LOCK_READY))
            for i, name in ((CXL_LOCK_META, META_NAME), (CXL_LOCK_ALLOC, ALLOC_NAME))]


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
        ln = cxl_lock_line_off(record_offset(region, i), node)
        region.flush(ln, CXL_LINE_SIZE)
        if h[1] == CXL_LOCK_BAKERY:
            region.store64(cxl_ln_choosing(ln), 0)
            region.store64(cxl_ln_number(ln), 0)
        else:
            region.store64(cxl_ln_rel(ln), region.load64(cxl_ln_req(ln)))
        region.persist(ln, CXL_LINE_SIZE)
    m = _mgr_words(region, node)
    region.flush(m, CXL_LINE_SIZE)
    region.store64(m, 0)  # mgr_epoch: no manager runs in the new life
    region.persist(m, CXL_LINE_SIZE)


def node_busy(region, uint32_t i, uint32_t j, uint32_t mode):
    """True if node j holds or waits on lock record i of `mode`, by its line (observed)."""
    cdef cxl_lock_node_line v
    _observe_into(region, cxl_lock_line_off(record_offset(region, i), j), &v, sizeof(v))
    return bool(v.number or v.choosing) if mode == CXL_LOCK_BAKERY else v.req_seq > v.rel_seq


def _reset_node_line(LockService svc, uint32_t i, uint32_t mode):
    """Clear this node's line of lock i (repair, running as a dead node). True if busy."""
    cdef int rc
    busy = node_busy(svc.region, i, svc.L.node, mode)
    if busy:
        with nogil:
            rc = _global_reset(&svc.L, i, mode)
        check_rc(rc, "repair")
    return busy


def record_offset(region, uint32_t i):
    """Offset of lock record i in `region` (no LockService needed)."""
    return cxl_lock_record_off(region.sections["locks"][0], region.nodes, i)


def read_header(region, uint32_t i):
    """(name, mode) of lock record i, observed, or None if the record is free."""
    cdef cxl_lock_header h
    _observe_into(region, record_offset(region, i), &h, sizeof(h))
    if h.state != CXL_LOCK_READY:
        return None
    if h.name_len > NAME_BYTES or h.mode not in MODE_NAMES:
        raise RegionError(f"lock record {i} is corrupt (mode {h.mode}, name length {h.name_len})")
    return h.name[:h.name_len].decode("utf-8", "replace"), h.mode
