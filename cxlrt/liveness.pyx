# cython: language_level=3
"""Liveness: node states, process identity and the heartbeat (invariants in liveness.pxd).

Every algorithm that must decide whether an owner is gone (lock waiters, the
lock manager, KV writers and pins, channel roles, `cxlrt check`) asks here.
"""

import os
import time

cimport cython

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset

from cxlrt.backend cimport (Backend, CXL_HINT_REPEAT, cxl_flush, cxl_hint, cxl_load, cxl_load64,
                            cxl_observe, cxl_observe64, cxl_persist, cxl_store64)
from cxlrt.includes.intrin cimport (CXLRT_DEBUG, CXLRT_TEST_HOOK, cxl_atomic_add_relaxed64, cxl_atomic_load_relaxed64,
                                    cxl_atomic_store_relaxed64, cxl_now_ns, cxl_wall_ns, cxl_coarse_slack_ns)
from cxlrt.includes.thread cimport (cxl_atomic_load_acquire64, cxl_atomic_load_acquire_int,
                                    cxl_atomic_store_release64, cxl_atomic_store_release_int,
                                    cxl_plain_mutex_init, cxl_plain_mutex_lock,
                                    cxl_plain_mutex_unlock, cxl_sleep_ns, cxl_thread_join,
                                    cxl_thread_start)
from cxlrt.layout cimport (CXL_LINE_SIZE, CXL_NODE_AREA, CXL_NODE_ATTACHED, CXL_NODE_DETACHED,
                           CXL_NODE_NEVER)
from cxlrt.status cimport check_rc
from cxlrt.status import name_of

from cxlrt.errors import DebugBuildRequired, RegionError
from cxlrt.formats import Format

# The node area's liveness words (layout.pxd cxl_node_area, line 0): what we read of
# our own node, and what a survey compares between two looks.
_AREA7 = Format("cxl_node_area", "beat", "state", "incarnation", "host_id", "boot_id", "pid",
                "attaches")
_AREA8 = Format("cxl_node_area", "beat", "state", "incarnation", "host_id", "boot_id", "pid",
                "attaches", "beat_wall_ns")

cdef enum:
    AREA_BEAT = 0
    AREA_STATE = 8
    AREA_INC = 16
    AREA_HOST = 24
    AREA_BOOT = 32
    AREA_PID = 40
    AREA_ATTACHES = 48
    AREA_WALL = 56
    SLEEP_SLICE_NS = 5000000   # close() waits at most this long for the beat thread

# How long an open may watch an earlier life of its node before taking it over,
# unless the caller's `wait` is longer (the default lease, 2 s, fits).
TAKEOVER_WAIT_S = 3.0
# How long `cxlrt check` (survey) watches counters at most: a longer lease reports
# still nodes as "silent", not "dead".
SURVEY_MAX_S = 3.0

# How LeaseLost ends when the OS alone made the silence (Liveness.host_stalled): a test
# that fails with it is run once more (tests/conftest.py), since no code can keep a
# process running on a shared machine.
_HOST_STALL = "a host stall: the OS did not run this process (stopped, or not scheduled)"


cdef inline double _ago(uint64_t now, uint64_t t) noexcept:
    return (now - t) / 1e9 if now > t else 0.0

STATE_NAMES = {CXL_LIVE_NEVER: "never attached", CXL_LIVE_ALIVE: "alive",
               CXL_LIVE_DETACHED: "detached", CXL_LIVE_DEAD: "dead"}


# --- process identity: (boot id, pid namespace, pid, start time) ------------------------

def process_start(pid):
    """Start time of a process (clock ticks after boot), or 0 when unknown.

    With the pid it names one process: a pid reused later has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def boot_id():
    """16 bytes naming this boot of the host (zeros where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


def boot_hash():
    """The boot id folded to 64 bits (for the node area)."""
    raw = boot_id()
    return int.from_bytes(raw[:8], "little") ^ int.from_bytes(raw[8:], "little")


def claim_id():
    """64 bits naming this host for a node claim (rdma:): the processes that can share
    a node's local state. The hostname, this boot of the kernel (cloned VMs that share
    a hostname differ) and the IPC namespace (containers with their own /dev/shm have
    their own, even with the host's network and hostname)."""
    import hashlib
    import socket
    try:
        ipc = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipc = 0
    raw = socket.gethostname().encode() + b"\0" + boot_id() + ipc.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def pid_namespace():
    """Inode of this process's pid namespace (0 where unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_alive(pid, start, pidns=None):
    """False only when the process is certainly gone (or its pid was reused).

    A process of another pid namespace cannot be looked up by pid from here, so
    it counts as alive: only its node's heartbeat can tell that it is gone.
    """
    if pidns is not None and pidns != pid_namespace():
        return True
    if pid == 0 or pid > 0x7fffffff:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = process_start(pid)
    return not (start and now and now != start)


def host_id():
    from cxlrt.superblock import host_id as _host
    return _host()


# --- judging other nodes ------------------------------------------------------------

cdef int cxl_live_verify(cxl_live* V) noexcept nogil:
    """Re-read our node's incarnation now (after a stall, before writing as the node).

    1 if another life of the node took it over (we are fenced from then on).
    """
    cdef uint64_t off = V.nodes_off + <uint64_t>V.node * CXL_NODE_AREA, inc = 0
    if cxl_live_fenced(V):
        return 1
    if cxl_observe64(V.r, off + AREA_INC, &inc) == 0:
        if inc != V.incarnation:
            cxl_atomic_store_release_int(&V.fenced, 1)
    return cxl_live_fenced(V)


cdef int cxl_node_state(cxl_live* V, uint32_t j) noexcept nogil:
    """CXL_LIVE_* of node j, judged by its counter on our own monotonic clock.

    A node first seen now counts as alive until a whole lease of our time passes
    without its counter moving. Unreadable or corrupt areas count as alive: a
    wrong "dead" breaks mutual exclusion, a wrong "alive" only waits.
    """
    cdef uint64_t w[3]
    cdef uint64_t off, now, at
    if j >= V.nodes or j >= CXL_LIVE_MAX_NODES:
        return CXL_LIVE_NEVER
    if j == V.node:
        return CXL_LIVE_ALIVE
    off = V.nodes_off + <uint64_t>j * CXL_NODE_AREA
    # Pairs with the beat's persist.
    if cxl_observe(V.r, off, w, 24) != 0:
        return CXL_LIVE_ALIVE
    if w[1] == CXL_NODE_NEVER:
        return CXL_LIVE_NEVER
    if w[1] == CXL_NODE_DETACHED:
        return CXL_LIVE_DETACHED
    now = cxl_now_ns()
    at = cxl_atomic_load_relaxed64(&V.seen_at[j])
    if (at == 0 or w[0] != cxl_atomic_load_relaxed64(&V.seen_beat[j])
            or w[2] != cxl_atomic_load_relaxed64(&V.seen_inc[j])):
        # Benign race between our threads: at worst a change is timed a little late.
        cxl_atomic_store_relaxed64(&V.seen_beat[j], w[0])
        cxl_atomic_store_relaxed64(&V.seen_inc[j], w[2])
        cxl_atomic_store_relaxed64(&V.seen_at[j], now)
        return CXL_LIVE_ALIVE
    return CXL_LIVE_DEAD if now - at > V.lease_ns else CXL_LIVE_ALIVE


cdef int cxl_node_gone(cxl_live* V, uint32_t j) noexcept nogil:
    """1 if node j's claims no longer count: dead, detached or never attached."""
    return 0 if cxl_node_state(V, j) == CXL_LIVE_ALIVE else 1


# --- judging ourselves ---------------------------------------------------------------

cdef int64_t cxl_live_remaining_ns(cxl_live* V) noexcept nogil:
    """Nanoseconds until others may judge us dead if we stopped beating now."""
    cdef uint64_t last = cxl_atomic_load_acquire64(&V.last_beat)
    if cxl_live_fenced(V):
        return -1
    return <int64_t>(last + V.lease_ns) - <int64_t>cxl_now_ns()


# --- the heartbeat ---------------------------------------------------------------------

cdef int _beat(cxl_live* V) noexcept nogil:
    """Publish a new counter value; refuse if another life of our node took over."""
    cdef uint64_t off = V.nodes_off + <uint64_t>V.node * CXL_NODE_AREA, v
    cdef int rc
    if cxl_live_verify(V):  # observe our incarnation: a new life may own the area now
        return 0
    v = cxl_atomic_add_relaxed64(V.counter, 1)  # unique across the node's processes
    rc = cxl_store64(V.r, off + AREA_BEAT, v)
    if rc == 0:
        rc = cxl_store64(V.r, off + AREA_WALL, cxl_wall_ns())
    if rc == 0:
        rc = cxl_persist(V.r, off, CXL_LINE_SIZE)  # pairs with cxl_node_state's observe
    return rc


cdef void _beat_once(cxl_live* V) noexcept nogil:
    """One beat, then the time bookkeeping that lets us judge our own silence."""
    cdef int rc = _beat(V)
    cdef uint64_t t, last
    if rc != 0:
        V.beat_rc = rc
        V.failed_since_beat = 1
        cxl_atomic_store_release_int(&V.beat_failing, 1)
        return
    cxl_atomic_store_release_int(&V.beat_failing, 0)
    t = cxl_now_ns()
    last = cxl_atomic_load_acquire64(&V.last_beat)
    if last != 0 and t - last > V.lease_ns:
        V.gaps += 1
        cxl_atomic_store_release64(&V.gap_ns, t - last)
        # The OS's doing (a stop, or a host stall) only if, less the time we were ready
        # but not run, the gap would have kept within the lease by a margin; else a beat,
        # a sweep or a failed publish made it: the medium's doing, or a node-local lock's.
        if not V.failed_since_beat and \
                t - last < cxl_atomic_load_acquire64(&V.unrun_ns) + V.lease_ns // 2:
            cxl_atomic_store_release64(&V.unrun_end, t)
        else:
            cxl_atomic_store_release64(&V.blocked_end, t)
        cxl_atomic_store_release64(&V.gap_end, t)  # before last_beat: see silent_since
    cxl_atomic_store_release64(&V.last_beat, t)
    V.beats += 1
    V.failed_since_beat = 0
    cxl_atomic_store_release64(&V.unrun_ns, 0)  # after gap_end: see Liveness._silence


cdef void* _beat_main(void* arg) noexcept nogil:
    """The heartbeat thread: beat every period; sweep node-local state. Nothing else.

    It also notes when it last woke and since when it is busy in a beat, so that a
    silence can be told apart: a thread that was not run, or one blocked in a beat."""
    cdef cxl_live* V = <cxl_live*>arg
    cdef uint64_t end, t, slice_ns = min(SLEEP_SLICE_NS, V.period_ns)
    cdef uint64_t prev = cxl_atomic_load_acquire64(&V.woke)  # our start: a new thread
    while not cxl_atomic_load_acquire_int(&V.stop):
        end = prev + V.period_ns
        while not cxl_atomic_load_acquire_int(&V.stop) and prev < end:
            cxl_sleep_ns(slice_ns)
            t = cxl_now_ns()
            if t > prev + slice_ns and t - prev - slice_ns > V.unrun_ns:
                # Overslept: we were ready, not run. Published at once, for a silence()
                # that runs before this thread's next beat does.
                cxl_atomic_store_release64(&V.unrun_ns, t - prev - slice_ns)
            prev = t
            cxl_atomic_store_release64(&V.woke, t)
        if cxl_atomic_load_acquire_int(&V.stop) or cxl_live_fenced(V):
            break
        cxl_atomic_store_release64(&V.busy_since, prev)
        if CXLRT_TEST_HOOK(cxl_atomic_load_acquire64(&V.stall_ns) != 0):
            end = cxl_atomic_load_acquire64(&V.stall_ns)
            cxl_atomic_store_release64(&V.stall_ns, 0)
            cxl_sleep_ns(end)  # a beat blocked as if by the medium
        _beat_once(V)
        cxl_plain_mutex_lock(&V.sweep_mu)
        if V.sweep != NULL:
            V.sweep(V.sweep_ctx)
        cxl_plain_mutex_unlock(&V.sweep_mu)
        prev = cxl_now_ns()
        cxl_atomic_store_release64(&V.woke, prev)
        cxl_atomic_store_release64(&V.busy_since, 0)
    return NULL


@cython.no_gc_clear  # the beat thread uses our fields until __dealloc__ has stopped it
cdef class Liveness:
    """This process's membership of its node: attach, heartbeat, detach.

    Created when a region is attached as a node (not as an observer). The node's
    processes share a counter and a process table in the node-local file.
    """

    def __init__(self, region, double patience=0.0):
        self.region = region
        self._patience = max(patience, TAKEOVER_WAIT_S)
        self._closed = False
        self._thread = 0
        self.record = -1
        memset(&self.V, 0, sizeof(cxl_live))
        cxl_plain_mutex_init(&self.V.sweep_mu)
        self._backend = region.backend
        self.V.r = (<Backend>region.backend).region()
        self.V.nodes_off = region.sections["nodes"][0]
        self.V.lease_ns = <uint64_t>region.lease_ms * 1000000
        self.V.period_ns = max(self.V.lease_ns // 8, 1000000)
        self.V.coarse_slack_ns = cxl_coarse_slack_ns()
        self.V.nodes = region.nodes
        self.V.node = region.node
        self.local = NodeLocal(region.uuid, region.node, on_open=self._attach_locked)
        self._owner_pid = os.getpid()
        self.V.woke = cxl_now_ns()  # the thread counts from here: it may not run at once
        cdef int rc = cxl_thread_start(&self._thread, _beat_main, &self.V)
        if rc != 0:
            self._thread = 0
            err = OSError(-rc, "cannot start the heartbeat thread")
            try:
                self.close()  # not joined after all: its record and read lock go back
            except Exception as e:
                err.add_note(f"and leaving the node failed too: {e!r}")
            raise err

    cdef cxl_live* ctx(self) noexcept:
        return &self.V

    cdef void set_sweep(self, cxl_sweep_fn fn, void* ctx, object owner):
        """Install (or with NULL remove) the beat thread's node-local sweep; `owner`
        holds `ctx` and is kept alive while the sweep is installed."""
        with nogil:
            cxl_plain_mutex_lock(&self.V.sweep_mu)
            self.V.sweep = fn
            self.V.sweep_ctx = ctx
            cxl_plain_mutex_unlock(&self.V.sweep_mu)
        self._sweep_owner = owner

    # attach ------------------------------------------------------------------------
    def _area(self):
        """(beat, state, incarnation, host, boot, pid, attaches) of our node, observed."""
        r = self.region
        off = r.node_area(r.node)
        r.flush(off, _AREA7.size)
        return tuple(_AREA7.unpack(r.load(off, _AREA7.size)))

    def _attach_locked(self, NodeLocal local):
        """Join the node (node-local flock held: no sibling attaches or detaches now)."""
        self.V.counter = local.counter
        r = self.region
        off = r.node_area(r.node)
        beat, state, inc, host, boot, _, attaches = self._area()
        me_host, me_boot = host_id(), boot_hash()
        local_inc = local.incarnation
        new_life = local.fresh or local_inc != inc
        if new_life and state == CXL_NODE_ATTACHED:
            # Our node-local state does not know the processes of this attach: an
            # earlier life that crashed, or someone else attached as our node now.
            self._wait_previous_life(beat, inc, host)
        if new_life:
            from cxlrt.lock import forget_node_lines
            forget_node_lines(r)  # no process of this life holds or waits on a lock
            local.forget_owed()
            inc = (inc + 1) & 0xFFFFFFFFFFFFFFFF or 1
            local.incarnation = inc
        self.V.incarnation = inc
        rec = local.proc_add(os.getpid(), process_start(os.getpid()), pid_namespace())
        if rec < 0:
            self._reap(local)
            rec = local.proc_add(os.getpid(), process_start(os.getpid()), pid_namespace())
            if rec < 0:
                raise RegionError(f"{r.spec}: node {r.node} already has the most attached "
                                  "processes one node may have (124); close some regions")
        self.record = rec
        for field, value in ((AREA_INC, inc), (AREA_HOST, me_host), (AREA_BOOT, me_boot),
                             (AREA_PID, os.getpid()),
                             (AREA_ATTACHES, (attaches + 1) & 0xFFFFFFFFFFFFFFFF),
                             (AREA_STATE, CXL_NODE_ATTACHED)):
            r.store64(off + field, value)
        r.persist(off, CXL_LINE_SIZE)
        # Only this node writes its beat words, and a stale beat only says "alive" late:
        # a medium that can lose a write's completion may write them again (rdma:).
        cxl_hint(self.V.r, CXL_HINT_REPEAT, off + AREA_BEAT, 8)
        cxl_hint(self.V.r, CXL_HINT_REPEAT, off + AREA_WALL, 8)
        with nogil:
            _beat_once(&self.V)  # alive from the first instant (and last_beat set)
        if self.V.beat_rc:
            check_rc(self.V.beat_rc, f"{r.spec}: cannot publish node {r.node}'s heartbeat")

    def _wait_previous_life(self, uint64_t beat, uint64_t inc, uint64_t host):
        """Take the node over only once its recorded life is silent for a lease."""
        r = self.region
        lease = self.V.lease_ns / 1e9
        need = lease + 2 * self.V.period_ns / 1e9
        if need > self._patience:
            # Never block an open for a lease longer than the caller agreed to wait.
            raise RegionError(
                f"{r.spec}: node {r.node} is recorded as attached by an earlier life (host "
                f"{host:016x}, life {inc}); taking it over means watching it stay silent for "
                f"the {lease:g} s lease. Pass wait={need:.1f} (or more) to cxlrt.open, or "
                "use another node id.")
        deadline = time.monotonic() + need
        while time.monotonic() < deadline:
            time.sleep(self.V.period_ns / 1e9 / 2)
            b, state, i = self._area()[:3]
            if state != CXL_NODE_ATTACHED:
                return
            if (b, i) != (beat, inc):
                where = "this host" if host == host_id() else f"host {host:016x}"
                raise RegionError(
                    f"{r.spec}: node {r.node} is attached and alive on {where} by processes "
                    f"that do not share this one's node-local folder ({self.local_dir()}) "
                    "or pid namespace. Give each host (or container) its own node id, and "
                    "every process of one node the same $CXLRT_LOCAL_DIR.")

    def local_dir(self):
        from cxlrt.nodelocal import local_dir
        return local_dir()

    def _reap(self, local):
        """Drop records of processes of our pid namespace that are gone."""
        for slot, pid, start, pidns in local.procs_list():
            if not process_alive(pid, start, pidns):
                local.proc_remove(slot)

    # state -------------------------------------------------------------------------
    def state(self, uint32_t j):
        """'never attached', 'alive', 'detached' or 'dead' (see liveness.pxd)."""
        cdef int s
        with nogil:
            s = cxl_node_state(&self.V, j)
        return STATE_NAMES[s]

    def silent_since(self, uint64_t t0):
        return bool(cxl_live_silent_since(&self.V, t0))

    def remaining(self):
        """Seconds before others may judge this node dead if it stopped beating now."""
        return cxl_live_remaining_ns(&self.V) / 1e9

    @property
    def fenced(self):
        return bool(cxl_live_fenced(&self.V))

    @property
    def incarnation(self):
        return self.V.incarnation

    def stats(self):
        cdef uint64_t busy = cxl_atomic_load_acquire64(&self.V.busy_since)
        cdef uint64_t last = cxl_atomic_load_acquire64(&self.V.last_beat)
        cdef uint64_t woke = cxl_atomic_load_acquire64(&self.V.woke)
        cdef uint64_t now = cxl_now_ns()  # last: no field read is newer than it
        return {"beats": self.V.beats, "gaps": self.V.gaps, "fenced": bool(self.V.fenced),
                "incarnation": self.V.incarnation, "beat_error": self.V.beat_rc,
                "since_beat_s": _ago(now, last), "since_woke_s": _ago(now, woke),
                "in_beat_s": _ago(now, busy) if busy else 0.0,
                "unrun_s": cxl_atomic_load_acquire64(&self.V.unrun_ns) / 1e9}

    def silence(self, uint64_t t0=0):
        """What this process knows of why it counts as silent since `t0` (our clock), for
        a LeaseLost message: a stall and a heartbeat that cannot publish call for
        different fixes. It ends with _HOST_STALL when host_stalled(t0) is true."""
        return self._silence(t0)[0]

    def host_stalled(self, uint64_t t0=0):
        """True when our silence since `t0` is the OS's doing alone: the beat thread was
        ready but not run (the process was stopped, or its host did not schedule it),
        and no beat was slow and no publish failed meanwhile."""
        return self._silence(t0)[1]

    def _silence(self, uint64_t t0, bint may_blame_host=True):
        # Read before `now`, and in this order: the beat thread publishes gap_end (and
        # unrun_end or blocked_end) before it clears unrun_ns, so a silence that ends
        # while we look is seen either open or ended.
        cdef uint64_t last = cxl_atomic_load_acquire64(&self.V.last_beat)
        cdef uint64_t busy = cxl_atomic_load_acquire64(&self.V.busy_since)
        cdef uint64_t woke = cxl_atomic_load_acquire64(&self.V.woke)
        cdef uint64_t unrun_ns = cxl_atomic_load_acquire64(&self.V.unrun_ns)
        cdef uint64_t end = cxl_atomic_load_acquire64(&self.V.gap_end)
        cdef uint64_t unrun_end = cxl_atomic_load_acquire64(&self.V.unrun_end)
        cdef uint64_t blocked_end = cxl_atomic_load_acquire64(&self.V.blocked_end)
        cdef bint failing = cxl_atomic_load_acquire_int(&self.V.beat_failing)
        cdef uint64_t now = cxl_now_ns(), half = self.V.lease_ns // 2
        if cxl_live_fenced(&self.V):
            return "another life of this node took it over", False
        if self._owner_pid != os.getpid() or cxl_atomic_load_acquire_int(&self.V.stop):
            return "this process has no heartbeat (a forked child, or a closed region)", False
        out, unrun, blocked = [], False, blocked_end != 0 and blocked_end >= t0
        still = last and now > last + self.V.lease_ns and end <= last  # a silence still open
        if still:
            out.append(f"no beat published for {_ago(now, last):.3f} s")
            if not busy and woke and now > woke + unrun_ns:
                unrun_ns = now - woke  # not run since it last woke (or it runs again)
            if busy and now > busy + half:
                out.append(f"the heartbeat has been inside one beat for {_ago(now, busy):.3f}"
                           " s: the medium or a node-local lock blocks it")
                blocked = True
            elif now - last < unrun_ns + half:  # as _beat_once judges an ended gap
                out.append(f"the heartbeat thread was not run for {unrun_ns / 1e9:.3f} s")
                unrun = True
            else:
                out.append("its beats or sweeps were slow: the medium or a node-local lock")
                blocked = True
        if end and end >= t0:
            kind = (", made by slow beats: the medium or a node-local lock blocked them"
                    if blocked_end == end else ", its heartbeat thread not run"
                    if unrun_end == end else "")
            out.append(f"the latest silence lasted "
                       f"{cxl_atomic_load_acquire64(&self.V.gap_ns) / 1e9:.3f} s and ended "
                       f"{_ago(now, end):.3f} s ago{kind}")
            unrun = unrun or (not still and unrun_end != 0 and unrun_end >= t0)
        if failing:
            out.append(f"the heartbeat's latest publish failed: {name_of(self.V.beat_rc)}")
        stalled = unrun and not blocked and not failing and may_blame_host
        if stalled:
            out.append(_HOST_STALL)
        return "; ".join(out) or "no silence recorded", stalled

    def _stall_heartbeat(self, double seconds):
        """Test hook: the next beat sleeps `seconds` before it publishes, as one blocked
        by the medium would."""
        if not CXLRT_DEBUG:
            raise DebugBuildRequired()
        cxl_atomic_store_release64(&self.V.stall_ns, <uint64_t>(seconds * 1e9))

    # detach -------------------------------------------------------------------------
    def _stop_thread(self):
        if self._thread and self._owner_pid == os.getpid():
            cxl_atomic_store_release_int(&self.V.stop, 1)
            with nogil:
                cxl_thread_join(self._thread)
        self._thread = 0

    def close(self, sweep=None):
        """Leave the node: stop beating; `sweep()` gives back dead siblings' holds; the
        last process of the node marks it detached. Idempotent."""
        if self._closed:
            return
        self._closed = True
        inherited = self._owner_pid != os.getpid()  # a forked child never joined
        self._stop_thread()
        if inherited:
            return
        r = self.region
        try:
            with self.local.serialised():
                if sweep is not None:
                    sweep()
                self.local.proc_remove(self.record)
                self._reap(self.local)
                if not self.local.procs_list() and not self.V.fenced:
                    off = r.node_area(r.node)
                    r.store64(off + AREA_STATE, CXL_NODE_DETACHED)
                    r.persist(off, CXL_LINE_SIZE)
        finally:
            self.local.close()

    def __dealloc__(self):
        if self._thread and self._owner_pid == os.getpid():
            cxl_atomic_store_release_int(&self.V.stop, 1)
            with nogil:
                cxl_thread_join(self._thread)


def survey(region, double window=-1.0):
    """Every node's state as an observer judges it over `window` seconds (default: a
    lease): [{node, state, beat, incarnation, host_id, pid, attaches, beat_age_s}].

    An attached node whose counter does not move during the window is dead. The
    wall-clock age is for people only.
    """
    lease = region.lease_ms / 1000.0
    if window < 0:
        window = min(lease, SURVEY_MAX_S)
    base = region.sections["nodes"][0]

    def snap():
        out = []
        for n in range(region.nodes):
            off = base + n * CXL_NODE_AREA
            region.flush(off, _AREA8.size)
            out.append(tuple(_AREA8.unpack(region.load(off, _AREA8.size))))
        return out

    first = snap()
    t0 = time.monotonic()
    moved = set()
    attached = {n for n, a in enumerate(first) if a[1] == CXL_NODE_ATTACHED}
    while attached - moved and time.monotonic() - t0 <= window:
        time.sleep(min(0.05, window / 4 or 0.01))
        for n, a in enumerate(snap()):
            if (a[0], a[2]) != (first[n][0], first[n][2]) or a[1] != CXL_NODE_ATTACHED:
                moved.add(n)
    last = snap()
    now = time.time_ns()
    out = []
    for n, a in enumerate(last):
        beat, st, inc, host, boot, pid, attaches, wall = a
        if st == CXL_NODE_NEVER:
            state = "never attached"
        elif st == CXL_NODE_DETACHED:
            state = "detached"
        elif st == CXL_NODE_ATTACHED:
            # Dead only after a whole lease of stillness; a shorter look says "silent".
            state = "alive" if n in moved else ("dead" if window >= lease else "silent")
        else:
            state = f"corrupt state {st}"
        out.append({"node": n, "state": state, "beat": beat, "incarnation": inc,
                    "host_id": f"{host:016x}", "pid": pid, "attaches": attaches,
                    "beat_age_s": round((now - wall) / 1e9, 3) if wall else None})
    return out
