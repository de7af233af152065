# cython: language_level=3
"""``Channel``: a single-producer / single-consumer message ring in a region.

A prefill worker tells a decode worker "request R: these keys are ready" with
no network: the producer DMA-writes a message into the next slot of a ring in
the region, then publishes its tail counter; the consumer observes the tail,
DMA-reads the slot, then publishes its head counter. Each counter lives on a
line with one writer (see channel.pxd for the layout and invariants), so the
channel needs no lock and no cross-node atomic per message.

Roles: the first ``send()`` through a Channel object makes its process the
producer and the first ``recv()``/``try_recv()`` makes it the consumer. The
claim (node, incarnation, pid, start time, pid namespace, boot, epoch) is
written on the role's own claim line under the region lock "cxlrt.channel".
Another process asking for a role whose owner may be alive gets
:class:`ChannelBusyError`. The role is taken over only when its owner is
certainly gone, as judged by :mod:`cxlrt.liveness`:

- it ``close()``-d the channel (the role is free);
- its process is dead by (pid, start time), and it ran in our boot and our pid
  namespace (a process of another pid namespace is never judged by pid);
- its node is dead (its heartbeat counter stood still for a lease on our clock)
  or detached, or the node has begun another life since the claim.

A takeover bumps the epoch. The old owner, if it was only stalled, learns it at
its next publish and raises :class:`ChannelRoleLostError`; a send or recv that
returned was delivered, or taken, exactly once, across takeovers.
"""

import os
import time
import weakref

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy

from cxlrt.backend cimport (cxl_dma_read, cxl_dma_write, cxl_fence, cxl_flush, cxl_load64,
                            cxl_observe64, cxl_persist, cxl_region, cxl_store64)
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport (cxl_backoff, cxl_fence_release, cxl_now_ns, cxl_pid,
                                    likely, unlikely)
from cxlrt.includes.intrin cimport CXL_ASSERT, CXLRT_DEBUG, CXLRT_TEST_HOOK
from cxlrt.includes.thread cimport cxl_atomic_load_acquire64
from cxlrt.layout cimport (CXL_LINE_SIZE, cxl_chan_claim_epoch_off, cxl_chan_claim_off,
                           cxl_chan_claim_owner_off, cxl_chan_claim_run_off,
                           cxl_chan_claim_src_off, cxl_chan_run_base_off, cxl_chan_run_flags_off,
                           cxl_chan_run_key_off, cxl_chan_run_line, cxl_chan_run_seq_off,
                           cxl_chan_run_src_off,
                           cxl_chan_runs_off, cxl_chan_slot_num_off)
from cxlrt.liveness cimport Liveness, cxl_live_fenced, cxl_live_silent_since
from cxlrt.region cimport Region
from cxlrt.status cimport CXLRT_E_CHANCORRUPT, CXLRT_E_CHANLOST

from cxlrt import layoutinfo
from cxlrt.crash import point as _point
from cxlrt.formats import Format
from cxlrt.directory import check_name
from cxlrt.errors import (ChannelBusyError, ChannelRoleLostError, DebugBuildRequired, LeaseLost,
                          RegionError)
from cxlrt import rolelock
from cxlrt.liveness import boot_hash, pid_namespace, process_alive, process_start

CHAN_MAGIC = int.from_bytes(b"CXLCHAN2", "little")
OLD_MAGICS = {int.from_bytes(b"CXLCHAN1", "little"): 1}  # layouts this build refuses
LOCK_NAME = "cxlrt.channel"       # creation and role claims of every channel
PREFIX = "chan/"                  # directory key of channel `name`
MAX_NAME = 64 - len(PREFIX)       # bytes of UTF-8 (directory names are <= 64)
RUNS = CXL_CHAN_RUNS              # run lines per role
HEADER_BYTES = CXL_CHAN_HEADER    # header, claim and run lines before the ring

cdef enum:
    # A blocked send/recv comes back for the GIL this often, to notice signals
    # (Ctrl-C) and close(); the wait itself runs without the GIL.
    _SLICE_NS = 50000000
    # Messages below this many bytes are sent/received without releasing the
    # GIL when they need no wait: releasing it costs more than the copy.
    _NOGIL_BYTES = 4096
    PUBLISH_TRIES = 3  # stores of a counter whose medium failed (_publish)

cdef uint64_t NONE = <uint64_t>-1

# Member offsets for the Python layer's word-by-word writes (from the compiled structs).
_HEADER = Format("cxl_chan_header")
_CLAIM = Format("cxl_chan_claim")
_CLAIM_AT = {f.name: f.offset for f in layoutinfo.fields("cxl_chan_claim")}
_RUN_AT = {f.name: f.offset for f in layoutinfo.fields("cxl_chan_run")}
_NODE_INCARNATION = layoutinfo.offset("cxl_node_area", "incarnation")

assert sizeof(cxl_chan_header) == 64 and sizeof(cxl_chan_claim) == 64
assert sizeof(cxl_chan_run) == 64
assert CXL_CHAN_HEADER == 64 * (3 + 2 * CXL_CHAN_RUNS)

cdef int* _armed = cxl_crash_armed_ptr()

# Set by _test_skip_observe(): observe() then loads without flushing first.
# Only for the negative-control test; read only through CXLRT_TEST_HOOK (debug builds).
cdef bint _skip_observe = False
# Set by _test_skip_fencing(): owners never look at their epoch. Negative control only.
cdef bint _skip_fencing = False


# --- fast paths (no GIL, no Python) ------------------------------------------------------

cdef inline int _observe64(const cxl_region* r, uint64_t off, uint64_t* v) noexcept nogil:
    """The contract's observe; the negative-control hook (debug builds) skips the
    invalidate, which the emulation's checker must catch."""
    if unlikely(CXLRT_TEST_HOOK(_skip_observe)):
        return cxl_load64(r, off, v)
    return cxl_observe64(r, off, v)


cdef inline uint64_t _line(uint64_t runs, uint64_t x) noexcept nogil:
    """Offset of the line run `x` of a role lives on."""
    return cxl_chan_run_line(runs, x, CXL_CHAN_RUNS)


cdef inline int _corrupt(cxl_chan* C, uint32_t kind, uint64_t value, uint64_t off) noexcept nogil:
    """Record what was wrong for the Python layer's message; CXLRT_E_CHANCORRUPT."""
    C.bad_kind = kind
    C.bad_value = value
    C.bad_off = off
    return CXLRT_E_CHANCORRUPT


cdef int _read_seq(const cxl_region* r, uint64_t line, uint64_t x, uint64_t* seq) noexcept nogil:
    """Observe the counter of a run we have not read before: 0, CXL_CHAN_AGAIN if its
    line holds another run (not set up yet), or an error. Key first: a line whose key
    is x was complete when the key was stored (pairs with the run owner's persist), so
    the counter, observed afresh after it, is run x's. Callers then confirm that the
    claim still names x."""
    cdef uint64_t tag = 0
    cdef int rc = _observe64(r, cxl_chan_run_key_off(line), &tag)
    if rc != 0:
        return rc
    if tag != x:
        return CXL_CHAN_AGAIN
    return _observe64(r, line, seq)


cdef int _read_run(const cxl_region* r, uint64_t line, uint64_t x, uint64_t* base,
                   uint64_t* src, uint64_t* flags) noexcept nogil:
    """Observe run x's line (key, fields, key again): 0, CXL_CHAN_AGAIN if it holds
    another run (not written yet, or replaced meanwhile), or an error. The fields read
    here never change during run x (its counter, which does, is not read)."""
    cdef uint64_t tag = 0, tag2 = 0
    cdef int rc = cxl_observe64(r, cxl_chan_run_key_off(line), &tag)
    if rc == 0 and tag == x:
        rc = cxl_load64(r, cxl_chan_run_base_off(line), base)
        if rc == 0:
            rc = cxl_load64(r, cxl_chan_run_src_off(line), src)
        if rc == 0:
            rc = cxl_load64(r, cxl_chan_run_flags_off(line), flags)
        if rc == 0:
            rc = cxl_load64(r, cxl_chan_run_key_off(line), &tag2)
    if rc != 0:
        return rc
    return 0 if tag == x and tag2 == x else CXL_CHAN_AGAIN


cdef int _successor(cxl_chan* C, uint64_t claim, uint64_t runs, uint64_t x, uint64_t* succ,
                    uint64_t* base, uint64_t* flags) noexcept nogil:
    """The run that continued from run x, and its base (where x ends for everyone).

    Walks back from the claim's run along the runs' sources. 0; CXL_CHAN_AGAIN while
    that run is still being set up (or x is still current); CXLRT_E_CHANCORRUPT when
    the chain is broken (more than CXL_CHAN_RUNS runs passed since x, or corrupt).
    A run whose claimant stopped before writing its line is bypassed by the next
    claim, whose source is then the stopped one's source.
    """
    cdef uint64_t R = 0, S = 0, R2 = 0, cur, s = 0, b = 0, f = 0, steps = 0
    # Each word observed afresh (the claim may change meanwhile); a run's source is
    # fixed when the run is claimed, so if the run is the same before and after, the
    # source we read is that run's.
    cdef int rc = _observe64(C.r, cxl_chan_claim_run_off(claim), &R)
    if rc == 0:
        rc = _observe64(C.r, cxl_chan_claim_src_off(claim), &S)
    if rc == 0:
        rc = _observe64(C.r, cxl_chan_claim_run_off(claim), &R2)
    if rc != 0:
        return rc
    if R != R2 or R == x:
        return CXL_CHAN_AGAIN
    if R < x:
        return _corrupt(C, CXL_CHAN_BAD_RUN, R, cxl_chan_claim_run_off(claim))
    cur = R
    rc = _read_run(C.r, _line(runs, cur), cur, &b, &s, &f)
    if rc < 0:
        return rc
    if rc == CXL_CHAN_AGAIN:  # being set up, or its claimant stopped: its source is the claim's
        s = S
        b = NONE
        f = 0
    while True:
        if s == x:
            if b == NONE:
                return CXL_CHAN_AGAIN
            succ[0] = cur
            base[0] = b
            flags[0] = f
            return 0
        if s >= cur or s < x or steps >= CXL_CHAN_RUNS:
            return _corrupt(C, CXL_CHAN_BAD_RUN, s, cxl_chan_run_src_off(_line(runs, cur)))
        cur = s
        steps += 1
        rc = _read_run(C.r, _line(runs, cur), cur, &b, &s, &f)
        if rc < 0:
            return rc
        if rc == CXL_CHAN_AGAIN:  # a run of the chain was replaced: its history is gone
            return _corrupt(C, CXL_CHAN_BAD_RUN, cur, cxl_chan_run_key_off(_line(runs, cur)))


cdef inline int _epoch_ok(const cxl_region* r, uint64_t claim, uint64_t epoch,
                          uint64_t* ok_ns) noexcept nogil:
    """Observe our claim's epoch: 0 while it is ours (and *ok_ns = now), else
    CXLRT_E_CHANLOST. Pairs with a taker's persist of the claim, made before it reads
    our counter: if we still see our epoch after our publish, the taker sees the publish."""
    cdef uint64_t e = 0
    cdef int rc
    if unlikely(CXLRT_TEST_HOOK(_skip_fencing)):
        return 0
    rc = _observe64(r, claim, &e)
    if rc != 0:
        return rc
    if e != epoch:
        return CXLRT_E_CHANLOST
    ok_ns[0] = cxl_now_ns()
    return 0


cdef inline int _epoch_still(cxl_chan* C, uint64_t claim, uint64_t epoch,
                             uint64_t* ok_ns) noexcept nogil:
    """Is our claim still in our epoch? 0 if so, else CXLRT_E_CHANLOST.

    A takeover needs us gone by the liveness rules: our process dead (impossible
    while we run), or our node silent for a lease as another node's clock sees it, or
    our node in another life (which sets `fenced`). So while our node has beaten with
    no gap longer than the lease since *ok_ns, when we last saw our epoch, our own
    timestamps vouch for the epoch (the lock's LeaseLost rests on the same rule).
    Otherwise (silent, fenced, or no liveness) we observe the epoch itself.
    Budget when we were not silent: two process-local loads and a clock read.
    """
    if C.live != NULL:
        if likely(not cxl_live_silent_since(C.live, ok_ns[0])) or unlikely(
                CXLRT_TEST_HOOK(_skip_fencing)):
            return 0
    return _epoch_ok(C.r, claim, epoch, ok_ns)


cdef inline int _epoch_before(cxl_chan* C, uint64_t claim, uint64_t epoch,
                              uint64_t* ok_ns) noexcept nogil:
    """Before we write anything: _epoch_still without the clock read. It sees a silence
    once our beat thread has recorded it (or our node's life ended), not one we are
    still inside; the check after our publish, which reads the clock, decides.
    Budget: two process-local loads."""
    if C.live != NULL and likely(not cxl_live_fenced(C.live)) and likely(
            cxl_atomic_load_acquire64(&C.live.gap_end) < ok_ns[0]):
        return 0
    return _epoch_still(C, claim, epoch, ok_ns)


cdef inline int _publish(cxl_chan* C, uint64_t line, uint64_t* counter, uint64_t claim,
                         uint64_t epoch, uint64_t* ok_ns, const char* point) noexcept nogil:
    """Publish counter + 1 on our run line, then re-check our epoch: 0, CXLRT_E_CHANLOST
    (published, but the role may no longer be ours), or an error."""
    cdef int rc, tries
    cdef uint64_t v = 0
    CXL_ASSERT((line == C.p_line) | (line == C.c_line), b"a counter not on our run line")
    CXL_ASSERT((line & 63) == 0, b"a run line that is not a whole cache line")
    # Release: the slot's DMA (send) or reads (recv) complete before the counter moves
    # (pairs with the acquire fence of the other end after it observes the counter).
    cxl_fence_release()
    # A failed store or publish may still have landed (in our view, which any later
    # flush of the line writes back; or on the medium, its answer lost), and then the
    # other end sees this number now or later. Storing the same number again is
    # harmless (our run line has one writer, us, and no taker continues the run of a
    # live owner), so say it again: the call then has one outcome, done.
    for tries in range(PUBLISH_TRIES):
        rc = cxl_store64(C.r, line, counter[0] + 1)
        if rc == 0:
            # Publish (pairs with the other end's observe in _observe_tail/_observe_head).
            rc = cxl_persist(C.r, line, sizeof(uint64_t))
        if rc == 0:
            break
    if rc != 0:
        # Still failing: if the number is in our view, it reaches the other end, and the
        # next message must take the next one (reusing it would write that message
        # over a slot the consumer may be reading, and lose it). Our view says what the
        # other end will see. A sender is told it failed (a repeat may then arrive
        # twice, never garbled and never instead of another); a receiver whose head
        # moved has taken the message, and gets it: raising would lose it.
        for tries in range(PUBLISH_TRIES):
            if cxl_load64(C.r, line, &v) == 0:
                break
        if v != counter[0] + 1 or line != C.c_line:
            if v == counter[0] + 1:
                counter[0] += 1
            return rc
    counter[0] += 1
    if unlikely(_armed[0]):
        cxl_crash_hit(point)
    # Still ours when the counter became visible? Then a taker, whose claim comes
    # later, reads our counter after it and its base includes this message.
    return _epoch_still(C, claim, epoch, ok_ns)


cdef int _observe_head(cxl_chan* C) noexcept nogil:
    """Refresh C.seen_head from the consumer's current run: 0 when it moved,
    CXL_CHAN_AGAIN when it did not (or a consumer claim is being set up), or an error.

    A head is valid only if the consumer claim still names its run after we read it
    (pairs with a consumer taker, which publishes its claim before reading the old
    head for its base): a resumed stale consumer's later head is never used.
    """
    cdef uint64_t h = 0, R = 0, R2 = 0
    cdef int rc = CXL_CHAN_AGAIN
    if C.c_run_seen != NONE:
        # Our run's line holds it until a claim names a run RUNS later: if the claim
        # still names it after we read head, so did the line when we read it.
        rc = _observe64(C.r, _line(C.cruns, C.c_run_seen), &h)
        if rc == 0:
            rc = _observe64(C.r, cxl_chan_claim_run_off(C.cclaim), &R)
        if rc < 0:
            return rc
        if R != C.c_run_seen:
            rc = CXL_CHAN_AGAIN
    if rc != 0:  # the consumer's run changed: read the new one's head, then confirm it
        rc = _observe64(C.r, cxl_chan_claim_run_off(C.cclaim), &R)
        if rc == 0:
            rc = _read_seq(C.r, _line(C.cruns, R), R, &h)
        if rc == 0:
            rc = _observe64(C.r, cxl_chan_claim_run_off(C.cclaim), &R2)
            if rc == 0 and R2 != R:
                rc = CXL_CHAN_AGAIN
        if rc != 0:
            return rc
        C.c_run_seen = R
    # head only grows and never passes our tail: seen_head <= h <= tail.
    if unlikely(h - C.seen_head > C.tail - C.seen_head):
        return _corrupt(C, CXL_CHAN_BAD_HEAD, h, _line(C.cruns, C.c_run_seen))
    if h == C.seen_head:
        return CXL_CHAN_AGAIN
    C.seen_head = h
    # Acquire: our DMA into the freed slots starts after the load of head
    # (pairs with the consumer's release fence before it publishes head).
    return cxl_fence(C.r)


cdef inline int _room(cxl_chan* C) noexcept nogil:
    """0 if the ring has a free slot for message C.tail, CXL_CHAN_AGAIN if full."""
    cdef int rc
    if likely(C.tail - C.seen_head < C.slots):
        return 0
    rc = _observe_head(C)
    if rc != 0:
        return rc
    return 0 if C.tail - C.seen_head < C.slots else CXL_CHAN_AGAIN


cdef int _send_slow(cxl_chan* C) noexcept nogil:
    """A new run's hole, then its quarantined slot: 0 to go on, CXL_CHAN_AGAIN to wait."""
    cdef int rc
    if C.p_hole:
        rc = _room(C)
        if rc != 0:
            return rc
        # Publish the hole: message C.tail is the stalled old owner's, and its slot is
        # never read (pairs with the consumer's observe of tail).
        rc = cxl_store64(C.r, C.p_line, C.tail + 1)
        if rc == 0:
            rc = cxl_persist(C.r, C.p_line, sizeof(uint64_t))
        if rc != 0:
            return rc
        C.tail += 1
        C.p_hole = 0
    if C.q_until:
        if cxl_now_ns() >= C.q_until:
            C.q_until = 0
        elif C.tail % C.slots == C.q_slot:
            return CXL_CHAN_AGAIN  # the old owner may still write there: wait out a lease
    return 0


cdef int cxl_chan_send_try(cxl_chan* C, const char* p, uint64_t n) noexcept nogil:
    """Send one message if the ring has room: 0, CXL_CHAN_AGAIN when full, or an error.

    Budget while the last validated head leaves room: one DMA (two above
    CXL_CHAN_COPY_MAX bytes), one store and persist, and our silence checks (a few
    process-local loads and one clock read); our epoch is observed only after a
    silence. Pre: n <= msg_bytes, we own the producer role. CXLRT_E_CHANLOST with
    C.p_lost_phase 0: nothing was published; 1: the tail was, and the Python layer
    decides from the new run's base whether the message counts.
    """
    cdef uint64_t slot
    cdef uint64_t hdr[2]
    cdef int rc
    cdef char buf[CXL_CHAN_COPY_MAX + CXL_CHAN_LEN]
    C.p_lost_phase = 0
    rc = _epoch_before(C, C.pclaim, C.p_epoch, &C.p_ok_ns)  # stop before writing the slot
    if unlikely(rc != 0):
        return rc
    if unlikely(C.p_hole or C.q_until):
        rc = _send_slow(C)
        if rc != 0:
            return rc
    rc = _room(C)
    if rc != 0:
        return rc
    CXL_ASSERT(n <= C.msg_bytes, b"a message longer than the channel's (pre: n <= msg_bytes)")
    CXL_ASSERT(C.tail - C.seen_head < C.slots, b"sending into a slot the consumer has not freed")
    slot = C.ring + (C.tail % C.slots) * C.slot_bytes
    hdr[0] = n
    hdr[1] = C.tail  # the message number: a consumer checks it against its head
    if n <= CXL_CHAN_COPY_MAX:
        memcpy(buf, hdr, CXL_CHAN_LEN)
        memcpy(buf + CXL_CHAN_LEN, p, n)
        rc = cxl_dma_write(C.r, slot, buf, n + CXL_CHAN_LEN)
    else:
        rc = cxl_dma_write(C.r, slot + CXL_CHAN_LEN, p, n)
        if rc == 0:
            rc = cxl_dma_write(C.r, slot, hdr, CXL_CHAN_LEN)
    if rc != 0:
        return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"chan.send")
    # The DMA is complete and visible on return; the tail store stays after it.
    rc = _publish(C, C.p_line, &C.tail, C.pclaim, C.p_epoch, &C.p_ok_ns, b"chan.send.post")
    if unlikely(rc == CXLRT_E_CHANLOST):
        C.p_lost_phase = 1
    return rc


cdef int cxl_chan_send_wait(cxl_chan* C, const char* p, uint64_t n,
                            uint64_t until_ns) noexcept nogil:
    """cxl_chan_send_try, spinning then sleeping while full, until `until_ns` (monotonic)."""
    cdef uint64_t spins = 0
    cdef int rc
    while True:
        rc = cxl_chan_send_try(C, p, n)
        if rc != CXL_CHAN_AGAIN or cxl_now_ns() >= until_ns:
            return rc
        cxl_backoff(&spins)


cdef int _observe_tail(cxl_chan* C) noexcept nogil:
    """Validate a tail beyond C.head: 0 (C.seen_tail > C.head), CXL_CHAN_AGAIN when
    nothing new is published, or an error. Follows the producer's runs.

    A tail read from run x's line counts only if the producer claim still names x
    after the read (pairs with a producer taker, which publishes its claim before it
    reads x's tail for its base). Once the claim names a later run, x ends at that
    run's base, whatever a resumed stale owner of x publishes later.
    """
    cdef uint64_t t = 0, R = 0, x = 0, b = 0, s = 0, f = 0
    cdef int rc
    while True:
        if C.p_end != NONE:
            if C.head < C.p_end:
                C.seen_tail = C.p_end
                return cxl_fence(C.r)  # acquire: the slot reads follow the validating loads
            # Message `head` is the successor's: its line was complete when we found it.
            rc = _read_run(C.r, _line(C.pruns, C.p_next), C.p_next, &b, &s, &f)
            if rc < 0:
                return rc
            if rc != 0 or b != C.head:
                return _corrupt(C, CXL_CHAN_BAD_RUN, C.p_next,
                                cxl_chan_run_key_off(_line(C.pruns, C.p_next)))
            C.p_run_seen = C.p_next
            C.p_end = NONE
            if f & CXL_CHAN_RUN_HOLE:
                C.hole_at = b
        # Budget: two observes. The run's line holds it until a claim names a run RUNS
        # later, so a claim naming it after our read vouches for the value we read.
        rc = _observe64(C.r, _line(C.pruns, C.p_run_seen), &t)
        if rc != 0:
            return rc
        rc = _observe64(C.r, cxl_chan_claim_run_off(C.pclaim), &R)
        if rc != 0:
            return rc
        if R == C.p_run_seen:
            # tail only grows and stays within `slots` of our head (wraps show as huge).
            if unlikely(t - C.head > C.slots):
                return _corrupt(C, CXL_CHAN_BAD_TAIL, t, _line(C.pruns, C.p_run_seen))
            if t == C.head:
                return CXL_CHAN_AGAIN
            C.seen_tail = t
            # Acquire: the slot reads start after the load of tail (pairs with the
            # producer's release fence between its DMA and its tail store).
            return cxl_fence(C.r)
        rc = _successor(C, C.pclaim, C.pruns, C.p_run_seen, &x, &b, &f)
        if rc != 0:
            return rc
        if unlikely(b - C.head > C.slots):
            return _corrupt(C, CXL_CHAN_BAD_TAIL, b, cxl_chan_run_base_off(_line(C.pruns, x)))
        C.p_end = b
        C.p_next = x


cdef int _skip_hole(cxl_chan* C) noexcept nogil:
    """Consume the hole at head: publish head + 1 without reading the slot."""
    cdef int rc = _epoch_before(C, C.cclaim, C.c_epoch, &C.c_ok_ns)
    if rc == 0:
        rc = cxl_store64(C.r, C.c_line, C.head + 1)
    if rc == 0:
        rc = cxl_persist(C.r, C.c_line, sizeof(uint64_t))  # publish head (pairs with _observe_head)
    if rc == 0:
        C.head += 1
        C.hole_at = NONE
    return rc


cdef int cxl_chan_peek(cxl_chan* C) noexcept nogil:
    """Read the first line of the message at head: 0, CXL_CHAN_AGAIN when empty, or an error.

    Budget while the last validated tail is ahead of head: one 64-byte DMA read;
    tail (and the producer's run) is observed only when the ring looks empty. On 0,
    C.cur_len and C.first hold the length (checked) and the first line.
    """
    cdef uint64_t hdr[2]
    cdef uint64_t slot
    cdef int rc
    C.c_lost_phase = 0
    while True:
        if C.head == C.seen_tail:
            rc = _observe_tail(C)
            if rc != 0:
                return rc
        if unlikely(C.head == C.hole_at):
            rc = _skip_hole(C)
            if rc != 0:
                return rc
            continue
        break
    slot = C.ring + (C.head % C.slots) * C.slot_bytes
    rc = cxl_dma_read(C.r, slot, C.first, CXL_LINE_SIZE)  # slot_bytes >= a line: inside the slot
    if rc != 0:
        return rc
    memcpy(hdr, C.first, CXL_CHAN_LEN)
    if unlikely(hdr[0] > C.msg_bytes):
        return _corrupt(C, CXL_CHAN_BAD_LEN, hdr[0], slot)
    if unlikely(hdr[1] != C.head):
        return _corrupt(C, CXL_CHAN_BAD_NUM, hdr[1], cxl_chan_slot_num_off(slot))
    C.cur_len = hdr[0]
    return 0


cdef int cxl_chan_recv_wait(cxl_chan* C, uint64_t until_ns) noexcept nogil:
    """cxl_chan_peek, spinning then sleeping while empty, until `until_ns` (monotonic)."""
    cdef uint64_t spins = 0
    cdef int rc
    while True:
        rc = cxl_chan_peek(C)
        if rc != CXL_CHAN_AGAIN or cxl_now_ns() >= until_ns:
            return rc
        cxl_backoff(&spins)


cdef int cxl_chan_take(cxl_chan* C, char* out) noexcept nogil:
    """Copy the peeked message into `out` (C.cur_len bytes), then publish head + 1.

    CXLRT_E_CHANLOST with C.c_lost_phase 0: head was not published (the message is
    the new consumer's); 1: it was, and the Python layer decides from the new run's
    base whether the message counts as ours.
    """
    cdef uint64_t n = C.cur_len
    cdef uint64_t slot = C.ring + (C.head % C.slots) * C.slot_bytes
    cdef int rc = 0
    CXL_ASSERT(C.seen_tail - C.head - 1 < C.slots, b"head would pass the validated tail")
    CXL_ASSERT(n <= C.msg_bytes, b"a peeked length longer than the channel's messages")
    C.c_lost_phase = 0
    memcpy(out, C.first + CXL_CHAN_LEN, n if n < CXL_CHAN_INLINE else CXL_CHAN_INLINE)
    if n > CXL_CHAN_INLINE:
        rc = cxl_dma_read(C.r, slot + CXL_CHAN_LEN + CXL_CHAN_INLINE, out + CXL_CHAN_INLINE,
                          n - CXL_CHAN_INLINE)
        if rc != 0:
            return rc
    if unlikely(_armed[0]):
        cxl_crash_hit(b"chan.recv")
    rc = _epoch_before(C, C.cclaim, C.c_epoch, &C.c_ok_ns)  # stop before publishing head
    if unlikely(rc != 0):
        return rc
    # Every read of the slot is done before head moves and the producer may reuse it.
    rc = _publish(C, C.c_line, &C.head, C.cclaim, C.c_epoch, &C.c_ok_ns, b"chan.recv.post")
    if unlikely(rc == CXLRT_E_CHANLOST):
        C.c_lost_phase = 1
    return rc


cdef int cxl_chan_release(const cxl_region* r, uint64_t claim, uint64_t epoch,
                          uint64_t owner) noexcept nogil:
    """Clear the owner word of a claim line if it still names us (owner) in our epoch:
    a process that took the role over is the line's writer now, and a line has one
    writer. One word: a partial write-back cannot mix two claims."""
    cdef uint64_t e = 0, o = 0
    cdef int rc = cxl_observe64(r, cxl_chan_claim_epoch_off(claim), &e)
    if rc == 0:
        rc = cxl_load64(r, cxl_chan_claim_owner_off(claim), &o)
    if rc != 0 or e != epoch or o != owner:
        return rc
    rc = cxl_store64(r, cxl_chan_claim_owner_off(claim), 0)
    if rc == 0:
        rc = cxl_persist(r, claim, sizeof(cxl_chan_claim))
    return rc


# --- Python layer --------------------------------------------------------------------------

# Roles held through live Channel objects of this process:
# (pid, region uuid, channel offset, "producer"|"consumer") -> weakref(Channel).
# Two objects of one process must not share a role: each keeps its own counter.
_roles = {}
_IDS = {}  # pid -> (start time, pid namespace, boot) of this process


def _ids():
    """(start time, pid namespace, boot hash) of this process (a forked child has its own)."""
    pid = os.getpid()
    v = _IDS.get(pid)
    if v is None:
        _IDS.clear()
        v = _IDS[pid] = (process_start(pid), pid_namespace(), boot_hash())
    return v


def _check_name(name):
    check_name(name, "channel", MAX_NAME)


def _check_count(what, value, lo, hi):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in {lo}..{hi}, got {value}")


def _slot_bytes(msg_bytes):
    return (CXL_CHAN_LEN + msg_bytes + CXL_LINE_SIZE - 1) // CXL_LINE_SIZE * CXL_LINE_SIZE


def _deadline(timeout):
    """Monotonic ns deadline of a `timeout` in seconds (None: never)."""
    if timeout is None:
        return <uint64_t>-1
    t = float(timeout)
    if not t >= 0:  # also rejects NaN
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    return cxl_now_ns() + <uint64_t>min(t * 1e9, 1e18)


def _claim_words(r, uint64_t off):
    """The claim line at `off`, observed (one load of the line)."""
    r.flush(off, _CLAIM.size)
    c = _CLAIM.unpack(r.load(off, _CLAIM.size))
    return {"epoch": c.epoch, "run": c.run, "src": c.src, "owner": c.owner,
            "node": (c.owner & 0xFFFFFFFF) - 1, "pid": c.owner >> 32,
            "incarnation": c.incarnation, "start": c.start, "pidns": c.pidns, "boot": c.boot}


def _run_words(r, uint64_t runs, uint64_t x):
    """Run x's line, observed key first and key again; None if it holds another run."""
    line = _line(runs, x)
    r.flush(line, sizeof(cxl_chan_run))
    if r.load64(cxl_chan_run_key_off(line)) != x:
        return None
    base = r.load64(cxl_chan_run_base_off(line))
    src = r.load64(cxl_chan_run_src_off(line))
    flags = r.load64(cxl_chan_run_flags_off(line))
    r.flush(line, sizeof(cxl_chan_run))  # the counter may move meanwhile: observe it afresh
    seq = r.load64(cxl_chan_run_seq_off(line))
    if r.load64(cxl_chan_run_key_off(line)) != x:
        return None
    return {"seq": seq, "base": base, "src": src, "flags": flags, "line": line}


cdef class Channel:
    """A single-producer / single-consumer message channel in a region.

    Parameters
    ----------
    region : cxlrt.Region
        The region holding the channel.
    name : str
        1 to 59 bytes of UTF-8; the channel is the directory entry ``"chan/" + name``.
    slots : int or None, optional
        Messages the ring holds (default 64). When attaching, it must match the
        channel's (None accepts whatever it has).
    msg_bytes : int or None, optional
        Largest message in bytes (default 4096); each slot takes
        ``16 + msg_bytes`` rounded up to 64 bytes. Checked like `slots`.
    create : bool, optional
        Create the channel if the name is absent (default True); else KeyError.

    Notes
    -----
    One process sends and one receives (roles are claimed on first use, see
    the module docs); a Channel object serves one sending thread and one
    receiving thread at a time. Messages arrive in order, each once: a send()
    that returned is received exactly once, even across takeovers; a message
    whose send() raised is never received. A consumer killed between taking a
    message and returning it from recv() takes it with it (at most once).
    """

    def __init__(self, Region region not None, str name not None, *, slots=64,
                 msg_bytes=4096, bint create=True):
        _check_name(name)
        _check_count("slots", slots, 1, CXL_CHAN_MAX_SLOTS)
        _check_count("msg_bytes", msg_bytes, 1, CXL_CHAN_MAX_MSG)
        self.region = region
        region._closing.add(self)  # gives our roles back if the region closes first
        self.name = name
        self.C.r = region.r
        self.C.c_run_seen = NONE
        self.C.p_end = NONE
        self.C.hole_at = NONE
        live = region.liveness
        if live is not None:
            self._live = live
            self.C.live = (<Liveness>live).ctx()
        key = PREFIX + name
        try:
            off = region.get(key)
        except KeyError:
            if not create:
                raise KeyError(f"no channel {name!r} in {region.spec}") from None
            with region.lock(LOCK_NAME):
                try:
                    off = region.get(key)  # another creator won the race: attach to its
                except KeyError:
                    off = self._create(key, 64 if slots is None else slots,
                                       4096 if msg_bytes is None else msg_bytes)
        self._attach(off, slots, msg_bytes)

    def _create(self, key, slots, msg_bytes):
        """Allocate, initialise and name a channel (the channel lock is held)."""
        r = self.region
        sb = _slot_bytes(msg_bytes)
        total = CXL_CHAN_HEADER + slots * sb
        off = r.alloc(total, CXL_LINE_SIZE)
        try:
            # Write back and drop whatever our node cached of this memory's earlier
            # life, so the DMAs below (and the producer's) are never over our dirty lines.
            r.flush(off, total)
            # No owners, epoch 0, run 0 (whose zero-filled line is valid: seq 0, base 0).
            r.dma_write(off + _HEADER.size, bytes(CXL_CHAN_HEADER - _HEADER.size))
            r.dma_write(off, _HEADER.pack(  # magic 0 until the body is in the medium
                version=CXL_CHAN_VERSION, slots=slots, msg_bytes=msg_bytes, slot_bytes=sb,
                ring=CXL_CHAN_HEADER, runs=CXL_CHAN_RUNS, created_ns=time.time_ns()))
            # dma_write fences: the body is in the medium before the magic is.
            r.dma_write(off, CHAN_MAGIC.to_bytes(8, "little"))
            r.put(key, off)
        except BaseException:
            # A put that raised may still have named it (its answer lost after the
            # entry was decided): then the memory is the channel's, and freeing it
            # would leave the name on memory the next alloc hands out. Where we cannot
            # tell, it leaks.
            try:
                named = r.get(key) == off
            except Exception:  # noqa: BLE001  (the first error is the one to raise)
                named = True
            if not named:
                r.free(off)
            raise
        return off

    def _attach(self, off, slots, msg_bytes):
        """Validate the header at `off` against the region and the caller's geometry."""
        r = self.region
        where = f"channel {self.name!r} at offset {off:#x}"
        if off % 64 or off + CXL_CHAN_HEADER > r.size:
            raise RegionError(f"{where}: offset is not a 64-byte aligned object inside the "
                              f"region of {r.size} bytes (corrupt directory?)")
        # immutable since creation: never dirty anywhere
        h = _HEADER.unpack(r.dma_read(off, _HEADER.size))
        magic, version, h_slots, h_msg = h.magic, h.version, h.slots, h.msg_bytes
        h_sb, h_ring, h_runs = h.slot_bytes, h.ring, h.runs
        if magic in OLD_MAGICS:
            raise RegionError(f"{where} is a layout-version {OLD_MAGICS[magic]} channel, which "
                              f"keeps role claims beside its counters; this build reads "
                              f"version {CXL_CHAN_VERSION} only. Delete it (region.delete("
                              f"{PREFIX + self.name!r})) and create it again")
        if magic != CHAN_MAGIC:
            raise RegionError(f"{where} does not hold a channel (magic {magic:#x}; "
                              "another kind of object, or a creator died mid-way)")
        if version != CXL_CHAN_VERSION:
            raise RegionError(f"{where} has layout version {version}; this build reads "
                              f"version {CXL_CHAN_VERSION}")
        if not (1 <= h_slots <= CXL_CHAN_MAX_SLOTS and 1 <= h_msg <= CXL_CHAN_MAX_MSG
                and h_sb == _slot_bytes(h_msg) and h_ring == CXL_CHAN_HEADER
                and h_runs == CXL_CHAN_RUNS and off + h_ring + h_slots * h_sb <= r.size):
            raise RegionError(f"{where}: header is corrupt (slots={h_slots}, "
                              f"msg_bytes={h_msg}, slot_bytes={h_sb}, ring={h_ring}, "
                              f"runs={h_runs}) for a region of {r.size} bytes")
        diff = []
        if slots is not None and slots != h_slots:
            diff.append(f"slots={h_slots} (asked for {slots})")
        if msg_bytes is not None and msg_bytes != h_msg:
            diff.append(f"msg_bytes={h_msg} (asked for {msg_bytes})")
        if diff:
            raise ValueError(f"channel {self.name!r} exists with a different geometry: "
                             f"{', '.join(diff)}")
        self.offset = off
        self.C.pclaim = cxl_chan_claim_off(off, 0)
        self.C.cclaim = cxl_chan_claim_off(off, 1)
        self.C.pruns = cxl_chan_runs_off(off, 0, CXL_CHAN_RUNS)
        self.C.cruns = cxl_chan_runs_off(off, 1, CXL_CHAN_RUNS)
        self.C.ring = off + h_ring
        self.C.slots = h_slots
        self.C.msg_bytes = h_msg
        self.C.slot_bytes = h_sb

    # --- properties ----------------------------------------------------------------

    @property
    def slots(self):
        """Messages the ring holds."""
        return self.C.slots

    @property
    def msg_bytes(self):
        """Largest message, in bytes."""
        return self.C.msg_bytes

    @property
    def slot_bytes(self):
        """Bytes a slot takes in the region (16-byte header + msg_bytes, whole lines)."""
        return self.C.slot_bytes

    @property
    def ring_offset(self):
        """Region offset of slot 0; slot i is at ``ring_offset + i * slot_bytes``."""
        return self.C.ring

    @property
    def closed(self):
        return bool(self._closed)

    # --- roles ---------------------------------------------------------------------

    def owner(self, role):
        """The claim of `role`: ``{"node", "pid", "incarnation", "epoch", "run",
        "pidns", "boot"}``, or None when nobody holds it.

        Parameters
        ----------
        role : {"producer", "consumer"}
        """
        c = _claim_words(self.region, self._claim_off(role))
        if not c["owner"]:
            return None
        return {k: c[k] for k in ("node", "pid", "incarnation", "epoch", "run", "pidns",
                                  "boot")}

    def _claim_off(self, role):
        if role == "producer":
            return self.C.pclaim
        if role == "consumer":
            return self.C.cclaim
        raise ValueError(f"role is 'producer' or 'consumer', not {role!r}")

    def _runs_off(self, role):
        return self.C.pruns if role == "producer" else self.C.cruns

    def _node_incarnation(self, node):
        """The current life of `node`, observed in its node area (written by that node)."""
        r = self.region
        if node == r.node:
            return self._live.incarnation
        off = r.node_area(node)
        r.flush(off, CXL_LINE_SIZE)
        return r.load64(off + _NODE_INCARNATION)

    def _judge(self, c):
        """'alive', 'dead' (certainly gone: it cannot write again) or 'silent' (gone by
        its node's liveness: it may be stalled and resume).

        A process is judged by (pid, start time) in our boot and pid namespace; in
        another pid namespace of our node by the role lock, which the claim took
        first (rolelock.py: no live process of our node holds the role); anywhere
        else only its node's heartbeat and incarnation can tell.
        """
        r = self.region
        _, pidns, boot = _ids()
        if c["boot"] == boot and c["pidns"] == pidns and not process_alive(
                c["pid"], c["start"], c["pidns"]):
            return "dead"
        node = c["node"]
        if node == r.node and c["boot"] == boot and c["pidns"] != pidns:
            return "dead"
        if not 0 <= node < r.nodes:
            return "silent"  # a scribbled owner word names no node: nobody can hold it
        state = r.liveness.state(node)
        if state in ("dead", "never attached"):
            return "silent"
        if self._node_incarnation(node) != c["incarnation"]:
            return "silent"  # the node began another life: the owner's life is over
        if state == "detached":
            return "dead"  # its last process left cleanly: none of its processes remain
        return "alive"

    def _busy(self, role, c):
        _, pidns, boot = _ids()
        r = self.region
        if c is None:
            return ChannelBusyError(
                f"channel {self.name!r}: its {role} role is held or being claimed by "
                f"another process of node {r.node}, which is alive (it holds the role lock, "
                f"in this or another pid namespace); a channel has one {role} (open one "
                f"channel per sender/receiver pair, or close() the other {role} first)")
        if c["boot"] == boot and c["pidns"] == pidns:
            why = "its process exists"
        else:
            why = (f"its node's heartbeat moved within the last {r.lease_ms / 1000.0} s "
                   "lease (a node first looked at counts as alive for a lease)")
        return ChannelBusyError(
            f"channel {self.name!r}: its {role} is node {c['node']} pid {c['pid']}, which "
            f"is alive ({why}); a channel has one {role} (open one channel per "
            f"sender/receiver pair, or close() the other {role} first)")

    def _history_ok(self, c, uint64_t new_run):
        """A new producer run may replace the line of run new_run - RUNS only once the
        consumer is past that run's end (it walks the runs it has not finished)."""
        r = self.region
        runs = self.C.pruns
        line = _line(runs, new_run)
        r.flush(line, sizeof(cxl_chan_run))
        x = r.load64(cxl_chan_run_key_off(line))
        if x % CXL_CHAN_RUNS != new_run % CXL_CHAN_RUNS or x >= new_run:
            return True  # never used
        cur, ln = c["run"], _run_words(r, runs, c["run"])
        if ln is None:
            cur, ln = c["src"], _run_words(r, runs, c["src"])
        end = None
        while ln is not None and cur > x:
            end = ln["base"]
            if ln["src"] >= cur:
                break
            cur, ln = ln["src"], _run_words(r, runs, ln["src"])
        if end is None:
            return False
        cc = _claim_words(r, self.C.cclaim)
        cl = _run_words(r, self.C.cruns, cc["run"])
        return cl is not None and cl["seq"] >= end

    def _locate(self, uint64_t head):
        """(producer run holding message `head`, hole number or NONE), walking back from
        the producer's newest complete run."""
        r = self.region
        c = _claim_words(r, self.C.pclaim)
        cur, ln = c["run"], _run_words(r, self.C.pruns, c["run"])
        if ln is None:
            cur, ln = c["src"], _run_words(r, self.C.pruns, c["src"])
        for _ in range(CXL_CHAN_RUNS + 1):
            if ln is None:
                break
            if ln["base"] <= head:
                hole = head if ln["flags"] & CXL_CHAN_RUN_HOLE and ln["base"] == head else NONE
                return cur, hole
            if ln["src"] >= cur:
                break
            cur, ln = ln["src"], _run_words(r, self.C.pruns, ln["src"])
        raise RegionError(f"channel {self.name!r}: cannot find the producer run holding "
                          f"message {head} (run chain broken at run {cur}: corrupt, or more "
                          f"than {CXL_CHAN_RUNS} producer takeovers ago)")

    cdef _claim(self, str role):
        """Make this process the channel's `role` (first send/recv); ChannelBusyError if
        its owner may be alive."""
        self._check_open()
        r = self.region
        pid = os.getpid()
        key = (pid, r.uuid, self.offset, role)
        ref = _roles.get(key)
        other = ref() if ref is not None else None
        if other is not None and other is not self and not other.closed:
            raise ChannelBusyError(f"channel {self.name!r}: another Channel object of this "
                                   f"process is already its {role}; use that one")
        if self._live is None:
            raise RegionError(f"channel {self.name!r}: {r.spec} is attached as an observer, "
                              f"which cannot take the {role} role; open it as a node")
        start, pidns, boot = _ids()
        me = {"owner": (r.node + 1) | (pid << 32), "incarnation": self._live.incarnation,
              "start": start, "pidns": pidns, "boot": boot}
        # The role lock first: while we hold it no other live process of our node,
        # in any pid namespace, can hold the role (see _judge).
        if not rolelock.hold(r.uuid, r.node, self._role_key(role)):
            raise self._busy(role, None)
        lk = r.lock(LOCK_NAME)
        lk.acquire()
        err = info = None
        try:
            info = self._claim_locked(role, me)
        except BaseException as e:
            err = e
        try:
            lk.release()
        except LeaseLost as e:
            # We were silent past the lease holding the lock: another claimant may have
            # run meanwhile. Keep the claim only if it still names us in our epoch.
            if err is None:
                c = _claim_words(r, self._claim_off(role))
                if c["epoch"] != info["epoch"] or c["owner"] != me["owner"]:
                    err = ChannelRoleLostError(
                        f"channel {self.name!r}: this process was silent past the lease "
                        f"while claiming the {role} role, and node {c['node']} pid "
                        f"{c['pid']} took it over")
                    err.__cause__ = e
        if err is not None:
            rolelock.release(r.uuid, r.node, self._role_key(role))
            raise err
        now = cxl_now_ns()
        if role == "producer":
            self.C.p_epoch = info["epoch"]
            self.C.p_run = info["run"]
            self.C.p_line = info["line"]
            self.C.tail = info["seq"]
            # Any lower bound of head will do: the first full-looking ring observes it.
            self.C.seen_head = info["seq"] - self.C.slots if info["seq"] > self.C.slots else 0
            self.C.c_run_seen = NONE
            self.C.p_hole = info["hole"]
            self.C.q_until = 0
            if info["hole"]:
                self.C.q_slot = info["seq"] % self.C.slots
                self.C.q_until = now + <uint64_t>r.lease_ms * 1000000
            self.C.p_ok_ns = now
            self._prod_pid = pid
            self._prod_lost = None
        else:
            self.C.c_epoch = info["epoch"]
            self.C.c_run = info["run"]
            self.C.c_line = info["line"]
            self.C.head = info["seq"]
            self.C.seen_tail = info["seq"]  # observe tail on the first peek
            self.C.p_run_seen, self.C.hole_at = info["prun"], info["hole_at"]
            self.C.p_end = NONE
            self.C.c_ok_ns = now
            self._cons_pid = pid
            self._cons_lost = None
        _roles[key] = weakref.ref(self)

    cdef _claim_locked(self, str role, me):
        """The claim itself, under the channel lock (see channel.pxd for the protocol)."""
        r = self.region
        prod = role == "producer"
        cl = self._claim_off(role)
        runs = self._runs_off(role)
        c = _claim_words(r, cl)
        cur = _run_words(r, runs, c["run"])
        if not c["owner"]:
            verdict = "free"
        elif all(c[k] == me[k] for k in me):
            verdict = "mine"
        else:
            verdict = self._judge(c)
            if verdict == "alive" and c["node"] == r.node:
                # We hold the role lock, so no live process of our node holds the role:
                # this claim names our node but no living owner. It is a claim of ours
                # whose stores failed part-way, its later words an earlier owner's (or
                # zero), which would otherwise keep the role taken for as long as our
                # node lives. Taken over as a silent one (a new run): that earlier owner
                # may be another node's, and stalled.
                verdict = "silent"
            if verdict == "alive":
                raise self._busy(role, c)
        epoch, run, src, hole = c["epoch"], c["run"], c["src"], False
        new_run = False
        if verdict in ("dead", "silent") or cur is None:
            # A takeover: the epoch fences the old owner. Its run continues only when
            # it certainly cannot write again and ran on our node (whose cache its
            # dirty lines are in); else a new run starts on the next line.
            epoch = c["epoch"] + 1
            new_run = not (verdict == "dead" and c["node"] == r.node and cur is not None)
            if new_run:
                src = c["run"] if cur is not None else c["src"]
                run = c["run"] + 1
                hole = prod and verdict == "silent"
                if prod and not self._history_ok(c, run):
                    raise ChannelBusyError(
                        f"channel {self.name!r}: the producer role cannot be taken over yet: "
                        f"the consumer has not received past the messages of a producer run "
                        f"{CXL_CHAN_RUNS} takeovers ago; retry once it has")
        # Publish the claim, key last: identity, run, epoch; then persist. Everything
        # below reads the old owner's counter only after this is visible.
        r.flush(cl, sizeof(cxl_chan_claim))
        for name, v in (("src", src), ("owner", me["owner"]), ("incarnation", me["incarnation"]),
                        ("start", me["start"]), ("pidns", me["pidns"]), ("boot", me["boot"]),
                        ("run", run), ("epoch", epoch)):
            r.store64(cl + _CLAIM_AT[name], v)
        r.persist(cl, sizeof(cxl_chan_claim))
        _point("chan.claim")
        if new_run:
            old = _run_words(r, runs, src)
            if old is None:
                raise RegionError(f"channel {self.name!r}: the {role} run {src} this claim "
                                  f"continues is not on its line (corrupt)")
            seq = old["seq"]  # the old run's end for everyone (observed after our claim)
            line = _line(runs, run)
            r.flush(line, sizeof(cxl_chan_run))
            for name, v in (("seq", seq), ("base", seq), ("src", src),
                            ("flags", CXL_CHAN_RUN_HOLE if hole else 0), ("epoch", epoch),
                            ("run", run)):
                r.store64(line + _RUN_AT[name], v)
            r.persist(line, sizeof(cxl_chan_run))
        else:
            ln = _run_words(r, runs, run)
            if ln is None:
                raise RegionError(f"channel {self.name!r}: the {role} run {run} is not on "
                                  "its line (corrupt)")
            seq, line = ln["seq"], ln["line"]
        # Still ours? A stall of ours inside this claim is caught here (or at our first
        # publish, which checks the epoch again).
        c2 = _claim_words(r, cl)
        if c2["epoch"] != epoch or c2["owner"] != me["owner"]:
            raise ChannelRoleLostError(
                f"channel {self.name!r}: the {role} role was taken over by node "
                f"{c2['node']} pid {c2['pid']} (epoch {c2['epoch']}) while this process was "
                "silent inside its claim; nothing was sent or received")
        info = {"epoch": epoch, "run": run, "seq": seq, "hole": hole, "line": line}
        if not prod:
            info["prun"], info["hole_at"] = self._locate(seq)
        return info

    cdef _release(self, str role):
        """Let go of `role` if this process holds it through us (and still in our epoch)."""
        cdef uint64_t claim = self.C.pclaim if role == "producer" else self.C.cclaim
        cdef uint64_t epoch = self.C.p_epoch if role == "producer" else self.C.c_epoch
        cdef uint64_t owner = (<uint64_t>self.region.node + 1) | (<uint64_t>os.getpid() << 32)
        cdef int rc
        with self.region.lock(LOCK_NAME):  # no claim may run between our check and write
            with nogil:
                rc = cxl_chan_release(self.C.r, claim, epoch, owner)
        self._drop(role)
        return rc

    def _role_key(self, role):
        return self.offset * 2 + (role == "consumer")

    def _drop(self, role):
        """Forget that we hold `role` (released, or taken over)."""
        if role == "producer":
            self._prod_pid = 0
        else:
            self._cons_pid = 0
        if not self.region.closed:
            rolelock.release(self.region.uuid, self.region.node, self._role_key(role))
        key = (os.getpid(), self.region.uuid, self.offset, role)
        ref = _roles.get(key)
        if ref is not None and ref() is self:
            del _roles[key]

    # --- errors --------------------------------------------------------------------

    cdef int _raise(self, int rc, str op) except -1:
        """Turn a status into the matching exception."""
        where = f"channel {self.name!r} {op}"
        detail = None
        if rc == CXLRT_E_CHANCORRUPT:
            v, at, k = self.C.bad_value, self.C.bad_off, self.C.bad_kind
            if k == CXL_CHAN_BAD_LEN:
                what = (f"slot {(at - self.C.ring) // self.C.slot_bytes} holds a message "
                        f"length of {v} bytes, more than msg_bytes={self.C.msg_bytes}")
            elif k == CXL_CHAN_BAD_NUM:
                # at is the slot's number word: inside the slot, so it names the slot
                what = (f"slot {(at - self.C.ring) // self.C.slot_bytes} holds message "
                        f"number {v} where message {self.C.head} was published (overwritten "
                        "by a producer that had lost its role, or corrupt)")
            elif k == CXL_CHAN_BAD_TAIL:
                what = (f"tail {v} is not within {self.C.slots} slots ahead of head "
                        f"{self.C.head}")
            elif k == CXL_CHAN_BAD_RUN:
                what = (f"the chain of role runs is broken at {v} (corrupt, or more than "
                        f"{CXL_CHAN_RUNS} takeovers since this process last looked)")
            else:
                what = f"head {v} is not between {self.C.seen_head} and tail {self.C.tail}"
            detail = f"{what} (corrupt word at offset {at:#x})"
        return self.region._rc(rc, where, 0, 0, detail)

    cdef _lost(self, str role, str op):
        """Our role was taken over (CXLRT_E_CHANLOST). Return if this call's message
        counts (it was published before the taker read our counter), else raise.

        Either way the role is no longer ours, and the next call raises (once).
        """
        cdef bint prod = role == "producer"
        cdef uint32_t phase = self.C.p_lost_phase if prod else self.C.c_lost_phase
        cdef uint64_t published = self.C.tail if prod else self.C.head
        cdef uint64_t myrun = self.C.p_run if prod else self.C.c_run
        cdef uint64_t claim = self.C.pclaim if prod else self.C.cclaim
        cdef uint64_t runs = self.C.pruns if prod else self.C.cruns
        cdef uint64_t succ = 0, base = 0, flags = 0
        cdef int rc
        self._drop(role)
        r = self.region
        c = _claim_words(r, claim)
        who = (f"node {c['node']} pid {c['pid']}" if c["owner"] else "another process")
        head = (f"channel {self.name!r}: the {role} role was taken over by {who} (epoch "
                f"{c['epoch']}) while this process was silent past the "
                f"{r.lease_ms / 1000.0} s lease")
        if self._live is not None and self._live.fenced:
            head += f" (node {r.node} began another life meanwhile)"
        done = "sent" if prod else "received"
        if phase == 0:
            raise ChannelRoleLostError(f"{head}; this {op} {done} nothing")
        n = published - 1
        unknown = ChannelRoleLostError(
            f"{head}; whether message {n} counts is unknown (the new {role}'s claim could "
            "not be read to the end)")
        if c["run"] == myrun:
            raise unknown
        deadline = time.monotonic() + 2 * r.lease_ms / 1000.0 + 1
        while True:
            rc = _successor(&self.C, claim, runs, myrun, &succ, &base, &flags)
            if rc == 0:
                break
            if rc != CXL_CHAN_AGAIN or time.monotonic() > deadline:
                raise unknown
            time.sleep(0.001)
        if base >= published:
            later = ChannelRoleLostError(
                f"{head}; message {n} was {done} before that (this {op} returned it), later "
                f"ones cannot be")
            if prod:
                self._prod_lost = later
            else:
                self._cons_lost = later
            return
        if prod:
            raise ChannelRoleLostError(f"{head}; message {n} was not delivered (the new "
                                       f"producer continues from message {base})")
        raise ChannelRoleLostError(f"{head}; message {n} was not taken: the new consumer "
                                   f"receives it")

    def _taken_over(self, role):
        """True if our claim of `role` no longer holds our epoch (observed now)."""
        epoch = self.C.p_epoch if role == "producer" else self.C.c_epoch
        if CXLRT_TEST_HOOK(_skip_fencing):
            return False
        return _claim_words(self.region, self._claim_off(role))["epoch"] != epoch

    cdef _check_open(self):
        if self._closed:
            raise ValueError(f"channel {self.name!r} is closed")

    cdef int _wait(self, bint sending, const char* p, uint64_t n, uint64_t deadline) except -1:
        """Block (without the GIL) until the ring has room/a message or `deadline` passes."""
        cdef Region reg = self.region
        cdef uint64_t until
        cdef int rc
        while True:
            until = cxl_now_ns() + _SLICE_NS
            if until > deadline:
                until = deadline
            reg._busy += 1  # Region.close() refuses while we run without the GIL
            try:
                with nogil:
                    if sending:
                        rc = cxl_chan_send_wait(&self.C, p, n, until)
                    else:
                        rc = cxl_chan_recv_wait(&self.C, until)
            finally:
                reg._busy -= 1
            if rc != CXL_CHAN_AGAIN or cxl_now_ns() >= deadline:
                return rc
            PyErr_CheckSignals()
            self._check_open()

    # --- messages ------------------------------------------------------------------

    def send(self, msg, timeout=None):
        """Send one message, blocking while the ring is full.

        Parameters
        ----------
        msg : bytes-like
            At most `msg_bytes` bytes (ValueError otherwise); copied out before return.
        timeout : float, optional
            Seconds to wait for room; None waits for ever. TimeoutError past it.

        Raises
        ------
        ChannelBusyError
            Another process holds the producer role and may be alive.
        ChannelRoleLostError
            This process's producer role was taken over while it was silent; the
            message was not sent (the error says so when it was, and then the next
            send raises instead).
        """
        cdef const unsigned char[::1] view
        cdef const char* p
        cdef uint64_t n
        cdef uint64_t deadline
        cdef int rc
        if type(msg) is bytes:
            p = PyBytes_AS_STRING(msg)
            n = len(<bytes>msg)
        else:
            mv = memoryview(msg)
            if not mv.c_contiguous:
                raise TypeError(f"channel {self.name!r}: send() needs a C-contiguous buffer")
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")  # any C-contiguous buffer, as bytes
            view = mv
            n = view.shape[0]
            p = <const char*>&view[0] if n else NULL
        if n > self.C.msg_bytes:
            raise ValueError(f"channel {self.name!r}: a {n}-byte message is larger than "
                             f"msg_bytes={self.C.msg_bytes}")
        deadline = _deadline(timeout)
        self._check_open()
        if self._in_send:
            raise RuntimeError(f"channel {self.name!r}: send() is already running in another "
                               "thread (a channel has one sending thread)")
        self._in_send = True  # set under the GIL before anything may release it
        try:
            if unlikely(self._prod_lost is not None):
                err, self._prod_lost = self._prod_lost, None
                raise err
            if unlikely(self._prod_pid != cxl_pid()):
                self._claim("producer")
            if n < _NOGIL_BYTES:
                rc = cxl_chan_send_try(&self.C, p, n)
            else:
                rc = CXL_CHAN_AGAIN
            if rc == CXL_CHAN_AGAIN:
                rc = self._wait(True, p, n, deadline)
            if unlikely(rc == CXLRT_E_CHANLOST):
                self._lost("producer", "send")
                return
        finally:
            self._in_send = False
        if rc == CXLRT_E_CHANCORRUPT and self._taken_over("producer"):
            self.C.p_lost_phase = 0
            self._lost("producer", "send")  # a stale producer sees the new one's counters
        if rc == CXL_CHAN_AGAIN:
            raise TimeoutError(f"channel {self.name!r}: send timed out after {timeout} s with "
                               f"the ring full ({self.C.slots} messages unreceived); "
                               f"consumer: {self.owner('consumer')}")
        if rc != 0:
            self._raise(rc, "send")

    def recv(self, timeout=None):
        """Receive the next message (bytes), blocking while the ring is empty.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait; None waits for ever. TimeoutError past it.

        Raises
        ------
        ChannelBusyError
            Another process holds the consumer role and may be alive.
        ChannelRoleLostError
            This process's consumer role was taken over while it was silent; no
            message was taken (the new consumer receives it).
        """
        out = self._recv(_deadline(timeout), True)
        if out is None:
            raise TimeoutError(f"channel {self.name!r}: no message within {timeout} s; "
                               f"producer: {self.owner('producer')}")
        return out

    def try_recv(self):
        """The next message (bytes), or None if there is none right now."""
        return self._recv(0, False)

    cdef _recv(self, uint64_t deadline, bint block):
        cdef int rc
        cdef uint64_t n
        cdef char* p
        cdef Region reg
        self._check_open()
        if self._in_recv:
            raise RuntimeError(f"channel {self.name!r}: recv() is already running in another "
                               "thread (a channel has one receiving thread)")
        self._in_recv = True  # set under the GIL before anything may release it
        try:
            if unlikely(self._cons_lost is not None):
                err, self._cons_lost = self._cons_lost, None
                raise err
            if unlikely(self._cons_pid != cxl_pid()):
                self._claim("consumer")
            rc = cxl_chan_peek(&self.C)
            if rc == CXL_CHAN_AGAIN and block:
                rc = self._wait(False, NULL, 0, deadline)
            if rc == CXL_CHAN_AGAIN:
                return None
            if rc == CXLRT_E_CHANCORRUPT and self._taken_over("consumer"):
                rc = CXLRT_E_CHANLOST  # a stale consumer sees the new one's counters
                self.C.c_lost_phase = 0
            if unlikely(rc == CXLRT_E_CHANLOST):
                self._lost("consumer", "recv")
                return None  # not reached: nothing was taken, so _lost raised
            if rc != 0:
                self._raise(rc, "recv")
            n = self.C.cur_len
            out = PyBytes_FromStringAndSize(NULL, n)
            p = PyBytes_AS_STRING(out)
            if n < _NOGIL_BYTES:
                rc = cxl_chan_take(&self.C, p)
            else:
                reg = self.region
                reg._busy += 1
                try:
                    with nogil:
                        rc = cxl_chan_take(&self.C, p)
                finally:
                    reg._busy -= 1
            if unlikely(rc == CXLRT_E_CHANLOST):
                self._lost("consumer", "recv")  # returns only if the message is ours
                return out
            if rc != 0:
                self._raise(rc, "recv")
            return out
        finally:
            self._in_recv = False

    def _counter(self, role):
        """The current run's counter of `role`, as published (its source's while a
        claim is being set up)."""
        r = self.region
        runs = self._runs_off(role)
        c = _claim_words(r, self._claim_off(role))
        ln = _run_words(r, runs, c["run"]) or _run_words(r, runs, c["src"])
        if ln is None:
            raise RegionError(f"channel {self.name!r}: the {role}'s run {c['run']} is not on "
                              "its line (corrupt)")
        return ln["seq"]

    def _holes(self, uint64_t h, uint64_t t):
        """Producer holes among message numbers h .. t - 1."""
        r = self.region
        c = _claim_words(r, self.C.pclaim)
        cur, ln = c["run"], _run_words(r, self.C.pruns, c["run"])
        if ln is None:
            cur, ln = c["src"], _run_words(r, self.C.pruns, c["src"])
        n = 0
        for _ in range(CXL_CHAN_RUNS):
            if ln is None or ln["base"] < h:
                break
            if ln["flags"] & CXL_CHAN_RUN_HOLE and ln["base"] < t:
                n += 1
            if ln["src"] >= cur:
                break
            cur, ln = ln["src"], _run_words(r, self.C.pruns, ln["src"])
        return n

    def pending(self):
        """Messages sent but not yet received, as published (observes both counters)."""
        self._check_open()
        h1 = self._counter("consumer")  # head, then tail, then head again: h1 <= tail
        t = self._counter("producer")  # always, and a tail read later is within
        h2 = self._counter("consumer")  # `slots` of any head read after it
        if h1 > t or h2 < h1 or (h2 <= t and t - h2 > self.C.slots):
            raise RegionError(f"channel {self.name!r}: counters are corrupt (tail {t}, "
                              f"head {h1} then {h2}, {self.C.slots} slots)")
        if h2 > t:
            return 0
        return t - h2 - self._holes(h2, t)

    def __len__(self):
        return self.pending()

    # --- lifecycle -----------------------------------------------------------------

    def close(self):
        """Let go of the roles this process holds through this object. Idempotent.

        The channel itself stays in the region (the other end may still use it);
        another process may then take the released role.
        """
        cdef int pid = cxl_pid(), rc = 0, rc2 = 0
        if self._closed:
            return
        self._closed = True
        if self.region.closed:
            return
        # Another thread blocked in send()/recv() sees _closed within one 50 ms slice
        # and leaves; give the role up only after it has (else it could publish a
        # counter after we let go).
        deadline = time.monotonic() + 5
        while (self._in_send or self._in_recv) and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._in_send or self._in_recv:
            raise RuntimeError(f"channel {self.name!r}: close() waited 5 s for a send() or "
                               "recv() of another thread to return; roles kept")
        if self._prod_pid == pid:
            rc = self._release("producer")
        if self._cons_pid == pid:
            rc2 = self._release("consumer")
        if rc or rc2:
            self._raise(rc or rc2, "close")

    def __dealloc__(self):
        # Best effort and silent: an object dropped without close() gives its
        # roles back only if this process still holds them through it, in its epoch.
        cdef int pid = cxl_pid()
        cdef uint64_t owner
        if self._closed or self.region is None or self.region.closed:
            return
        owner = (<uint64_t>self.region.node + 1) | (<uint64_t>pid << 32)
        if self._prod_pid == pid:
            cxl_chan_release(self.C.r, self.C.pclaim, self.C.p_epoch, owner)
        if self._cons_pid == pid:
            cxl_chan_release(self.C.r, self.C.cclaim, self.C.c_epoch, owner)
        try:
            for role, mine in (("producer", self._prod_pid == pid),
                               ("consumer", self._cons_pid == pid)):
                if mine:
                    rolelock.release(self.region.uuid, self.region.node, self._role_key(role))
        except Exception:
            pass  # dealloc stays silent: the lock goes with the process at the latest

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else f"{self.C.slots} slots of {self.C.msg_bytes} B"
        return f"<cxlrt.Channel {self.name!r} at {self.offset:#x}, {state}>"


def _test_skip_observe(bint on):
    """Negative control for the tests: observe() loads without flushing first."""
    global _skip_observe
    if not CXLRT_DEBUG:
        raise DebugBuildRequired()
    _skip_observe = on


def _test_skip_fencing(bint on):
    """Negative control for the tests: owners publish without checking their epoch."""
    global _skip_fencing
    if not CXLRT_DEBUG:
        raise DebugBuildRequired()
    _skip_fencing = on
