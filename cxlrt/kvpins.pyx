# The pins of a KV cache (invariants in kvpins.pxd). A block pinned by a live node
# is never evicted (the pins of a detached or dead node are void to eviction:
# kvclaim.pyx); the pins of a process that died are given back by its own node, and a
# process gives its record back when it closes the cache (or, if it could not,
# at its next attach: a record of ours that no live PinTable holds is an orphan).
from libc.stdint cimport uint16_t, uint64_t
from libc.errno cimport EBUSY
from libc.string cimport memset

from cxlrt.backend cimport (CXL_F_DIRECT, cxl_fence, cxl_flush_nodrain, cxl_gather64, cxl_load,
                            cxl_load64, cxl_scatter64, cxl_store64)
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport CXL_ASSERT, cxl_pid, cxl_prefetch_w, cxl_wall_ns, unlikely
from cxlrt.lock cimport (cxl_local_enter, cxl_local_exit, cxl_local_needs_repair,
                         cxl_local_try_enter, cxl_lock_held)
from cxlrt.layout cimport CXL_LINE_SIZE
from cxlrt.mapping cimport Mapping
from cxlrt.status cimport CXLRT_E_KVNOREC, CXLRT_E_KVPINS, check_rc

import fcntl
import os

from cxlrt.errors import RegionError
from cxlrt.liveness import boot_id, pid_namespace, process_alive, process_start

__all__ = ["PinTable", "process_alive", "process_start"]

cdef uint64_t TABLE_MAGIC = 0x31305050_4B4C5843  # "CXLKPP01"
# where the header's identity words are (the rest of the line is zero)
cdef size_t _WHERE = <size_t>&(<kv_pin_file_header*>NULL).boot_id
cdef size_t _PIDNS = <size_t>&(<kv_pin_file_header*>NULL).pidns
cdef size_t _HEAD_USED = _PIDNS + sizeof(uint64_t)
assert sizeof(kv_pin_file_header) == CXL_LINE_SIZE and sizeof(kv_pin_record_head) == CXL_LINE_SIZE
cdef int RECORDS = 64                           # processes of one node pinning at once
cdef int* _armed = cxl_crash_armed_ptr()


_HELD = set()  # (table path, record) held by a live PinTable of this process
_START = [0, 0]  # [pid, its start time]


def _my_start():
    pid = cxl_pid()
    if _START[0] != pid:
        _START[1] = process_start(pid)
        _START[0] = pid
    return _START[1]


cdef bint kv_repeats(const uint64_t* slots, uint64_t n) noexcept nogil:
    """Whether a slot appears twice among n (n <= PIN_BATCH: the quadratic scan is
    cheaper than one request)."""
    cdef uint64_t i, j
    for i in range(1, n):
        for j in range(i):
            if slots[i] == slots[j]:
                return True
    return False


cdef class PinTable:
    """Pin words of one KV cache for this node, and the node-local record table.

    Every process of a node must share the node-local folder and pid namespace.
    """

    def __init__(self, region, LockService locks, uint32_t lock_id, uint64_t pins,
                 uint64_t slots, str path):
        self._region = region
        self._locks = locks
        self.L = &locks.L
        self.r = self.L.r
        self.lock_id = lock_id
        self.node = region.node
        self.nodes = region.nodes
        self.pins = pins
        self.slots = slots
        self._rec = -1
        self._path = path
        self._open(path)

    def _open(self, str path):
        size = kv_pin_record_off(self.slots, RECORDS)
        head = (TABLE_MAGIC.to_bytes(8, "little") + self.pins.to_bytes(8, "little")
                + self.slots.to_bytes(8, "little"))
        where = boot_id() + pid_namespace().to_bytes(8, "little")
        fresh = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process of the node builds it
            old = os.pread(fd, _HEAD_USED, 0)
            if (os.fstat(fd).st_size != size or old[:_WHERE] != head
                    or old[_WHERE:_PIDNS] != where[:_PIDNS - _WHERE]):
                # New, or left by an earlier boot (a local dir that outlives reboots):
                # either way no live process holds a pin through it.
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
                os.pwrite(fd, head + where, 0)
                fresh = True
            elif old[_PIDNS:] != where[_PIDNS - _WHERE:]:
                raise RegionError(
                    f"{path}: another process of node {self.node} runs in a different pid "
                    "namespace (another container?). Pins are given back by pid, so every "
                    "process of one node must share a pid namespace and the node-local "
                    "folder ($CXLRT_LOCAL_DIR); give other containers their own node ids")
            self._map = Mapping(path, size)
            self._base = self._map.base
            if fresh:
                # No process of this node holds a pin now (its table is new: a first
                # attach, or a host that lost /dev/shm or rebooted). Pins left in the
                # region by the node's earlier life would keep their blocks: clear them.
                self._clear()
        finally:
            os.close(fd)

    # --- the node-local mutex ----------------------------------------------------------

    cdef int enter(self) noexcept nogil:
        """Take the node's pin mutex; if its last holder died mid-update, rebuild
        our node's pin words from the records (the truth for live processes)."""
        return self._entered(cxl_local_enter(self.L, self.lock_id))

    cdef int try_enter(self) noexcept nogil:
        """enter() if the mutex is free this instant; -EBUSY (nothing taken) if not."""
        return self._entered(cxl_local_try_enter(self.L, self.lock_id))

    cdef int try_enter_clean(self) noexcept nogil:
        """try_enter() that repairs nothing: a mutex whose last holder died is let go
        again, still marked, with -EBUSY. For callers that hold the GIL: the repair
        rebuilds the node's pin words from every record, which takes milliseconds
        in a large cache; a taker without the GIL does it."""
        cdef int rc = cxl_local_try_enter(self.L, self.lock_id)
        if rc == 1:
            cxl_local_exit(self.L, self.lock_id)
            return -EBUSY
        return rc

    cdef int _entered(self, int rc) noexcept nogil:
        if rc == 1:
            rc = self._rebuild()
            if rc != 0:
                cxl_local_exit(self.L, self.lock_id)  # still marked: the next taker rebuilds
                return rc
            cxl_local_needs_repair(self.L, self.lock_id, False)
        return rc

    cdef void leave(self) noexcept nogil:
        cxl_local_exit(self.L, self.lock_id)

    def _enter(self):
        cdef int rc
        with nogil:
            rc = self.enter()
        if rc != 0:
            check_rc(rc, "pin table: node-local mutex")

    # --- pins ----------------------------------------------------------------------------

    cdef int add(self, const uint64_t* slots, uint64_t n, int delta) noexcept nogil:
        """add_locked() under the pin mutex."""
        cdef int rc = self.enter()
        if rc != 0:
            return rc
        rc = self.add_locked(slots, n, delta)
        self.leave()
        return rc

    cdef void prefetch(self, const uint64_t* slots, uint64_t n) noexcept nogil:
        """Name the lines add_locked() will write for `slots` (our record's counts,
        and our pin words where the region is mapped), before taking the mutex."""
        cdef uint64_t i
        cdef uint16_t* mine
        if self._rec < 0 or self._rec_pid != cxl_pid():
            return
        mine = self._record(self._rec)
        for i in range(n):
            cxl_prefetch_w(&mine[slots[i]])
            if self.r.flags & CXL_F_DIRECT:
                cxl_prefetch_w(self.r.base + self.at(self.node, slots[i]))

    cdef int add_locked(self, const uint64_t* slots, uint64_t n, int delta) noexcept nogil:
        """Add `delta` (+1 or -1) to our node's pin on each slot, in the region and in
        our record, and publish (pin mutex held). `done` tells how many slots took it:
        all of them, or on CXLRT_E_KVPINS those before the saturated one. Whatever the
        medium does, our record ends exact: pins go on all or nothing (an error takes
        back those that went on), and always come off. Where a write failed, the mutex
        is marked, and the next taker writes the words from the records."""
        cdef uint64_t i = 0, m, did = 0, stamp
        cdef uint16_t* mine
        cdef int rc = 0
        CXL_ASSERT(cxl_lock_held(self.L, self.lock_id, False), b"pins changed without the mutex")
        if self._rec < 0 or self._rec_pid != cxl_pid():
            return CXLRT_E_KVNOREC
        mine = self._record(self._rec)
        if delta < 0:
            return self._lower(slots, n, mine)
        # A block's recency is its latest pin, which is its latest lookup: an unpin
        # keeps the word's stamp (so a lookup reads the clock once, not twice, and a
        # sweep of a dead process's pins makes no block look used). It is an LRU hint
        # compared with entries' store stamps (fine clock): a coarse clock lags by up
        # to a tick (4 ms), and a block pinned just after a store then looks older
        # than it, so eviction takes the wrong one.
        stamp = (cxl_wall_ns() // 1000000) << 16
        if self.r.flags & CXL_F_DIRECT:
            rc = self._add_each(slots, n, delta, mine, stamp, &i)
        else:
            # Not a direct mapping: each word is a call into the backend (a request
            # over rdma:), so the words go PIN_BATCH at a time as one gather and one
            # scatter. A batch naming a slot twice goes a word at a time: its second
            # count must build on its first.
            while i < n and rc == 0:
                m = n - i if n - i < PIN_BATCH else PIN_BATCH
                if kv_repeats(slots + i, m):
                    rc = self._add_each(slots + i, m, delta, mine, stamp, &did)
                else:
                    rc = self._add_batch(slots + i, m, delta, mine, stamp, &did)
                i += did
        self.done = i if rc != 0 else n
        if rc == CXLRT_E_KVPINS:
            # A block this node already pins 65535 times: the pins before it hold,
            # and the caller ends its hit there (done says where).
            rc = cxl_fence(self.r)
            if rc == 0:
                return CXLRT_E_KVPINS
            i = self.done
        if rc != 0:
            # A failed read changed nothing, but a failed write may have landed, and a
            # failed fence leaves the words unpublished: the next taker rebuilds.
            self._unsound()
            if i > 0:
                self._lower(slots, i, mine)  # all or nothing: the caller fails
            self.done = 0
            return rc
        rc = cxl_fence(self.r)
        if rc != 0:
            self._unsound()
            self._lower(slots, n, mine)
            self.done = 0
        return rc

    cdef int _lower(self, const uint64_t* slots, uint64_t n, uint16_t* mine) noexcept nogil:
        """add_locked(-1): PIN_BATCH slots at a time, our record first, then the
        region's words of the slots it lowered; after an error only the record, and
        the mutex is marked. A process killed between the two leaves the region one
        too many (a pin that stays until the next taker rebuilds), never one too few
        (that would take another process's pin with it). Slots whose count in our
        record is 0 are not ours to give back (a Hit of another process)."""
        cdef uint64_t take[PIN_BATCH]
        cdef uint64_t i = 0, j, m, k, did = 0
        cdef int rc = 0
        while i < n:
            m = n - i if n - i < PIN_BATCH else PIN_BATCH
            k = 0
            for j in range(i, i + m):
                CXL_ASSERT(slots[j] < self.slots, b"a pin on a slot the cache does not have")
                if mine[slots[j]] != 0:
                    mine[slots[j]] -= 1
                    take[k] = slots[j]
                    k += 1
            if rc == 0 and k:
                if (self.r.flags & CXL_F_DIRECT) or kv_repeats(take, k):
                    rc = self._add_each(take, k, -1, NULL, 0, &did)
                else:
                    rc = self._add_batch(take, k, -1, NULL, 0, &did)
            i += m
        if rc == 0:
            rc = cxl_fence(self.r)
        self.done = n
        if rc != 0:
            self._unsound()
        return rc

    cdef int _add_each(self, const uint64_t* slots, uint64_t n, int delta, uint16_t* mine,
                       uint64_t stamp, uint64_t* did) noexcept nogil:
        """add_locked's pass a word at a time; *did: slots done (all, unless rc != 0).
        A raise changes `mine` after each word and writes `stamp`; a lowering comes
        from _lower, which changed the record first (mine is NULL), and keeps each
        word's stamp."""
        cdef uint64_t i = 0, w, at, cnt
        cdef int rc = 0
        for i in range(n):
            CXL_ASSERT(slots[i] < self.slots, b"a pin on a slot the cache does not have")
            at = self.at(self.node, slots[i])
            rc = cxl_load64(self.r, at, &w)
            if rc != 0:
                break  # nothing changed for this slot
            if delta < 0 and unlikely(_armed[0]):
                cxl_crash_hit(b"kv.unpin.lowered")  # our record lowered, the word not yet
            cnt = w & KV_PIN_MAX
            if delta > 0:
                if cnt == KV_PIN_MAX or mine[slots[i]] == KV_PIN_MAX:
                    rc = CXLRT_E_KVPINS
                    break
                cnt += 1
            elif cnt > 0:
                cnt -= 1
            if delta < 0:
                stamp = w & ~(<uint64_t>KV_PIN_MAX)  # recency stays the latest pin's
            rc = cxl_store64(self.r, at, stamp | cnt)
            if rc == 0:
                rc = cxl_flush_nodrain(self.r, at, sizeof(uint64_t))
            if rc != 0:
                break
            if delta > 0:
                if unlikely(_armed[0]):
                    cxl_crash_hit(b"kv.pin.raised")
                mine[slots[i]] += 1
        did[0] = i if rc != 0 else n
        return rc

    cdef int _add_batch(self, const uint64_t* slots, uint64_t n, int delta, uint16_t* mine,
                        uint64_t stamp, uint64_t* did) noexcept nogil:
        """add_locked's pass over n <= PIN_BATCH distinct slots: every pin word read in
        one gather and written in one scatter. As a word at a time (kvpins.pxd), the
        region's count is raised before our record and lowered after it: a process
        killed in between leaves the region one too many (a pin that stays), never one
        too few (the sweep then gives back what the record holds: a count the region
        no longer had would take another process's pin with it). A raise changes the
        record only once the scatter has worked; a lowering comes from _lower, which
        changed it first (mine is NULL)."""
        cdef uint64_t offs[PIN_BATCH]
        cdef uint64_t w[PIN_BATCH]
        cdef uint32_t pick[PIN_BATCH]  # which slot each word is
        cdef uint64_t i, k, m = 0, cnt
        cdef int rc = 0, wrc
        for i in range(n):
            CXL_ASSERT(slots[i] < self.slots, b"a pin on a slot the cache does not have")
            pick[m] = <uint32_t>i
            offs[m] = self.at(self.node, slots[i])
            m += 1
        rc = cxl_gather64(self.r, <uint32_t>m, offs, w)
        if rc != 0:
            did[0] = 0
            return rc  # nothing changed in the region
        if delta < 0 and m and unlikely(_armed[0]):
            cxl_crash_hit(b"kv.unpin.lowered")  # our record lowered, the words not yet
        k = 0  # words to write: all m, or those before a saturated one
        while k < m:
            cnt = w[k] & KV_PIN_MAX
            if delta > 0:
                if cnt == KV_PIN_MAX or mine[slots[pick[k]]] == KV_PIN_MAX:
                    rc = CXLRT_E_KVPINS
                    break
                cnt += 1
            elif cnt > 0:
                cnt -= 1
            w[k] = (stamp if delta > 0 else w[k] & ~(<uint64_t>KV_PIN_MAX)) | cnt
            k += 1
        wrc = cxl_scatter64(self.r, <uint32_t>k, offs, w) if k else 0
        for i in range(k):
            if wrc == 0:
                wrc = cxl_flush_nodrain(self.r, offs[i], sizeof(uint64_t))
        if wrc != 0:
            did[0] = 0
            return wrc
        if delta > 0:
            if k and unlikely(_armed[0]):
                cxl_crash_hit(b"kv.pin.raised")
            for i in range(k):
                mine[slots[pick[i]]] += 1
        did[0] = pick[k] if rc != 0 else n
        return rc

    def has_record(self):
        return self._rec >= 0 and self._rec_pid == cxl_pid()

    # --- records -------------------------------------------------------------------------

    cdef uint16_t* _record(self, int k) noexcept nogil:
        return <uint16_t*>(self._base + kv_pin_record_off(self.slots, k)
                           + sizeof(kv_pin_record_head))

    cdef uint64_t* _head(self, int k) noexcept nogil:
        """[pid, start time] of record k; pid 0 = free."""
        return <uint64_t*>(self._base + kv_pin_record_off(self.slots, k))

    cdef int _rebuild(self) noexcept nogil:
        """Set our node's pin words to what the records count (pin mutex held, its
        last holder died inside). Words are read REBUILD_WORDS at a time (one request
        each off a direct mapping) and only the ones that differ are stored, each as
        one untorn word: other nodes read them meanwhile. Every word is written back,
        changed or not: a dead holder's store may sit in the node's view with its
        write-back lost."""
        cdef uint64_t w[REBUILD_WORDS]
        cdef uint64_t s0, s, m, total, at0 = self.at(self.node, 0)
        cdef int k, rc = 0
        s0 = 0
        while s0 < self.slots and rc == 0:
            m = min(self.slots - s0, <uint64_t>REBUILD_WORDS)
            rc = cxl_load(self.r, at0 + s0 * sizeof(uint64_t), w, m * sizeof(uint64_t))
            for s in range(s0, s0 + m):
                if rc != 0:
                    break
                total = 0
                for k in range(RECORDS):
                    if self._head(k)[0] != 0:
                        total += self._record(k)[s]
                total = min(total, KV_PIN_MAX)
                if (w[s - s0] & KV_PIN_MAX) != total:
                    rc = cxl_store64(self.r, at0 + s * sizeof(uint64_t),
                                     (w[s - s0] & ~(<uint64_t>KV_PIN_MAX)) | total)
            s0 += m
        if rc == 0:
            rc = cxl_flush_nodrain(self.r, at0, self.slots * sizeof(uint64_t))
        if rc == 0:
            rc = cxl_fence(self.r)
        return rc

    cdef int _release(self, int k) noexcept nogil:
        """Give back every pin of record k and free it (pin mutex held). The record
        is freed only once the region's words are written back."""
        cdef uint64_t s, w = 0, at, cnt
        cdef uint16_t* c = self._record(k)
        cdef int rc = 0
        for s in range(self.slots):
            if c[s] == 0:
                continue
            at = self.at(self.node, s)
            rc = cxl_load64(self.r, at, &w)
            if rc != 0:
                break
            cnt = w & KV_PIN_MAX
            cnt = cnt - c[s] if cnt > c[s] else 0
            c[s] = 0
            rc = cxl_store64(self.r, at, (w & ~(<uint64_t>KV_PIN_MAX)) | cnt)
            if rc == 0:
                rc = cxl_flush_nodrain(self.r, at, sizeof(uint64_t))
            if rc != 0:
                break
        if rc == 0:
            rc = cxl_fence(self.r)
        if rc != 0:
            self._unsound()
            return rc
        self._head(k)[0] = 0
        self._head(k)[1] = 0
        return 0

    cdef void _unsound(self) noexcept nogil:
        """A write inside the pin mutex failed part-way: the region and the records
        may disagree. The next taker rebuilds the words from the records."""
        cxl_local_needs_repair(self.L, self.lock_id, True)

    def _recover_locked(self):
        """Give back records of dead processes, and this process's orphans: records
        of ours that no open PinTable of this process holds (a cache closed after
        its region, or dropped without close)."""
        cdef int k, rc
        cdef uint64_t s
        me = cxl_pid()
        mine = _my_start()
        freed = 0
        for k in range(RECORDS):
            pid, start = self._head(k)[0], self._head(k)[1]
            if pid == 0:
                continue
            if pid == me and start == mine:
                if (self._path, k) in _HELD:
                    continue
            elif process_alive(pid, start):
                continue
            for s in range(self.slots):
                freed += self._record(k)[s]
            with nogil:
                rc = self._release(k)
            if rc != 0:
                check_rc(rc, "pin table: giving back pins")
        return freed

    def recover(self):
        """Give back the pins of this node's dead processes (and this process's
        orphaned records); returns how many."""
        self._enter()
        try:
            return self._recover_locked()
        finally:
            self.leave()

    def claim(self):
        """Give this process a record (its first pin after start or fork)."""
        cdef int k
        pid = cxl_pid()
        self._enter()
        try:
            self._recover_locked()
            for k in range(RECORDS):
                if self._head(k)[0] == 0:
                    memset(self._record(k), 0, self.slots * sizeof(uint16_t))
                    self._head(k)[1] = _my_start()
                    self._head(k)[0] = pid
                    self._rec = k
                    self._rec_pid = pid
                    _HELD.add((self._path, k))
                    return
        finally:
            self.leave()
        raise RuntimeError(f"{RECORDS} live processes of node {self.node} already hold "
                           "records of this KV cache's pin table")

    def close(self):
        """Give our record back, with every pin it still holds. Idempotent.

        Once the region is closed its pins cannot be written: the record is then
        left to this process's next claim or recover (an orphan), or to the node's
        other processes once this one exits.
        """
        cdef int rc, k = self._rec
        if k < 0 or self._rec_pid != cxl_pid():
            self._rec = -1
            return
        self._rec = -1
        _HELD.discard((self._path, k))
        if self.r.closed:
            return
        with nogil:
            rc = self.enter()
            if rc == 0:
                rc = self._release(k)
                self.leave()
        if rc != 0:
            check_rc(rc, "pin table: giving back pins")

    def __dealloc__(self):
        if self._rec >= 0 and self._rec_pid == cxl_pid() and _HELD is not None:
            _HELD.discard((self._path, self._rec))  # the record is an orphan from now on

    def _clear(self):
        self._enter()
        try:
            at = self.at(self.node, 0)
            zeros = bytes(self.slots * sizeof(uint64_t))
            self._region.flush(at, len(zeros))
            self._region.store(at, zeros)
            self._region.persist(at, len(zeros))
        finally:
            self.leave()
