# cython: language_level=3
"""``Region``: one node's handle on a shared region, over any backend.

Python wrappers validate, release the GIL for bulk work, and map every status
through ``_rc``; the same operations are available to Cython algorithms as the
``cxl_*`` inline functions of backend.pxd.
"""

import os
import time
import weakref

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_MAPPABLE, CXL_HINT_ADMIT, CXL_HINT_DRAIN,
                            CXL_HINT_PREFETCH, CXL_HINT_REFUSED, CXL_HINT_RELEASE, CXL_HINT_WAIT, Backend, cxl_check_range, cxl_dma_read,
                            cxl_dma_write, cxl_fence, cxl_flush, cxl_flush_nodrain, cxl_hint,
                            cxl_load, cxl_load64, cxl_persist, cxl_store, cxl_store64)
from cxlrt.status cimport (CXLRT_E_CLOSED, CXLRT_E_COHERENCE, CXLRT_E_IO, CXLRT_E_RANGE,
                           CXLRT_E_UNSUPPORTED, check_rc)

from cxlrt import superblock as _sb
from cxlrt.caps import Caps
from cxlrt.errors import (MediumError, NotARegionError, RegionError, RegionSizeError,
                          UnsupportedError)

# close() waits this long for other threads' lock holds to end, then goes ahead (a hold
# that outlasts it outlives the close: its release fails, see LockService.begin_close).
CLOSE_WAIT_S = 10.0

# Below this many bytes a copy costs less than releasing and retaking the GIL.
DEF_NOGIL_BYTES = 4096


cdef class Region:
    """One node's view of a shared region. Create with :func:`cxlrt.open`.

    Attributes
    ----------
    size : int
        Region bytes.
    nodes : int
        Nodes that may attach (ids ``0 .. nodes-1``).
    node : int
        This view's node id.
    backend : Backend
        The backend object (scheme, path, params, stats).
    sections : dict
        ``{name: (offset, size)}`` of the region's sections (``nodes``, ``heap``).
    """

    def __init__(self, Backend backend, str spec):
        self.backend = backend
        self.r = backend.region()
        self.spec = spec
        self.sections = {}
        self._busy = 0
        self._closing = weakref.WeakSet()  # KV caches and channels: closed first

    # --- lifecycle --------------------------------------------------------------

    def _format(self, int nodes, unsigned long long uuid, unsigned int lease_ms):
        """Write a fresh superblock; the magic goes last (see layout.pxd)."""
        from cxlrt.lock import builtin_headers
        _sb.check_node(self.r.node, nodes, self.spec)
        sec = _sb.layout(self.r.size, nodes)
        # Zero everything before the heap first: zero-filled lock, directory and
        # chunk tables are valid and empty, and nothing of an earlier format survives.
        self.dma_write(0, bytes(sec["heap"][0]))
        for off, raw in builtin_headers(sec["locks"][0], nodes):
            self.dma_write(off, raw)
        body = _sb.pack(self.r.size, nodes, uuid, with_magic=False, lease_ms=lease_ms)
        self.dma_write(8, body[8:])
        self.backend.bind(nodes, uuid, True)
        # dma_write fences, so the body is in the medium before the magic is.
        self.dma_write(0, _sb.pack(self.r.size, nodes, uuid, lease_ms=lease_ms)[:8])
        self._adopt(self._read_superblock())

    def _attach(self, size=None, nodes=None, double wait=0.0, bint observer=False):
        """Validate the superblock (waiting up to `wait` s for a formatter) and bind."""
        deadline = time.monotonic() + wait
        while True:
            try:
                info = self._read_superblock()
                break
            except NotARegionError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        if size is not None and size != info["size"]:
            raise RegionSizeError(f"{self.spec}: asked for {size} bytes but the region "
                                  f"holds {info['size']}")
        if nodes is not None and nodes != info["nodes"]:
            raise RegionError(f"{self.spec}: asked for {nodes} nodes but the region was "
                              f"formatted for {info['nodes']}")
        _sb.check_node(self.r.node, info["nodes"], self.spec)
        self.backend.bind(info["nodes"], info["uuid"], False)
        self._adopt(info, announce=not observer, patience=wait)

    def _read_superblock(self):
        return _sb.unpack(self.dma_read(0, _sb.SB_BYTES), self.r.size, self.spec)

    def _adopt(self, info, bint announce=True, double patience=0.0):
        self.nodes = info["nodes"]
        self.uuid = info["uuid"]
        self.lease_ms = info["lease_ms"]
        self.sections = dict(info["sections"])
        if announce:
            from cxlrt.liveness import Liveness
            claim = getattr(self.backend, "claim", None)
            if claim is not None:  # a medium that can vouch for who is which node (rdma:)
                claim(self.nodes)
            self._live = Liveness(self, patience)

    @property
    def liveness(self):
        """This process's membership of its node (heartbeat, node states), or None for an
        observer."""
        return self._live

    def node_area(self, int node):
        """Offset of node `node`'s area (written only by that node)."""
        _sb.check_node(node, self.nodes, self.spec)
        return self.sections["nodes"][0] + node * _sb.NODE_AREA

    def close(self):
        """Detach: delayed flushes are completed, the mapping is released. Idempotent.

        Refused (RegionError, nothing changed) while this thread holds one of the
        region's locks. Threads waiting for a lock leave with RegionClosedError;
        other threads' holds are waited for up to CLOSE_WAIT_S."""
        self._close(False)

    cdef _close(self, bint held_ok):
        if self._busy:
            raise RegionError(f"{self.spec}: close() while another thread is inside a bulk "
                              "copy on this region")
        if self._locks is not None and not held_ok:
            self._locks.check_close()
        # Dependents first (KV caches, channels), while the mapping is still there:
        # pending counters are published and pins and roles given back, not left for
        # a later life of this process or node to recover. Their hits and locks then
        # find the region closed.
        for obj in list(self._closing):
            try:
                obj.close()
            except MediumError:
                if not self._cut_off():
                    raise
        self._closing.clear()
        if self._heap is not None and not self.r.closed:
            try:
                self._heap.close()  # the magazines: what our threads cached goes back
            except MediumError:
                if not self._cut_off():
                    raise
        if self._locks is not None:
            try:
                self._locks.stop_manager()
            except MediumError:
                if not self._cut_off():
                    raise
            self._locks.begin_close(CLOSE_WAIT_S)
        live, self._live = self._live, None
        if live is not None and not self.r.closed:
            # Give back what dead processes of our node hold before we may declare
            # the node detached: a detach never hides a dead sibling's holds.
            svc = self._locks
            if svc is None and live.local.busy_slots():
                svc = self.locks_for(live)
            try:
                live.close(sweep=svc.sweep if svc is not None else None)
            except MediumError:
                if not self._cut_off():
                    raise
        if self._locks is not None:
            self._locks.close()
            self._locks = None
        self._heap = None
        self.backend.close()

    cdef bint _cut_off(self):
        """The backend lost the medium for good (rdma:'s attachment broke): close()
        then frees what is ours without the detach writes, which cannot land; the
        node is left to others as a stalled one is (its lease runs out)."""
        fn = getattr(self.backend, "failure", None)
        return fn is not None and fn() is not None

    # --- locks, allocator, directory ------------------------------------------------

    @property
    def locks(self):
        """The region's LockService (node-local lock slots, lock manager)."""
        if self._locks is None:
            self.backend.region()  # raises if closed
            if self._live is None:
                raise RegionError(f"{self.spec}: attached as an observer, which takes no "
                                  "locks; open it as a node")
            self._locks = self.locks_for(self._live)
        return self._locks

    def locks_for(self, live):
        from cxlrt.lock import LockService
        svc = LockService(self, live)
        try:
            svc.ensure_builtin()
        except BaseException:
            svc.close()  # uninstalls its sweep: nothing of it outlives the error
            raise
        self._locks = svc
        return svc

    def lock(self, str name, *, mode=None):
        """The cross-node lock called `name`, created on first use.

        Parameters
        ----------
        name : str
            1 to 40 bytes of UTF-8.
        mode : {"bakery", "manager"}, optional
            Fixed when the lock is created (default "bakery"); asking for another
            mode than the existing lock's is a ValueError. "manager" locks need a
            lock manager: ``cxlrt lockmgr SPEC`` or ``cxlrt.open(..., lock_manager=True)``.
        """
        return self.locks.get(name, mode)

    def start_lock_manager(self, spin=None):
        """Run the lock manager for this region in a background thread of this process.

        `spin`: seconds it keeps spinning after a grant changed hands before it sleeps
        between passes (default cxlrt.lock.MANAGER_SPIN_S; 0 never spins: a shared core).
        """
        if spin is not None:
            self.locks.manager_spin = spin
        self.locks.start_manager()

    @property
    def _allocator(self):
        if self._heap is None:
            from cxlrt.alloc import Allocator
            self._heap = Allocator(self)
        return self._heap

    def alloc(self, nbytes, align=64):
        """Allocate `nbytes` in the region; returns the offset.

        Objects up to 16 KiB come from this node's size-class chunks without the
        global lock; larger ones are runs of 64 KiB chunks. `align` is a power of
        two up to 64 KiB. Raises cxlrt.OutOfMemory when there is no room.
        """
        return self._allocator.alloc(nbytes, align)

    def free(self, off):
        """Free an object allocated by any node; double or invalid frees raise."""
        self._allocator.free(off)

    def trim(self):
        """Give this node's empty cached chunks back to the region."""
        self._allocator.trim()

    def usage(self):
        """Allocator figures from the region (chunks, live objects and bytes, per node)."""
        from cxlrt.heapscan import scan
        return scan(self).usage()

    @property
    def directory(self):
        if self._dir is None:
            from cxlrt.directory import Directory
            self._dir = Directory(self)
        return self._dir

    def put(self, name, off):
        """Name a root object: ``get(name)`` returns `off` on every node."""
        self.directory.put(name, off)

    def get(self, name):
        """The offset named `name` (KeyError if absent)."""
        return self.directory.get(name)

    def delete(self, name):
        self.directory.delete(name)

    def names(self):
        return self.directory.names()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # With an exception on its way out, a hold it left behind does not replace it:
        # the close goes ahead (the node-local file stays mapped, so the hold ends,
        # at the latest, when its thread does).
        self._close(exc_type is not None)

    def __repr__(self):
        state = "closed" if self.r.closed else f"node {self.r.node}/{self.nodes}"
        return f"<cxlrt.Region {self.spec} {self.r.size} bytes, {state}>"

    # --- properties ---------------------------------------------------------------

    @property
    def size(self):
        return self.r.size

    @property
    def node(self):
        return self.r.node

    @property
    def closed(self):
        return bool(self.r.closed)

    @property
    def coherent(self):
        """True when every node sees every store at once (flushes are no-ops)."""
        return bool(self.r.caps & CXL_CAP_COHERENT)

    @property
    def caps(self):
        return Caps(self.r.caps)

    @property
    def heap(self):
        """(offset, size) of the free space after the fixed sections."""
        return self.sections["heap"]

    def stats(self):
        """Backend counters of this process (dict); see the backend's docs."""
        return self.backend.stats()

    # --- status -------------------------------------------------------------------

    cdef int _rc(self, int rc, str op, uint64_t off, uint64_t n, str detail=None) except -1:
        """Raise what a status means (status.pyx), told with what the caller knows
        (`detail`) or else with what this region knows."""
        if rc == 0:
            return 0
        if detail is not None:
            return check_rc(rc, op, detail)
        detail, extra = self._what(rc, op, off, n)
        return check_rc(rc, op, detail, extra)

    cdef tuple _what(self, int rc, str op, uint64_t off, uint64_t n):
        """(detail, exception keywords) for a status: the range of an access, the spec,
        the checker's last violation."""
        if rc == CXLRT_E_RANGE:
            return (f"[{off}, {off + n}) is outside the region of {self.r.size} bytes"
                    + (" or not 8-byte aligned" if op.endswith("64") else "")), None
        if rc == CXLRT_E_CLOSED:
            return f"{self.spec} is closed", None
        if rc == CXLRT_E_COHERENCE:
            v = self.backend.last_violation() or {}
            other = v.get("other", -1)
            who = f" (node {other} holds it dirty)" if other >= 0 else ""
            return (f"{v.get('kind', 'violation')} at offset 0x{v.get('offset', 0):x} "
                    f"(line {v.get('offset', 0) // 64}) by node {self.r.node}{who}; "
                    f"replay with seed={self.backend.params.get('seed')}",
                    dict(kind=v.get("kind", ""), offset=v.get("offset", -1), node=self.r.node,
                         other=other))
        if rc == CXLRT_E_IO:
            why = getattr(self.backend, "failure", lambda: None)()
            return (f"{self.spec}: the medium failed" + (f": {why}" if why else "")), None
        if rc == CXLRT_E_UNSUPPORTED:
            return (f"not supported by {self.backend.scheme}: "
                    "(backend not bound to a node yet?)"), None
        return None, None

    # --- loads and stores through this node's view -------------------------------

    def load64(self, uint64_t off):
        """Load an aligned 8-byte little-endian word through this node's view."""
        cdef uint64_t v = 0
        self._rc(cxl_load64(self.r, off, &v), "load64", off, sizeof(uint64_t))
        return v

    def store64(self, uint64_t off, uint64_t value):
        """Store an aligned 8-byte word into this node's view (publish with persist)."""
        self._rc(cxl_store64(self.r, off, value), "store64", off, sizeof(uint64_t))

    def load(self, uint64_t off, uint64_t n):
        """Copy `n` bytes out of this node's view."""
        cdef int rc = cxl_check_range(self.r, off, n)
        self._rc(rc, "load", off, n)
        out = PyBytes_FromStringAndSize(NULL, n)
        cdef char* p = PyBytes_AS_STRING(out)
        if n >= DEF_NOGIL_BYTES:
            self._busy += 1
            with nogil:
                rc = cxl_load(self.r, off, p, n)
            self._busy -= 1
        else:
            rc = cxl_load(self.r, off, p, n)
        self._rc(rc, "load", off, n)
        return out

    def store(self, uint64_t off, const unsigned char[::1] data not None):
        """Copy a bytes-like object into this node's view (publish with persist)."""
        cdef uint64_t n = data.shape[0]
        cdef int rc
        cdef const unsigned char* p = &data[0] if n else NULL
        if n >= DEF_NOGIL_BYTES:
            self._busy += 1
            with nogil:
                rc = cxl_store(self.r, off, p, n)
            self._busy -= 1
        else:
            rc = cxl_store(self.r, off, p, n)
        self._rc(rc, "store", off, n)

    def flush(self, uint64_t off, uint64_t n, *, bint drain=True):
        """Write back and drop the lines of ``[off, off+n)`` from this node's view.

        With ``drain=False`` the write-back may complete only at the next
        :meth:`fence` (clflushopt semantics; ``emu:...&delay=1`` models that).
        """
        if drain:
            self._rc(cxl_flush(self.r, off, n), "flush", off, n)
        else:
            self._rc(cxl_flush_nodrain(self.r, off, n), "flush", off, n)

    def fence(self):
        """Full fence: every earlier access and flush completes before any later one."""
        self._rc(cxl_fence(self.r), "fence", 0, 0)

    def persist(self, uint64_t off, uint64_t n):
        """Publish: flush ``[off, off+n)`` then fence."""
        self._rc(cxl_persist(self.r, off, n), "persist", off, n)

    # --- bulk DMA, bypassing every view --------------------------------------------

    def dma_read(self, uint64_t off, uint64_t n):
        """Read `n` bytes of the medium (device DMA semantics) into new bytes."""
        self._rc(cxl_check_range(self.r, off, n), "dma_read", off, n)
        out = PyBytes_FromStringAndSize(NULL, n)
        self._dma_read(off, PyBytes_AS_STRING(out), n)
        return out

    def dma_read_into(self, uint64_t off, unsigned char[::1] out not None):
        """Read ``len(out)`` bytes of the medium into a writable contiguous buffer."""
        cdef uint64_t n = out.shape[0]
        self._dma_read(off, <char*>&out[0] if n else NULL, n)

    cdef _dma_read(self, uint64_t off, char* p, uint64_t n):
        cdef int rc
        self._busy += 1
        try:
            with nogil:
                rc = cxl_dma_read(self.r, off, p, n)
        finally:
            self._busy -= 1
        self._rc(rc, "dma_read", off, n)

    def dma_write(self, uint64_t off, const unsigned char[::1] data not None):
        """Write a bytes-like object to the medium; visible to every node on return."""
        cdef uint64_t n = data.shape[0]
        cdef const unsigned char* p = &data[0] if n else NULL
        cdef int rc
        self._busy += 1
        try:
            with nogil:
                rc = cxl_dma_write(self.r, off, p, n)
        finally:
            self._busy -= 1
        self._rc(rc, "dma_write", off, n)

    # --- the device's write buffer (HyMCache's write isolation) -----------------

    def admit(self, uint64_t nbytes, uint64_t pieces=1):
        """Whether `nbytes` of DMA writes in `pieces` pieces may go to the device's
        write buffer now: its answer to HyMCache's admission question. False means the
        buffer is full (reads have kept the capacity tier busy): skip the store rather
        than stall on that tier. True where the backend has no write buffer, since
        every write then goes to its tier at once. Advisory: the room is not reserved;
        a write that finds it gone goes through to the capacity tier, correct but slower.
        Raises ValueError for a size the buffer could never take."""
        if pieces == 0:
            raise ValueError("pieces must be at least 1")
        cdef int rc = self._hint(CXL_HINT_ADMIT, nbytes, pieces)
        if rc == CXLRT_E_UNSUPPORTED:
            return True
        if rc == CXLRT_E_RANGE:
            raise ValueError(f"{self.spec}: {nbytes} bytes in {pieces} pieces are more than "
                             "the device's whole write buffer (wbuf=) could ever take")
        self._rc(rc, "admit", 0, 0)
        return rc != CXL_HINT_REFUSED

    def drain(self):
        """Write the device's write buffer back to its capacity tier now, and wait for
        it (nothing to do where the backend has none)."""
        cdef int rc = self._hint(CXL_HINT_DRAIN, 0, 0)
        if rc != CXLRT_E_UNSUPPORTED:
            self._rc(rc, "drain", 0, 0)

    # --- prefetch into the device's fast memory (HyMCache's chm_prefetch_object) ---

    def prefetch(self, uint64_t off, uint64_t n):
        """Ask the device to stage [off, off+n) in its fast memory (a CXL-HM device's
        DRAM) ahead of DMA reads, and hold it there until ``prefetch_release`` or
        until the device's pin time lapses. Returns at once; a read of a page still
        landing waits for it, and ``prefetch_wait`` waits for the whole range. True
        if the device took it; False if it has no room it can spare now, or takes
        no prefetch (reads then go to the capacity tier: correct, slower). Advice
        only: no outcome of it changes what a read returns."""
        self._need_range(off, n, "prefetch")
        cdef int rc = self._hint(CXL_HINT_PREFETCH, off, n)
        if rc == CXLRT_E_UNSUPPORTED or rc == CXL_HINT_REFUSED:
            return False
        self._rc(rc, "prefetch", off, n)
        return True

    def prefetch_wait(self, uint64_t off, uint64_t n):
        """Wait until the prefetched pages of [off, off+n) have landed."""
        self._need_range(off, n, "prefetch_wait")
        cdef int rc = self._hint(CXL_HINT_WAIT, off, n)
        if rc != CXLRT_E_UNSUPPORTED:
            self._rc(rc, "prefetch_wait", off, n)

    def prefetch_release(self, uint64_t off, uint64_t n):
        """Give back a prefetch's hold on [off, off+n): it was consumed, and the
        device may evict it first."""
        self._need_range(off, n, "prefetch_release")
        cdef int rc = self._hint(CXL_HINT_RELEASE, off, n)
        if rc != CXLRT_E_UNSUPPORTED:
            self._rc(rc, "prefetch_release", off, n)

    cdef int _need_range(self, uint64_t off, uint64_t n, str op) except -1:
        if n == 0:
            raise ValueError(f"{op}: an empty range")
        self._rc(cxl_check_range(self.r, off, n), op, off, n)
        return 0

    cdef int _hint(self, int kind, uint64_t a, uint64_t b) noexcept:
        """cxl_hint without the GIL, counted in _busy as every device call is."""
        cdef int rc
        self._busy += 1
        with nogil:
            rc = cxl_hint(self.r, kind, a, b)
        self._busy -= 1
        return rc

    def register_cuda(self):
        """Page-lock the mapping for CUDA (cudaHostRegister, in pieces of at most
        128 GiB), so host-device copies run straight from region memory. Idempotent;
        undone by close() before the unmap. Raises UnsupportedError without a CUDA
        device or on a backend that is not mappable, CudaRegistrationError when the
        driver refuses (nothing then stays registered: no silent pageable copies)."""
        from cxlrt import _cuda
        holder = _cuda.register(self)
        if holder is not None:
            self._closing.add(holder)  # closed with the dependents, before the unmap

    @property
    def cuda_registered(self):
        from cxlrt import _cuda
        return _cuda.registered(self)

    def tensor(self, uint64_t off, shape, dtype):
        """A CPU torch tensor of `shape` and `dtype` over the medium at `off` (mappable
        backends): a DMA window, like view(); close() refuses while it is alive."""
        from cxlrt import _cuda
        return _cuda.tensor(self, off, shape, dtype)

    def view(self, uint64_t off, uint64_t n):
        """A writable memoryview of the medium ``[off, off+n)`` (mappable backends).

        The view is a DMA window: it bypasses node views, so use it for payload
        bytes and publish metadata only after writing through it.
        """
        self._rc(cxl_check_range(self.r, off, n), "view", off, n)
        if not self.r.caps & CXL_CAP_MAPPABLE:
            raise UnsupportedError(f"view: {self.backend.scheme}: memory is not mappable")
        return self.backend.view(off, n)
