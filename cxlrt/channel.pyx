# cython: language_level=3
"""``Channel``: a single-producer / single-consumer message ring in a region.

A prefill worker tells a decode worker "request R: these keys are ready" with
no network: the producer DMA-writes a message into the next slot of a ring in
the region, then publishes its tail counter; the consumer observes the tail,
DMA-reads the slot, then publishes its head counter. Each counter lives on its
own line with one writer (see channel.pxd for the layout and invariants), so
the channel needs no lock and no cross-node atomic per message.

Roles: the first ``send()`` through a Channel object makes its process the
producer and the first ``recv()``/``try_recv()`` makes it the consumer; the
claim (node, pid, host) is recorded on the role's line under the region lock
"cxlrt.channel". Another process asking for a role whose owner is alive gets
:class:`ChannelBusyError`. An owner counts as gone once it ``close()``-d the
channel, or when it ran on this host and its pid no longer exists, or when it
ran on another host and its node's heartbeat is absent or older than the
region's lease. A new owner continues from the counters on the line.
"""

import os
import time
import weakref

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy

from cxlrt.backend cimport (cxl_dma_read, cxl_dma_write, cxl_fence, cxl_flush, cxl_load64,
                            cxl_persist, cxl_region, cxl_store64)
from cxlrt.includes.intrin cimport (cxl_backoff, cxl_fence_release, cxl_now_ns, cxl_pid,
                                    likely, unlikely)
from cxlrt.region cimport Region

from cxlrt.directory import check_name
from cxlrt.errors import CxlrtError, RegionError
from cxlrt.superblock import host_id as _host_id

CHAN_MAGIC = int.from_bytes(b"CXLCHAN1", "little")
LOCK_NAME = "cxlrt.channel"       # creation and role claims of every channel
PREFIX = "chan/"                  # directory key of channel `name`
MAX_NAME = 64 - len(PREFIX)       # bytes of UTF-8 (directory names are <= 64)

cdef enum:
    # A blocked send/recv comes back for the GIL this often, to notice signals
    # (Ctrl-C) and close(); the wait itself runs without the GIL.
    _SLICE_NS = 50000000
    # Messages below this many bytes are sent/received without releasing the
    # GIL when they need no wait: releasing it costs more than the copy.
    _NOGIL_BYTES = 4096

assert sizeof(cxl_chan_header) == 64 and sizeof(cxl_chan_end) == 64

# Set by _test_skip_observe(): observe() then loads without flushing first.
# Only for the negative-control test; never set in production.
cdef bint _skip_observe = False


class ChannelBusyError(CxlrtError, RuntimeError):
    """The producer (or consumer) role of a channel is held by another live process."""


# --- fast paths (no GIL, no Python) ------------------------------------------------------

cdef inline int _observe64(const cxl_region* r, uint64_t off, uint64_t* v) noexcept nogil:
    """Observe a word another node publishes: drop our copy of its line, then load.

    Pairs with the writer's persist (store, flush, fence) of the same line.
    """
    cdef int rc = 0
    if likely(not _skip_observe):
        rc = cxl_flush(r, off, 8)
    if rc == 0:
        rc = cxl_load64(r, off, v)
    return rc


cdef inline int _corrupt(cxl_chan* C, uint32_t kind, uint64_t value, uint64_t off) noexcept nogil:
    """Record what was wrong for the Python layer's message; CXLRT_E_CHANCORRUPT."""
    C.bad_kind = kind
    C.bad_value = value
    C.bad_off = off
    return CXLRT_E_CHANCORRUPT


cdef int cxl_chan_send_try(cxl_chan* C, const char* p, uint64_t n) noexcept nogil:
    """Send one message if the ring has room: 0, CXL_CHAN_AGAIN when full, or an error.

    Budget while the last observed head leaves room: one DMA (two above
    CXL_CHAN_COPY_MAX bytes), one store and one persist; head is observed again
    only when the ring looks full. Pre: n <= msg_bytes, we own the producer role.
    """
    cdef uint64_t h = 0, slot, word = n
    cdef int rc
    cdef char buf[CXL_CHAN_COPY_MAX + CXL_CHAN_LEN]
    if unlikely(C.tail - C.seen_head >= C.slots):
        rc = _observe64(C.r, C.cons, &h)
        if rc != 0:
            return rc
        # head only grows and never passes our tail: seen_head <= h <= tail.
        if unlikely(h - C.seen_head > C.tail - C.seen_head):
            return _corrupt(C, CXL_CHAN_BAD_HEAD, h, C.cons)
        if h == C.seen_head:
            return CXL_CHAN_AGAIN
        C.seen_head = h
        # Acquire: our DMA into the freed slots starts after the load of head
        # (pairs with the consumer's release fence before it publishes head).
        rc = cxl_fence(C.r)
        if rc != 0:
            return rc
    slot = C.ring + (C.tail % C.slots) * C.slot_bytes
    if n <= CXL_CHAN_COPY_MAX:
        memcpy(buf, &word, CXL_CHAN_LEN)
        memcpy(buf + CXL_CHAN_LEN, p, n)
        rc = cxl_dma_write(C.r, slot, buf, n + CXL_CHAN_LEN)
    else:
        rc = cxl_dma_write(C.r, slot + CXL_CHAN_LEN, p, n)
        if rc == 0:
            rc = cxl_dma_write(C.r, slot, &word, CXL_CHAN_LEN)
    if rc != 0:
        return rc
    # The DMA is complete and visible on return; keep the tail store after it.
    cxl_fence_release()
    rc = cxl_store64(C.r, C.prod, C.tail + 1)
    if rc == 0:
        # Publish tail (pairs with the consumer's observe in cxl_chan_peek).
        rc = cxl_persist(C.r, C.prod, 8)
    if rc == 0:
        C.tail += 1
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


cdef int cxl_chan_peek(cxl_chan* C) noexcept nogil:
    """Read the first line of the message at head: 0, CXL_CHAN_AGAIN when empty, or an error.

    Budget while the last observed tail is ahead of head: one 64-byte DMA read;
    tail is observed again only when the ring looks empty. On 0, C.cur_len and
    C.first hold the length (checked against msg_bytes) and the first line.
    """
    cdef uint64_t t = 0, n = 0, slot
    cdef int rc
    if C.head == C.seen_tail:
        rc = _observe64(C.r, C.prod, &t)
        if rc != 0:
            return rc
        # tail only grows and stays within `slots` of our head (wraps show as huge).
        if unlikely(t - C.head > C.slots):
            return _corrupt(C, CXL_CHAN_BAD_TAIL, t, C.prod)
        if t == C.head:
            return CXL_CHAN_AGAIN
        C.seen_tail = t
        # Acquire: the slot reads start after the load of tail (pairs with the
        # producer's release fence between its DMA and its tail store).
        rc = cxl_fence(C.r)
        if rc != 0:
            return rc
    slot = C.ring + (C.head % C.slots) * C.slot_bytes
    rc = cxl_dma_read(C.r, slot, C.first, 64)  # slot_bytes >= 64: inside the slot
    if rc != 0:
        return rc
    memcpy(&n, C.first, CXL_CHAN_LEN)
    if unlikely(n > C.msg_bytes):
        return _corrupt(C, CXL_CHAN_BAD_LEN, n, slot)
    C.cur_len = n
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
    """Copy the peeked message into `out` (C.cur_len bytes), then publish head + 1."""
    cdef uint64_t n = C.cur_len
    cdef uint64_t slot = C.ring + (C.head % C.slots) * C.slot_bytes
    cdef int rc = 0
    memcpy(out, C.first + CXL_CHAN_LEN, n if n < CXL_CHAN_INLINE else CXL_CHAN_INLINE)
    if n > CXL_CHAN_INLINE:
        rc = cxl_dma_read(C.r, slot + 64, out + CXL_CHAN_INLINE, n - CXL_CHAN_INLINE)
        if rc != 0:
            return rc
    # Release: every read of the slot is done before head moves and the producer
    # may reuse it (pairs with the producer's acquire fence after observing head).
    cxl_fence_release()
    rc = cxl_store64(C.r, C.cons, C.head + 1)
    if rc == 0:
        # Publish head (pairs with the producer's observe in cxl_chan_send_try).
        rc = cxl_persist(C.r, C.cons, 8)
    if rc == 0:
        C.head += 1
    return rc


cdef int cxl_chan_release(cxl_chan* C, uint64_t line, uint32_t node, uint64_t pid) noexcept nogil:
    """Clear the owner words of our role's line and publish them, if they still name
    us (node, pid): a process that took the role over, having judged us dead, is the
    line's writer now, and a line has one writer."""
    cdef int rc = cxl_flush(C.r, line, 64)
    cdef uint64_t i, owner = 0, opid = 0
    if rc == 0:
        rc = cxl_load64(C.r, line + 8, &owner)
    if rc == 0:
        rc = cxl_load64(C.r, line + 16, &opid)
    if rc != 0 or owner != node + 1 or opid != pid:
        return rc
    for i in range(1, 5):
        if rc == 0:
            rc = cxl_store64(C.r, line + i * 8, 0)
    if rc == 0:
        rc = cxl_persist(C.r, line, 64)
    return rc


# --- Python layer --------------------------------------------------------------------------

# Roles held through live Channel objects of this process:
# (pid, region uuid, channel offset, "producer"|"consumer") -> weakref(Channel).
# Two objects of one process must not share a role: each keeps its own counter.
_roles = {}


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
    return (CXL_CHAN_LEN + msg_bytes + 63) // 64 * 64


def _deadline(timeout):
    """Monotonic ns deadline of a `timeout` in seconds (None: never)."""
    if timeout is None:
        return <uint64_t>-1
    t = float(timeout)
    if not t >= 0:  # also rejects NaN
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    return cxl_now_ns() + <uint64_t>min(t * 1e9, 1e18)


def _pid_alive(pid):
    if not 0 < pid < 1 << 31:
        return False  # no process has that id: a scribbled owner word
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        ``8 + msg_bytes`` rounded up to 64 bytes. Checked like `slots`.
    create : bool, optional
        Create the channel if the name is absent (default True); else KeyError.

    Notes
    -----
    One process sends and one receives (roles are claimed on first use, see
    the module docs); a Channel object serves one sending thread and one
    receiving thread at a time. Messages arrive in order, each once (a
    consumer that dies inside recv() may leave its message to the next one).
    """

    def __init__(self, Region region not None, str name not None, *, slots=64,
                 msg_bytes=4096, bint create=True):
        _check_name(name)
        _check_count("slots", slots, 1, CXL_CHAN_MAX_SLOTS)
        _check_count("msg_bytes", msg_bytes, 1, CXL_CHAN_MAX_MSG)
        self.region = region
        self.name = name
        self.C.r = region.r
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
        off = r.alloc(total, 64)
        try:
            # Write back and drop whatever our node cached of this memory's earlier
            # life, so the DMAs below (and the producer's) are never over our dirty lines.
            r.flush(off, total)
            r.dma_write(off + 64, bytes(128))  # no owners, tail = head = 0
            hdr = bytearray(64)
            for i, v in enumerate((0, CXL_CHAN_VERSION, slots, msg_bytes, sb, CXL_CHAN_HEADER,
                                   time.time_ns())):
                hdr[i * 8:i * 8 + 8] = v.to_bytes(8, "little")
            r.dma_write(off, hdr)
            # dma_write fences: the body is in the medium before the magic is.
            r.dma_write(off, CHAN_MAGIC.to_bytes(8, "little"))
            r.put(key, off)
        except BaseException:
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
        raw = r.dma_read(off, 64)  # immutable since creation: never dirty anywhere
        w = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, 64, 8)]
        magic, version, h_slots, h_msg, h_sb, h_ring = w[:6]
        if magic != CHAN_MAGIC:
            raise RegionError(f"{where} does not hold a channel (magic {magic:#x}; "
                              "another kind of object, or a creator died mid-way)")
        if version != CXL_CHAN_VERSION:
            raise RegionError(f"{where} has layout version {version}; this build reads "
                              f"version {CXL_CHAN_VERSION}")
        if not (1 <= h_slots <= CXL_CHAN_MAX_SLOTS and 1 <= h_msg <= CXL_CHAN_MAX_MSG
                and h_sb == _slot_bytes(h_msg) and h_ring == CXL_CHAN_HEADER
                and off + h_ring + h_slots * h_sb <= r.size):
            raise RegionError(f"{where}: header is corrupt (slots={h_slots}, "
                              f"msg_bytes={h_msg}, slot_bytes={h_sb}, ring={h_ring}) for a "
                              f"region of {r.size} bytes")
        diff = []
        if slots is not None and slots != h_slots:
            diff.append(f"slots={h_slots} (asked for {slots})")
        if msg_bytes is not None and msg_bytes != h_msg:
            diff.append(f"msg_bytes={h_msg} (asked for {msg_bytes})")
        if diff:
            raise ValueError(f"channel {self.name!r} exists with a different geometry: "
                             f"{', '.join(diff)}")
        self.offset = off
        self.C.prod = off + 64
        self.C.cons = off + 128
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
        """Bytes a slot takes in the region (8-byte length + msg_bytes, whole lines)."""
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
        """``{"node", "pid", "host"}`` of the process holding `role`, or None.

        Parameters
        ----------
        role : {"producer", "consumer"}
        """
        line = self._line(role)
        r = self.region
        r.flush(line, 64)  # observe: the owner words change under the channel lock
        node1, pid, host = r.load64(line + 8), r.load64(line + 16), r.load64(line + 24)
        if not node1:
            return None
        return {"node": node1 - 1, "pid": pid, "host": host}

    def _line(self, role):
        if role == "producer":
            return self.C.prod
        if role == "consumer":
            return self.C.cons
        raise ValueError(f"role is 'producer' or 'consumer', not {role!r}")

    def _owner_alive(self, node, pid, host):
        r = self.region
        if host == _host_id():
            return _pid_alive(pid)
        if node >= r.nodes:
            return False
        # Another host: the best we can see is whether its node still beats.
        return r.liveness.state(node) == "alive"

    cdef _claim(self, str role):
        """Make this process the channel's `role` (first send/recv); ChannelBusyError if taken."""
        self._check_open()
        r = self.region
        pid = os.getpid()
        key = (pid, r.uuid, self.offset, role)
        ref = _roles.get(key)
        other = ref() if ref is not None else None
        if other is not None and other is not self and not other.closed:
            raise ChannelBusyError(f"channel {self.name!r}: another Channel object of this "
                                   f"process is already its {role}; use that one")
        line = self._line(role)
        with r.lock(LOCK_NAME):
            r.flush(line, 64)  # observe the line: its last writer may be another node
            seq, node1, opid, ohost = (r.load64(line), r.load64(line + 8),
                                       r.load64(line + 16), r.load64(line + 24))
            if node1 and not (node1 - 1 == r.node and opid == pid):
                if self._owner_alive(node1 - 1, opid, ohost):
                    raise ChannelBusyError(
                        f"channel {self.name!r}: its {role} is node {node1 - 1} pid {opid}, "
                        f"which is alive; a channel has one {role} (open one channel per "
                        f"sender/receiver pair, or close() the other {role} first)")
            r.store64(line + 8, r.node + 1)
            r.store64(line + 16, pid)
            r.store64(line + 24, _host_id())
            r.store64(line + 32, time.time_ns())
            r.persist(line, 64)  # publish the claim before the lock is released
        other_line = self.C.cons if role == "producer" else self.C.prod
        r.flush(other_line, 8)  # observe the other end's counter
        oseq = r.load64(other_line)
        tail, head = (seq, oseq) if role == "producer" else (oseq, seq)
        if head > tail or tail - head > self.C.slots:
            self._release(role)
            raise RegionError(f"channel {self.name!r}: counters are corrupt (tail {tail}, "
                              f"head {head}, {self.C.slots} slots)")
        if role == "producer":
            self.C.tail = seq
            self.C.seen_head = oseq
            self._prod_pid = pid
        else:
            self.C.head = seq
            self.C.seen_tail = seq  # observe tail on the first peek
            self._cons_pid = pid
        _roles[key] = weakref.ref(self)

    cdef _release(self, str role):
        """Let go of `role` if this process holds it through us."""
        cdef uint64_t line = self.C.prod if role == "producer" else self.C.cons
        cdef uint32_t node = self.region.node
        cdef uint64_t pid = os.getpid()
        cdef int rc
        with self.region.lock(LOCK_NAME):  # no claim may run between our check and write
            with nogil:
                rc = cxl_chan_release(&self.C, line, node, pid)
        if role == "producer":
            self._prod_pid = 0
        else:
            self._cons_pid = 0
        key = (os.getpid(), self.region.uuid, self.offset, role)
        ref = _roles.get(key)
        if ref is not None and ref() is self:
            del _roles[key]
        return rc

    # --- errors --------------------------------------------------------------------

    cdef int _raise(self, int rc, str op) except -1:
        """Turn a status into the matching exception."""
        where = f"channel {self.name!r} {op}"
        if rc == CXLRT_E_CHANCORRUPT:
            v, at = self.C.bad_value, self.C.bad_off
            if self.C.bad_kind == CXL_CHAN_BAD_LEN:
                what = (f"slot {(at - self.C.ring) // self.C.slot_bytes} holds a message "
                        f"length of {v} bytes, more than msg_bytes={self.C.msg_bytes}")
            elif self.C.bad_kind == CXL_CHAN_BAD_TAIL:
                what = (f"tail {v} is not within {self.C.slots} slots ahead of head "
                        f"{self.C.head}")
            else:
                what = f"head {v} is not between {self.C.seen_head} and tail {self.C.tail}"
            raise RegionError(f"{where}: {what} (corrupt word at offset {at:#x})")
        self.region._rc(rc, where, 0, 0)
        raise RegionError(f"{where}: status {rc}")

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
            if unlikely(self._prod_pid != cxl_pid()):
                self._claim("producer")
            if n < _NOGIL_BYTES:
                rc = cxl_chan_send_try(&self.C, p, n)
            else:
                rc = CXL_CHAN_AGAIN
            if rc == CXL_CHAN_AGAIN:
                rc = self._wait(True, p, n, deadline)
        finally:
            self._in_send = False
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
            if unlikely(self._cons_pid != cxl_pid()):
                self._claim("consumer")
            rc = cxl_chan_peek(&self.C)
            if rc == CXL_CHAN_AGAIN and block:
                rc = self._wait(False, NULL, 0, deadline)
            if rc == CXL_CHAN_AGAIN:
                return None
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
            if rc != 0:
                self._raise(rc, "recv")
            return out
        finally:
            self._in_recv = False

    def pending(self):
        """Messages sent but not yet received, as published (observes both counters)."""
        self._check_open()
        r = self.region
        r.flush(self.C.cons, 8)  # observe head, then tail, then head again:
        h1 = r.load64(self.C.cons)  # h1 <= tail always, and a tail read later is
        r.flush(self.C.prod, 8)  # within `slots` of any head read after it
        t = r.load64(self.C.prod)
        r.flush(self.C.cons, 8)
        h2 = r.load64(self.C.cons)
        if h1 > t or h2 < h1 or (h2 <= t and t - h2 > self.C.slots):
            raise RegionError(f"channel {self.name!r}: counters are corrupt (tail {t}, "
                              f"head {h1} then {h2}, {self.C.slots} slots)")
        return t - h2 if h2 <= t else 0

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
        # counter on a line a new owner writes).
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
        # roles back only if this process still holds them through it.
        cdef int pid = cxl_pid()
        if self._closed or self.region is None:
            return
        if self._prod_pid == pid:
            cxl_chan_release(&self.C, self.C.prod, self.region.node, <uint64_t>pid)
        if self._cons_pid == pid:
            cxl_chan_release(&self.C, self.C.cons, self.region.node, <uint64_t>pid)

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
    _skip_observe = on
