# cython: language_level=3
"""A staging window: ordered prefetch of region objects into bounded fast memory.

HyMCache's request-level prefetch (issue 13): after a prefix lookup the engine knows
the ordered list of objects a request will read, so it issues them all at once and
then consumes them in order. The window is not a cache of that footprint: it holds at
most `size` bytes and `slots` objects, and a refill thread stages the next issued
object as soon as a release makes room for it (prefetch, consume, release, refill).
The capacity tier's bandwidth, not the window's size, then bounds the request.

Protocol (every field below lives in `sw_ctx` and changes only under its mutex):
- prefetch() appends a QUEUED request with the next handle (1, 2, 3, ...).
- The refill thread takes requests strictly in handle order. It places the next one
  in the first gap of the window that fits, once at most `slots - 1` others are staged
  and the bytes fit; then it copies without any lock (and without the GIL) in pieces,
  and marks it READY (or FAILED with the copy's status). Only then does it look at the
  next request: completion order is issue order.
- release() frees a request's bytes and slot at once (a QUEUED one is skipped when
  its turn comes; a COPYING one is cancelled at the next piece, and release() waits
  for that, so no copy of a released object is in flight when it returns).
- wait() sleeps on a condition variable without the GIL. A wait without a timeout
  that could only end after a release (the next request does not fit, and no copy is
  in flight) raises StagingStalled instead of hanging; one with a timeout waits for
  another thread's release. Every release clears the stall until the refill thread
  has looked again.
The window's bytes are this process's memory: the copy is a DMA read of the region
(cxl_dma_read), so it sees what stores published, whatever this node's view caches.

With ``device=True`` the window is the device's own fast memory (a CXL-HM device's
DRAM, HyMCache's design): staging an object is CXL_HINT_PREFETCH then CXL_HINT_WAIT,
a release is CXL_HINT_RELEASE, and the consumer reads the region itself, from device
DRAM. The window still bounds what this requester holds there. A device that has no
room to spare refuses; that object then counts as staged but not held, and its read
goes to the capacity tier (skip, never stall). Prefetches of the device are shared by
every process, so one that another process issued (a serving engine's scheduler)
serves this one's reads too.
"""

cimport cython
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free, qsort
from libc.string cimport memcpy
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.types cimport clockid_t

from cxlrt.backend cimport (CXL_HINT_PREFETCH, CXL_HINT_REFUSED, CXL_HINT_RELEASE,
                            CXL_HINT_WAIT, cxl_check_range, cxl_dma_read, cxl_hint, cxl_region)
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_UNSUPPORTED
from cxlrt.includes.intrin cimport cxl_pid
from cxlrt.includes.mutex cimport pthread_mutex_t
from cxlrt.includes.thread cimport (cxl_atomic_load_acquire_int, cxl_atomic_store_release_int,
                                    cxl_plain_mutex_init, cxl_plain_mutex_lock,
                                    cxl_plain_mutex_unlock, cxl_thread_join, cxl_thread_start)
from cxlrt.region cimport Region

from cxlrt.errors import (RegionClosedError, StagingError, StagingHandleError, StagingStalled,
                          StagingTimeout)


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_condattr_init(pthread_condattr_t* a)
    int pthread_condattr_setclock(pthread_condattr_t* a, clockid_t c)
    int pthread_cond_init(pthread_cond_t* c, const pthread_condattr_t* a)
    int pthread_cond_destroy(pthread_cond_t* c)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t)
    int pthread_cond_broadcast(pthread_cond_t* c)


DEF PIECE = 1 << 20  # bytes a copy moves between looks at cancel and stop
MAX_SLOTS = 1 << 16

cdef enum sw_state:
    SW_RELEASED = 0
    SW_QUEUED = 1
    SW_COPYING = 2
    SW_READY = 3
    SW_FAILED = 4


ctypedef struct sw_req:
    uint64_t off, n      # the object in the region
    uint64_t at          # where it is staged in the window (COPYING, READY)
    int state
    int rc               # the copy's status (FAILED)
    int cancel           # released while COPYING: the copy stops, the refill frees it
    int views            # buffer exports alive (release refuses while any are)
    int held             # device window: the device took the prefetch (release gives it back)
    int issuing          # device window: its prefetch call is in flight (no mutex held)


ctypedef struct sw_ctx:
    const cxl_region* r
    char* buf
    uint64_t size, slots
    sw_req* reqs         # ring of the requests lo .. next-1, indexed by handle & (cap-1)
    uint64_t cap
    uint64_t lo          # oldest handle not yet released
    uint64_t next        # the handle prefetch() gives next
    uint64_t stage       # the handle the refill thread takes next
    uint64_t staged, bytes_in_use, peak_bytes, copied, stalls, refused
    int device           # the window is the device's memory: hints, no copies
    uint64_t* live       # the `staged` handles that hold room (COPYING, READY), any order
    uint64_t* spans      # scratch for _place: (at, n) of each, 2 * slots words
    int copying          # copies in flight (no lock held): 0 or 1; a device window's
    #                      requests the device is staging, any number the window holds
    int stalled          # the request `stage` waits for room
    int stop
    pthread_mutex_t m
    pthread_cond_t work  # prefetch, release and stop wake the refill thread
    pthread_cond_t done  # a copy ended, a release: waiters look again


cdef inline sw_req* _req(sw_ctx* c, uint64_t h) noexcept nogil:
    return &c.reqs[h & (c.cap - 1)]


cdef int _grow(sw_ctx* c) noexcept nogil:
    """Double the request ring (mutex held); 0, or -1 when out of memory."""
    cdef uint64_t cap = c.cap * 2, h
    cdef sw_req* reqs = <sw_req*>calloc(cap, sizeof(sw_req))
    if reqs == NULL:
        return -1
    for h in range(c.lo, c.next):
        reqs[h & (cap - 1)] = _req(c, h)[0]
    free(c.reqs)
    c.reqs = reqs
    c.cap = cap
    return 0


cdef int _by_at(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef int _place(sw_ctx* c, uint64_t n, uint64_t* at) noexcept nogil:
    """First gap of the window that holds n bytes, among the staged requests (mutex
    held): 1 placed at `at`, 0 no room now. O(slots log slots), whatever the number
    of handles issued and not yet released."""
    cdef uint64_t* spans = c.spans
    cdef uint64_t k, pos = 0, i
    cdef sw_req* q
    cdef int found = 0
    if c.staged >= c.slots or c.bytes_in_use + n > c.size:
        return 0
    for k in range(c.staged):
        q = _req(c, c.live[k])
        spans[2 * k] = q.at
        spans[2 * k + 1] = q.n
    qsort(spans, c.staged, 2 * sizeof(uint64_t), _by_at)
    for i in range(c.staged):
        if spans[2 * i] - pos >= n:
            found = 1
            break
        pos = spans[2 * i] + spans[2 * i + 1]
    if not found and c.size - pos < n:
        return 0
    at[0] = pos
    return 1


cdef void _advance(sw_ctx* c) noexcept nogil:
    """Step `lo` (and `stage` with it) past released requests (mutex held)."""
    while c.lo < c.next and _req(c, c.lo).state == SW_RELEASED:
        c.lo += 1
    if c.stage < c.lo:
        c.stage = c.lo


cdef void _unstage(sw_ctx* c, uint64_t h) noexcept nogil:
    """Give staged request h's bytes and slot back (mutex held)."""
    cdef uint64_t k
    for k in range(c.staged):
        if c.live[k] == h:
            c.live[k] = c.live[c.staged - 1]
            break
    c.staged -= 1
    c.bytes_in_use -= _req(c, h).n
    c.stalled = 0  # the refill thread looks again before anyone may call it a stall


cdef void* _refill_main(void* arg) noexcept nogil:
    """The refill thread: stage requests one after another, in handle order."""
    cdef sw_ctx* c = <sw_ctx*>arg
    cdef sw_req* q
    cdef uint64_t h, at = 0, off, n, pos, piece
    cdef int got, rc, quit
    cxl_plain_mutex_lock(&c.m)
    while not c.stop:
        while c.stage < c.next and _req(c, c.stage).state == SW_RELEASED:
            c.stage += 1
        if c.stage == c.next:
            c.stalled = 0
            pthread_cond_wait(&c.work, &c.m)
            continue
        q = _req(c, c.stage)
        got = _place(c, q.n, &at)
        if got == 0:
            if not c.stalled:
                c.stalls += 1
                c.stalled = 1
                pthread_cond_broadcast(&c.done)  # waiters may now call it a stall
            pthread_cond_wait(&c.work, &c.m)
            continue
        h = c.stage
        c.stage += 1
        c.stalled = 0
        q.at = at
        q.state = SW_COPYING
        c.live[c.staged] = h
        c.staged += 1
        c.bytes_in_use += q.n
        if c.bytes_in_use > c.peak_bytes:
            c.peak_bytes = c.bytes_in_use
        c.copying = 1
        off = q.off
        n = q.n
        cxl_plain_mutex_unlock(&c.m)
        rc = 0
        pos = 0
        quit = 0
        while pos < n and not quit:
            piece = n - pos if n - pos < PIECE else PIECE
            rc = cxl_dma_read(c.r, off + pos, c.buf + at + pos, piece)
            if rc != 0:
                break
            pos += piece
            cxl_plain_mutex_lock(&c.m)  # the ring may grow: look at q only under the mutex
            quit = c.stop or _req(c, h).cancel
            cxl_plain_mutex_unlock(&c.m)
        cxl_plain_mutex_lock(&c.m)
        q = _req(c, h)
        c.copying = 0
        c.copied += pos
        if q.cancel:
            _unstage(c, h)
            q.state = SW_RELEASED
            _advance(c)
        elif rc != 0 or pos < n:
            _unstage(c, h)
            q.state = SW_FAILED
            q.rc = rc
        else:
            q.state = SW_READY
        pthread_cond_broadcast(&c.done)
    cxl_plain_mutex_unlock(&c.m)
    return NULL


cdef int _take_next(sw_ctx* c, uint64_t* h) noexcept nogil:
    """Place the request `stage` names in the window (mutex held): 1 and its handle, or
    0 when there is none queued or no room for it (c.stalled says which, as in
    _refill_main)."""
    cdef sw_req* q
    cdef uint64_t at = 0
    while c.stage < c.next and _req(c, c.stage).state == SW_RELEASED:
        c.stage += 1
    if c.stage == c.next:
        return 0
    q = _req(c, c.stage)
    if _place(c, q.n, &at) == 0:
        if not c.stalled:
            c.stalls += 1
            c.stalled = 1
            pthread_cond_broadcast(&c.done)  # waiters may now call it a stall
        return 0
    h[0] = c.stage
    c.stage += 1
    c.stalled = 0
    q.at = at
    q.state = SW_COPYING
    c.live[c.staged] = h[0]
    c.staged += 1
    c.bytes_in_use += q.n
    if c.bytes_in_use > c.peak_bytes:
        c.peak_bytes = c.bytes_in_use
    return 1


cdef void* _refill_device(void* arg) noexcept nogil:
    """The refill thread of a device window. It asks the device to stage every request
    that fits as soon as it fits (CXL_HINT_PREFETCH returns at once, and the device
    queues the reads back to back), and only when none more fits does it wait for the
    oldest in flight to land and mark it READY: completion order is issue order, and
    the device is never idle while the window has room (a wait per request would leave
    it idle while the consumer copies). A request stays COPYING from its prefetch until
    it lands; release() may end it meanwhile (once its prefetch call has returned:
    `issuing`), and the refill thread then leaves it be."""
    cdef sw_ctx* c = <sw_ctx*>arg
    cdef sw_req* q
    cdef uint64_t h, off, n
    cdef int rc
    cxl_plain_mutex_lock(&c.m)
    while not c.stop:
        if _take_next(c, &h):
            q = _req(c, h)
            off = q.off
            n = q.n
            q.issuing = 1
            c.copying += 1
            cxl_plain_mutex_unlock(&c.m)
            rc = cxl_hint(c.r, CXL_HINT_PREFETCH, off, n)
            cxl_plain_mutex_lock(&c.m)
            q = _req(c, h)
            q.issuing = 0
            q.held = rc == 0
            if rc == CXL_HINT_REFUSED:
                c.refused += 1  # its consumer reads the capacity tier: slower, never stalled
                rc = 0
            q.rc = rc
            pthread_cond_broadcast(&c.done)  # a release() may wait for the call to return
            continue
        # Nothing more fits: wait for the oldest request in flight to land.
        h = c.lo
        while h < c.stage and _req(c, h).state != SW_COPYING:
            h += 1
        if h == c.stage:
            if c.stage == c.next:
                c.stalled = 0
            pthread_cond_wait(&c.work, &c.m)
            continue
        q = _req(c, h)
        off = q.off
        n = q.n
        rc = q.rc
        if rc == 0 and q.held:
            cxl_plain_mutex_unlock(&c.m)
            rc = cxl_hint(c.r, CXL_HINT_WAIT, off, n)
            cxl_plain_mutex_lock(&c.m)
        q = _req(c, h)
        if q.state != SW_COPYING:
            continue  # released while it landed: release() gave everything back
        c.copying -= 1
        if rc != 0:
            _unstage(c, h)
            q.state = SW_FAILED
            q.rc = rc
            if q.held:  # nobody will consume it: the device may have the room back
                q.held = 0
                cxl_hint(c.r, CXL_HINT_RELEASE, off, n)
        else:
            c.copied += n if q.held else 0
            q.state = SW_READY
        pthread_cond_broadcast(&c.done)
    # Stopped: nothing in flight will land for anyone. Its holds go in _unhold_all.
    for h in range(c.lo, c.stage):
        q = _req(c, h)
        if q.state == SW_COPYING:
            c.copying -= 1
            _unstage(c, h)
            q.state = SW_FAILED
            q.rc = CXLRT_E_CLOSED
    pthread_cond_broadcast(&c.done)
    cxl_plain_mutex_unlock(&c.m)
    return NULL


# What _wait() found, besides a copy's own status (a negative CXLRT_E_* or errno).
cdef enum:
    SW_OK = 0
    SW_UNKNOWN = 1
    SW_GONE = 2
    SW_STALLED = 3
    SW_TIMEOUT = 4
    SW_CLOSED = 5


cdef int _check(sw_ctx* c, uint64_t h) noexcept nogil:
    """SW_UNKNOWN, SW_GONE (released) or SW_OK for a handle (mutex held)."""
    cdef sw_req* q
    if h == 0 or h >= c.next:
        return SW_UNKNOWN
    if h < c.lo:
        return SW_GONE
    q = _req(c, h)
    if q.state == SW_RELEASED or q.cancel:
        return SW_GONE
    return SW_OK


cdef int _wait(sw_ctx* c, uint64_t h, double timeout, bint verdict,
               sw_req* out) noexcept nogil:
    """Until h is READY (SW_OK, with one more view counted), FAILED (its copy's
    status), or one of SW_*; `out` gets the request as it then was. `timeout` < 0
    has no deadline; `verdict` (no timeout given) raises the stall instead of
    waiting when nothing but a release could end the wait."""
    cdef timespec until
    cdef sw_req* q
    cdef int rc
    cdef long ns
    if timeout >= 0:
        clock_gettime(CLOCK_MONOTONIC, &until)
        ns = until.tv_nsec + <long>((timeout - <long>timeout) * 1e9)
        until.tv_sec += <long>timeout + ns // 1000000000
        until.tv_nsec = ns % 1000000000
    cxl_plain_mutex_lock(&c.m)
    while True:
        rc = _check(c, h)
        if rc != SW_OK:
            break
        q = _req(c, h)
        if c.stop:
            rc = SW_CLOSED
            break
        if q.state == SW_READY:
            q.views += not c.device  # the caller's view, counted before anyone may release
            out[0] = q[0]
            break
        if q.state == SW_FAILED:
            rc = q.rc
            out[0] = q[0]
            break
        if verdict and c.stalled and not c.copying and h >= c.stage:
            rc = SW_STALLED  # with a timeout, another thread's release may still come
            break
        if timeout < 0:
            pthread_cond_wait(&c.done, &c.m)
        elif pthread_cond_timedwait(&c.done, &c.m, &until) != 0:
            rc = SW_TIMEOUT
            break
    cxl_plain_mutex_unlock(&c.m)
    return rc


cdef void _unhold_all(sw_ctx* c) noexcept nogil:
    """After the refill thread is joined: give back every hold the device still has
    for this window (a closed window's objects are never consumed). Under the mutex,
    as release() checks and clears a hold: each is given back once."""
    cdef uint64_t h
    cdef sw_req* q
    cxl_plain_mutex_lock(&c.m)
    for h in range(c.lo, c.next):
        q = _req(c, h)
        if q.held:
            q.held = 0
            cxl_hint(c.r, CXL_HINT_RELEASE, q.off, q.n)
    cxl_plain_mutex_unlock(&c.m)


@cython.no_gc_clear  # the refill thread reads the region until __dealloc__ joins it
cdef class StagingWindow:
    """A fixed window of `size` bytes and `slots` objects, refilled in issue order.

    ``prefetch(off, n)`` issues an object of the region and returns its handle;
    ``wait(h)`` returns its staged bytes (a read-only memoryview) once the refill
    thread has copied them; ``release(h)`` gives its room back at once. Issue a whole
    request's objects up front (``prefetch_many``), then wait and release them in
    order: the window never holds more than `size` bytes or `slots` objects, and
    object i+1 is copied while object i is consumed.
    """

    cdef sw_ctx c
    cdef readonly Region region
    cdef unsigned long _tid
    cdef pthread_mutex_t _jm     # one closer joins; any other waits for it (then unmaps)
    cdef int _pid                # the process whose refill thread this is
    cdef bint _started, _closed, _joined
    cdef readonly uint64_t size, slots
    cdef readonly bint device
    cdef object __weakref__  # Region.close() closes its windows first (a WeakSet)

    def __cinit__(self, Region region not None, size=128 << 20, slots=8, *, bint device=False):
        from cxlrt.spec import parse_size
        cdef uint64_t nbytes = parse_size(size) if isinstance(size, str) else size
        if nbytes == 0:
            raise ValueError("a staging window needs size > 0")
        if slots < 1 or slots > MAX_SLOTS:
            raise ValueError(f"slots must be 1 .. {MAX_SLOTS}, not {slots}")
        self.region = region
        self.c.r = region.backend.region()  # raises if the region is closed
        self.size = self.c.size = nbytes
        self.slots = self.c.slots = slots
        self.device = self.c.device = device
        if device:
            if cxl_hint(self.c.r, CXL_HINT_WAIT, 0, 1) == CXLRT_E_UNSUPPORTED:
                raise ValueError(f"{region.spec}: this backend takes no prefetch hints, so a "
                                 "window in device memory cannot be had; use device=False "
                                 "(a window in this process's memory), or a CXL-HM device "
                                 "under chm:?policy=staging")
        else:
            self.c.buf = <char*>mmap(NULL, nbytes, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if <void*>self.c.buf == MAP_FAILED:
                self.c.buf = NULL
                raise MemoryError(f"cannot map a staging window of {nbytes} bytes")
        self.c.reqs = <sw_req*>calloc(16, sizeof(sw_req))  # grows with the handles in use
        self.c.live = <uint64_t*>calloc(self.c.slots, sizeof(uint64_t))
        self.c.spans = <uint64_t*>calloc(2 * self.c.slots, sizeof(uint64_t))
        if self.c.reqs == NULL or self.c.live == NULL or self.c.spans == NULL:
            raise MemoryError("staging window requests")
        self.c.cap = 16
        self.c.lo = self.c.next = self.c.stage = 1
        cdef pthread_condattr_t attr
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        cxl_plain_mutex_init(&self.c.m)
        cxl_plain_mutex_init(&self._jm)
        pthread_cond_init(&self.c.work, &attr)
        pthread_cond_init(&self.c.done, &attr)
        cdef int rc = cxl_thread_start(&self._tid, _refill_device if device else _refill_main,
                                       &self.c)
        if rc != 0:
            raise OSError(-rc, "cannot start the staging window's refill thread")
        self._started = True
        self._pid = cxl_pid()
        region._closing.add(self)

    def __dealloc__(self):
        self._stop()
        if self._started and self._pid == cxl_pid():
            pthread_cond_destroy(&self.c.work)
            pthread_cond_destroy(&self.c.done)
        if self.c.buf != NULL:
            munmap(self.c.buf, self.c.size)
        free(self.c.reqs)
        free(self.c.live)
        free(self.c.spans)

    cdef void _stop(self) noexcept:
        """Stop and join the refill thread (idempotent); its copy ends at a piece.
        Every caller returns only after the join: Region.close() unmaps next."""
        if not self._started:
            return
        self._closed = True
        if self._pid != cxl_pid():
            # A forked child: the refill thread exists only in the parent, and the
            # mutexes may have been copied locked. Touch neither.
            return
        with nogil:
            cxl_plain_mutex_lock(&self._jm)
            if not self._joined:
                cxl_plain_mutex_lock(&self.c.m)
                self.c.stop = 1
                pthread_cond_broadcast(&self.c.work)
                pthread_cond_broadcast(&self.c.done)
                cxl_plain_mutex_unlock(&self.c.m)
                cxl_thread_join(self._tid)
                self._joined = True
                _unhold_all(&self.c)
            cxl_plain_mutex_unlock(&self._jm)

    def close(self):
        """Stop the refill thread. Idempotent; views already returned stay readable."""
        self._stop()

    @property
    def closed(self):
        return bool(self._closed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    cdef void _need_process(self) except *:
        if self._pid != cxl_pid():
            raise StagingError("a staging window does not survive fork(): its refill "
                               "thread stayed in the parent; open one in this process")

    cdef void _need_open(self) except *:
        self._need_process()
        if self._closed:
            raise RegionClosedError("the staging window is closed")

    cdef void _need_fit(self, uint64_t off, uint64_t n) except *:
        if n == 0:
            raise StagingError("an empty object cannot be staged")
        if n > self.c.size:
            raise StagingError(f"an object of {n} bytes is larger than the window "
                               f"({self.c.size} bytes): it can never be staged")
        self.region._rc(cxl_check_range(self.c.r, off, n), "prefetch", off, n)

    def prefetch(self, uint64_t off, uint64_t n):
        """Issue the object [off, off+n) of the region; returns its handle."""
        return self.prefetch_many([(off, n)])[0]

    def prefetch_many(self, ordered):
        """Issue objects ((off, n) pairs) in order; returns their handles. Every
        object is checked before any is issued."""
        cdef list objs = [(int(o), int(n)) for o, n in ordered]
        cdef uint64_t off, n, first
        cdef sw_req* q
        cdef int rc = 0
        self._need_open()
        for off, n in objs:
            self._need_fit(off, n)
        with nogil:
            cxl_plain_mutex_lock(&self.c.m)
        first = self.c.next
        for off, n in objs:
            if self.c.next - self.c.lo >= self.c.cap and _grow(&self.c) != 0:
                rc = -1
                break
            q = _req(&self.c, self.c.next)
            q[0] = sw_req(off=off, n=n, at=0, state=SW_QUEUED, rc=0, cancel=0, views=0, held=0,
                          issuing=0)
            self.c.next += 1
        if rc != 0:
            self.c.next = first  # all or nothing: the refill thread saw none of them
        else:
            pthread_cond_broadcast(&self.c.work)
        cxl_plain_mutex_unlock(&self.c.m)
        if rc != 0:
            raise MemoryError(f"staging window: no memory for {len(objs)} more requests")
        return list(range(first, first + len(objs)))

    def wait(self, uint64_t h, timeout=None):
        """The staged bytes of `h` (a read-only memoryview, valid until release). In a
        device window: True once `h` is in device memory (read the region itself), or
        False when the device had no room for it (the read goes to the capacity tier).

        Raises StagingTimeout after `timeout` seconds. Without a timeout, a wait that
        only a release could end (`h` does not fit until one, and no copy is in
        flight) raises StagingStalled rather than hang; with one, it waits for another
        thread's release until the timeout. A copy that failed raises its error
        (CoherenceError, OutOfRangeError, ...)."""
        cdef double t = -1.0 if timeout is None else float(timeout)
        cdef int rc
        cdef sw_req q
        if timeout is not None and not t >= 0:  # NaN too
            raise ValueError(f"timeout must be a number >= 0 or None, not {timeout!r}")
        if t > 1e9:  # 31 years: no deadline (the clock arithmetic cannot hold it), but
            t = -1.0  # still a timeout: another thread's release may end it
        self._need_open()
        with nogil:
            rc = _wait(&self.c, h, t, timeout is None, &q)
        if rc == SW_OK and self.device:
            return bool(q.held)
        if rc == SW_OK:
            try:
                s = Staged._of(self, h, q.at, q.n)  # from here on, s gives the view back
            except BaseException:
                self._views(h, -1)  # _wait counted the view we could not hand out
                raise
            return memoryview(s)
        if rc < 0:  # the copy failed
            return self.region._rc(rc, "staging wait", q.off, q.n)
        self._raise(rc, h, "wait", timeout)

    cdef int _raise(self, int rc, uint64_t h, str op, timeout=None) except -1:
        if rc == SW_UNKNOWN:
            raise StagingHandleError(f"{op}({h}): this window never issued handle {h}")
        if rc == SW_GONE:
            raise StagingHandleError(f"{op}({h}): handle {h} was released")
        if rc == SW_STALLED:
            raise StagingStalled(
                f"{op}({h}): handle {h} can be staged only after a release: the window "
                f"holds {self.c.staged} staged objects ({self.c.bytes_in_use} of "
                f"{self.c.size} bytes, {self.c.slots} slots), all complete")
        if rc == SW_TIMEOUT:
            raise StagingTimeout(f"{op}({h}): not staged within {timeout} s")
        raise RegionClosedError("the staging window is closed")

    def release(self, uint64_t h):
        """Give `h`'s room back at once (a queued handle is never staged; a copy in
        flight stops at its next 1 MiB piece, and release() returns after that: the
        window never reads the object again; in a device window, the device's hold is
        given back, without waiting for the object to land). Refused while a view of
        it is alive."""
        cdef sw_req* q
        cdef int rc, views = 0, unhold = 0
        cdef uint64_t off = 0, n = 0
        self._need_process()
        with nogil:
            cxl_plain_mutex_lock(&self.c.m)
            rc = _check(&self.c, h)
            if rc == SW_OK and self.c.device:
                # The device stages it: wait only for its prefetch call to return (the
                # refill thread then records the hold), never for it to land.
                while _req(&self.c, h).issuing:
                    pthread_cond_wait(&self.c.done, &self.c.m)
                rc = _check(&self.c, h)  # another thread may have released it meanwhile
            if rc == SW_OK:
                q = _req(&self.c, h)
                views = q.views
                if views == 0 and q.held:
                    unhold, off, n = 1, q.off, q.n
                    q.held = 0
                if views == 0:
                    if q.state == SW_COPYING and not self.c.device:
                        # Stop the copy, and return only once the refill thread has let
                        # go of the object: the caller may then give up its right to it
                        # (a KV hit unpins its blocks).
                        q.cancel = 1
                        while _req(&self.c, h).state == SW_COPYING:
                            pthread_cond_wait(&self.c.done, &self.c.m)
                    else:
                        if q.state == SW_COPYING:  # a device's, landing: the refill skips it
                            self.c.copying -= 1
                        if q.state == SW_COPYING or q.state == SW_READY:
                            _unstage(&self.c, h)
                        q.state = SW_RELEASED
                        _advance(&self.c)
                    # The refill thread may have stalled on this very handle: nobody
                    # may call it a stall until it has looked again.
                    self.c.stalled = 0
                    pthread_cond_broadcast(&self.c.work)
                    pthread_cond_broadcast(&self.c.done)
            cxl_plain_mutex_unlock(&self.c.m)
            if unhold:
                cxl_hint(self.c.r, CXL_HINT_RELEASE, off, n)
        if rc != SW_OK:
            self._raise(rc, h, "release")
        if views:
            raise BufferError(f"release({h}): {views} view(s) of its staged bytes are "
                              "still alive; drop them (or call .release() on them) first")

    def stats(self):
        """Counters: size, slots, staged, bytes_in_use, peak_bytes, queued, copied
        (bytes; in a device window, bytes the device took), stalls (times the refill
        thread waited for room), refused (device window: objects the device had no
        room for), device."""
        cdef sw_ctx snap
        self._need_process()
        with nogil:  # copied under the mutex, turned into objects after it
            cxl_plain_mutex_lock(&self.c.m)
            snap = self.c
            cxl_plain_mutex_unlock(&self.c.m)
        return {"size": snap.size, "slots": snap.slots, "staged": snap.staged,
                "bytes_in_use": snap.bytes_in_use, "peak_bytes": snap.peak_bytes,
                "queued": snap.next - snap.stage, "copied": snap.copied,
                "stalls": snap.stalls, "refused": snap.refused, "device": bool(snap.device)}

    def ready(self, uint64_t h):
        """True once `h` is staged and readable (False while queued or copying)."""
        cdef int rc
        self._need_process()
        with nogil:
            cxl_plain_mutex_lock(&self.c.m)
            rc = _check(&self.c, h)
            if rc == SW_OK and _req(&self.c, h).state != SW_READY:
                rc = -1
            cxl_plain_mutex_unlock(&self.c.m)
        if rc > 0:
            self._raise(rc, h, "ready")
        return rc == SW_OK

    cdef int _views(self, uint64_t h, int d) except -1:
        if self._pid != cxl_pid():
            return 0
        with nogil:
            cxl_plain_mutex_lock(&self.c.m)
            if _check(&self.c, h) == SW_OK:
                _req(&self.c, h).views += d
            cxl_plain_mutex_unlock(&self.c.m)
        return 0


@cython.no_gc_clear  # its window must outlive every buffer it exports
cdef class Staged:
    """The buffer behind wait()'s memoryview. It holds one view of its handle, counted
    by wait() under the window's mutex, until the last memoryview of it goes."""

    cdef StagingWindow w
    cdef uint64_t h, at, n

    @staticmethod
    cdef Staged _of(StagingWindow w, uint64_t h, uint64_t at, uint64_t n):
        cdef Staged s = Staged.__new__(Staged)
        s.w = w
        s.h = h
        s.at = at
        s.n = n
        return s

    def __getbuffer__(self, Py_buffer* buf, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("staged bytes are read-only")
        PyBuffer_FillInfo(buf, self, self.w.c.buf + self.at, self.n, 1, flags)

    def __dealloc__(self):
        if self.w is not None:
            self.w._views(self.h, -1)
