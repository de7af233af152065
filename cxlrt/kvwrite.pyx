# The writer's side of a KV cache store: reserve slots and payloads under the
# cache lock, copy with no lock held while the progress words move, publish under
# the lock again; and the eviction that makes room on the way. How other nodes
# judge a writer that stalls or dies: kvclaim.pyx. The object map: kvcache.pxd.
"""Store blocks into a KV cache: reserve, copy, publish, and evict for room.

A store holds the rack-wide cache lock twice: once to settle the records, claim a
slot and a payload for each key (evicting least-recently-used unpinned blocks, or
taking over writers judged gone, when the cache is full), and once to publish the
entries READY. In between it copies the blocks by DMA with no lock held, chunk by
chunk, advancing each claim's progress word every lease / 8 and re-reading its
entry, so that it stops writing a block another node took over and a stalled
store is told ClaimLost instead of publishing.
"""
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc, qsort
from libc.string cimport memcpy, memset

from cpython.bytes cimport PyBytes_AS_STRING

from cxlrt.alloc cimport cxl_alloc
from cxlrt.backend cimport cxl_dma_write
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport CXL_ASSERT, cxl_now_ns, cxl_wall_ns, unlikely
from cxlrt.kvcache cimport (KV_COPY_CHUNK, KV_EMPTY, KV_KEY_BYTES, KV_PAYLOAD_HDR, KV_PROGRESS,
                            KV_READY, KV_REC_CLAIM, KV_REC_EVICT, KV_TOMBSTONE, KV_WRITING,
                            kv_claim, kv_entry, kv_job)
from cxlrt.kvclaim cimport Claims, kv_raise
from cxlrt.kvevict cimport kv_cand, kv_cand_cmp, kv_evict_batch, kv_evict_ready, kv_scan, kv_sweep
from cxlrt.kvindex cimport (KV_PAYLOAD_MAGIC, kv_add_occupancy, kv_claim_at, kv_gen, kv_get,
                            kv_get_counters, kv_kind, kv_line_ok, kv_meta, kv_payload_ok, kv_probe,
                            kv_put, kv_read, kv_set_counters, kv_set_key, kv_state, kv_write)
from cxlrt.kvpins cimport PinTable
from cxlrt.layout cimport kv_counters, kv_payload_header
from cxlrt.region cimport Region
from cxlrt.status cimport CXLRT_E_KVCORRUPT, CXLRT_E_NOMEM

import time

from cxlrt.errors import LeaseLost, MediumError

cdef int* _armed = cxl_crash_armed_ptr()


cdef class Writer:
    """The stores of one attached cache (see the module docstring)."""

    def __cinit__(self, Region region, str name, Claims claims, object lock, PinTable pt,
                  uint64_t capacity):
        self.region = region
        self.name = name
        self.claims = claims
        self.K = claims.K
        self.lock = lock
        self.pt = pt
        self.capacity = capacity
        self.tick_ns = max(<uint64_t>region.lease_ms * 1000000 // 8, 1000000)

    cdef int _raise(self, int rc, str what) except -1:
        return kv_raise(self.region, self.name, self.K, rc, what)

    def store(self, list ks, list srcs):
        """Store srcs[j] under ks[j]: (indexes published, indexes taken over by another
        node, keys skipped as present or being written, blocks reserved)."""
        cdef list reserved = []          # (slot, gen, off, index)
        cdef uint64_t skipped = 0
        self.claims.ident()
        self.hold(None)
        try:
            self.claims.settle()
            for j in range(len(ks)):
                got = self.reserve(ks, j, reserved)
                if got is None:
                    skipped += 1
                    continue
                if got is False:
                    break  # no room even after eviction: store what we have
            self.release_quietly()  # every write above was fenced: a late LeaseLost is moot
        except BaseException:
            self.release_quietly()
            try:
                self.abandon(reserved, ks)  # nothing half-reserved stays behind
            finally:
                self.claims.writing(reserved, -1)
            raise
        done = False
        published = lost = ()
        try:
            if reserved:
                self.region._busy += 1  # Region.close() refuses while we copy without the GIL
                try:
                    self.copy(reserved, ks, srcs)
                finally:
                    self.region._busy -= 1
            done = True
        finally:
            try:
                if reserved:
                    try:
                        published, lost = self.publish(reserved, ks, done)
                    except BaseException:
                        # A failed write left the rest of our claims as being written,
                        # which every store (this caller's retry too) skips until they
                        # are taken over, a lease or more from now: bury them now if the
                        # medium lets us (the entries published before the failure stay).
                        self.abandon(reserved, ks)
                        raise
            finally:
                # What even abandon() left, our next store takes over: nobody writes it.
                self.claims.writing(reserved, -1)
        return published, lost, skipped, len(reserved)

    cdef uint64_t alloc_payload(self) except? 0:
        """A payload chunk for one block (cache lock held), or 0 when the heap has
        no room for one; any other failure of the allocator raises."""
        cdef uint64_t off = 0
        cdef int rc
        with nogil:
            rc = cxl_alloc(self.K.A, KV_PAYLOAD_HDR + self.K.block_bytes, &off)
        if rc == CXLRT_E_NOMEM:
            return 0
        if rc != 0:
            # the allocator's own status, not the cache lock's: check_rc says it as is
            self.region._rc(rc, f"KV cache {self.name!r}: store: allocating a payload", 0, 0)
        return off

    def set_occupancy(self, uint64_t occ, uint64_t nbytes):
        cdef kv_counters w
        self.claims.io(kv_get_counters(self.K, &w), "counters")
        w.occupancy = occ
        w.payload_bytes = nbytes
        self.claims.io(kv_set_counters(self.K, &w), "counters")

    def hold(self, list reserved):
        """Take the cache lock, and make sure the hold is sound before we write.

        A hold whose acquire began before a silence of ours longer than the lease
        may overlap another node's (LeaseLost from check()): let go and take it
        again. While we wait with claims of ours (`reserved`), their progress
        words keep moving, so nobody takes them over for waiting.
        """
        cdef uint64_t t0
        tick_s = self.tick_ns / 1e9
        for _ in range(64):
            t0 = cxl_now_ns()
            if reserved:
                while not self.lock.acquire(timeout=tick_s):
                    self.tick_progress(reserved)
            else:
                self.lock.acquire()
            try:
                self.lock.check()
            except LeaseLost:
                self.lock_release()
                time.sleep(tick_s)  # our heartbeat thread resumes beating meanwhile
                continue
            self.K.hold_t0 = t0  # from here every write first asks kv_fenced()
            return
        raise LeaseLost(f"KV cache {self.name!r}: this process keeps being silent for longer "
                        "than the lease; it cannot hold the cache lock soundly")

    def lock_release(self):
        try:
            self.lock.release()
        except LeaseLost:
            pass  # a silence the fence already answered: nothing was written during it
        except MediumError:
            # Every write under the hold was made; the leave that failed is the lock's
            # to say again (its heartbeat sweep does). Raising here left a store's
            # claims being written, skipped by every store until this process ended.
            pass

    def release_quietly(self):
        """Let the cache lock go (if this thread holds it)."""
        if self.K.hold_t0 == 0:
            return
        self.K.hold_t0 = 0
        self.lock_release()

    def abandon(self, list reserved, list ks):
        """Give back the claims of a store that failed before its copy (best effort:
        what we cannot give back is taken over by the next store and freed once this
        process is gone)."""
        if not reserved:
            return
        try:
            self.hold(None)
            try:
                self.finish(reserved, ks, False)
            finally:
                self.release_quietly()
        except Exception:  # noqa: BLE001  (the caller re-raises the first error)
            pass

    def publish(self, list reserved, list ks, bint done):
        """finish() under a sound hold; a hold cut short by a silence of ours (the
        fence refused a write) is taken again and the step repeated."""
        for attempt in range(4):
            self.hold(reserved)  # keeps our progress words moving while it waits
            try:
                return self.finish(reserved, ks, done)
            except LeaseLost:
                if attempt == 3:
                    raise
            finally:
                self.release_quietly()

    def tick_progress(self, list reserved):
        """Advance the progress word of each claim (outside the lock)."""
        self.progress += 1
        v = int(self.progress).to_bytes(8, "little")
        for s, gen, off, j in reserved:
            self.region.dma_write(off + KV_PROGRESS, v)

    cdef object reserve(self, list ks, Py_ssize_t j, list reserved):
        """Claim a slot and a payload for `ks[j]` (cache lock held), appending
        (slot, gen, off, j) to `reserved` as soon as a write of ours may name the
        payload (then only the claim's own protocol frees it). A full cache
        evicts for every key of ks[j:] still absent at once: one table scan per store
        rather than one per capacity/16 keys, and never room for keys it would skip.

        True when claimed; None when the key is present or being written; False
        when there is no room even after evicting.
        """
        cdef kv_entry e
        cdef kv_claim c, old
        cdef kv_counters w
        cdef uint64_t s = 0, free_slot = 0, off = 0, gen
        cdef int rc, verdict
        cdef bint orphan
        cdef bytes key = ks[j]
        cdef const char* kp = PyBytes_AS_STRING(key)
        with nogil:
            rc = kv_probe(self.K, kp, &s, &e, &free_slot)
        if rc < 0:
            self._raise(rc, "store")
        if rc == 1:
            if kv_state(&e) != KV_WRITING:
                return None  # present: exactly one copy wins
            verdict = self.claims.judge(s, &e, &c)
            if verdict == 0 or not self.claims.bury(s, &e, self.claims.take_kind(verdict), &c,
                                                    "store"):
                return None  # being written by a writer that may still finish
            with nogil:
                rc = kv_probe(self.K, kp, &s, &e, &free_slot)
            if rc != 0:
                if rc < 0:
                    self._raise(rc, "store")
                return None
        with nogil:
            rc = kv_get_counters(self.K, &w)
        self.claims.io(rc, "store")
        if w.occupancy >= self.capacity:
            if not self.evict(self.batch(self.absent(ks, j))):
                return False
            with nogil:
                rc = kv_probe(self.K, kp, &s, &e, &free_slot)
            if rc < 0:
                self._raise(rc, "store")
        if free_slot == <uint64_t>-1:
            return False
        off = self.alloc_payload()
        if off == 0:
            # Each evicted payload makes room for one of the same size, unless its
            # memory goes back through another node's remote-free queue (usable once
            # that node drains it) or into quarantine. So one round, for exactly the
            # blocks still needed; then no room, rather than emptying the cache for
            # memory this node cannot have yet.
            if self.evict(min(self.absent(ks, j), self.capacity)):
                off = self.alloc_payload()
            if off == 0:
                return False
            with nogil:
                rc = kv_probe(self.K, kp, &s, &e, &free_slot)  # eviction may free an earlier slot
            if rc < 0:
                self.region.free(off)
                self._raise(rc, "store")
            if free_slot == <uint64_t>-1:
                self.region.free(off)
                return False
        s = free_slot
        with nogil:
            rc = kv_read(self.K, s, &e)
            if rc == 0:
                rc = kv_get(self.K, kv_claim_at(self.K, s), &old)
        if rc != 0:
            self.region.free(off)
            self._raise(rc, "store")
        CXL_ASSERT((kv_state(&e) == KV_EMPTY) | (kv_state(&e) == KV_TOMBSTONE),
                   b"reserving a slot the probe did not find free (under the cache lock)")
        gen = kv_gen(&e) + 1
        # A claim line for this very epoch over a free entry: a reserve died between
        # its claim line and its entry, and nobody else knows that payload.
        orphan = (kv_line_ok(&old) and kv_kind(&old) == KV_REC_CLAIM and old.epoch == gen
                  and old.slot == s and old.off != 0 and old.off != off)
        # The claim first, on its own line: who writes this slot's payload, in which
        # life of its node, at which epoch.
        self.claims.fill(&c, s, gen, off)
        kv_set_key(&e, kp)
        e.meta = kv_meta(gen, KV_WRITING)
        e.off = off
        e.len = KV_PAYLOAD_HDR + self.K.block_bytes
        e.owner = self.claims.id_owner
        e.stamp_ns = cxl_wall_ns()
        CXL_ASSERT(kv_payload_ok(self.K, &e), b"reserved payload outside the heap or misaligned")
        # From the claim line's first store on, the payload is the claim's: a write that
        # failed may still have landed (in our node's view, or on the medium with only
        # its answer lost), so freeing it here would free it a second time once the
        # entry is buried or the claim line found orphaned. The caller's abandon()
        # buries the entry if it is there; a claim line alone is the orphan that the
        # next reserve of this slot frees, as after a crash here.
        reserved.append((s, gen, off, j))
        self.claims.writing([(s, gen, off, j)], 1)  # before anyone, this store too, judges it
        with nogil:
            rc = kv_put(self.K, kv_claim_at(self.K, s), &c)
            if rc == 0:
                rc = kv_write(self.K, s, &e)
        if rc != 0:
            self._raise(rc, "store")
        if unlikely(_armed[0]):
            cxl_crash_hit(b"kv.store.writing")
        with nogil:
            rc = kv_add_occupancy(self.K, 1, <long long>self.K.block_bytes)
        self.claims.io(rc, "store")
        if orphan:  # our claim line replaced it first: a crash now leaks it, never frees twice
            self.claims.free_payload(old.off)
        return True

    def copy(self, list reserved, list ks, list srcs):
        """DMA each reserved payload (no lock held): the headers, then the blocks in
        chunks, advancing the progress words and re-reading our entries every tick;
        a block whose claim was taken over is not written further."""
        cdef uint64_t n = len(reserved), i
        cdef kv_job* jobs = <kv_job*>malloc(max(n, 1) * sizeof(kv_job))
        cdef const unsigned char[::1] src
        cdef int rc
        if jobs == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                s, gen, off, j = reserved[i]
                src = srcs[j]
                jobs[i].slot = s
                jobs[i].gen = gen
                jobs[i].off = off
                jobs[i].src = &src[0]  # srcs keeps the buffer alive
                jobs[i].key = PyBytes_AS_STRING(ks[j])
                jobs[i].lost = 0
            with nogil:
                rc = self.copy_jobs(jobs, n)
        finally:
            free(jobs)
        if rc != 0:
            self._raise(rc, "store")

    cdef int copy_jobs(self, kv_job* jobs, uint64_t n) noexcept nogil:
        cdef kv_payload_header h
        cdef uint64_t i, pos, step, bb = self.K.block_bytes, last, chunk
        cdef uint64_t prog = self.progress + 1
        cdef int rc = 0
        # Two chunks at least, so a block always has a "half copied" point.
        chunk = min(<uint64_t>KV_COPY_CHUNK, max(<uint64_t>64, ((bb + 1) // 2 + 63) & ~63ULL))
        for i in range(n):
            memset(&h, 0, sizeof(h))
            h.magic = KV_PAYLOAD_MAGIC
            memcpy(h.key, jobs[i].key, KV_KEY_BYTES)
            h.generation = jobs[i].gen
            h.block_bytes = bb
            h.cache = self.K.offset
            h.progress = prog
            h.writer = self.claims.id_owner
            rc = cxl_dma_write(self.K.r, jobs[i].off, &h, sizeof(h))
            if rc != 0:
                return rc
        last = cxl_now_ns()
        for i in range(n):
            pos = 0
            while pos < bb:
                if cxl_now_ns() - last >= self.tick_ns:
                    prog += 1
                    rc = self.tick(jobs, n, prog)
                    if rc != 0:
                        return rc
                    last = cxl_now_ns()
                if jobs[i].lost:
                    break
                step = min(chunk, bb - pos)
                if pos and unlikely(_armed[0]):
                    cxl_crash_hit(b"kv.store.copy")
                rc = cxl_dma_write(self.K.r, jobs[i].off + KV_PAYLOAD_HDR + pos,
                                   jobs[i].src + pos, step)
                if rc != 0:
                    return rc
                pos += step
        self.progress = prog + 1
        return self.tick(jobs, n, prog + 1)  # the last word before we publish

    cdef int tick(self, kv_job* jobs, uint64_t n, uint64_t prog) noexcept nogil:
        """Re-read each claim's entry (lock-free); advance the progress word of the
        claims that are still ours, mark the others lost."""
        cdef kv_entry e
        cdef uint64_t i
        cdef int rc
        for i in range(n):
            if jobs[i].lost:
                continue
            rc = kv_read(self.K, jobs[i].slot, &e)
            if rc != 0:
                return rc
            if kv_state(&e) != KV_WRITING or kv_gen(&e) != jobs[i].gen or e.off != jobs[i].off:
                jobs[i].lost = 1
                continue
            rc = cxl_dma_write(self.K.r, jobs[i].off + KV_PROGRESS, &prog, sizeof(prog))
            if rc != 0:
                return rc
        return 0

    def finish(self, list reserved, list ks, bint ok):
        """Publish the reserved entries ready, or give them back (cache lock held).

        Returns (indexes into `ks` published, indexes taken over by another node).
        """
        cdef kv_entry e
        cdef uint64_t s, gen, off
        cdef int rc
        published = []
        lost = []
        # An earlier try of this step (a publish retried after a stall, an abandon()
        # after a failed publish) may have left a record whose tombstone never came:
        # dropped now, or it would free the payload a second time once we bury the
        # entry again below.
        self.claims.settle()
        for s, gen, off, j in reserved:
            with nogil:
                rc = kv_read(self.K, s, &e)
            self.claims.io(rc, "store")
            if ok and kv_state(&e) == KV_READY and kv_gen(&e) == gen and e.off == off:
                published.append(j)  # an earlier try of this step published it
                continue
            if kv_state(&e) != KV_WRITING or kv_gen(&e) != gen or e.off != off:
                lost.append(j)  # taken over: our epoch is over, we publish nothing
                self.claims.ack(off, gen)
                continue
            if not ok:
                if not self.claims.bury(s, &e, KV_REC_EVICT, NULL, "store"):
                    self.claims.bury_unrecorded(s, &e)
                continue
            if unlikely(_armed[0]):
                cxl_crash_hit(b"kv.store.publish")
            e.meta = kv_meta(gen, KV_READY)
            e.stamp_ns = cxl_wall_ns()
            CXL_ASSERT(kv_payload_ok(self.K, &e), b"publishing an entry whose payload is not ours")
            with nogil:
                rc = kv_write(self.K, s, &e)
            self.claims.io(rc, "store")
            published.append(j)
        return published, lost

    # --- occupancy and eviction ----------------------------------------------------------

    cdef uint64_t absent(self, list ks, Py_ssize_t j) except? 0:
        """How many of ks[j:] the table does not hold (cache lock held): the blocks a
        store still needs room for (keys present or being written are skipped)."""
        cdef kv_entry e
        cdef uint64_t s = 0, free_slot = 0, n = 0
        cdef const char* kp
        cdef int rc
        for k in ks[j:]:
            kp = PyBytes_AS_STRING(k)
            with nogil:
                rc = kv_probe(self.K, kp, &s, &e, &free_slot)
            if rc < 0:
                self._raise(rc, "store")
            n += rc == 0
        return n

    cdef uint64_t batch(self, uint64_t need) noexcept:
        """Blocks to evict for a store that still needs `need`: at least capacity/16
        (so small stores do not scan the table each), at most the capacity."""
        return min(max(need, self.capacity // 16, <uint64_t>1), self.capacity)

    def evict(self, uint64_t want):
        """Evict up to `want` least-recently-used unpinned blocks (cache lock held).

        Also takes over entries whose writer died or stalled mid-store. Returns the
        number of entries freed.
        """
        cdef kv_entry e
        cdef kv_claim c
        cdef kv_cand* cands
        cdef uint64_t* writing
        # Some slack: a candidate a lookup pins between the scan and its EVICTING mark
        # stays, and the next oldest goes instead.
        cdef uint64_t s, i, used = 0, nc = 0, nw = 0, k = min(2 * want + 8, self.K.slots)
        cdef uint64_t batch = 0, freed = 0
        cdef int rc, verdict
        cands = <kv_cand*>malloc(max(k, 1) * sizeof(kv_cand) + self.K.slots * sizeof(uint64_t))
        if cands == NULL:
            raise MemoryError()
        writing = <uint64_t*>(cands + max(k, 1))
        try:
            with nogil:
                rc = kv_scan(self.K, cands, k, &nc, writing, &nw, &used)
            if rc < 0:
                self._raise(rc, "evict")
            # The scan saw every entry under the lock: the exact count, whatever a
            # crash between an entry write and a counter update left behind.
            self.set_occupancy(used, used * self.K.block_bytes)
            # Every writer is judged (a judgement watches its progress across calls);
            # those judged gone go first (their blocks can never become ready), then
            # the oldest unpinned blocks, oldest first.
            gone = []
            for i in range(nw):
                s = writing[i]
                with nogil:
                    rc = kv_read(self.K, s, &e)
                self.claims.io(rc, "evict")
                if kv_state(&e) == KV_WRITING:
                    verdict = self.claims.judge(s, &e, &c)
                    if verdict:
                        gone.append((s, verdict))
            for s, verdict in gone:
                if freed >= want:
                    break
                if self.evict_one(s, verdict):
                    freed += 1
            if nc > 1:
                qsort(cands, nc, sizeof(kv_cand), kv_cand_cmp)
            if freed < want:
                with nogil:
                    rc = kv_evict_batch(self.K, cands, nc, want - freed, &batch)
                self.evicted += batch
                freed += batch
                self.claims.io(rc, "evict")
        finally:
            free(cands)
        if freed:
            self.sweep_tombstones()
        elif self.pt.recover():
            return self.evict(want)  # our node's dead processes held the pins
        return freed

    def evict_one(self, uint64_t s, int verdict):
        """Evict slot s: a writer judged gone a moment ago under this same hold
        (verdict != 0), or the least recently used block (verdict 0)."""
        cdef kv_entry e
        cdef kv_claim c
        cdef int rc, freed = 0
        if verdict == 0:
            with nogil:
                rc = kv_evict_ready(self.K, s, &freed)
            if freed:
                self.evicted += 1
            self.claims.io(rc, "evict")
            if freed:
                self.claims.shrink()
            return freed
        with nogil:
            rc = kv_read(self.K, s, &e)
        self.claims.io(rc, "evict")
        if kv_state(&e) != KV_WRITING:
            return False
        self.claims.claim_of(s, &e, &c)
        if not kv_payload_ok(self.K, &e):
            self.K.bad_slot = s
            self._raise(CXLRT_E_KVCORRUPT, "evict")
        if not self.claims.bury(s, &e, self.claims.take_kind(verdict), &c, "evict"):
            return False
        self.evicted += 1
        return True

    def sweep_tombstones(self):
        """Empty the tombstones no present key's probe walks through (cache lock held)."""
        cdef int rc
        with nogil:
            rc = kv_sweep(self.K)
        if rc != 0:
            self._raise(rc, "evict")
