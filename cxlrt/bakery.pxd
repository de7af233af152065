# Lamport's bakery over single-writer lines: the manager-free global tier of a lock
# (lock.pxd states the protocol). Node n writes only its own line (choosing, number);
# every read of another node's line is an observe (flush, load).
#
# Written once for every backend, over the backend contract: a lock record is opened
# as one checked window (backend.pxd), and the algorithm is compiled for two kinds of
# words (`words`): on a coherent direct mapping each word is one plain access and
# each persist one store -> load fence, with no per-word check or branch; elsewhere
# every access is the contract's op, and the scans read every node's line in one
# observe (one request over rdma:, where a word at a time is one each: see
# `_snapshot`). All of it is inline here, compiled into the
# lock service: a call into another module costs an uncontended acquire+release
# about 9% (perf/README.md, "bakery inline").
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport (cxl_load64, cxl_observe, cxl_store, cxl_window,
                            cxl_window_observe64, cxl_window_open, cxl_window_persist,
                            cxl_window_publish, cxl_window_store64)
from cxlrt.crash cimport cxl_crash_hit
from cxlrt.includes.intrin cimport (cxl_atomic_load_acquire32, cxl_backoff, cxl_fence_release,
                                    cxl_fence_sc, cxl_load64_volatile, cxl_now_ns,
                                    cxl_store64_volatile, unlikely)
from cxlrt.layout cimport (CXL_LINE_SIZE, CXL_MAX_NODES, cxl_ln_acq, cxl_ln_choosing,
                           cxl_ln_number, cxl_lock_line_off, cxl_lock_node_line,
                           cxl_lock_record_bytes)
from cxlrt.liveness cimport cxl_live_fenced
from cxlrt.lockctx cimport (CXL_DEAD_CHECK_NS, cxl_lock_line, cxl_lock_record, cxl_lockctx,
                            cxl_node_dead)
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_TIMEOUT

# The algorithm below is written once and compiled twice (a Cython fused type): for
# a window on a coherent direct mapping (cxl_window.plain set by the contract from the
# region's flags) every word is one plain volatile access with no per-word branch, as
# fast as hand-written code; for any other window every word is the contract's op.
ctypedef struct plain_words:
    char unused
ctypedef struct contract_words:
    char unused
ctypedef fused words:          # passed as a zeroed tag: only its type matters
    plain_words
    contract_words


cdef inline int _store(const cxl_window* w, words k, uint64_t off, uint64_t v) noexcept nogil:
    if words is plain_words:
        cxl_store64_volatile(w.plain + off, v)
        return 0
    else:
        return cxl_window_store64(w, off, v)


cdef inline int _load(const cxl_window* w, words k, uint64_t off, uint64_t* v) noexcept nogil:
    if words is plain_words:
        v[0] = cxl_load64_volatile(w.plain + off)
        return 0
    else:
        return cxl_load64(w.r, off, v)  # our own word: no observe


cdef inline int _observe(const cxl_window* w, words k, uint64_t off, uint64_t* v) noexcept nogil:
    if words is plain_words:
        v[0] = cxl_load64_volatile(w.plain + off)  # coherent: no stale copy to drop
        return 0
    else:
        return cxl_window_observe64(w, off, v)


cdef inline int _persist(const cxl_window* w, words k, uint64_t off) noexcept nogil:
    if words is plain_words:
        cxl_fence_sc()  # coherent: only the store -> load order is left to enforce
        return 0
    else:
        return cxl_window_persist(w, off, CXL_LINE_SIZE)


cdef inline int _publish(const cxl_window* w, words k, uint64_t off) noexcept nogil:
    if words is plain_words:
        cxl_fence_release()  # coherent x86: TSO keeps store order
        return 0
    else:
        return cxl_window_publish(w, off, CXL_LINE_SIZE)


cdef inline int _snapshot(cxl_lockctx* L, const cxl_window* w, uint64_t rec,
                          cxl_lock_node_line* lines) noexcept nogil:
    """Observe every node's line of the record at `rec` at once (contract words only).

    The bakery's reads of different nodes may happen in any order (Lamport's proof
    holds for any order of the scan), so one observe of the whole run of lines serves
    a scan; the order that matters, a node's `choosing` seen 0 before its ticket is
    read, is kept by taking a second snapshot for the tickets. Over rdma: this is
    one READ where a word at a time was one per node (perf/round_trips.py)."""
    return cxl_observe(w.r, cxl_lock_line_off(rec, 0), lines,
                       L.nodes * sizeof(cxl_lock_node_line))


cdef inline int _open(cxl_lockctx* L, uint32_t id, cxl_window* w) noexcept nogil:
    """Lock `id`'s whole record as one checked window."""
    return cxl_window_open(w, L.r, cxl_lock_record(L, id), cxl_lock_record_bytes(L.nodes))


cdef inline int _withdraw(cxl_lockctx* L, uint32_t id, const cxl_window* w, words k) noexcept nogil:
    """Not choosing, ticket 0, published (a release: store order suffices)."""
    cdef uint64_t me = cxl_lock_line(L, id, L.node)
    cdef uint64_t pair[2]
    cdef int rc
    if words is plain_words:
        rc = _store(w, k, cxl_ln_choosing(me), 0)
        if rc == 0:
            rc = _store(w, k, cxl_ln_number(me), 0)
    else:
        # Both words in one store (one request over rdma:). Their order does not
        # matter here: a reader that sees choosing still 1 waits, one that sees the
        # old ticket waits until it is 0, and either is a state the line has had.
        pair[0] = pair[1] = 0
        rc = cxl_store(w.r, cxl_ln_choosing(me), pair, sizeof(pair))
    if rc == 0:
        rc = _publish(w, k, me)
    return rc


cdef inline int _enter(cxl_lockctx* L, uint32_t id, uint64_t deadline, bint acquire) noexcept nogil:
    """Open lock `id`'s record as one checked window, then acquire (or withdraw) on it,
    with the code compiled for its kind of words (see `words`)."""
    cdef cxl_window w
    cdef plain_words plain
    cdef contract_words ops
    cdef int rc = _open(L, id, &w)
    plain.unused = ops.unused = 0
    if rc != 0:
        return rc
    if w.plain != NULL:
        return _acquire(L, id, &w, plain, deadline) if acquire else _withdraw(L, id, &w, plain)
    return _acquire(L, id, &w, ops, deadline) if acquire else _withdraw(L, id, &w, ops)


cdef inline int cxl_bakery_release(cxl_lockctx* L, uint32_t id) noexcept nogil:
    """Leave the bakery (also a dead holder's leftovers: our node's line only)."""
    return _enter(L, id, 0, False)


cdef inline int cxl_bakery_acquire(cxl_lockctx* L, uint32_t id, uint64_t deadline) noexcept nogil:
    """Take a ticket one above every ticket we observe, then wait our turn.

    Budget, uncontended on a coherent direct mapping: four stores and, per other
    node, three loads; two store -> load fences and one release fence.
    """
    return _enter(L, id, deadline, True)


cdef inline int _acquire(cxl_lockctx* L, uint32_t id, const cxl_window* w, words k,
                  uint64_t deadline) noexcept nogil:
    """cxl_bakery_acquire on an open window, its words accessed as `k` says."""
    cdef uint64_t rec = cxl_lock_record(L, id), me = cxl_lock_line_off(rec, L.node)
    cdef uint64_t v = 0, mx = 0, ticket
    cdef uint32_t j, node = L.node
    cdef cxl_lock_node_line lines[CXL_MAX_NODES]  # contract words: the last snapshot
    cdef int rc = _store(w, k, cxl_ln_choosing(me), 1)
    if rc == 0:  # choosing = 1 is visible before we read anyone's ticket (store -> load)
        rc = _persist(w, k, me)
    if words is plain_words:
        for j in range(L.nodes):
            if rc != 0:
                break
            if j != node:
                rc = _observe(w, k, cxl_ln_number(cxl_lock_line_off(rec, j)), &v)
                if v > mx:
                    mx = v
    elif rc == 0:
        rc = _snapshot(L, w, rec, lines)
        for j in range(L.nodes):
            if rc == 0 and j != node and lines[j].number > mx:
                mx = lines[j].number
    ticket = mx + 1
    if rc == 0:
        rc = _store(w, k, cxl_ln_number(me), ticket)
    if rc == 0:  # the ticket is published before choosing drops (store -> store)
        rc = _publish(w, k, me)
    if rc == 0:
        rc = _store(w, k, cxl_ln_choosing(me), 0)
    if rc == 0:  # our ticket is visible before we read the others' (store -> load)
        rc = _persist(w, k, me)
    if rc == 0:
        if unlikely(L.armed[0]):
            cxl_crash_hit(b"lock.acquire.ticket")
        rc = _bakery_wait(L, rec, w, k, ticket, deadline, lines)
    if rc == 0 and unlikely(w.r.closed):  # what a plain window read may be retired zeros
        rc = CXLRT_E_CLOSED
    if rc != 0:
        _withdraw(L, id, w, k)
        return rc
    # Our own line, our own statistics: published with the release. Only we write
    # it, so the wait's snapshot holds its current value (no request of its own).
    if words is plain_words:
        if _load(w, k, cxl_ln_acq(me), &v) == 0:
            _store(w, k, cxl_ln_acq(me), v + 1)
    elif not cxl_live_fenced(L.live):  # a stale life's count would undo the new life's
        _store(w, k, cxl_ln_acq(me), lines[node].acquisitions + 1)
    return 0


cdef inline int _wait_tick(cxl_lockctx* L, uint32_t j, uint64_t* next_check,
                          uint64_t deadline) noexcept nogil:
    """While waiting on node j: 1 if j is dead, CXLRT_E_TIMEOUT past the deadline, else 0.

    The clock is read only once we actually wait, and j's heartbeat only every
    CXL_DEAD_CHECK_NS, so an uncontended wait costs nothing here.
    """
    cdef uint64_t now
    if next_check[0] == 0:
        next_check[0] = cxl_now_ns() + CXL_DEAD_CHECK_NS
        return 0
    now = cxl_now_ns()
    if now <= next_check[0]:
        return 0
    if cxl_node_dead(L, j):
        return 1
    next_check[0] = now + CXL_DEAD_CHECK_NS
    return CXLRT_E_TIMEOUT if now > deadline else 0


cdef inline bint _ahead(cxl_lockctx* L, uint32_t j, uint64_t v, uint64_t ticket) noexcept nogil:
    """Whether node j's ticket v comes before ours: a smaller (ticket, node), 0 = none."""
    return v != 0 and (v < ticket or (v == ticket and j < L.node))


cdef inline int _bakery_wait(cxl_lockctx* L, uint64_t rec, const cxl_window* w, words k,
                             uint64_t ticket, uint64_t deadline,
                             cxl_lock_node_line* lines) noexcept nogil:
    """Wait until no node is choosing or holds a smaller (ticket, node); a dead node's
    line no longer counts. 0, or an error (the caller withdraws our ticket).

    Fast path: one look at each other node's line (choosing, then ticket); only a node
    that is choosing or ahead of us is waited on, in _wait_on. With contract words the
    look is two snapshots of every line (`lines` keeps the second): the first for
    `choosing`, the second, taken after it, for the tickets of the nodes not choosing.
    """
    cdef uint64_t ln, v = 0, settled = 0
    cdef uint32_t j, node = L.node
    cdef int rc = 0
    if words is contract_words:
        rc = _snapshot(L, w, rec, lines)
        for j in range(L.nodes):
            if rc == 0 and j != node and lines[j].choosing == 0:
                settled |= <uint64_t>1 << j
        if rc == 0 and settled:
            rc = _snapshot(L, w, rec, lines)
        if rc != 0:
            return rc
    for j in range(L.nodes):
        if j == node:
            continue
        ln = cxl_lock_line_off(rec, j)
        if words is contract_words:
            if (settled >> j) & 1 and not _ahead(L, j, lines[j].number, ticket):
                continue
        else:
            rc = _observe(w, k, cxl_ln_choosing(ln), &v)
            if rc == 0 and v == 0:
                rc = _observe(w, k, cxl_ln_number(ln), &v)
                if rc == 0 and not _ahead(L, j, v, ticket):
                    continue
        if rc == 0:
            rc = _wait_on(L, w, k, j, ln, ticket, deadline)
        if rc != 0:
            return rc
    return 0


cdef inline int _wait_on(cxl_lockctx* L, const cxl_window* w, words k, uint32_t j, uint64_t ln,
                  uint64_t ticket, uint64_t deadline) noexcept nogil:
    """Slow path: wait while node j is choosing, then while its ticket is ahead of ours,
    backing off, until j is done or dead. 0, or an error."""
    cdef uint64_t word = cxl_ln_choosing(ln), v = 0, spins = 0, next_check = 0
    cdef int rc, tick
    while True:
        if unlikely(w.r.closed):  # a plain window's words do not check it themselves
            return CXLRT_E_CLOSED
        if unlikely(cxl_atomic_load_acquire32(&L.closing)):  # leave while the mapping lives
            return CXLRT_E_CLOSED
        rc = _observe(w, k, word, &v)
        if rc != 0:
            return rc
        if word != cxl_ln_number(ln):
            if v == 0:  # j has its ticket (or none): now compare tickets
                word = cxl_ln_number(ln)
                continue
        elif not _ahead(L, j, v, ticket):
            return 0
        tick = _wait_tick(L, j, &next_check, deadline)
        if tick == 1:
            return 0  # j is dead: its ticket no longer counts
        if tick < 0:
            return tick
        cxl_backoff(&spins)
