# cython: language_level=3
"""``chm:`` — a CXL hybrid-memory device: a small device DRAM in front of an SSD.

The region file is the SSD. The device's DRAM, its page map and frame table live in
``<path>.chm``, shared by every process that opens the region, so every node sees one
device, as hosts on a CXL switch do. Two policies (``policy=``):

  lru      the transparent cache of commercial devices: every access goes through
           DRAM; a miss reads the whole page from the SSD (one request, one latency),
           and a dirty victim is written back first.
  staging  HyMCache's device: DMA reads and writes of pages not in DRAM go straight
           to the SSD as one sequential request, never filling DRAM; the runtime's
           StagingWindow stages objects ahead of use instead. CPU loads and stores
           (the runtime's metadata) still go through DRAM as under lru.

SSD time is modelled (``lat``, ``bw``, ``wbw``) on one device-wide timeline: work
queued by any process delays every later request, as on one SSD. The device
serialises accesses, so the medium is coherent: host-cache non-coherence is emu:'s
subject, not this model's. A process stopped (SIGSTOP) inside the device's lock
stalls the device until it resumes; after ``lock_timeout`` the others get an I/O
error rather than hang. A process killed there is recovered by _repair().
"""

cimport cython
from libc.errno cimport EINTR, errno
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from posix.time cimport nanosleep, timespec
from posix.unistd cimport close, pread, pwrite

from cxlrt.backend cimport CXL_CAP_COHERENT, CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH, cxl_ops
from cxlrt.includes.intrin cimport (cxl_atomic_add_relaxed64, cxl_atomic_load_acquire32,
                                    cxl_atomic_load_relaxed64, cxl_fence_full, cxl_now_ns,
                                    cxl_spin_ns, unlikely)
from cxlrt.includes.mutex cimport (cxl_mutex_timedlock, cxl_mutex_unlock,
                                   pthread_mutex_t)
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_IO

import os

from cxlrt.emulation import chmside as _side

LOCK_TIMEOUT_S = 30.0
"""A device lock not had in this long is reported as an I/O error (a stopped holder)."""


cdef enum:
    CHM_MAX_QUEUE_NS = 10000000000  # queued SSD time past this is a scribble, not work

# --- the SSD --------------------------------------------------------------------

cdef inline uint64_t _page_len(chm_ctx* c, uint64_t pg) noexcept nogil:
    """Bytes of page pg inside the region (the last page may be short)."""
    cdef uint64_t start = pg * c.page
    return min(c.page, c.region_size - start)


cdef int _ssd_io(chm_ctx* c, char* buf, uint64_t n, uint64_t off, bint write) noexcept nogil:
    """Move n bytes between buf and the SSD at off, whole: 0 or CXLRT_E_IO."""
    cdef long r
    while n:
        if write:
            r = pwrite(c.fd, buf, n, <long>off)
        else:
            r = pread(c.fd, buf, n, <long>off)
        if r < 0:
            if errno == EINTR:
                continue
            return CXLRT_E_IO
        if r == 0:
            return CXLRT_E_IO  # the file is shorter than the region: never silently zeros
        buf += r
        off += <uint64_t>r
        n -= <uint64_t>r
    return 0


cdef inline uint64_t _ssd_cost(chm_ctx* c, uint64_t n, bint write) noexcept nogil:
    """Modelled time of one SSD request of n bytes."""
    cdef double bpns = c.write_bpns if write else c.read_bpns
    cdef double t = c.lat_ns + (n / bpns if bpns > 0 else 0.0)
    return <uint64_t>t if t < CHM_MAX_QUEUE_NS else CHM_MAX_QUEUE_NS


cdef int _ssd_page(chm_ctx* c, uint64_t f, uint64_t pg, bint write,
                   uint64_t* cost) noexcept nogil:
    """Read page pg into frame f, or write frame f back as page pg."""
    cdef uint64_t n = _page_len(c, pg)
    cdef int rc = _ssd_io(c, c.dram + f * c.page, n, pg * c.page, write)
    if rc == 0:
        cost[0] += _ssd_cost(c, n, write)
        c.h.st[CHM_ST_SSD_WRITE_BYTES if write else CHM_ST_SSD_READ_BYTES] += n
    return rc


# --- the controller (device lock held) ---------------------------------------------

cdef inline int _frame_of(chm_ctx* c, uint64_t pg) noexcept nogil:
    """The frame holding page pg, or -1. An entry that does not name the page back
    (a scribble, a repair in progress) is not trusted."""
    cdef uint64_t f = c.pmap[pg]
    if f == 0 or f > c.frames:
        return -1
    f -= 1
    if (c.ftab[f] >> 8) != pg + 1 or not (c.ftab[f] & CHM_F_VALID):
        return -1
    return <int>f


cdef long _victim(chm_ctx* c, uint64_t* cost) noexcept nogil:
    """A free frame, evicting by clock if none is: a dirty victim is written back
    before it is unmapped, so a holder killed anywhere leaves its bytes on the SSD
    or still mapped. The frame number, or CXLRT_E_IO."""
    cdef uint64_t i, f, w, pg
    cdef int rc
    for i in range(2 * c.frames + 1):
        f = c.h.hand % c.frames  # shared: never trusted as an index
        c.h.hand = (f + 1) % c.frames
        w = c.ftab[f]
        if w == 0:
            return <long>f
        if w & CHM_F_REF:
            c.ftab[f] = w & ~(<uint64_t>CHM_F_REF)
            continue
        pg = (w >> 8) - 1
        if w & CHM_F_DIRTY and pg < c.pages:
            rc = _ssd_page(c, f, pg, True, cost)
            if rc != 0:
                return rc
            c.h.st[CHM_ST_WRITEBACKS] += 1
            c.ftab[f] = w & ~(<uint64_t>CHM_F_DIRTY)
        if pg < c.pages and c.pmap[pg] == f + 1:
            c.pmap[pg] = 0
        c.ftab[f] = 0
        return <long>f
    return CXLRT_E_IO  # unreachable: the first sweep clears every reference bit


cdef long _fill(chm_ctx* c, uint64_t pg, bint read, uint64_t* cost) noexcept nogil:
    """A frame for page pg, read from the SSD unless the caller overwrites it whole.
    It stays FILL and unmapped: the caller maps it with _publish once its own copy is
    done, so a holder killed before then leaves nothing a reader could take for the
    page (repair drops a FILL frame)."""
    cdef long f = _victim(c, cost)
    cdef int rc
    if f < 0:
        return f
    c.ftab[f] = ((pg + 1) << 8) | CHM_F_FILL
    if read:
        rc = _ssd_page(c, <uint64_t>f, pg, False, cost)
        if rc != 0:
            c.ftab[f] = 0
            return rc
        c.h.st[CHM_ST_FILLS] += 1
    return f


cdef inline void _publish(chm_ctx* c, uint64_t f, uint64_t pg, bint dirty) noexcept nogil:
    """Map a filled frame: the page map first, then the entry that names it back, so
    the page is its frame's only when both agree."""
    c.pmap[pg] = <uint32_t>(f + 1)
    c.ftab[f] = ((pg + 1) << 8) | CHM_F_VALID | CHM_F_REF | (CHM_F_DIRTY if dirty else 0)


cdef void _repair(chm_ctx* c) noexcept nogil:
    """Finish what a holder killed inside the controller left: drop half-filled
    frames and entries that do not name each other; a valid frame its page no longer
    maps is written back if its page is nowhere else, then freed."""
    cdef uint64_t f, w, pg, cost = 0
    for f in range(c.frames):
        w = c.ftab[f]
        if w == 0:
            continue
        pg = (w >> 8) - 1
        if pg >= c.pages or (w & CHM_F_FILL) or not (w & CHM_F_VALID):
            c.ftab[f] = 0
            continue
        if c.pmap[pg] != f + 1:
            if (w & CHM_F_DIRTY) and c.pmap[pg] == 0 and _ssd_page(c, f, pg, True, &cost) != 0:
                c.pmap[pg] = <uint32_t>(f + 1)  # the only copy: keep it in DRAM, mapped
                continue
            c.ftab[f] = 0
    for pg in range(c.pages):
        if c.pmap[pg] != 0 and _frame_of(c, pg) < 0:
            c.pmap[pg] = 0
    c.h.st[CHM_ST_REPAIRS] += 1
    _charge(c, cxl_now_ns(), cost)


cdef int _lock(chm_ctx* c) noexcept nogil:
    cdef int rc = cxl_mutex_timedlock(c.lock, c.lock_timeout_ns)
    if unlikely(rc == 1):
        _repair(c)
        return 0
    return CXLRT_E_IO if rc < 0 else 0


cdef uint64_t _charge(chm_ctx* c, uint64_t t0, uint64_t cost) noexcept nogil:
    """Queue `cost` of SSD time from t0 on the device's one timeline (lock held); when
    it ends, or 0 for no cost."""
    cdef uint64_t end
    if cost == 0:
        return 0
    end = c.h.ssd_free_ns
    if end < t0 or end > t0 + CHM_MAX_QUEUE_NS:  # shared: a wild value never hangs us
        end = t0
    end += cost
    c.h.ssd_free_ns = end
    c.h.st[CHM_ST_BUSY_NS] += cost
    return end


cdef void _wait_until(uint64_t end) noexcept nogil:
    """Spin through a modelled delay, as emu: does; only a long one (a queue behind
    other processes' work) sleeps most of it. A sleeping thread wakes late by the timer
    slack and whatever the scheduler adds (measured: a 282 us request ran 10-40 %
    long on this 2-vCPU guest when it slept from 200 us up)."""
    cdef uint64_t now = cxl_now_ns()
    cdef timespec ts
    if end > now + 2000000:
        ts.tv_sec = <long>((end - now - 500000) // 1000000000)
        ts.tv_nsec = <long>((end - now - 500000) % 1000000000)
        nanosleep(&ts, NULL)
        now = cxl_now_ns()
    if end > now:
        cxl_spin_ns(end - now)


cdef inline void _nap() noexcept nogil:
    cdef timespec ts
    ts.tv_sec = 0
    ts.tv_nsec = 50000
    nanosleep(&ts, NULL)


cdef int _access(chm_ctx* c, uint64_t off, char* buf, uint64_t n, bint write,
                 bint dma) noexcept nogil:
    """_access_in, counted in this process's in-flight accesses, which close() waits
    out before it retires the device's mapping: a thread inside the device never
    meets a retired lock or zeroed tables."""
    cdef int rc
    cxl_atomic_add_relaxed64(&c.inflight, 1)
    cxl_fence_full()  # Dekker with close(): it sets closed, fences, then reads inflight
    if unlikely(cxl_atomic_load_acquire32(c.closed) != 0):
        rc = CXLRT_E_CLOSED
    else:
        rc = _access_in(c, off, buf, n, write, dma)
    cxl_atomic_add_relaxed64(&c.inflight, <uint64_t>-1)
    return rc


cdef int _access_in(chm_ctx* c, uint64_t off, char* buf, uint64_t n, bint write,
                    bint dma) noexcept nogil:
    """Move n bytes between buf and the device at off through the policy; then wait
    for the SSD time this request queued."""
    cdef uint64_t cost = 0, pg, a, k, run, q, end = 0, t0
    cdef long f
    cdef int rc = _lock(c)
    if rc != 0:
        return rc
    # The model's clock starts when the device takes the request: the real copies
    # below are part of the modelled time, not added to it.
    t0 = cxl_now_ns()
    while n:
        pg = off // c.page
        a = off - pg * c.page
        k = min(n, _page_len(c, pg) - a)
        f = _frame_of(c, pg)
        if f < 0 and dma and c.policy == CHM_STAGING:
            # One sequential request for the whole run of pages not in DRAM.
            run = k
            q = pg + 1
            while run < n and _frame_of(c, q) < 0:
                run += min(n - run, _page_len(c, q))
                q += 1
            rc = _ssd_io(c, buf, run, off, write)
            if rc != 0:
                break
            cost += _ssd_cost(c, run, write)
            c.h.st[CHM_ST_DIRECT_WRITES if write else CHM_ST_DIRECT_READS] += 1
            c.h.st[CHM_ST_SSD_WRITE_BYTES if write else CHM_ST_SSD_READ_BYTES] += run
            k = run
        elif f < 0:
            f = _fill(c, pg, not (write and a == 0 and k == _page_len(c, pg)), &cost)
            if f < 0:
                rc = <int>f
                break
            if write:
                memcpy(c.dram + f * c.page + a, buf, k)
            else:
                memcpy(buf, c.dram + f * c.page + a, k)
            _publish(c, <uint64_t>f, pg, write)
            c.h.st[CHM_ST_DRAM_BYTES] += k
        else:
            c.h.st[CHM_ST_HITS] += 1
            if write:
                # Dirty before the copy: a holder killed mid-copy leaves a torn store
                # that is written back, never one that shows and then vanishes.
                c.ftab[f] |= CHM_F_REF | CHM_F_DIRTY
                memcpy(c.dram + f * c.page + a, buf, k)
            else:
                c.ftab[f] |= CHM_F_REF
                memcpy(buf, c.dram + f * c.page + a, k)
            c.h.st[CHM_ST_DRAM_BYTES] += k
        off += k
        buf += k
        n -= k
    end = _charge(c, t0, cost)
    cxl_mutex_unlock(c.lock)
    if end:
        _wait_until(end)
    return rc


# --- ops --------------------------------------------------------------------------

cdef int chm_load(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return _access(<chm_ctx*>ctx, off, <char*>dst, n, False, False)


cdef int chm_store(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return _access(<chm_ctx*>ctx, off, <char*>src, n, True, False)


cdef int chm_load64(void* ctx, uint64_t off, uint64_t* out) noexcept nogil:
    return _access(<chm_ctx*>ctx, off, <char*>out, 8, False, False)


cdef int chm_store64(void* ctx, uint64_t off, uint64_t v) noexcept nogil:
    return _access(<chm_ctx*>ctx, off, <char*>&v, 8, True, False)


cdef int chm_flush(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    return 0  # the device serialises every access: nothing is held in a host's view


cdef int chm_fence(void* ctx) noexcept nogil:
    cxl_fence_full()
    return 0


cdef int chm_dma_read(void* ctx, uint64_t off, void* dst, uint64_t n) noexcept nogil:
    return _access(<chm_ctx*>ctx, off, <char*>dst, n, False, True)


cdef int chm_dma_write(void* ctx, uint64_t off, const void* src, uint64_t n) noexcept nogil:
    return _access(<chm_ctx*>ctx, off, <char*>src, n, True, True)


cdef cxl_ops CHM_OPS = cxl_ops(
    load=chm_load, store=chm_store, load64=chm_load64, store64=chm_store64, flush=chm_flush,
    flush_nodrain=chm_flush, fence=chm_fence, dma_read=chm_dma_read, dma_write=chm_dma_write)

_STATS = ("hits", "fills", "writebacks", "direct_reads", "direct_writes", "ssd_read_bytes",
          "ssd_write_bytes", "dram_bytes", "busy_ns", "repairs")
assert len(_STATS) == CHM_NSTATS

PARAMS = _side.PARAMS


@cython.no_gc_clear  # a beat thread may still be inside the device: keep the sidecar
cdef class ChmBackend(Backend):
    """One process's handle on a CXL-HM device model.

    Parameters
    ----------
    path : str
        The region file (the SSD); the device lives in ``path + ".chm"``.
    params : dict
        Parsed spec parameters, see :data:`PARAMS`.
    node : int
        This view's node id.
    size : int
        Region bytes (the file's size).
    """

    def __cinit__(self):
        self.c.fd = -1

    def __init__(self, str path, dict params, int node, unsigned long long size):
        cdef char* side
        self.scheme = "chm"
        self.path = path
        self.params = dict(params)
        self.sidecar_path = path + ".chm"
        self.sidecar, geo = _side.attach(path, size, params)
        self.c.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        side = self.sidecar.base
        self.c.h = <chm_hdr*>side
        self.c.lock = <pthread_mutex_t*>(side + CHM_LOCK_OFFSET)
        self.c.pmap = <uint32_t*>(side + <size_t>geo["pmap"])
        self.c.ftab = <uint64_t*>(side + <size_t>geo["ftab"])
        self.c.dram = side + <size_t>geo["data"]
        self.c.page = geo["page"]
        self.c.frames = geo["frames"]
        self.c.pages = geo["pages"]
        self.c.region_size = size
        self.c.policy = CHM_STAGING if params["policy"] == "staging" else CHM_LRU
        self.c.closed = &self.reg.closed
        self.c.lat_ns = params["lat"]
        self.c.read_bpns = params["bw"]
        self.c.write_bpns = params["wbw"] or params["bw"]
        self.c.lock_timeout_ns = <uint64_t>(LOCK_TIMEOUT_S * 1e9)
        self._use_device(size, CXL_CAP_COHERENT | CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH, node,
                         &self.c, &CHM_OPS)

    def bind(self, int nodes, unsigned long long uuid, bint fresh):
        """Nothing per node: every node reaches the one device."""

    cpdef close(self):
        # Closed first, then every access of this process already inside the device is
        # waited out (each holds the device lock for at most one request, or times out
        # on it), and only then is the mapping retired: a holder that unlocked a
        # retired lock would leave the real one owned for good. The descriptor stays
        # open until dealloc, so nothing ever writes through a reused number.
        cdef chm_ctx* c = &self.c
        if self.sidecar is None or self.sidecar.closed:
            self.reg.closed = 1
            return
        self.reg.closed = 1
        with nogil:
            cxl_fence_full()
            while cxl_atomic_load_relaxed64(&c.inflight) != 0:
                _nap()
        self._retire(self.sidecar)

    def __dealloc__(self):
        self.reg.closed = 1
        if self.c.fd >= 0:
            close(self.c.fd)
            self.c.fd = -1

    def stats(self):
        """The device's counters (dict of int), shared by every process using it."""
        self.region()
        return {name: self.c.h.st[i] for i, name in enumerate(_STATS)}

    def resident(self):
        """Pages in DRAM and how many of them are dirty: (pages, dirty)."""
        cdef uint64_t f, n = 0, d = 0
        self.region()
        for f in range(self.c.frames):
            if self.c.ftab[f] & CHM_F_VALID:
                n += 1
                d += (self.c.ftab[f] & CHM_F_DIRTY) != 0
        return n, d

    def writeback(self, bint drop=False):
        """Write every dirty page back to the SSD (and with ``drop``, empty the DRAM,
        as a device power cycle that persists does); the number written back."""
        cdef uint64_t f, w, pg, cost = 0, done = 0, end = 0
        cdef int rc = 0
        self.region()
        with nogil:
            cxl_atomic_add_relaxed64(&self.c.inflight, 1)
            cxl_fence_full()
            rc = CXLRT_E_CLOSED if cxl_atomic_load_acquire32(self.c.closed) else _lock(&self.c)
            if rc == 0:
                for f in range(self.c.frames):
                    w = self.c.ftab[f]
                    pg = (w >> 8) - 1
                    if (w & CHM_F_VALID) and (w & CHM_F_DIRTY) and pg < self.c.pages:
                        rc = _ssd_page(&self.c, f, pg, True, &cost)
                        if rc != 0:
                            break
                        self.c.ftab[f] = w & ~(<uint64_t>CHM_F_DIRTY)
                        self.c.h.st[CHM_ST_WRITEBACKS] += 1
                        done += 1
                    if drop and self.c.ftab[f] != 0:
                        if pg < self.c.pages and self.c.pmap[pg] == f + 1:
                            self.c.pmap[pg] = 0
                        self.c.ftab[f] = 0
                end = _charge(&self.c, cxl_now_ns(), cost)
                cxl_mutex_unlock(self.c.lock)
            cxl_atomic_add_relaxed64(&self.c.inflight, <uint64_t>-1)
            if end:
                _wait_until(end)
        if rc == CXLRT_E_CLOSED:
            self.region()  # raises RegionClosedError
        if rc != 0:
            raise OSError(f"chm:{self.path}: the device could not write back "
                          "(SSD I/O error, or its lock is held by a stopped process)")
        return done
