# cython: language_level=3
"""``rdma:HOST:PORT/NAME`` — a region that another host serves over RDMA (``cxlrt serve``).

The server registers the region's whole mapping as one memory region and gives each
attachment its own reliable-connected queue pair; after that its CPU takes no part in
an access. Every access here is a one-sided READ or WRITE of exactly the bytes asked
for, complete before the call returns. No node keeps a copy, so there is nothing
stale to drop: the medium is coherent for every node, and flushes are no-ops. That is
stronger than the non-coherent model the algorithms are written for, and costs one
round trip per access.

When the server goes (its control connection ends) or a READ fails, the attachment
reconnects: accesses wait, for at most ``reconnect`` seconds from the first failure,
while a supervisor thread attaches again (new queue pair, new keys, the same region
checked by its uuid, the node's claim restored) and then go on. While they wait the
node beats nothing: an outage past the lease is a stall, and the liveness layer fences
what the node held exactly as for a SIGSTOPped process. A failed WRITE is different:
the responder may have taken it, so it may land or may already have been seen, and
repeating it could undo what another node did after seeing it. That, an outage longer
than the window, a region that is not the one attached to, or a refused claim breaks
the attachment for good: every later access fails at once with CXLRT_E_IO, the node
stops beating and is recovered like a dead one, and :meth:`RdmaBackend.failure` says
why. ``reconnect=0`` breaks it at the first failure of any kind.
"""

cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from cxlrt.backend cimport (Backend, CXL_CAP_COHERENT, CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH,
                            CXL_HINT_REFUSED, CXL_HINT_REPEAT, CXL_OPS_ABI, cxl_ops)
from cxlrt.includes.intrin cimport cxl_atomic_load_acquire32, cxl_atomic_store_release32
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_IO, CXLRT_E_UNSUPPORTED

import os
import threading
import time
import weakref

from cxlrt.backends import _rdmawire as _wire
from cxlrt.spec import parse_float_range, parse_int_range


cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** p, size_t align, size_t n)


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)
    int pthread_mutex_init(pthread_mutex_t* m, const void* attr)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)


cdef extern from "rdma_verbs.h" nogil:
    struct ibv_mr:
        uint32_t lkey
        uint32_t rkey
    union ibv_gid:
        uint8_t raw[16]
    ctypedef struct cxv_dev:
        uint8_t port
        int gid_index
        ibv_gid gid
        int mtu
        int rd_atom
    struct ibv_qp:
        uint32_t qp_num
    ctypedef struct cxv_qp:
        ibv_qp* qp
        uint32_t psn
    int cxv_open(cxv_dev* d, const char* name, int port, int gid_index, char* err,
                 size_t errlen)
    void cxv_close(cxv_dev* d)
    ibv_mr* cxv_reg(cxv_dev* d, void* addr, size_t length, int remote)
    int ibv_dereg_mr(ibv_mr* mr)
    int cxv_qp_create(cxv_dev* d, cxv_qp* q, int depth, uint32_t psn)
    int cxv_qp_connect(cxv_dev* d, cxv_qp* q, uint32_t rqpn, uint32_t rpsn,
                       const uint8_t* rgid, int mtu, int rd_atom, int timeout, int retry)
    void cxv_qp_destroy(cxv_qp* q)
    int cxv_qp_stall(cxv_qp* q)
    int cxv_xfer(cxv_qp* q, int write, char* laddr, uint32_t lkey, uint64_t raddr,
                 uint32_t rkey, uint64_t n, uint64_t chunk, uint64_t timeout_ns,
                 int* wc_status)
    int cxv_xfer_v(cxv_qp* q, int write, char* laddr, uint32_t lkey, uint64_t raddr,
                   uint32_t rkey, const uint64_t* offs, uint64_t len, uint64_t count,
                   uint64_t timeout_ns, int* wc_status)
    uint64_t cxv_now_ns()
    enum:
        CXV_OK, CXV_POST, CXV_WC, CXV_TIMEOUT, CXV_POLL


cdef extern from "<errno.h>":
    int errno


cdef extern from "<sys/socket.h>" nogil:
    int shutdown(int fd, int how)
    enum:
        SHUT_RDWR


cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int us)


cdef extern from "Python.h" nogil:
    int PyGILState_Check()


cdef int _errno() noexcept:
    return errno


cdef enum:
    CXV_FORKED = 100      # failure kinds of ours: used in a forked child,
    CXV_GAVE_UP = 101     # the server not back within the reconnect window,
    CXV_REFUSED = 102     # the server back, but refusing this attachment (see `why`)
    CXV_AGAIN = 103       # one READ failing on every new attachment for the whole window
    RETRY = 1             # _move: the transfer was cut by a clean break; go again
    SMALL = 64 << 10      # staging for metadata accesses
    BOUNCE = 4 << 20      # staging for dma_read/dma_write, in `chunk` requests
    DEPTH = 16            # requests in flight per queue pair
    REG_MAX = 32          # buffers registered at once (RdmaBackend.register)
    REPEAT_MAX = 4        # ranges whose writes may be repeated (CXL_HINT_REPEAT)


# What a failure looks like from here: cxv_xfer's kind, then the completion status.
_KINDS = {CXV_FORKED: "used in a forked child: an RDMA attachment belongs to the process "
                      "that opened it (open the region again in the child)",
          CXV_POST: "posting a request failed", CXV_WC: "a completion error",
          CXV_TIMEOUT: "no completion for the attachment's timeout", CXV_POLL: "polling failed",
          CXV_GAVE_UP: "the server did not come back within the reconnect window",
          CXV_AGAIN: "a READ kept failing across reconnects for the whole window"}
# ibv_wc_status values worth naming (infiniband/verbs.h).
_WC = {5: "flushed (the queue pair is in error)", 9: "remote invalid request",
       10: "remote access error (a key that is no longer valid, or out of range)",
       11: "remote operation error", 12: "transport retries exceeded (the server is gone?)",
       13: "receiver-not-ready retries exceeded"}


ctypedef struct rdma_reg:
    uint64_t start
    uint64_t end
    ibv_mr* mr
    uint64_t used           # c.tick at its last use: the least recent goes first


ctypedef struct rdma_ctx:
    cxv_dev dev
    cxv_qp qp
    pthread_mutex_t lock    # one request at a time on the queue pair: its completions are ours
    char* small
    char* bounce
    ibv_mr* small_mr
    ibv_mr* bounce_mr
    uint64_t raddr          # the served mapping's address in the server
    uint32_t rkey
    uint32_t broken         # set once; read without the lock
    uint32_t reconnecting   # a clean break: accesses wait for the supervisor to attach again
    uint64_t outage_ns      # cxv_now_ns() at the first failure of this outage, 0 in none
    uint64_t window_ns      # how long an outage may last (`reconnect`); 0: never reconnect
    int ctl_fd              # the control socket: shut down to wake the supervisor; -1 none
    int cause_kind          # what began the outage (a CXV_* kind, -1 the server hung up)
    int cause_status
    uint64_t reconnects
    uint64_t repeated       # writes written again after a lost completion (CXL_HINT_REPEAT)
    uint32_t worked         # an access has succeeded since the last swap
    uint64_t rep_off[REPEAT_MAX]  # CXL_HINT_REPEAT's ranges, under `lock`
    uint64_t rep_len[REPEAT_MAX]
    uint32_t nrep
    uint32_t gen            # _fork_gen when attached
    uint32_t gone           # close() freed the queue pair and buffers
    int fail_kind
    int fail_status
    uint64_t timeout_ns
    uint64_t chunk
    uint64_t ops
    uint64_t bytes
    uint64_t direct         # bytes moved straight from or into registered buffers
    rdma_reg regs[REG_MAX]  # RdmaBackend.register's buffers, under `lock`
    uint32_t nregs
    uint64_t tick


# Verbs resources belong to the process that made them: a forked child inherits the
# queue pair's memory but not its use (the kernel refuses its commands). Every fork
# bumps the generation; an attachment made in an older one fails at once, saying so.
cdef uint32_t _fork_gen = 0


cdef void _after_fork_in_child() noexcept nogil:
    global _fork_gen
    _fork_gen += 1


pthread_atfork(NULL, NULL, _after_fork_in_child)


cdef int _registered(rdma_ctx* c, char* buf, uint64_t n) noexcept nogil:
    """The registration that holds all of [buf, buf+n), or -1. Lock held."""
    cdef uint64_t a = <uint64_t><size_t>buf
    cdef int i
    for i in range(REG_MAX):
        if (c.regs[i].mr != NULL and c.regs[i].start <= a <= c.regs[i].end
                and n <= c.regs[i].end - a):
            c.tick += 1
            c.regs[i].used = c.tick
            return i
    return -1


cdef int _slot(rdma_ctx* c, uint64_t a) noexcept nogil:
    """The registration that starts at `a`, or -1."""
    cdef int i
    for i in range(REG_MAX):
        if c.regs[i].mr != NULL and c.regs[i].start == a:
            return i
    return -1


cdef void _drop_regs(rdma_ctx* c) noexcept nogil:
    """Deregister every registered buffer (the lock held, or no other user left)."""
    cdef int i
    for i in range(REG_MAX):
        if c.regs[i].mr != NULL:
            ibv_dereg_mr(c.regs[i].mr)
            c.regs[i].mr = NULL
    c.nregs = 0


cdef int _fail(rdma_ctx* c, int kind, int st) noexcept nogil:
    c.fail_kind = kind
    c.fail_status = st
    cxl_atomic_store_release32(&c.broken, 1)
    cxl_atomic_store_release32(&c.reconnecting, 0)
    return CXLRT_E_IO


cdef void _hang_up(rdma_ctx* c) noexcept nogil:
    """End the control connection (lock held): the server drops our queue pair and
    claim at once, and the supervisor wakes. Never in a forked child, whose descriptor
    is the parent's connection (or closed, and its number reused)."""
    if c.ctl_fd >= 0 and c.gen == _fork_gen:
        shutdown(c.ctl_fd, SHUT_RDWR)


cdef void _interrupt(rdma_ctx* c, int kind, int st) noexcept nogil:
    """A clean break (lock held): nothing of ours may still land, so the accesses can
    wait for a new attachment. The supervisor is woken through the control socket."""
    if not c.reconnecting:
        c.cause_kind = kind
        c.cause_status = st
        if c.outage_ns == 0:
            c.outage_ns = cxv_now_ns()
        cxl_atomic_store_release32(&c.reconnecting, 1)
    _hang_up(c)


cdef void _await(rdma_ctx* c, uint64_t deadline) noexcept nogil:
    """Wait, lock not held, until the outage ends, the attachment is closed or broken,
    or the access's deadline passes (the caller then breaks the attachment)."""
    while (cxl_atomic_load_acquire32(&c.reconnecting) and not c.gone
           and not cxl_atomic_load_acquire32(&c.broken) and cxv_now_ns() < deadline):
        usleep(2000)


cdef void _await_released(rdma_ctx* c, uint64_t deadline) noexcept nogil:
    # The supervisor is a Python thread: a caller that holds the GIL (a small access
    # from Python) must let go of it while it waits, or the outage could never end.
    if PyGILState_Check():
        with gil:
            with nogil:
                _await(c, deadline)
    else:
        _await(c, deadline)


cdef bint _repeatable(rdma_ctx* c, uint64_t off, uint64_t n) noexcept nogil:
    """A write to [off, off+n) may be written again after a lost completion (lock held)."""
    cdef uint32_t i
    for i in range(c.nrep):
        if c.rep_off[i] <= off and n <= c.rep_len[i] and off - c.rep_off[i] <= c.rep_len[i] - n:
            return True
    return False


cdef int _move(rdma_ctx* c, bint write, uint64_t off, char* buf, uint64_t n,
               bint big, const uint64_t* words) noexcept nogil:
    """One attempt at the transfer (lock held): 0, CXLRT_E_IO (broken for good) or
    RETRY (a READ cut by a clean break: repeat it once the attachment is back).
    With `words`, n 8-byte words at those offsets (a gather or scatter), in flight
    together through the small staging buffer."""
    cdef char* stage = c.bounce if big else c.small
    cdef uint32_t lkey
    cdef uint64_t cap = BOUNCE if big else SMALL, k, off0 = off, n0 = n
    cdef int r = CXV_OK, st = 0, i = -1
    if big and c.nregs:
        i = _registered(c, buf, n)
    if words != NULL:
        if write:
            memcpy(c.small, buf, n * 8)
        r = cxv_xfer_v(&c.qp, write, c.small, c.small_mr.lkey, c.raddr, c.rkey, words, 8, n,
                       c.timeout_ns, &st)
        if r == CXV_OK:
            if not write:
                memcpy(buf, c.small, n * 8)
            c.ops += 1
            c.bytes += n * 8
    elif i >= 0:
        r = cxv_xfer(&c.qp, write, buf, c.regs[i].mr.lkey, c.raddr + off, c.rkey, n,
                     c.chunk, c.timeout_ns, &st)
        if r == CXV_OK:
            c.ops += 1
            c.bytes += n
            c.direct += n
    else:
        lkey = c.bounce_mr.lkey if big else c.small_mr.lkey
        while n:
            k = n if n < cap else cap
            if write:
                memcpy(stage, buf, k)
            r = cxv_xfer(&c.qp, write, stage, lkey, c.raddr + off, c.rkey, k, c.chunk,
                         c.timeout_ns, &st)
            if r != CXV_OK:
                break
            if not write:
                memcpy(buf, stage, k)
            c.ops += 1
            c.bytes += k
            off += k
            buf += k
            n -= k
    if r == CXV_OK:
        c.outage_ns = 0  # the attachment works again: a later failure is a new outage
        c.worked = 1
        return 0
    if c.window_ns == 0 or (write and (words != NULL or not _repeatable(c, off0, n0))):
        _hang_up(c)
        return _fail(c, r, st)
    if write:
        c.repeated += 1
    _interrupt(c, r, st)
    return RETRY


cdef int _xfer(rdma_ctx* c, bint write, uint64_t off, char* buf, uint64_t n,
               bint big, const uint64_t* words) noexcept nogil:
    """Move n bytes: straight from or into `buf` when it lies in a registered buffer
    (RdmaBackend.register), every request of the transfer in flight; else through a
    registered staging buffer, one buffer's worth at a time. Waits out an outage."""
    cdef int rc
    cdef uint64_t first = 0  # when this access first met an outage: its own window
    cdef uint64_t seen = 0   # c.reconnects then: a later one means the server came back
    if c.gen != _fork_gen:
        # Before the lock: a parent thread inside an access at fork() left the child's
        # copy of it locked for good. The child's copy of the context is its own.
        if not c.broken:
            _fail(c, CXV_FORKED, 0)
        return CXLRT_E_IO
    pthread_mutex_lock(&c.lock)
    while True:
        if c.gone:
            rc = CXLRT_E_CLOSED
        elif c.broken:
            rc = CXLRT_E_IO
        elif c.reconnecting:
            if first == 0:
                first = c.outage_ns if c.outage_ns != 0 else cxv_now_ns()
                seen = c.reconnects
            if cxv_now_ns() - first > c.window_ns:
                # The window is only judged while there is no attachment to try: the
                # outage outlasted it, or (the server came back meanwhile) this READ
                # failed on every new attachment, as on a poisoned line.
                _fail(c, CXV_AGAIN if c.reconnects != seen else CXV_GAVE_UP, 0)
                _hang_up(c)
                rc = CXLRT_E_IO
            else:
                pthread_mutex_unlock(&c.lock)
                _await_released(c, first + c.window_ns + 1)
                pthread_mutex_lock(&c.lock)
                continue
        else:
            rc = _move(c, write, off, buf, n, big, words)
            if rc == RETRY:
                continue  # now reconnecting
        break
    pthread_mutex_unlock(&c.lock)
    return rc


cdef int rdma_load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, False, off, <char*>dst, n, n > SMALL, NULL)


cdef int rdma_store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, True, off, <char*>src, n, n > SMALL, NULL)


cdef int rdma_load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, False, off, <char*>out, 8, False, NULL)


cdef int rdma_store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, True, off, <char*>&v, 8, False, NULL)


cdef int _words(rdma_ctx* c, bint write, uint32_t n, const uint64_t* offs,
                uint64_t* vals) noexcept nogil:
    """A gather or scatter of n words, as few requests as the staging buffer allows."""
    cdef uint32_t k
    cdef int rc = 0
    while n and rc == 0:
        k = n if n < SMALL // 8 else SMALL // 8
        rc = _xfer(c, write, 0, <char*>vals, k, False, offs)
        n -= k
        offs += k
        vals += k
    return rc


cdef int rdma_gather64(void* ctx, uint32_t n, const uint64_t* offs, uint64_t* out) noexcept nogil:
    return _words(<rdma_ctx*>ctx, False, n, offs, out)


cdef int rdma_scatter64(void* ctx, uint32_t n, const uint64_t* offs,
                        const uint64_t* vals) noexcept nogil:
    return _words(<rdma_ctx*>ctx, True, n, offs, <uint64_t*>vals)


cdef int rdma_flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    # No copy to write back or drop; a broken attachment still says so.
    return CXLRT_E_IO if cxl_atomic_load_acquire32(&(<rdma_ctx*>ctx).broken) else 0


cdef int rdma_fence(void* ctx) noexcept nogil:
    # Every access completed before it returned: nothing is left to order.
    return CXLRT_E_IO if cxl_atomic_load_acquire32(&(<rdma_ctx*>ctx).broken) else 0


cdef int rdma_dma_read(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, False, off, <char*>dst, n, True, NULL)


cdef int rdma_dma_write(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, True, off, <char*>src, n, True, NULL)


cdef int rdma_hint(void* ctx, int kind, uint64_t a, uint64_t b) noexcept nogil:
    # The heartbeat's words: a beat whose completion was lost is written again after a
    # reconnect rather than ending the attachment (an idle client's only writes).
    cdef rdma_ctx* c = <rdma_ctx*>ctx
    cdef int rc = 0
    if kind != CXL_HINT_REPEAT:
        return CXLRT_E_UNSUPPORTED
    if c.gen != _fork_gen:
        return CXLRT_E_IO
    pthread_mutex_lock(&c.lock)
    if c.nrep >= REPEAT_MAX:
        rc = CXL_HINT_REFUSED
    else:
        c.rep_off[c.nrep] = a
        c.rep_len[c.nrep] = b
        c.nrep += 1
    pthread_mutex_unlock(&c.lock)
    return rc


cdef cxl_ops RDMA_OPS = cxl_ops(
    abi=CXL_OPS_ABI, load=rdma_load, store=rdma_store, load64=rdma_load64, store64=rdma_store64,
    flush=rdma_flush, flush_nodrain=rdma_flush, fence=rdma_fence,
    dma_read=rdma_dma_read, dma_write=rdma_dma_write, hint=rdma_hint,
    gather64=rdma_gather64, scatter64=rdma_scatter64)


PARAMS = {
    "dev": (str, "", "RDMA device name (default: the first one)"),
    "port": (parse_int_range(1, 255), 1, "RDMA port number"),
    "gid": (parse_int_range(-1, 255), -1,
            "GID index (default: the first IPv4-mapped GID, else the first set one)"),
    "timeout": (parse_float_range(1.0, 600.0), 5.0,
                "seconds without a completion before the attachment is broken (at least "
                "the device's own retry window, about 0.5 s)"),
    "chunk": (parse_int_range(4096, 1 << 30), 1 << 20, "bytes per RDMA request"),
    "reconnect": (parse_float_range(0.0, 3600.0), 10.0,
                  "seconds an outage may last while accesses wait for the server to come "
                  "back (0: break the attachment at the first failure)"),
}
"""Spec parameters accepted by ``rdma:``."""


def server(*args, **kwargs):
    """A :class:`cxlrt.backends.rdma_serve.Server` (``cxlrt serve``)."""
    from cxlrt.backends.rdma_serve import Server
    return Server(*args, **kwargs)


def parse_region_arg(str text):
    """``NAME=SPEC`` or ``SPEC`` -> (name, spec), as ``cxlrt serve`` takes them."""
    from cxlrt.backends.rdma_serve import parse_region_arg as parse
    return parse(text)


def is_device(str path):
    """A served region is used whole, like a device: its size is the server's."""
    return True


def medium_size(str path):
    """The served region's bytes, asked of the server."""
    return _wire.info(path)["size"]


cdef class Device:
    """An open RDMA device, its protection domain and the GID this side uses.

    Parameters
    ----------
    name : str
        Device name; "" for the first one.
    port : int
        Port number.
    gid : int
        GID index; -1 picks one (see :data:`PARAMS`).
    """

    cdef cxv_dev d
    cdef uint32_t gen

    def __init__(self, str name="", int port=1, int gid=-1):
        self.gen = _fork_gen
        cdef char err[256]
        cdef bytes bname = name.encode()
        err[0] = 0
        if cxv_open(&self.d, bname, port, gid, err, sizeof(err)) != 0:
            raise OSError(f"RDMA device: {err.decode(errors='replace')}")

    @property
    def gid(self):
        return bytes(self.d.gid.raw[:16]).hex()

    @property
    def mtu(self):
        """The port's active MTU (ibv_mtu: 1 = 256 B ... 5 = 4096 B)."""
        return self.d.mtu

    @property
    def rd_atom(self):
        """READs this side lets a queue pair have in flight."""
        return self.d.rd_atom

    def __dealloc__(self):
        if self.gen == _fork_gen:  # a forked child's copy is its parent's: leave it
            cxv_close(&self.d)


@cython.no_gc_clear  # its device must outlive it: a cleared device closes under the MR
cdef class MemoryRegion:
    """Memory registered for remote READ and WRITE (the server's region)."""

    cdef ibv_mr* mr
    cdef readonly Device device
    cdef readonly unsigned long long addr
    cdef readonly unsigned long long length

    def __init__(self, Device device, unsigned long long addr, unsigned long long length):
        self.device = device
        self.mr = cxv_reg(&device.d, <void*><size_t>addr, length, 1)
        if self.mr == NULL:
            raise OSError(_errno(), f"ibv_reg_mr of {length} bytes at {addr:#x}")
        self.addr = addr
        self.length = length

    @property
    def rkey(self):
        return self.mr.rkey if self.mr != NULL else 0

    def close(self):
        if self.mr != NULL and self.device.gen == _fork_gen:
            ibv_dereg_mr(self.mr)
        self.mr = NULL

    def __dealloc__(self):
        self.close()


@cython.no_gc_clear  # its device must outlive it: destroying a QP of a closed device crashes
cdef class QueuePair:
    """One reliable-connected queue pair (the server keeps one per attachment)."""

    cdef cxv_qp q
    cdef readonly Device device

    def __init__(self, Device device, int depth=DEPTH):
        self.device = device
        cdef int rc = cxv_qp_create(&device.d, &self.q, depth,
                                    int.from_bytes(os.urandom(3), "little"))
        if rc != 0:
            raise OSError(-rc, f"creating a queue pair: {os.strerror(-rc)}")

    @property
    def qpn(self):
        return self.q.qp.qp_num

    @property
    def psn(self):
        return self.q.psn

    def connect(self, unsigned int qpn, unsigned int psn, str gid, int mtu=0, int rd_atom=0,
                int timeout=14, int retry=7):
        """Bring the queue pair to ready-to-send against the peer's (its MTU and READ
        depth: the smaller of each side's is used; 0 = this side's)."""
        cdef bytes g = bytes.fromhex(gid)
        if len(g) != 16:
            raise ValueError(f"bad GID {gid!r}")
        cdef int rc = cxv_qp_connect(&self.device.d, &self.q, qpn, psn, g, mtu, rd_atom,
                                     timeout, retry)
        if rc != 0:
            raise OSError(-rc, f"connecting the queue pair: {os.strerror(-rc)}")

    def close(self):
        if self.device is not None and self.device.gen == _fork_gen:
            cxv_qp_destroy(&self.q)

    def __dealloc__(self):
        self.close()


@cython.no_gc_clear  # a thread may still be inside an access: keep the device open
cdef class RdmaBackend(Backend):
    """This process's attachment to a served region.

    Parameters
    ----------
    path : str
        ``HOST:PORT/NAME`` (an IPv6 host in brackets).
    params : dict
        Parsed spec parameters, see :data:`PARAMS`.
    node : int
        This view's node id (sent to the server, which refuses a node of another host).
    size : int
        Region bytes (the server's).
    """

    cdef rdma_ctx c
    cdef Device device
    cdef QueuePair qp
    cdef object conn       # the control connection: its end is the server's end
    cdef object watcher
    cdef str why
    cdef dict pinned       # start address -> the registered object (kept alive)
    cdef object uuid       # the region's, once bound: a reconnect must find the same one
    cdef object claimed    # the node count claimed with, or None
    cdef object swap_mu    # the Python side of a swap against close(): conn, qp, server
    cdef str last_try      # why the supervisor's last attempt to attach again failed
    cdef str refusal       # why the server's answer to a reconnect ends the attachment
    cdef bint claim_refused  # that answer was a refusal of the node's claim
    cdef double backoff    # seconds between new attachments that each move nothing
    cdef bint poison       # test hook: every new attachment gets a key that is not valid
    cdef object gate       # test hook: (arrived, go) events a swap waits at, or None
    cdef readonly dict server

    def __cinit__(self):
        memset(&self.c, 0, sizeof(self.c))
        pthread_mutex_init(&self.c.lock, NULL)
        self.c.gone = 1
        self.c.ctl_fd = -1
        self.swap_mu = threading.Lock()
        self.last_try = "no attempt finished"
        self.backoff = 0.02

    def __init__(self, str path, dict params, int node, unsigned long long size):
        cdef void* p = NULL
        self.c.gen = _fork_gen
        self.scheme = "rdma"
        self.path = path
        self.pinned = {}
        self.params = dict(params)
        self.c.timeout_ns = <uint64_t>(params["timeout"] * 1e9)
        self.c.window_ns = <uint64_t>(params["reconnect"] * 1e9)
        self.c.chunk = params["chunk"]
        self.device = Device(params["dev"], params["port"], params["gid"])
        self.qp = QueuePair(self.device)
        for big in (False, True):
            if posix_memalign(&p, 4096, BOUNCE if big else SMALL) != 0:
                raise MemoryError("rdma: staging buffer")
            if big:
                self.c.bounce = <char*>p
            else:
                self.c.small = <char*>p
        self.c.small_mr = cxv_reg(&self.device.d, self.c.small, SMALL, 0)
        self.c.bounce_mr = cxv_reg(&self.device.d, self.c.bounce, BOUNCE, 0)
        if self.c.small_mr == NULL or self.c.bounce_mr == NULL:
            raise OSError(_errno(), "rdma: registering the staging buffers")
        self.conn, self.server = _wire.attach(
            path, node=node, qpn=self.qp.qpn, psn=self.qp.psn, gid=self.device.gid,
            mtu=self.device.mtu, rd_atom=self.device.rd_atom, timeout=params["timeout"])
        if self.server["size"] != size:
            self.conn.close()
            raise OSError(f"rdma:{path}: the server's region is {self.server['size']} "
                          f"bytes, not {size}")
        try:
            self.qp.connect(self.server["qpn"], self.server["psn"], self.server["gid"],
                            self.server.get("mtu", 0), self.server.get("rd_atom", 0))
        except BaseException:
            self.conn.close()
            raise
        self.c.raddr = self.server["addr"]
        self.c.rkey = self.server["rkey"]
        self.c.qp = self.qp.q
        self.c.dev = self.device.d
        self.c.ctl_fd = self.conn.sock.fileno()
        self.c.gone = 0
        self._use_device(size, CXL_CAP_COHERENT | CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH, node,
                         &self.c, &RDMA_OPS)
        self.watcher = threading.Thread(target=_supervise, args=(weakref.ref(self), self.conn),
                                        name="cxlrt-rdma-watch", daemon=True)
        self.watcher.start()

    cdef bint _lost(self, str why):
        """The control connection ended: True if the supervisor should attach again
        (its old socket is no longer ours to shut down from here on)."""
        cdef bint again = False
        # Before the break is published: a waiter may read failure() at once. Only a
        # break of kind -1 (this one) shows it.
        self.why = why
        with nogil:  # under the lock: a failure an access reports at once keeps its cause
            pthread_mutex_lock(&self.c.lock)
            if not self.c.gone and not self.c.broken:
                self.c.ctl_fd = -1
                if self.c.window_ns == 0:
                    _fail(&self.c, -1, 0)
                else:
                    if not self.c.reconnecting:
                        _interrupt(&self.c, -1, 0)
                    again = True
            pthread_mutex_unlock(&self.c.lock)
        return again

    def _reconnect(self):
        """Attach again (the supervisor's thread) until it works, the window runs out
        or the server refuses this attachment for good; the new control connection,
        or None."""
        delay = 0.02
        if self.c.reconnects and not self.c.worked:
            # The last new attachment moved nothing before it failed too (a READ that
            # fails everywhere): attach again, but not at the rate of a tight loop.
            self.backoff = min(self.backoff * 2, 1.0)
            time.sleep(self.backoff)
        else:
            self.backoff = 0.02
        while not self.c.gone and not self.c.broken:
            try:
                return self._reattach()
            except _Refused as e:
                self.refusal = str(e)  # before the break: a waiter may read it at once
                self._give_up(CXV_REFUSED)
                return None
            except Exception as e:  # noqa: BLE001  refused, unreachable, timed out, junk:
                self.last_try = f"{type(e).__name__}: {e}"  # the window decides, not the kind
            left = (<double>self.c.outage_ns + self.c.window_ns - cxv_now_ns()) / 1e9
            if left <= 0:
                self._give_up(CXV_GAVE_UP)
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.5)
        return None

    def _reattach(self):
        cdef QueuePair qp = QueuePair(self.device)
        try:
            conn, server = _wire.attach(
                self.path, node=self.reg.node, qpn=qp.qpn, psn=qp.psn, gid=self.device.gid,
                mtu=self.device.mtu, rd_atom=self.device.rd_atom,
                timeout=self.params["timeout"], claim=self.claimed)
        except _wire.ClaimRefused as e:
            qp.close()
            self.claim_refused = True
            raise _Refused(str(e)) from None
        except BaseException:
            qp.close()
            raise
        swapped = False
        try:
            if None not in (server.get("boot"), self.server.get("boot")) and \
                    server["boot"] != self.server["boot"]:
                # The same file after a crash of the server's host may have lost pages
                # the node wrote (the uuid, written first, survives): not a stall.
                raise _Refused(f"rdma:{self.path}: the server's host has restarted since "
                               "this attachment was made, so the region may have lost "
                               "writes; check it (`cxlrt check`) and open it again")
            if server["size"] != self.reg.size:
                raise _Refused(f"rdma:{self.path}: the server's region is now "
                               f"{server['size']} bytes, not {self.reg.size}")
            qp.connect(server["qpn"], server["psn"], server["gid"], server.get("mtu", 0),
                       server.get("rd_atom", 0))
            self._same_region(qp, server)
            if self.gate is not None:
                self.gate[0].set()
                self.gate[1].wait()
            swapped = self._swap(qp, conn, server)
        finally:
            if not swapped:
                conn.close()
                qp.close()
        return conn if swapped else None

    def _same_region(self, QueuePair qp, dict server):
        """Read the superblock through the new queue pair: the served memory must be
        the region this attachment was bound to (a server restarted on a re-formatted
        or other file keeps the name and the size, but not the uuid)."""
        from cxlrt import superblock as _sb
        from cxlrt.errors import RegionError
        cdef bytearray raw = bytearray(_sb.SB_BYTES)
        cdef char* dst = raw
        cdef uint64_t n = len(raw), raddr = server["addr"]
        cdef uint32_t rkey = server["rkey"]
        cdef int r, st = 0
        if self.uuid is None:
            return
        with nogil:  # c.small is the accesses' buffer; none runs while we reconnect
            pthread_mutex_lock(&self.c.lock)
            if self.c.gone:  # close() has freed the buffers
                r = -1
            else:
                r = cxv_xfer(&qp.q, False, self.c.small, self.c.small_mr.lkey, raddr, rkey,
                             n, self.c.chunk, self.c.timeout_ns, &st)
                if r == CXV_OK:
                    memcpy(dst, self.c.small, n)
            pthread_mutex_unlock(&self.c.lock)
        if r == -1:
            raise OSError(f"rdma:{self.path}: closed while reconnecting")
        if r != CXV_OK:
            raise OSError(f"rdma:{self.path}: reading the superblock after reconnecting: "
                          f"{_describe(r, st)}")
        try:
            uuid = _sb.unpack(bytes(raw), self.reg.size, f"rdma:{self.path}")["uuid"]
        except RegionError as e:
            raise _Refused(f"rdma:{self.path}: the served memory is no longer this region "
                           f"({e})") from None
        if uuid != self.uuid:
            raise _Refused(f"rdma:{self.path}: the server now serves another region under "
                           f"this name (uuid {uuid:#x}, attached to {self.uuid:#x})")

    def _swap(self, QueuePair qp, conn, dict server):
        """Put the new attachment in place and let the waiting accesses go on."""
        cdef QueuePair old
        cdef cxv_qp q = qp.q
        cdef uint64_t raddr = server["addr"]
        cdef uint32_t rkey = server["rkey"] ^ (0x5A5A if self.poison else 0)
        cdef int fd = conn.sock.fileno()
        cdef bint done = False
        # Never the GIL under c.lock: a thread that holds the GIL may be waiting for
        # c.lock (a small access from Python). swap_mu orders the Python fields with
        # close(), which takes it too.
        with self.swap_mu:
            with nogil:
                pthread_mutex_lock(&self.c.lock)
                if not self.c.gone and not self.c.broken:
                    self.c.qp = q
                    self.c.raddr = raddr
                    self.c.rkey = rkey
                    self.c.ctl_fd = fd
                    self.c.outage_ns = 0  # the new queue pair has read the superblock
                    self.c.worked = 0
                    self.c.reconnects += 1
                    cxl_atomic_store_release32(&self.c.reconnecting, 0)
                    done = True
                pthread_mutex_unlock(&self.c.lock)
            if not done:
                return False
            old, self.qp, self.conn, self.server = self.qp, qp, conn, server
            self.last_try = "no attempt finished"
        old.close()  # its last user was the access that failed; none can reach it now
        return True

    def _give_up(self, int kind):
        with nogil:
            pthread_mutex_lock(&self.c.lock)
            if not self.c.gone and not self.c.broken:
                _fail(&self.c, kind, 0)
                _hang_up(&self.c)
            pthread_mutex_unlock(&self.c.lock)

    def bind(self, int nodes, unsigned long long uuid, bint fresh):
        """Nothing per node: every node reaches the server's memory. The uuid is kept:
        a reconnect must find this region, not another under the same name."""
        self.uuid = uuid

    def claim(self, int nodes):
        """Tell the server this attachment is node `node` of `nodes` (Region calls it when
        it announces the node; observers and tools do not). The server refuses a node
        that another host holds: each node is one host, whose processes share node-local
        state no other host can see. A host is its hostname and boot (liveness.claim_id)."""
        from cxlrt.errors import MediumError, NodeClaimError, RegionClosedError
        from cxlrt.liveness import claim_id
        if self.c.gen != _fork_gen:  # no supervisor here: an outage would never end
            raise MediumError(f"rdma:{self.path}: {_KINDS[CXV_FORKED]}")
        msg = {"op": "claim", "node": self.reg.node, "nodes": nodes,
               "host": f"{claim_id():016x}"}
        self.claimed = nodes  # first: a reconnect from now on claims it in its handshake
        while True:
            conn = self.conn
            try:
                conn.ask(msg, self.params["timeout"])
                return
            except _wire.ConnectionLost:
                pass  # an outage, not a refusal: ask again on the next attachment
            except _wire.RdmaServerError as e:
                self.claimed = None
                raise NodeClaimError(str(e)) from None
            # The supervisor ends the outage (a new connection) or the attachment, within
            # its window, which starts again at every swap; the deadline here is a guard.
            deadline = time.monotonic() + self.params["reconnect"] + 2 * self.params["timeout"]
            while (self.conn is conn and not self.c.broken and not self.c.gone
                   and time.monotonic() < deadline):
                time.sleep(0.005)
            if self.conn is not conn:
                continue  # a claim of the same host is idempotent: the handshake's or ours
            self.claimed = None
            if self.c.gone:
                raise RegionClosedError(f"rdma:{self.path}: closed while claiming node "
                                        f"{self.reg.node}")
            if self.c.broken and self.c.fail_kind == CXV_REFUSED and self.claim_refused:
                raise NodeClaimError(self.refusal)  # refused in the reconnect's handshake
            raise MediumError(f"claiming node {self.reg.node} of rdma:{self.path}: "
                              f"{self.failure() or 'the server did not come back'}")

    def failure(self):
        """Why the attachment broke for good, or None while it works or reconnects."""
        if not self.c.broken:
            return None
        if self.c.fail_kind == -1:
            return f"the server closed the control connection ({self.why})"
        if self.c.fail_kind == CXV_REFUSED:
            return self.refusal
        what = self._what(self.c.fail_kind, self.c.fail_status)
        cause = self._what(self.c.cause_kind, self.c.cause_status)
        if self.c.fail_kind == CXV_GAVE_UP:
            what = (f"the server did not come back within {self.params['reconnect']} s "
                    f"(the outage began with: {cause}; the last attempt to attach again: "
                    f"{self.last_try})")
        elif self.c.fail_kind == CXV_AGAIN:
            what = (f"a READ kept failing across reconnects for {self.params['reconnect']} s "
                    f"(the last failure: {cause})")
        return what

    def outage(self):
        """While accesses wait for the server to come back: what began the outage, and
        for how many seconds it has lasted; else None."""
        if not self.c.reconnecting or self.c.broken:
            return None
        return (self._what(self.c.cause_kind, self.c.cause_status),
                (cxv_now_ns() - self.c.outage_ns) / 1e9)

    def _what(self, int kind, int status):
        if kind == -1:
            return f"the server closed the control connection ({self.why})"
        what = _describe(kind, status)
        if kind == CXV_TIMEOUT:
            what += f" ({self.params['timeout']} s)"
        return what

    def _set_rkey(self, unsigned int rkey):
        """Test hook: address the server's memory with another key from now on."""
        self.c.rkey = rkey

    def _poison_swaps(self, bint on):
        """Test hook: each new attachment addresses the server with a key that is not
        valid (a READ that fails on every attachment, as on a poisoned line)."""
        self.poison = on

    def _gate_swaps(self, gate):
        """Test hook: a reconnect sets gate[0] once the new attachment is checked and
        waits for gate[1] before it swaps it in (None: no gate)."""
        self.gate = gate

    def _supervising(self):
        """Whether the supervisor thread still runs (it ends with the attachment)."""
        return self.watcher is not None and self.watcher.is_alive()

    def _stall(self):
        """Test hook: the queue pair stops completing requests (a hung device)."""
        cdef int rc
        with nogil:
            pthread_mutex_lock(&self.c.lock)
            rc = -1 if self.c.gone else cxv_qp_stall(&self.c.qp)
            pthread_mutex_unlock(&self.c.lock)
        if rc != 0:
            raise OSError(-rc, "rdma: moving the queue pair to the drain state")

    def register(self, obj):
        """Register a writable buffer (numpy array, bytearray, CPU tensor's numpy view)
        for RDMA: dma_read and dma_write into or out of it then go straight between it
        and the server's memory, with no staging copy.

        The backend keeps a reference to `obj` while it is registered, so its memory
        cannot be freed and reused under the registration (a registration caches
        physical pages: a freed and reused buffer would be written behind its new
        owner's back). At most REG_MAX (32) buffers are registered at once; the least
        recently used one goes (falls back to staging) to make room. Returns the bytes
        registered."""
        mv = memoryview(obj).cast("B")  # held while registered: `obj` cannot be resized
        cdef unsigned char[::1] v = mv
        cdef uint64_t a, n = v.shape[0]
        cdef int i, j = -1
        cdef ibv_mr* mr
        self.region()
        if self.c.gen != _fork_gen:
            raise OSError(f"rdma:{self.path}: {_KINDS[CXV_FORKED]}")
        if n == 0:
            raise ValueError("register: an empty buffer")
        a = <uint64_t><size_t>&v[0]
        self.unregister(obj)
        mr = cxv_reg(&self.device.d, <void*><size_t>a, n, 0)
        if mr == NULL:
            raise OSError(_errno(), f"rdma: registering {n} bytes at {a:#x}")
        with nogil:
            pthread_mutex_lock(&self.c.lock)
            for i in range(REG_MAX):
                if self.c.regs[i].mr == NULL:
                    j = i
                    break
            if j < 0:
                j = 0
                for i in range(REG_MAX):
                    if self.c.regs[i].used < self.c.regs[j].used:
                        j = i
                ibv_dereg_mr(self.c.regs[j].mr)
                self.c.nregs -= 1
            self.c.tick += 1
            self.c.regs[j] = rdma_reg(start=a, end=a + n, mr=mr, used=self.c.tick)
            self.c.nregs += 1
            pthread_mutex_unlock(&self.c.lock)
        self.pinned = {k: o for k, o in self.pinned.items() if _slot(&self.c, k) >= 0}
        self.pinned[a] = mv
        return n

    def unregister(self, obj):
        """Undo register(obj) (nothing if it is not registered)."""
        cdef unsigned char[::1] v = memoryview(obj).cast("B")
        cdef uint64_t a = <uint64_t><size_t>&v[0] if v.shape[0] else 0
        cdef int i
        if self.c.gen != _fork_gen or self.c.gone:
            return  # the parent's registrations, or all dropped by close()
        with nogil:
            pthread_mutex_lock(&self.c.lock)
            i = _slot(&self.c, a)
            if i >= 0:
                ibv_dereg_mr(self.c.regs[i].mr)
                self.c.regs[i].mr = NULL
                self.c.nregs -= 1
            pthread_mutex_unlock(&self.c.lock)
        self.pinned.pop(a, None)

    def stats(self):
        return {"requests": self.c.ops, "bytes": self.c.bytes, "direct_bytes": self.c.direct,
                "registered": self.c.nregs, "broken": bool(self.c.broken),
                "reconnecting": bool(self.c.reconnecting and not self.c.broken),
                "reconnects": self.c.reconnects, "repeated_writes": self.c.repeated}

    cpdef close(self):
        # Closed first; then the queue pair's lock waits out an access in flight (each
        # ends by its deadline), and only then go the queue pair and the buffers. In a
        # forked child nothing of the parent's is touched (not even the lock, which a
        # parent thread may have held at fork): the queue pair, the keys and the
        # control connection are the parent's, and a shutdown would end it.
        self.reg.closed = 1
        if self.c.gone:
            return
        if self.c.gen != _fork_gen:
            self.c.gone = 1
            if self.conn is not None:
                self.conn.close(hang_up=False)
            return
        cdef ibv_mr* small_mr
        cdef ibv_mr* bounce_mr
        with self.swap_mu:  # a reconnect's swap is all done, or not begun and never will
            with nogil:
                pthread_mutex_lock(&self.c.lock)
                self.c.gone = 1
                self.c.ctl_fd = -1
                _drop_regs(&self.c)
                small_mr, bounce_mr = self.c.small_mr, self.c.bounce_mr
                self.c.small_mr = self.c.bounce_mr = NULL
                pthread_mutex_unlock(&self.c.lock)
            if self.conn is not None:
                self.conn.close()
            self.qp.close()
        self.pinned = {}
        if small_mr != NULL:
            ibv_dereg_mr(small_mr)
        if bounce_mr != NULL:
            ibv_dereg_mr(bounce_mr)

    def __dealloc__(self):
        cdef bint forked = self.c.gen != _fork_gen
        self.reg.closed = 1
        self.c.gone = 1
        if self.conn is not None:
            self.conn.close(hang_up=not forked)  # the server drops our queue pair at once
        if forked:
            return  # the parent's: nothing to give back here
        _drop_regs(&self.c)  # the QueuePair's own dealloc destroys it
        if self.c.small_mr != NULL:
            ibv_dereg_mr(self.c.small_mr)
        if self.c.bounce_mr != NULL:
            ibv_dereg_mr(self.c.bounce_mr)
        free(self.c.small)
        free(self.c.bounce)


class _Refused(Exception):
    """The server is back but this attachment cannot resume: not worth trying again."""


def _describe(int kind, int status):
    what = _KINDS.get(kind, f"failure {kind}")
    if kind == CXV_WC:
        what += f": {_WC.get(status, f'status {status}')}"
    return what


def _supervise(ref, conn):
    """The attachment's supervisor: it reads the control connection, and when that
    ends (the server went, or an access hung up on a failed READ) it attaches again,
    or breaks the attachment for good. It notices a server that went at once, not at
    the next access's transport retries. Weak: a region dropped without close() is
    still freed, and its dealloc hangs up."""
    cdef RdmaBackend b
    while conn is not None:
        why = conn.wait_closed()
        b = ref()
        if b is None:
            return
        again = b._lost(why)
        conn.close()
        conn = b._reconnect() if again else None
        b = None


def mapped_address(Backend b):
    """The address of a mappable backend's medium in this process (what the server
    registers), or ValueError."""
    if b.reg.base == NULL:
        raise ValueError(f"{b.scheme}:{b.path} has no mapping to serve over RDMA "
                         "(serve a file:, numa: or dax: region)")
    return <size_t>b.reg.base
