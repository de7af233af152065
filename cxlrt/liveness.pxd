# Liveness: the one place where cxlrt decides whether a node is alive (issue 9).
#
# Invariants:
#  - A node is judged by its heartbeat COUNTER (cxl_node_area.beat), never by a
#    clock: it is dead when the counter has not changed for a lease, timed on the
#    observer's own monotonic clock. Clocks of different hosts are never compared.
#  - Node states are distinct: never attached, attached (alive or dead by the
#    rule above), detached (its last process left cleanly after giving back every
#    hold of its dead siblings). Holds of a node that is not ALIVE do not count.
#  - A node's area is written only by that node's processes, and its attach and
#    detach steps only under the node-local flock, so two processes of one node
#    starting together cannot undo each other.
#  - The heartbeat is a C thread that only beats and sweeps node-local state: it
#    never takes a lock another node can hold and never needs the GIL, so a slow
#    peer or a busy interpreter cannot make a healthy node look dead.
#  - A process judges its own silence from its own timestamps: a gap between two
#    of its beats longer than the lease, or a current gap longer than the lease.
#  - It also says why (LeaseLost's text): the beat thread notes each wake-up and each
#    beat's start, so a thread the OS did not run (a stop, a host stall: "unrun") is
#    told apart from one that ran but whose beat or sweep was slow ("blocked").
from libc.stdint cimport int64_t, uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.includes.mutex cimport pthread_mutex_t
from cxlrt.includes.intrin cimport cxl_now_coarse_ns, cxl_now_ns
from cxlrt.includes.thread cimport cxl_atomic_load_acquire64, cxl_atomic_load_acquire_int
from cxlrt.nodelocal cimport NodeLocal


cdef enum:
    CXL_LIVE_NEVER = 0        # never attached since format
    CXL_LIVE_ALIVE = 1        # attached, and its counter moved within the lease
    CXL_LIVE_DETACHED = 2     # left cleanly
    CXL_LIVE_DEAD = 3         # attached, and its counter stood still for a lease
    CXL_LIVE_MAX_NODES = 64


ctypedef int (*cxl_sweep_fn)(void* ctx) noexcept nogil


ctypedef struct cxl_live:
    const cxl_region* r
    uint64_t nodes_off               # node areas
    uint64_t lease_ns
    uint64_t period_ns               # beat period (lease / 8)
    uint64_t coarse_slack_ns         # the coarse clock lags the fine one by less than this
    uint32_t nodes
    uint32_t node
    uint64_t* counter                # node-local beat counter shared by the node's processes
    uint64_t incarnation             # the node's life we attached in
    uint64_t seen_beat[64]           # per node: counter we last saw
    uint64_t seen_inc[64]            # per node: incarnation we last saw
    uint64_t seen_at[64]             # per node: our monotonic ns when it last changed, 0 never
    uint64_t last_beat               # our monotonic ns after our latest beat was published
    uint64_t gap_end                 # our monotonic ns at the end of our latest silence > lease
    uint64_t gaps                    # silences longer than the lease so far
    uint64_t gap_ns                  # how long our latest silence > lease lasted
    uint64_t beats                   # beats published by this process
    uint64_t woke                    # our monotonic ns when the beat thread last woke
    uint64_t busy_since              # our monotonic ns when its beat (and sweep) began, 0 idle
    uint64_t unrun_ns                # longest the thread went unrun since its latest beat
    uint64_t unrun_end               # our ns at the end of our latest silence the OS made
    uint64_t blocked_end             # ... and of our latest one made by a slow beat or sweep
    int beat_failing                 # 1 while the latest publish failed
    int failed_since_beat            # a publish failed since our latest beat (beat thread's)
    uint64_t stall_ns                # test hook: sleep this long inside the next beat
    int stop                         # set by close(): the beat thread exits
    int beat_rc                      # latest backend error the beat thread met, 0 none
    int fenced                       # another life of our node took over: write nothing more
    cxl_sweep_fn sweep               # node-local work each beat (dead holders), or NULL
    void* sweep_ctx
    pthread_mutex_t sweep_mu         # guards sweep/sweep_ctx against close() (process-private)



cdef int cxl_live_verify(cxl_live* V) noexcept nogil
cdef int cxl_node_state(cxl_live* V, uint32_t j) noexcept nogil
cdef int cxl_node_gone(cxl_live* V, uint32_t j) noexcept nogil
cdef int64_t cxl_live_remaining_ns(cxl_live* V) noexcept nogil


cdef class Liveness:
    cdef cxl_live V
    cdef readonly NodeLocal local    # this node's node-local file
    cdef readonly object region
    cdef readonly int record         # our slot in the node-local process table
    cdef object _backend             # keeps V.r's memory alive while the thread runs
    cdef object _sweep_owner         # keeps sweep_ctx's memory alive while installed
    cdef unsigned long _thread       # pthread_t of the beat thread, 0 none
    cdef int _owner_pid              # the process that started it (fork safety)
    cdef double _patience            # seconds an attach may watch an earlier life
    cdef bint _closed

    cdef cxl_live* ctx(self) noexcept
    cdef void set_sweep(self, cxl_sweep_fn fn, void* ctx, object owner)


# Inline: the allocator, locks, KV cache and channel ask these on every fenced
# publish, and a call into another module costs as much as the check.
cdef inline int cxl_live_fenced(cxl_live* V) noexcept nogil:
    """1 once another life of our node has taken the node over: we must not write."""
    return cxl_atomic_load_acquire_int(&V.fenced)


cdef inline int cxl_live_silent_since(cxl_live* V, uint64_t t0) noexcept nogil:
    """1 if this process was silent past the lease at some point since t0 (our clock).

    Either the beat thread saw a gap that ended after t0, or the gap is still
    open now (we resumed and the beat thread has not run yet), or our node was
    taken over by another life.
    """
    cdef uint64_t last = cxl_atomic_load_acquire64(&V.last_beat)
    if cxl_live_fenced(V):
        return 1
    # The fine clock, always: the coarse one can lag by several ticks (a guest whose
    # timekeeping vCPU has not ticked since a pause) and would then miss this gap.
    if last != 0 and cxl_now_ns() > last + V.lease_ns:
        return 1
    return 1 if cxl_atomic_load_acquire64(&V.gap_end) >= t0 else 0


cdef inline uint64_t cxl_live_t0(cxl_live* V) noexcept nogil:
    """A start time for cxl_live_silent_since: the coarse clock, never ahead of the fine
    one, so no silence that ends after now is missed however stale it is; the fine
    clock when a silence ended within the coarse clock's usual lag (the coarse value
    would count it: a false alarm) or when the deadline is that close (the caller
    compares t0 with it; a stale coarse clock there only defers the verdict to
    cxl_live_silent_since, which reads the fine clock)."""
    cdef uint64_t t = cxl_now_coarse_ns(), last = cxl_atomic_load_acquire64(&V.last_beat)
    if (V.coarse_slack_ns >= V.lease_ns or last == 0
            or t + V.coarse_slack_ns > last + V.lease_ns
            or cxl_atomic_load_acquire64(&V.gap_end) + V.coarse_slack_ns >= t):
        return cxl_now_ns()
    return t
