# The writers of a KV cache, as any holder of its cache lock judges them, and the
# records that give payloads back to the allocator. kvwrite.pyx reserves, copies
# and publishes; this module decides whose claim stands and finishes what a
# crashed or stalled writer, evictor or reader left.
"""Claims, takeovers, quarantines and records of the prefix KV cache.

Claims and epochs
    store() claims a slot under the cache lock: it writes the slot's claim line
    (kvcache.pxd ``kv_claim``: node, pid, the node's incarnation, the process's
    start time, a hash of its boot id and pid namespace, the payload, and the
    epoch) and then the entry, WRITING at a new generation. The generation is
    the epoch: a takeover buries the entry (tombstone, generation + 1), so the
    writer, which re-reads its entry every tick while it copies and once more
    under the lock before it publishes, sees that the claim is gone and stops
    with :class:`ClaimLost` instead of publishing.

Progress and takeover
    While it copies (outside the lock) the writer's only shared word is the
    progress word of its own payload header (KV_PROGRESS); it advances it every
    lease / 8 of its own monotonic clock, between chunks of KV_COPY_CHUNK bytes,
    while it waits for the lock to publish, and before publishing. Any node that
    holds the cache lock and meets a WRITING entry (storing the same key, or
    evicting) judges its claim:
      - the claim is ours: keep it;
      - the writer shares our boot and pid namespace and its process is gone
        (pid and start time): take it now, and free the payload;
      - its node is detached: take it now, and free the payload;
      - otherwise, if the progress word has not changed for a whole lease on
        the judge's own monotonic clock since the judge first looked, take it
        over, and quarantine the payload. Clocks of two hosts are never
        compared. A dead writer whose node stays alive is reclaimed by any node:
        at once where its process can be looked up, within a lease of the first
        look elsewhere.

Quarantine
    A payload taken from a writer that may still run stays allocated, named by a
    KV_REC_QUARANTINE record, so a resumed writer can only scribble into memory
    no reader looks at. It goes back to the allocator when the writer is known
    to have stopped:
      - at once when the writer itself resumes and learns it lost the claim
        (it gives the payload back under the lock, then raises ClaimLost);
      - at once when a process sharing the writer's boot and pid namespace sees
        the writer's process gone (while it sees it alive, even stopped, the
        payload stays quarantined), or the writer's node is detached;
      - for a writer nobody here can look up (another host): after
        KV_QUARANTINE_LEASES (8) leases during which the writer's node was
        continuously dead or in another incarnation, timed on the releasing
        node's own monotonic clock from its first look (a crashed host must not
        hold memory forever). A writer on a live node that stalls forever keeps
        its payload until it resumes or its process is seen gone.
    The quarantine is never shorter than a lease (the takeover itself needs a
    lease of standstill). What is not covered: a whole host that stalls inside
    one chunk copy for longer than lease + 8 leases, and then resumes; it writes
    at most the rest of that chunk (KV_COPY_CHUNK bytes) before its next check.

Pins of a node that is gone
    A node's pin words are written only by that node, so only it gives its pins
    back (at close, and for its dead processes at its next attach, pin or
    eviction). Eviction and delete therefore count a node's pins only while the
    liveness module judges the node alive: a non-zero pin word of a node that is
    detached, never attached, or dead (its counter still for a lease on our
    clock) is void. The node state is read in that slow path only, and only for
    non-zero pin words; lookups and pins are unchanged. A payload evicted despite
    void pins is not freed: a record (KV_REC_TAKE, then KV_REC_QUARANTINE, its
    `where` KV_PIN_WHERE and its `start` the mask of those nodes) keeps it until
    each of them is detached or never attached, or alive again with no pin on
    the slot (its hits of the payload are released), or dead for
    KV_QUARANTINE_LEASES leases from our first look. Its header is zeroed just
    before it is freed, so a stalled reader that resumes and loads its old hit
    fails the header check (LeaseLost: the entry moved on) whatever the memory
    holds by then. When the node attaches the cache again, its PinTable gives
    back its dead processes' records (or clears its pin words: a fresh table),
    so the old pins are not counted twice; a resumed process's own stale pin on
    a reused slot holds the new block until it releases its hit (too many pins,
    never too few).

Records
    Every payload leaves an entry through a record written before the entry's
    tombstone (KV_REC_EVICT: free it; KV_REC_TAKE: quarantine it). The next lock
    holder finishes a record whose entry moved on and drops one whose entry did
    not, so a crash anywhere in an eviction or takeover neither leaks nor frees
    twice. The record is cleared just before free() is called: a crash in that
    window leaks one payload, it never frees one twice. A free() that fails (an
    owner's full remote-free queue) leaves a KV_REC_DEFERRED record, retried by
    every later store() and recover(): no exception leaves an eviction between
    the tombstone and the free.
"""

import hashlib
import os

from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset

from cxlrt.backend cimport cxl_dma_read, cxl_dma_write, cxl_observe64
from cxlrt.includes.intrin cimport CXLRT_TEST_HOOK, cxl_now_ns
from cxlrt.kvcache cimport (KV_PAYLOAD_HDR, KV_PROGRESS, KV_QUARANTINE_LEASES, KV_REC_CLAIM,
                            KV_REC_DEFERRED, KV_REC_EVICT, KV_REC_QUARANTINE, KV_REC_TAKE,
                            KV_TOMBSTONE, kv_claim, kv_entry)
from cxlrt.kvindex cimport (KV_PIN_WHERE, kv_add_occupancy, kv_bury, kv_claim_at, kv_cnode,
                            kv_complete, kv_cpid, kv_fenced, kv_free_payload, kv_gen, kv_get,
                            kv_give_back, kv_holds, kv_index, kv_kind, kv_line_ok, kv_meta,
                            kv_mix, kv_owner, kv_owner_node, kv_owner_pid, kv_payload_ok,
                            kv_pin_at, kv_read, kv_rec_clear, kv_rec_top, kv_record_at,
                            kv_retag, kv_set_key, kv_tag, kv_write, kv_zero)
from cxlrt.kvpins cimport KV_PIN_MAX
from cxlrt.layout cimport cxl_node_area, kv_payload_header
from cxlrt.liveness cimport (CXL_LIVE_ALIVE, CXL_LIVE_DEAD, CXL_LIVE_DETACHED,
                             CXL_LIVE_MAX_NODES, CXL_LIVE_NEVER, cxl_node_state)
from cxlrt.region cimport Region
from cxlrt.status cimport CXLRT_E_FENCED, CXLRT_E_KVCORRUPT, CXLRT_E_KVPINS

from cxlrt.liveness import boot_id, pid_namespace, process_alive, process_start

cdef cxl_node_area _na
cdef uint64_t NODE_INCARNATION = <char*>&_na.incarnation - <char*>&_na  # offsetof

_WHERE = [0, 0]  # [pid, hash of (boot id, pid namespace)] for this process


def _where_hash():
    """64-bit name of this process's boot and pid namespace: a writer whose claim
    carries ours can be looked up by pid from here. Never KV_PIN_WHERE by chance."""
    pid = os.getpid()
    if _WHERE[0] != pid:
        raw = boot_id() + pid_namespace().to_bytes(8, "little")
        _WHERE[1] = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") or 1
        _WHERE[0] = pid
    return _WHERE[1]


cdef object _kv_detail(Region region, const kv_index* K, int rc):
    """What this cache knows of status `rc`, beyond status.pyx's own words (or None)."""
    if rc == CXLRT_E_FENCED:
        return (f"this process was silent for longer than the {region.lease_ms / 1000.0:g} s "
                "lease while it held the cache lock; another node may hold it now, so "
                "nothing more was written")
    if rc == CXLRT_E_KVCORRUPT:
        return (f"slot {K.bad_slot} holds an entry or payload that cannot be right "
                "(corrupt region; run `cxlrt check`)")
    if rc == CXLRT_E_KVPINS:
        return f"this node holds {KV_PIN_MAX} pins on one block; release hits"
    return None


cdef int kv_raise(Region region, str name, const kv_index* K, int rc, str what) except -1:
    """Raise what status `rc` means (status.pyx), told with what cache `name` knows."""
    return region._rc(rc, f"KV cache {name!r}: {what}", 0, 0, _kv_detail(region, K, rc))


# The claims this process's stores are writing now, by (region uuid, cache, our tag, slot,
# generation), across its instances of a cache and its threads. A claim that names us
# but is not here was left by a store of ours that failed and could not bury it (the
# medium kept failing): nobody writes it, so the next store takes it over at once
# instead of skipping its key as being written for as long as we live.
_WRITING = {}


cdef class Claims:
    """The claims and records of one attached cache (see the module docstring)."""

    def __cinit__(self, Region region, str name):
        self.region = region
        self.name = name
        self.lease_ns = <uint64_t>region.lease_ms * 1000000
        self._seen = {}
        self._doomed = {}

    cdef int io(self, int rc, str what) except -1:
        if rc != 0:
            kv_raise(self.region, self.name, self.K, rc, what)
        return 0

    cdef int shrink(self) except -1:
        """One block fewer in the counters line."""
        return self.io(kv_add_occupancy(self.K, -1, -<long long>self.K.block_bytes), "counters")

    # --- identity -----------------------------------------------------------------------

    cdef int ident(self) except -1:
        """This process as a claim names it (recomputed after a fork)."""
        cdef int pid = os.getpid()
        if self.id_pid == pid:
            return 0
        live = self.region.liveness
        self.id_tag = kv_tag(0, self.K.node, <uint64_t>pid)
        self.id_owner = kv_owner(self.K.node, <uint64_t>pid)
        self.id_inc = live.incarnation if live is not None else 0
        self.id_start = process_start(pid)
        self.id_where = _where_hash()
        self.id_pid = pid
        return 0

    cdef void fill(self, kv_claim* c, uint64_t s, uint64_t gen, uint64_t off) noexcept nogil:
        """Our claim of slot s's payload `off` at epoch `gen` (after ident())."""
        memset(c, 0, sizeof(kv_claim))  # a field the literal misses stays 0 (Cython only warns)
        c[0] = kv_claim(tag=self.id_tag | KV_REC_CLAIM, off=off, epoch=gen, slot=s,
                        inc=self.id_inc, start=self.id_start, where=self.id_where, check=0)
        c.check = kv_mix(c)

    cdef tuple _key(self, uint64_t s, uint64_t gen):
        # The region's format id, not its spec: two Regions of one node in a process may
        # name the same region by different strings and must find each other's claims.
        return (self.region.uuid, self.name, self.id_tag, s, gen)

    def writing(self, list reserved, int d):
        """Count the claims of `reserved` ((slot, gen, off, index)) as being written by a
        store of ours (d = 1, under the cache lock, before anyone may judge them), or
        no longer (d = -1, once the store has published or given them back)."""
        for s, gen, off, j in reserved:
            k = self._key(s, gen)
            n = _WRITING.get(k, 0) + d
            if n > 0:
                _WRITING[k] = n
            else:
                _WRITING.pop(k, None)

    cdef bint _is_me(self, const kv_claim* c) noexcept:
        return (kv_retag(c.tag, 0) == self.id_tag and c.start == self.id_start
                and c.where == self.id_where)

    cdef uint64_t _node_inc(self, uint32_t node) except? 0xffffffffffffffff:
        """Node `node`'s current incarnation (its area's word 2)."""
        cdef uint64_t at = self.region.node_area(node) + NODE_INCARNATION, v = 0
        cdef int rc = cxl_observe64(self.K.r, at, &v)
        self.io(rc, "node area")
        return v

    # --- judging a writer ------------------------------------------------------------------

    cdef int claim_of(self, uint64_t s, const kv_entry* e, kv_claim* c) except -1:
        """Entry s's claim line if it is the claim of this entry (1); else (0) a claim
        made up from the entry's owner word, whose identity nobody can check."""
        self.io(kv_get(self.K, kv_claim_at(self.K, s), c), "claims")
        if (kv_line_ok(c) and kv_kind(c) == KV_REC_CLAIM and c.epoch == kv_gen(e)
                and c.off == e.off and c.slot == s):
            return 1
        memset(c, 0, sizeof(kv_claim))
        c.tag = kv_tag(KV_REC_CLAIM, kv_owner_node(e.owner), kv_owner_pid(e.owner))
        c.off = e.off
        c.epoch = kv_gen(e)
        c.slot = s
        return 0

    cdef int judge(self, uint64_t s, kv_entry* e, kv_claim* c) except -1:
        """Decide a WRITING entry's claim: 0 keep it, 1 take it over and quarantine
        its payload, 2 take it over and free its payload (its writer certainly
        stopped). `c` receives the claim."""
        cdef uint64_t v = 0, now
        cdef int st, rc
        if self.claim_of(s, e, c):
            if self._is_me(c):
                # Ours: a store of ours is writing it, or one that failed left it.
                return 0 if self._key(s, kv_gen(e)) in _WRITING else 2
            if (not CXLRT_TEST_HOOK(self.foreign) and c.where == self.id_where
                    and not process_alive(kv_cpid(c), c.start)):
                return 2
            with nogil:
                st = cxl_node_state(self.K.L.live, kv_cnode(c))
            if st == CXL_LIVE_DETACHED:
                return 2
        if not kv_payload_ok(self.K, e):
            self.K.bad_slot = s
            self.io(CXLRT_E_KVCORRUPT, "store")
        with nogil:
            rc = cxl_dma_read(self.K.r, e.off + KV_PROGRESS, &v, sizeof(v))
        self.io(rc, "store")
        now = cxl_now_ns()
        key = (s, kv_gen(e))
        seen = self._seen.get(key)
        if seen is None or seen[0] != v:
            if len(self._seen) > 2 * self.K.slots + 64:
                self._seen.clear()
            self._seen[key] = (v, now)  # first look, or it moved: a lease from now
            return 0
        return 1 if now - <uint64_t>seen[1] >= self.lease_ns else 0

    cdef uint32_t take_kind(self, int verdict) noexcept:
        """How a taken-over payload leaves: quarantined unless its writer surely stopped."""
        if verdict == 1 and not CXLRT_TEST_HOOK(self.K.no_quarantine):
            return KV_REC_TAKE
        return KV_REC_EVICT

    # --- burying ---------------------------------------------------------------------------

    cdef int bury(self, uint64_t s, kv_entry* e, uint32_t kind, const kv_claim* who,
                  str what) except -1:
        """kv_bury for one entry, with its occupancy: 1 when buried, 0 when no record
        line is free (nothing changed)."""
        cdef int rc, buried = 0
        with nogil:
            rc = kv_bury(self.K, s, e, kind, who, &buried)
        self.io(rc, what)
        if buried:
            self.shrink()
        return buried

    cdef int bury_unrecorded(self, uint64_t s, kv_entry* e) except -1:
        """Our own claim, when no record line is free: tombstone, then free (a crash
        between the two leaks this payload)."""
        cdef uint64_t off = e.off
        cdef int rc
        kv_set_key(e, NULL)
        e.meta = kv_meta(kv_gen(e) + 1, KV_TOMBSTONE)
        e.off = e.len = e.owner = 0
        with nogil:
            rc = kv_write(self.K, s, e)
        self.io(rc, "store")
        self.free_payload(off)
        return self.shrink()

    # --- records ---------------------------------------------------------------------------

    cdef uint64_t rec_top(self) except? 0xffffffffffffffff:
        cdef uint64_t top = 0
        self.io(kv_rec_top(self.K, &top), "records")
        return top

    cdef int rec_get(self, uint64_t i, kv_claim* c) except -1:
        return self.io(kv_get(self.K, kv_record_at(self.K, i), c), "records")

    cdef int free_payload(self, uint64_t off) except -1:
        return self.io(kv_free_payload(self.K, off), "free")

    cdef int settle(self) except -1:
        """Finish what the records describe: drop an eviction or takeover whose
        tombstone never came, finish one whose entry moved on, release quarantines
        whose writer has stopped, retry deferred frees."""
        cdef kv_claim c
        cdef kv_entry e
        cdef uint64_t i
        cdef uint32_t kind
        cdef int rc
        for i in range(self.rec_top()):
            self.rec_get(i, &c)
            if kv_zero(&c):
                continue
            kind = kv_kind(&c)
            if not kv_line_ok(&c) or kind < KV_REC_EVICT or kind > KV_REC_DEFERRED:
                self.io(kv_rec_clear(self.K, i), "records")  # torn by a crash: forget it
                continue                                      # (may leak one payload)
            if kind == KV_REC_EVICT or kind == KV_REC_TAKE:
                if c.slot >= self.K.slots:
                    self.io(kv_rec_clear(self.K, i), "records")
                    continue
                with nogil:
                    rc = kv_read(self.K, c.slot, &e)
                self.io(rc, "records")
                if kv_gen(&e) == c.epoch and e.off == c.off and kv_holds(&e):
                    # the tombstone never came: the entry still holds it
                    self.io(kv_rec_clear(self.K, i), "records")
                else:
                    self.io(kv_complete(self.K, i, &c), "records")
                    self.shrink()
            elif kind == KV_REC_QUARANTINE:
                if self._released(i, &c):
                    if c.where == KV_PIN_WHERE:
                        self._wipe_header(c.off)
                    self.io(kv_give_back(self.K, i, c.off), "records")
            else:
                self.io(kv_give_back(self.K, i, c.off), "records")
        return 0

    cdef int ack(self, uint64_t off, uint64_t gen) except -1:
        """We stopped writing a payload another node took from us: give it back.
        Only if a record still names it (else it was released and may be reused);
        never one kept for void pins (readers, not a writer, may still use it)."""
        cdef kv_claim c
        cdef uint64_t i
        cdef uint32_t kind
        for i in range(self.rec_top()):
            self.rec_get(i, &c)
            kind = kv_kind(&c)
            if (kv_line_ok(&c) and (kind == KV_REC_QUARANTINE or kind == KV_REC_TAKE)
                    and c.off == off and c.epoch == gen and c.where != KV_PIN_WHERE):
                if kind == KV_REC_TAKE:
                    self.shrink()
                return self.io(kv_give_back(self.K, i, off), "records")
        return 0

    cdef bint _released(self, uint64_t i, const kv_claim* c) except -1:
        """Whether a quarantined payload's writer is known to have stopped (module
        docstring, "Quarantine")."""
        cdef uint32_t node = kv_cnode(c)
        cdef int st
        key = (i, c.off, c.epoch)
        if node >= self.K.nodes:
            return True
        if c.where == KV_PIN_WHERE:
            return self._pins_released(key, c)
        if c.where == _where_hash() and not CXLRT_TEST_HOOK(self.foreign):  # its process decides
            if process_alive(kv_cpid(c), c.start):
                return False  # alive, maybe stopped: it may resume, so it keeps the memory
            self._doomed.pop(key, None)
            return True
        with nogil:
            st = cxl_node_state(self.K.L.live, node)
        if st == CXL_LIVE_DETACHED or st == CXL_LIVE_NEVER:
            self._doomed.pop(key, None)
            return True
        if st == CXL_LIVE_DEAD or self._node_inc(node) != c.inc:
            return self._dead_long_enough(key)
        self._doomed.pop(key, None)
        return False

    cdef bint _pins_released(self, object key, const kv_claim* c) except -1:
        """Whether no node whose void pins let payload `c` go can still read it through
        a hit: each is detached or never attached; or alive with no pin left on the
        slot (its hits of the payload are released; a later pin there is on another
        payload); or, for those still dead, dead on our clock for KV_QUARANTINE_LEASES
        leases from our first look (a dead host must not hold memory for ever; a
        stalled one that resumes then fails its load's header check)."""
        cdef uint64_t mask = c.start, w = 0, at
        cdef uint32_t j
        cdef int st, rc
        cdef bint dead = False
        for j in range(min(self.K.nodes, <uint64_t>CXL_LIVE_MAX_NODES)):
            if not (mask >> j) & 1:
                continue
            with nogil:
                st = cxl_node_state(self.K.L.live, j)
            if st == CXL_LIVE_DETACHED or st == CXL_LIVE_NEVER:
                continue
            if st == CXL_LIVE_ALIVE:
                if c.slot < self.K.slots:
                    at = kv_pin_at(self.K, j, c.slot)
                    with nogil:
                        rc = cxl_observe64(self.K.r, at, &w)
                    self.io(rc, "records")
                    if w & KV_PIN_MAX:
                        self._doomed.pop(key, None)  # back and pinning: not dead throughout
                        return False
                continue
            dead = True
        if not dead:
            self._doomed.pop(key, None)
            return True
        return self._dead_long_enough(key)

    cdef bint _dead_long_enough(self, object key) except -1:
        """True once `key`'s owner has been judged dead for KV_QUARANTINE_LEASES leases,
        timed from our first look (our clock: a resumed stall may still write until then)."""
        cdef uint64_t now = cxl_now_ns()
        if len(self._doomed) > 4 * self.K.nrec:
            self._doomed.clear()
        since = self._doomed.setdefault(key, now)
        if now - <uint64_t>since >= KV_QUARANTINE_LEASES * self.lease_ns:
            self._doomed.pop(key, None)
            return True
        return False

    cdef int _wipe_header(self, uint64_t off) except -1:
        """Zero a quarantined payload's header before it is freed: a stale hit's load
        that checks it after this fails, whatever the memory is reused for."""
        cdef kv_payload_header h
        cdef int rc
        if kv_fenced(self.K):
            self.io(CXLRT_E_FENCED, "free")
        if off % 64 or off < self.K.heap_lo or off + KV_PAYLOAD_HDR > self.K.heap_hi:
            return 0  # not a payload offset (a corrupt record): nothing to wipe
        memset(&h, 0, sizeof(h))
        with nogil:
            rc = cxl_dma_write(self.K.r, off, &h, sizeof(h))
        return self.io(rc, "free")
