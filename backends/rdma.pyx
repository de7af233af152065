# cython: language_level=3
"""``rdma:HOST:PORT/NAME`` — a region that another host serves over RDMA (``cxlrt serve``).

The server registers the region's whole mapping as one memory region and gives each
attachment its own reliable-connected queue pair; after that its CPU takes no part in
an access. Every access here is a one-sided READ or WRITE of exactly the bytes asked
for, complete before the call returns. No node keeps a copy, so there is nothing
stale to drop: the medium is coherent for every node, and flushes are no-ops. That is
stronger than the non-coherent model the algorithms are written for, and costs one
round trip per access.

A completion error, a missed deadline (``timeout``) or the server closing the control
connection breaks the attachment: every later access fails at once with CXLRT_E_IO,
and :meth:`RdmaBackend.failure` says why. A broken attachment is never repaired in
place: open the region again (the server may have restarted with new keys).
"""

cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from cxlrt.backend cimport Backend, CXL_CAP_COHERENT, CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH, cxl_ops
from cxlrt.includes.intrin cimport cxl_atomic_load_acquire32, cxl_atomic_store_release32
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_IO

import os
import threading
import weakref

from cxlrt.backends import _rdmawire as _wire
from cxlrt.spec import parse_float_range, parse_int_range


cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** p, size_t align, size_t n)


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
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
                       const uint8_t* rgid, int timeout, int retry)
    void cxv_qp_destroy(cxv_qp* q)
    int cxv_xfer(cxv_qp* q, int write, char* laddr, uint32_t lkey, uint64_t raddr,
                 uint32_t rkey, uint64_t n, uint64_t chunk, uint64_t deadline_ns,
                 int* wc_status)
    uint64_t cxv_now_ns()
    enum:
        CXV_OK, CXV_POST, CXV_WC, CXV_TIMEOUT, CXV_POLL


cdef extern from "<errno.h>":
    int errno


cdef int _errno() noexcept:
    return errno


cdef enum:
    SMALL = 64 << 10      # staging for metadata accesses
    BOUNCE = 4 << 20      # staging for dma_read/dma_write, in `chunk` requests
    DEPTH = 16            # requests in flight per queue pair


# What a failure looks like from here: cxv_xfer's kind, then the completion status.
_KINDS = {CXV_POST: "posting a request failed", CXV_WC: "a completion error",
          CXV_TIMEOUT: "no completion before the deadline", CXV_POLL: "polling failed"}
# ibv_wc_status values worth naming (infiniband/verbs.h).
_WC = {5: "flushed (the queue pair is in error)", 9: "remote invalid request",
       10: "remote access error (a key that is no longer valid, or out of range)",
       11: "remote operation error", 12: "transport retries exceeded (the server is gone?)",
       13: "receiver-not-ready retries exceeded"}


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
    uint32_t gone           # close() freed the queue pair and buffers
    int fail_kind
    int fail_status
    uint64_t timeout_ns
    uint64_t chunk
    uint64_t ops
    uint64_t bytes


cdef int _xfer(rdma_ctx* c, bint write, uint64_t off, char* buf, uint64_t n,
               bint big) noexcept nogil:
    """Move n bytes through a registered staging buffer, one buffer's worth at a time."""
    cdef char* stage = c.bounce if big else c.small
    cdef uint32_t lkey
    cdef uint64_t cap = BOUNCE if big else SMALL, k
    cdef int rc = 0, r, st = 0
    pthread_mutex_lock(&c.lock)
    if c.gone:
        rc = CXLRT_E_CLOSED
    elif c.broken:
        rc = CXLRT_E_IO
    else:
        lkey = c.bounce_mr.lkey if big else c.small_mr.lkey
        while n:
            k = n if n < cap else cap
            if write:
                memcpy(stage, buf, k)
            r = cxv_xfer(&c.qp, write, stage, lkey, c.raddr + off, c.rkey, k, c.chunk,
                         cxv_now_ns() + c.timeout_ns, &st)
            if r != CXV_OK:
                c.fail_kind = r
                c.fail_status = st
                cxl_atomic_store_release32(&c.broken, 1)
                rc = CXLRT_E_IO
                break
            if not write:
                memcpy(buf, stage, k)
            c.ops += 1
            c.bytes += k
            off += k
            buf += k
            n -= k
    pthread_mutex_unlock(&c.lock)
    return rc


cdef int rdma_load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, False, off, <char*>dst, n, n > SMALL)


cdef int rdma_store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, True, off, <char*>src, n, n > SMALL)


cdef int rdma_load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, False, off, <char*>out, 8, False)


cdef int rdma_store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, True, off, <char*>&v, 8, False)


cdef int rdma_flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    # No copy to write back or drop; a broken attachment still says so.
    return CXLRT_E_IO if cxl_atomic_load_acquire32(&(<rdma_ctx*>ctx).broken) else 0


cdef int rdma_fence(void* ctx) noexcept nogil:
    # Every access completed before it returned: nothing is left to order.
    return CXLRT_E_IO if cxl_atomic_load_acquire32(&(<rdma_ctx*>ctx).broken) else 0


cdef int rdma_dma_read(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, False, off, <char*>dst, n, True)


cdef int rdma_dma_write(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return _xfer(<rdma_ctx*>ctx, True, off, <char*>src, n, True)


cdef cxl_ops RDMA_OPS = cxl_ops(
    load=rdma_load, store=rdma_store, load64=rdma_load64, store64=rdma_store64,
    flush=rdma_flush, flush_nodrain=rdma_flush, fence=rdma_fence,
    dma_read=rdma_dma_read, dma_write=rdma_dma_write)


PARAMS = {
    "dev": (str, "", "RDMA device name (default: the first one)"),
    "port": (parse_int_range(1, 255), 1, "RDMA port number"),
    "gid": (parse_int_range(-1, 255), -1,
            "GID index (default: the first IPv4-mapped GID, else the first set one)"),
    "timeout": (parse_float_range(0.05, 600.0), 5.0,
                "seconds an access may wait for its completion before the attachment "
                "is broken"),
    "chunk": (parse_int_range(4096, 1 << 30), 1 << 20, "bytes per RDMA request"),
}
"""Spec parameters accepted by ``rdma:``."""


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

    def __init__(self, str name="", int port=1, int gid=-1):
        cdef char err[256]
        cdef bytes bname = name.encode()
        err[0] = 0
        if cxv_open(&self.d, bname, port, gid, err, sizeof(err)) != 0:
            raise OSError(f"RDMA device: {err.decode(errors='replace')}")

    @property
    def gid(self):
        return bytes(self.d.gid.raw[:16]).hex()

    def __dealloc__(self):
        cxv_close(&self.d)


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
        if self.mr != NULL:
            ibv_dereg_mr(self.mr)
            self.mr = NULL

    def __dealloc__(self):
        self.close()


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

    def connect(self, unsigned int qpn, unsigned int psn, str gid, int timeout=14,
                int retry=7):
        """Bring the queue pair to ready-to-send against the peer's."""
        cdef bytes g = bytes.fromhex(gid)
        if len(g) != 16:
            raise ValueError(f"bad GID {gid!r}")
        cdef int rc = cxv_qp_connect(&self.device.d, &self.q, qpn, psn, g, timeout, retry)
        if rc != 0:
            raise OSError(-rc, f"connecting the queue pair: {os.strerror(-rc)}")

    def close(self):
        cxv_qp_destroy(&self.q)

    def __dealloc__(self):
        cxv_qp_destroy(&self.q)


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
    cdef readonly dict server

    def __cinit__(self):
        memset(&self.c, 0, sizeof(self.c))
        pthread_mutex_init(&self.c.lock, NULL)
        self.c.gone = 1

    def __init__(self, str path, dict params, int node, unsigned long long size):
        cdef void* p = NULL
        self.scheme = "rdma"
        self.path = path
        self.params = dict(params)
        self.c.timeout_ns = <uint64_t>(params["timeout"] * 1e9)
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
            timeout=params["timeout"])
        if self.server["size"] != size:
            self.conn.close()
            raise OSError(f"rdma:{path}: the server's region is {self.server['size']} "
                          f"bytes, not {size}")
        try:
            self.qp.connect(self.server["qpn"], self.server["psn"], self.server["gid"])
        except BaseException:
            self.conn.close()
            raise
        self.c.raddr = self.server["addr"]
        self.c.rkey = self.server["rkey"]
        self.c.qp = self.qp.q
        self.c.dev = self.device.d
        self.c.gone = 0
        self.reg.base = NULL
        self.reg.size = size
        self.reg.caps = CXL_CAP_COHERENT | CXL_CAP_SHARED_HOSTS
        self.reg.flags = CXL_F_NOFLUSH
        self.reg.node = node
        self.reg.ctx = &self.c
        self.reg.ops = &RDMA_OPS
        self.reg.closed = 0
        self.watcher = threading.Thread(target=_watch, args=(weakref.ref(self), self.conn),
                                        name="cxlrt-rdma-watch", daemon=True)
        self.watcher.start()

    cdef _lost(self, str why):
        if not self.c.gone and not self.c.broken:
            self.c.fail_kind = -1
            self.why = why
            cxl_atomic_store_release32(&self.c.broken, 1)

    def bind(self, int nodes, unsigned long long uuid, bint fresh):
        """Nothing per node: every node reaches the server's memory."""

    def failure(self):
        """Why the attachment broke, or None while it works."""
        if not self.c.broken:
            return None
        if self.c.fail_kind == -1:
            return f"the server closed the control connection ({self.why})"
        what = _KINDS.get(self.c.fail_kind, f"failure {self.c.fail_kind}")
        if self.c.fail_kind == CXV_WC:
            what += f": {_WC.get(self.c.fail_status, f'status {self.c.fail_status}')}"
        elif self.c.fail_kind == CXV_TIMEOUT:
            what += f" ({self.params['timeout']} s)"
        return what

    def stats(self):
        return {"requests": self.c.ops, "bytes": self.c.bytes, "broken": bool(self.c.broken)}

    cpdef close(self):
        # Closed first; then the queue pair's lock waits out an access in flight (each
        # ends by its deadline), and only then go the queue pair and the buffers.
        self.reg.closed = 1
        if self.c.gone:
            return
        with nogil:
            pthread_mutex_lock(&self.c.lock)
            self.c.gone = 1
            pthread_mutex_unlock(&self.c.lock)
        if self.conn is not None:
            self.conn.close()
        self.qp.close()
        if self.c.small_mr != NULL:
            ibv_dereg_mr(self.c.small_mr)
        if self.c.bounce_mr != NULL:
            ibv_dereg_mr(self.c.bounce_mr)
        self.c.small_mr = self.c.bounce_mr = NULL

    def __dealloc__(self):
        self.reg.closed = 1
        self.c.gone = 1
        if self.conn is not None:
            self.conn.close()  # the server drops our queue pair at once  # the QueuePair's own dealloc destroys it
        if self.c.small_mr != NULL:
            ibv_dereg_mr(self.c.small_mr)
        if self.c.bounce_mr != NULL:
            ibv_dereg_mr(self.c.bounce_mr)
        free(self.c.small)
        free(self.c.bounce)


def _watch(ref, conn):
    """Break the attachment as soon as the server's end of the control connection
    goes, rather than at the next access's transport retries (weak: a region dropped
    without close() is still freed, and its dealloc hangs up)."""
    why = conn.wait_closed()
    cdef RdmaBackend b = ref()
    if b is not None:
        b._lost(why)


def mapped_address(Backend b):
    """The address of a mappable backend's medium in this process (what the server
    registers), or ValueError."""
    if b.reg.base == NULL:
        raise ValueError(f"{b.scheme}:{b.path} has no mapping to serve over RDMA "
                         "(serve a file:, numa: or dax: region)")
    return <size_t>b.reg.base
