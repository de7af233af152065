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
           With ``wbuf=``, that much DRAM is a write buffer: a DMA write of a page not
           in DRAM lands there (at DRAM speed) while a frame is free, else it goes
           through to the SSD. The buffer flushes in batches only once the SSD has
           been idle for ``wbidle`` ns, so reads never queue behind more than one
           batch; the runtime asks before it writes (CXL_HINT_ADMIT, Region.admit,
           KVCache.admit) and skips a store the buffer has no room for.
           The runtime may also ask the device to stage objects in DRAM itself
           (CXL_HINT_PREFETCH, Region.prefetch, StagingWindow(device=True)): their
           pages are read from the SSD as one request per run and pinned, so the
           clock passes them until they are released or their ``pin`` time lapses.

SSD time is modelled (``lat``, ``bw``, ``wbw``) on one device-wide timeline: work
queued by any process delays every later request, as on one SSD. The device
serialises accesses (a DMA read served from DRAM is copied outside its lock and
checked after, as a seqlock reader), so the medium is coherent: host-cache non-coherence is emu:'s
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

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH,
                            CXL_HINT_ADMIT, CXL_HINT_DRAIN, CXL_HINT_PREFETCH,
                            CXL_HINT_REFUSED, CXL_HINT_RELEASE, CXL_HINT_WAIT, CXL_OPS_ABI,
                            cxl_ops)
from cxlrt.includes.intrin cimport (CXLRT_DEBUG, CXLRT_TEST_HOOK, cxl_atomic_add_relaxed64,
                                    cxl_atomic_load_acquire32, cxl_atomic_load_relaxed64,
                                    cxl_fence_full, cxl_now_ns, cxl_spin_ns, unlikely)
from cxlrt.includes.mutex cimport (cxl_mutex_timedlock, cxl_mutex_unlock,
                                   pthread_mutex_t)
from cxlrt.status cimport (CXLRT_E_CLOSED, CXLRT_E_IO, CXLRT_E_NOMEM, CXLRT_E_RANGE,
                           CXLRT_E_UNSUPPORTED)

import os
import weakref

from cxlrt.emulation import chmside as _side
from cxlrt.emulation.sidecar import if_sidecar

LOCK_TIMEOUT_S = 30.0
"""A device lock not had in this long is reported as an I/O error (a stopped holder)."""


cdef enum:
    CHM_MAX_QUEUE_NS = 10000000000  # queued SSD time past this is a scribble, not work
    # The write buffer flushes only once the SSD has had no request for wbidle= ns (reads
    # idle), in batches of this many bytes: a read that comes meanwhile queues behind
    # one batch at most.
    CHM_WB_BATCH = 1 << 18
    # A prefetch reads at most this many pages as one SSD request (16 MiB of 64 KiB
    # pages: a KV block of the paper's size in one sequential read).
    CHM_PF_RUN = 256
    # A DMA read of at most this many pages, all in DRAM, copies outside the device lock
    # and then checks that no frame changed meanwhile (as a device serves DRAM reads in
    # parallel); the device lock then serialises only the controller's work.
    CHM_FAST_PAGES = 64

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


cdef inline bint _pinned(chm_ctx* c, uint64_t f, uint64_t now) noexcept nogil:
    """Frame f holds a page and a prefetch not yet released whose pin has not lapsed.
    A time past any pin this device gives (a scribble) holds nothing, and nor does a
    frame freed by any path (a drop, a repair) before _victim reset its entry."""
    cdef chm_pin* p = &c.pins[f]
    return (p.count != 0 and now < p.until_ns <= now + c.pin_ns
            and (c.ftab[f] & CHM_F_VALID) != 0)


cdef long _victim(chm_ctx* c, uint64_t* cost) noexcept nogil:
    """A free frame, evicting by clock if none is: a dirty victim is written back
    before it is unmapped, so a holder killed anywhere leaves its bytes on the SSD
    or still mapped. The clock passes over pinned frames; only when every frame is
    pinned does it take one anyway (pins are advice: the CPU path must always get a
    frame). It never takes a frame being filled (FILL): under the lock only this
    request's own prefetch run holds such frames (repair drops a dead holder's).
    The frame number, or CXLRT_E_IO."""
    cdef uint64_t i, f, w, pg, now = cxl_now_ns()
    cdef int rc
    for i in range(2 * c.cpu_frames + 2):
        f = c.h.hand % c.cpu_frames  # shared: never trusted as an index
        c.h.hand = (f + 1) % c.cpu_frames
        w = c.ftab[f]
        if w & CHM_F_FILL:
            continue  # taken by this very request (a prefetch run): never handed out twice
        if w != 0 and i <= 2 * c.cpu_frames:
            if _pinned(c, f, now):
                continue
            if w & CHM_F_REF:
                c.ftab[f] = w & ~(<uint64_t>CHM_F_REF)
                continue
        c.pins[f] = chm_pin(ready_ns=0, until_ns=0, count=0, gen=c.pins[f].gen + 1)
        if w == 0:
            return <long>f
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
    return CXLRT_E_IO  # a prefetch leaves frames unfilled and unpinned: unreachable


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
    if dirty and f >= c.cpu_frames:
        c.h.wb_dirty += 1


cdef inline void _dirty_hit(chm_ctx* c, uint64_t f) noexcept nogil:
    """Mark a mapped frame referenced and dirty (before the caller's copy into it)."""
    if f >= c.cpu_frames and not (c.ftab[f] & CHM_F_DIRTY):
        c.h.wb_dirty += 1
    c.ftab[f] |= CHM_F_REF | CHM_F_DIRTY


# --- the write buffer (staging with wbuf=) --------------------------------------------

cdef long _migrate(chm_ctx* c, uint64_t f, uint64_t pg, uint64_t* cost) noexcept nogil:
    """Move page pg from buffer frame f to a cache frame: CPU accesses (metadata) are
    the cache's, and the buffer keeps DMA data only. The copy is mapped before frame f
    is freed, so a holder killed between leaves the page in one of them (_repair).
    The new frame, or CXLRT_E_IO."""
    cdef uint64_t w = c.ftab[f]
    cdef long g = _victim(c, cost)
    if g < 0:
        return g
    c.ftab[g] = ((pg + 1) << 8) | CHM_F_FILL
    memcpy(c.dram + <uint64_t>g * c.page, c.dram + f * c.page, _page_len(c, pg))
    _publish(c, <uint64_t>g, pg, (w & CHM_F_DIRTY) != 0)
    c.ftab[f] = 0
    if (w & CHM_F_DIRTY) and c.h.wb_dirty:
        c.h.wb_dirty -= 1
    return g


cdef long _wb_take(chm_ctx* c, uint64_t pg, bint read, uint64_t* cost) noexcept nogil:
    """A write-buffer frame for page pg, FILL and unmapped as _fill leaves one (read
    from the SSD first when the write covers only part of the page); or CXLRT_E_NOMEM
    when every buffer frame holds a page not yet written back. A clean frame is reused:
    its page's bytes are on the SSD."""
    cdef uint64_t i, f, w, q
    cdef int rc
    for i in range(c.wb_frames):
        f = c.cpu_frames + (c.h.wb_hand + i) % c.wb_frames  # shared: never trusted
        w = c.ftab[f]
        if w & CHM_F_DIRTY:
            continue
        if w != 0:
            q = (w >> 8) - 1
            if q < c.pages and c.pmap[q] == f + 1:
                c.pmap[q] = 0
        c.h.wb_hand = (f - c.cpu_frames + 1) % c.wb_frames
        c.pins[f].gen += 1
        c.ftab[f] = ((pg + 1) << 8) | CHM_F_FILL
        if read:
            rc = _ssd_page(c, f, pg, False, cost)
            if rc != 0:
                c.ftab[f] = 0
                return rc
            c.h.st[CHM_ST_FILLS] += 1
        return <long>f
    return CXLRT_E_NOMEM


cdef long _wb_flush(chm_ctx* c, uint64_t most, uint64_t* cost) noexcept nogil:
    """Write up to `most` dirty buffer frames back as one batched SSD request (one
    latency: the device orders and merges them). They stay mapped and clean, so a read
    still hits them, and free for the next buffered write. How many, or CXLRT_E_IO."""
    cdef uint64_t f, w, pg, n = 0, nbytes = 0, k
    cdef int rc
    for f in range(c.cpu_frames, c.frames):
        if n >= most:
            break
        w = c.ftab[f]
        pg = (w >> 8) - 1
        if not (w & CHM_F_VALID) or not (w & CHM_F_DIRTY) or pg >= c.pages:
            continue
        k = _page_len(c, pg)
        rc = _ssd_io(c, c.dram + f * c.page, k, pg * c.page, True)
        if rc != 0:
            return rc
        c.ftab[f] = w & ~(<uint64_t>CHM_F_DIRTY)  # only once the SSD has it
        if c.h.wb_dirty:
            c.h.wb_dirty -= 1
        n += 1
        nbytes += k
    if n:
        cost[0] += _ssd_cost(c, nbytes, True)
        c.h.st[CHM_ST_SSD_WRITE_BYTES] += nbytes
        c.h.st[CHM_ST_WRITEBACKS] += n
        c.h.st[CHM_ST_FLUSHES] += 1
    return <long>n


cdef void _wb_recount(chm_ctx* c) noexcept nogil:
    cdef uint64_t f, n = 0
    for f in range(c.cpu_frames, c.frames):
        if (c.ftab[f] & CHM_F_VALID) and (c.ftab[f] & CHM_F_DIRTY):
            n += 1
    c.h.wb_dirty = n


cdef inline bint _ssd_idle(chm_ctx* c, uint64_t now) noexcept nogil:
    """No request on the SSD for wbidle= ns (reads are idle) and no flush in progress:
    the buffer may flush its next batch."""
    cdef uint64_t fg = c.h.ssd_free_ns, bg = c.h.bg_free_ns
    if c.wb_idle_ns > now:  # wbidle=never, or longer than the clock has run
        return False
    if fg > now + CHM_MAX_QUEUE_NS:  # a scribble: no real queue
        fg = 0
    return fg + c.wb_idle_ns <= now and (bg <= now or bg > now + CHM_MAX_QUEUE_NS)


cdef inline uint64_t _wb_room(chm_ctx* c, uint64_t now) noexcept nogil:
    """Buffer frames a write may take: not dirty, and not in a flush still running."""
    cdef uint64_t bg = c.h.bg_free_ns
    cdef uint64_t busy = min(c.h.wb_dirty, c.wb_frames)
    # A flush end past any real queue is a scribble, or a time of an earlier boot's clock.
    if now < bg <= now + CHM_MAX_QUEUE_NS:
        busy += min(c.h.bg_pages, c.wb_frames)
    return c.wb_frames - min(busy, c.wb_frames)


cdef int _wb_idle_flush(chm_ctx* c, uint64_t now) noexcept nogil:
    """One batch of the write buffer, if it holds any and reads are idle, queued in
    the background (_charge_bg): requests that come meanwhile go first."""
    cdef uint64_t cost = 0
    cdef long n
    if c.wb_frames == 0 or c.h.wb_dirty == 0 or not _ssd_idle(c, now):
        return 0
    n = _wb_flush(c, max(<uint64_t>1, <uint64_t>CHM_WB_BATCH // c.page), &cost)
    if n < 0:
        return <int>n
    _charge_bg(c, now, cost, <uint64_t>n)
    return 0


cdef void _repair(chm_ctx* c) noexcept nogil:
    """Finish what a holder killed inside the controller left, in three passes: drop
    half-filled frames; then page-map entries that do not name a valid frame naming
    them back; then a valid frame its page no longer maps is written back if its page
    is nowhere else (an eviction or a move cut short), and freed. The passes go in that
    order so that a map entry naming a dropped half-filled frame never counts as the
    page being elsewhere."""
    cdef uint64_t f, w, pg, cost = 0
    for f in range(c.frames):
        c.pins[f].gen += 1  # a read copying outside the lock starts again
        w = c.ftab[f]
        pg = (w >> 8) - 1
        if w != 0 and (pg >= c.pages or (w & CHM_F_FILL) or not (w & CHM_F_VALID)):
            c.ftab[f] = 0
    for pg in range(c.pages):
        if c.pmap[pg] != 0 and _frame_of(c, pg) < 0:
            c.pmap[pg] = 0
    for f in range(c.frames):
        w = c.ftab[f]
        if w == 0:
            continue
        pg = (w >> 8) - 1
        if c.pmap[pg] != f + 1:
            if (w & CHM_F_DIRTY) and c.pmap[pg] == 0 and _ssd_page(c, f, pg, True, &cost) != 0:
                c.pmap[pg] = <uint32_t>(f + 1)  # the only copy: keep it in DRAM, mapped
                continue
            c.ftab[f] = 0
    _wb_recount(c)
    # The model's queues start afresh: a dead holder may have left them half updated.
    c.h.bg_pages = 0
    c.h.bg_free_ns = 0
    c.h.ssd_free_ns = 0
    c.h.st[CHM_ST_REPAIRS] += 1
    _charge(c, cxl_now_ns(), cost)


cdef int _lock(chm_ctx* c) noexcept nogil:
    cdef int rc = cxl_mutex_timedlock(c.lock, c.lock_timeout_ns)
    if unlikely(rc == 1):
        _repair(c)
        return 0
    return CXLRT_E_IO if rc < 0 else 0


cdef inline uint64_t _sane(uint64_t t, uint64_t t0) noexcept nogil:
    """A time from shared memory: before t0, or past any real queue (a scribble), is t0."""
    return t0 if t < t0 or t > t0 + CHM_MAX_QUEUE_NS else t


cdef uint64_t _charge(chm_ctx* c, uint64_t t0, uint64_t cost) noexcept nogil:
    """Queue a request's `cost` of SSD time from t0 on the device's one timeline (lock
    held); when it ends, or 0 for no cost. Reads and writes take their turn in order;
    write-buffer flushes (_charge_bg) only yield: a request that finds one in progress
    waits for the page being written, and pushes the rest of the flush back."""
    cdef uint64_t end, bg
    if cost == 0:
        return 0
    end = _sane(c.h.ssd_free_ns, t0)
    bg = c.h.bg_free_ns
    if bg > end and bg <= t0 + CHM_MAX_QUEUE_NS:
        end += min(bg - end, c.bg_grain_ns)
        c.h.bg_free_ns = bg + cost
    end += cost
    c.h.ssd_free_ns = end
    c.h.st[CHM_ST_BUSY_NS] += cost
    return end


cdef void _charge_bg(chm_ctx* c, uint64_t t0, uint64_t cost, uint64_t pages) noexcept nogil:
    """Queue a flush of `pages` after all the work queued so far; its pages count as
    taken in the buffer until it ends."""
    cdef uint64_t start, bg = c.h.bg_free_ns
    if cost == 0:
        return
    start = max(_sane(c.h.ssd_free_ns, t0), _sane(bg, t0))
    c.h.bg_pages = (min(c.h.bg_pages, c.wb_frames) if t0 < bg <= t0 + CHM_MAX_QUEUE_NS
                    else 0) + pages
    c.h.bg_free_ns = start + cost
    c.h.st[CHM_ST_BUSY_NS] += cost


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


cdef int _read_hits(chm_ctx* c, uint64_t off, char* buf, uint64_t n) noexcept nogil:
    """A DMA read whose pages are all in DRAM, copied outside the device lock (called
    and returning with it held, unless it returns 0 or an error: then it is let go).
    Each frame's gen is noted under the lock and checked under it again after the
    copy; a frame reused or written meanwhile changed its gen first, and the read is
    then done again under the lock (1). 1 too when a page is not in DRAM."""
    cdef uint64_t p0 = off // c.page, p1 = (off + n - 1) // c.page, pg, k, a, t0, landed
    cdef uint64_t frames[CHM_FAST_PAGES]
    cdef uint64_t gens[CHM_FAST_PAGES]
    cdef long f
    cdef int rc
    if p1 - p0 >= CHM_FAST_PAGES:
        return 1
    for pg in range(p0, p1 + 1):
        f = _frame_of(c, pg)
        if f < 0:
            return 1
        frames[pg - p0] = <uint64_t>f
        gens[pg - p0] = c.pins[f].gen
    t0 = cxl_now_ns()
    landed = t0
    for pg in range(p0, p1 + 1):
        f = <long>frames[pg - p0]
        c.ftab[f] |= CHM_F_REF
        if <uint64_t>f < c.cpu_frames:  # a prefetched page lands when its read ends
            landed = max(landed, _sane(c.pins[f].ready_ns, t0))
    cxl_mutex_unlock(c.lock)
    if landed > t0:
        _wait_until(landed)
    a = off
    for pg in range(p0, p1 + 1):
        k = min(n - (a - off), (pg + 1) * c.page - a)
        memcpy(buf + (a - off), c.dram + frames[pg - p0] * c.page + (a - pg * c.page), k)
        a += k
    rc = _lock(c)
    if rc != 0:
        return rc
    for pg in range(p0, p1 + 1):
        if c.pins[frames[pg - p0]].gen != gens[pg - p0] and not CXLRT_TEST_HOOK(c.no_seqlock):
            return 1
    c.h.st[CHM_ST_HITS] += p1 - p0 + 1  # counted once: a read done again is the locked path's
    c.h.st[CHM_ST_DRAM_BYTES] += n
    cxl_mutex_unlock(c.lock)
    return 0


cdef int _access_in(chm_ctx* c, uint64_t off, char* buf, uint64_t n, bint write,
                    bint dma) noexcept nogil:
    """Move n bytes between buf and the device at off through the policy; then wait
    for the SSD time this request queued (not for a write-buffer batch it started),
    and for prefetched pages it read that were still landing."""
    cdef uint64_t cost = 0, pg, a, k, run, q, end = 0, t0, landed = 0
    cdef long f
    cdef bint buffered
    cdef int rc = _lock(c)
    if rc != 0:
        return rc
    if dma and not write and n >= c.page:
        rc = _read_hits(c, off, buf, n)
        if rc != 1:
            return rc  # done (0), or an error; with the lock let go
        rc = 0  # not all in DRAM, or a frame changed under the copy: the locked path
    # The model's clock starts when the device takes the request: the real copies
    # below are part of the modelled time, not added to it.
    t0 = cxl_now_ns()
    if write and dma:  # data, not metadata (a heartbeat) starts a flush
        rc = _wb_idle_flush(c, t0)
    while n and rc == 0:
        pg = off // c.page
        a = off - pg * c.page
        k = min(n, _page_len(c, pg) - a)
        f = _frame_of(c, pg)
        if f >= 0 and not dma and <uint64_t>f >= c.cpu_frames:
            f = _migrate(c, <uint64_t>f, pg, &cost)
            if f < 0:
                rc = <int>f
                break
        buffered = False
        if f < 0 and dma and write and c.wb_frames:
            f = _wb_take(c, pg, not (a == 0 and k == _page_len(c, pg)), &cost)
            if f >= 0:
                memcpy(c.dram + f * c.page + a, buf, k)
                _publish(c, <uint64_t>f, pg, True)
                c.h.st[CHM_ST_BUFFERED] += 1
                c.h.st[CHM_ST_DRAM_BYTES] += k
                buffered = True
            elif f != CXLRT_E_NOMEM:
                rc = <int>f
                break
            # else the buffer is full: this page goes through to the SSD below
        if buffered:
            pass
        elif f < 0 and dma and c.policy == CHM_STAGING:
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
                _dirty_hit(c, <uint64_t>f)
                c.pins[f].gen += 1
                memcpy(c.dram + f * c.page + a, buf, k)
            else:
                c.ftab[f] |= CHM_F_REF
                memcpy(buf, c.dram + f * c.page + a, k)
            if <uint64_t>f < c.cpu_frames:  # a prefetched page lands when its read ends
                landed = max(landed, _sane(c.pins[f].ready_ns, t0))
            c.h.st[CHM_ST_DRAM_BYTES] += k
        off += k
        buf += k
        n -= k
    end = max(_charge(c, t0, cost), landed)
    cxl_mutex_unlock(c.lock)
    if end > t0:
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


cdef int _admit_drain(chm_ctx* c, int kind, uint64_t a, uint64_t b, uint64_t t0,
                      uint64_t* cost) noexcept nogil:
    """ADMIT: room for `a` bytes in `b` pieces among the buffer frames not awaiting
    write-back (after one idle flush batch)? DRAIN: write the whole buffer back."""
    cdef uint64_t need, least
    cdef long n
    cdef int rc
    if kind == CXL_HINT_ADMIT:
        # Pages the pieces take at most, and at least (laid out aligned, end to end).
        least = a // c.page + (a % c.page != 0)
        if least > c.wb_frames or b > (<uint64_t>1 << 40):
            return CXLRT_E_RANGE  # could never be admitted: the caller's error, not a "no"
        need = min(least + b, c.wb_frames)
        rc = _wb_idle_flush(c, t0)
        if rc == 0 and need <= _wb_room(c, t0):
            c.h.st[CHM_ST_ADMITS] += 1
        elif rc == 0:
            c.h.st[CHM_ST_REFUSALS] += 1
            rc = CXL_HINT_REFUSED
        return rc
    n = _wb_flush(c, c.wb_frames, cost)
    if n < 0:
        return <int>n
    _wb_recount(c)  # everything is on the SSD once this request ends
    c.h.bg_pages = 0
    c.h.bg_free_ns = 0
    return 0


# --- prefetch into DRAM (staging): HyMCache's chm_prefetch_object / wait / release ---

cdef int _prefetch(chm_ctx* c, uint64_t p0, uint64_t p1, uint64_t t0) noexcept nogil:
    """Stage pages [p0, p1] in cache frames and pin them, reading the ones not in DRAM
    from the SSD as one sequential request per run; their frames are mapped at once
    and land (ready_ns) as the modelled read reaches each. Refused, with nothing
    changed, unless a reserve of frames stays unpinned for the CPU path afterwards."""
    cdef uint64_t pg, f, held = 0, add = 0, until
    cdef uint64_t reserve = max(<uint64_t>1, c.cpu_frames // 8)
    cdef long g
    cdef int rc
    for f in range(c.cpu_frames):
        held += _pinned(c, f, t0)
    for pg in range(p0, p1 + 1):
        g = _frame_of(c, pg)
        if g < 0:
            add += 1
        elif <uint64_t>g < c.cpu_frames and not _pinned(c, <uint64_t>g, t0):
            add += 1
    if held + add + reserve > c.cpu_frames:
        c.h.st[CHM_ST_PF_REFUSALS] += 1
        return CXL_HINT_REFUSED
    until = t0 + c.pin_ns
    rc = _prefetch_in(c, p0, p1, t0, until)
    if rc < 0:
        # Give back what this call pinned: every page of the range now in a cache frame
        # (those it found there, pinned first, and the runs it published; the failed
        # run's frames were freed), so no hold is left that nobody owns.
        _pf_release(c, p0, p1, False)
    return rc


cdef int _prefetch_in(chm_ctx* c, uint64_t p0, uint64_t p1, uint64_t t0,
                      uint64_t until) noexcept nogil:
    """_prefetch's work once the room is there: 0 or an error."""
    cdef uint64_t pg, run, j, k, cost, end, nbytes
    cdef uint64_t _run_frames[CHM_PF_RUN]
    cdef long g
    cdef int rc
    # Pages already in DRAM are pinned first, so filling the others cannot evict them.
    for pg in range(p0, p1 + 1):
        g = _frame_of(c, pg)
        if g >= 0 and <uint64_t>g < c.cpu_frames:
            _pin(c, <uint64_t>g, until, 0)
    pg = p0
    while pg <= p1:
        if _frame_of(c, pg) >= 0:
            pg += 1
            continue
        run = 0
        while pg + run <= p1 and run < CHM_PF_RUN and _frame_of(c, pg + run) < 0:
            run += 1
        cost = 0
        nbytes = 0
        for j in range(run):  # take frames; a victim's write-back goes first on the SSD
            g = _victim(c, &cost)
            if g < 0:
                for k in range(j):
                    c.ftab[_run_frames[k]] = 0
                return <int>g
            c.ftab[g] = ((pg + j + 1) << 8) | CHM_F_FILL
            _run_frames[j] = <uint64_t>g
        for j in range(run):
            k = _page_len(c, pg + j)
            rc = _ssd_io(c, c.dram + _run_frames[j] * c.page, k, (pg + j) * c.page, False)
            if rc != 0:
                for k in range(run):
                    c.ftab[_run_frames[k]] = 0
                return rc
            nbytes += k
        end = _charge(c, t0, cost + _ssd_cost(c, nbytes, False))
        c.h.st[CHM_ST_SSD_READ_BYTES] += nbytes
        c.h.st[CHM_ST_PREFETCHED] += run
        k = 0
        for j in range(run):
            k += _page_len(c, pg + j)
            _publish(c, _run_frames[j], pg + j, False)
            # Page j of the run lands when the sequential read has moved its bytes.
            _pin(c, _run_frames[j], until, end - <uint64_t>((nbytes - k) / c.read_bpns)
                 if c.read_bpns > 0 else end)
        pg += run
    return 0


cdef inline void _pin(chm_ctx* c, uint64_t f, uint64_t until, uint64_t ready) noexcept nogil:
    """One more hold on frame f; a lapsed pin's holders are forgotten first."""
    cdef chm_pin* p = &c.pins[f]
    if not _pinned(c, f, until - c.pin_ns):
        p.count = 0
    p.count += 1
    p.until_ns = until
    if ready:
        p.ready_ns = ready


cdef uint64_t _pf_release(chm_ctx* c, uint64_t p0, uint64_t p1, bint wait) noexcept nogil:
    """RELEASE: one hold less on each page of [p0, p1], and a page nobody holds is the
    clock's first choice (consumed KV is one-hit). WAIT: when the last of them lands."""
    cdef uint64_t pg, last = 0
    cdef long g
    cdef chm_pin* p
    for pg in range(p0, p1 + 1):
        g = _frame_of(c, pg)
        if g < 0 or <uint64_t>g >= c.cpu_frames:
            continue
        p = &c.pins[g]
        if wait:
            last = max(last, p.ready_ns)
        elif p.count:
            p.count -= 1
            if p.count == 0:
                p.until_ns = 0
                c.ftab[g] &= ~(<uint64_t>CHM_F_REF)
    return last


cdef int _hint_in(chm_ctx* c, int kind, uint64_t a, uint64_t b) noexcept nogil:
    """One hint under the device lock; then wait for the SSD time it queued (DRAIN) or
    for the range to land (WAIT). PREFETCH returns without waiting."""
    cdef uint64_t cost = 0, end = 0, t0, p0 = 0, p1 = 0
    cdef int rc
    if kind >= CXL_HINT_PREFETCH:
        if b == 0 or a >= c.region_size or b > c.region_size - a:
            return CXLRT_E_RANGE
        p0 = a // c.page
        p1 = (a + b - 1) // c.page
    rc = _lock(c)
    if rc != 0:
        return rc
    t0 = cxl_now_ns()
    if kind == CXL_HINT_PREFETCH:
        rc = _prefetch(c, p0, p1, t0)
    elif kind == CXL_HINT_WAIT:
        end = _sane(_pf_release(c, p0, p1, True), t0)
    elif kind == CXL_HINT_RELEASE:
        _pf_release(c, p0, p1, False)
    else:
        rc = _admit_drain(c, kind, a, b, t0, &cost)
        end = _charge(c, t0, cost)
    cxl_mutex_unlock(c.lock)
    if end > t0:
        _wait_until(end)
    return rc


cdef int chm_hint(void* ctx, int kind, uint64_t a, uint64_t b) noexcept nogil:
    cdef chm_ctx* c = <chm_ctx*>ctx
    cdef int rc
    if kind == CXL_HINT_ADMIT or kind == CXL_HINT_DRAIN:
        if c.wb_frames == 0:
            return CXLRT_E_UNSUPPORTED  # no write buffer: every write goes to its tier at once
    elif kind == CXL_HINT_PREFETCH or kind == CXL_HINT_WAIT or kind == CXL_HINT_RELEASE:
        if c.policy != CHM_STAGING:
            return CXLRT_E_UNSUPPORTED  # the transparent cache takes no advice
    else:
        return CXLRT_E_UNSUPPORTED
    cxl_atomic_add_relaxed64(&c.inflight, 1)
    cxl_fence_full()  # as _access: close() waits for us
    if unlikely(cxl_atomic_load_acquire32(c.closed) != 0):
        rc = CXLRT_E_CLOSED
    else:
        rc = _hint_in(c, kind, a, b)
    cxl_atomic_add_relaxed64(&c.inflight, <uint64_t>-1)
    return rc


cdef cxl_ops CHM_OPS = cxl_ops(
    abi=CXL_OPS_ABI, load=chm_load, store=chm_store, load64=chm_load64, store64=chm_store64, flush=chm_flush,
    flush_nodrain=chm_flush, fence=chm_fence, dma_read=chm_dma_read, dma_write=chm_dma_write,
    hint=chm_hint, gather64=NULL, scatter64=NULL)

_STATS = ("hits", "fills", "writebacks", "direct_reads", "direct_writes", "ssd_read_bytes",
          "ssd_write_bytes", "dram_bytes", "busy_ns", "repairs", "buffered", "flushes",
          "admits", "refusals", "prefetched", "prefetch_refusals")
assert len(_STATS) == CHM_NSTATS

PARAMS = _side.PARAMS


def sidecars(str path):
    """Files beside the region file that belong to it (`cxlrt delete` removes them): the
    sidecar, if the file at its name is one (a region may be named so too)."""
    return if_sidecar(path + ".chm", _side.MAGIC)

_devices = weakref.WeakSet()


def _after_fork_in_child():
    # `inflight` counts this process's threads inside the device; a child has none of
    # them (only the forking thread), and a count copied from a parent thread that was
    # inside would make the child's close() wait for it for ever.
    for b in list(_devices):
        (<ChmBackend>b).c.inflight = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _break_seqlock(ChmBackend b):
    """Make this process's DMA reads trust a copy made outside the device lock without
    checking that no frame changed under it: the broken protocol the tests must catch
    (a read torn by a concurrent write)."""
    from cxlrt.errors import DebugBuildRequired
    if not CXLRT_DEBUG:
        raise DebugBuildRequired()
    b.c.no_seqlock = 1


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
        self.c.pins = <chm_pin*>(side + <size_t>geo["pins"])
        self.c.pin_ns = params["pin"]
        self.c.dram = side + <size_t>geo["data"]
        self.c.page = geo["page"]
        self.c.frames = geo["frames"]
        self.c.wb_frames = geo["wb_frames"]
        self.c.wb_idle_ns = params["wbidle"]
        self.c.cpu_frames = geo["frames"] - geo["wb_frames"]
        self.c.pages = geo["pages"]
        self.c.region_size = size
        self.c.policy = CHM_STAGING if params["policy"] == "staging" else CHM_LRU
        self.c.closed = &self.reg.closed
        self.c.lat_ns = params["lat"]
        self.c.read_bpns = params["bw"]
        self.c.write_bpns = params["wbw"] or params["bw"]
        self.c.bg_grain_ns = <uint64_t>(geo["page"] / self.c.write_bpns
                                        if self.c.write_bpns > 0 else 0)
        self.c.lock_timeout_ns = <uint64_t>(LOCK_TIMEOUT_S * 1e9)
        self._use_device(size, CXL_CAP_COHERENT | CXL_CAP_SHARED_HOSTS, CXL_F_NOFLUSH, node,
                         &self.c, &CHM_OPS)
        _devices.add(self)

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

    def pinned(self):
        """Frames a prefetch holds now and the holds on them: (frames, holds)."""
        cdef uint64_t f, n = 0, holds = 0, now = cxl_now_ns()
        self.region()
        for f in range(self.c.cpu_frames):
            if _pinned(&self.c, f, now):
                n += 1
                holds += self.c.pins[f].count
        return n, holds

    def write_buffer(self):
        """The write buffer's frames and how many of them await write-back: (frames,
        dirty); (0, 0) without one."""
        self.region()
        return self.c.wb_frames, self.c.h.wb_dirty

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
                _wb_recount(&self.c)
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
