# Prefix KV cache (TraCT's rack-wide prefix cache): lookups and pins without the
# global lock, stores that copy payloads outside it, LRU eviction of unpinned
# blocks. Layout and invariants: kvcache.pxd. This file is the Python API, the
# lookups and the loads; kvwrite.pyx stores (reserve, copy, publish, evict),
# kvclaim.pyx judges writers and settles records, kvformat.pyx creates and checks
# the object, kvindex.pyx is the C index, kvevict.pyx the eviction pass,
# kvpins.pyx the pins, kvinspect.py read-only inspection.
"""The prefix KV cache.

Stores
    store() claims its slots under the cache lock (a claim line, then the entry
    WRITING at a new generation), copies the payloads with no lock held while it
    advances their progress words, and publishes them under the lock
    (:mod:`cxlrt.kvwrite`). How other nodes judge a writer that stalls or dies,
    and how its payloads go back to the allocator after any crash:
    :mod:`cxlrt.kvclaim`.

Loads
    A load checks the payload header (key, generation, geometry) before and
    after the copy, so it never returns bytes that are not the stored block.
    Lookups and loads do no fencing work of their own.
"""
cimport cython
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize,
                            PyBytes_GET_SIZE)
from cpython.object cimport PyObject
from cpython.sequence cimport (PySequence_Fast, PySequence_Fast_GET_SIZE,
                               PySequence_Fast_ITEMS)
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_MAPPABLE, CXL_F_DIRECT, CXL_F_NOFLUSH,
                            cxl_dma_read, cxl_fence, cxl_flush, cxl_flush_nodrain, cxl_load,
                            cxl_observe, cxl_observe64, cxl_observe_gather64, cxl_region,
                            cxl_store)
from cxlrt.alloc cimport Allocator
from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
from cxlrt.includes.intrin cimport CXLRT_DEBUG, cxl_pid, cxl_prefetch, unlikely
from cxlrt.kvclaim cimport Claims, kv_raise
from cxlrt.kvformat cimport kv_attach
from cxlrt.kvindex cimport (KV_PAYLOAD_MAGIC, kv_cnode, kv_cpid, kv_entry_at, kv_gen,
                            kv_get_counters, kv_index, kv_kind, kv_line_ok, kv_meta,
                            kv_mix, kv_owner_node, kv_owner_pid, kv_payload_ok, kv_probe,
                            kv_probe_from, kv_read, kv_same_key, kv_state, kv_stats_at, kv_zero)
from cxlrt.kvpins cimport KV_PIN_MAX, PIN_BATCH, PinTable, kv_repeats
from cxlrt.kvwrite cimport Writer
from cxlrt.layout cimport kv_counters, kv_geometry, kv_header, kv_payload_header
from cxlrt.lock cimport LockService, cxl_lockctx
from cxlrt.region cimport Region
from cxlrt.status cimport CXLRT_E_CLOSED, CXLRT_E_KVCORRUPT, CXLRT_E_KVPINS


import hashlib
import os
import time

from cxlrt.errors import (ClaimLost, DebugBuildRequired, LeaseLost, RegionClosedError,
                          StagingError)
from cxlrt.hashing import ALGORITHMS, KEY_BYTES, block_hashes, salt_digest
# the object format's public names, importable from here as before the split
from cxlrt.kvformat import DIR_PREFIX, FORMAT_MAGIC, FORMAT_VERSION, header_checksum

cdef extern from "Python.h":  # on a borrowed pointer: no reference count touched
    bint _bytes_exact "PyBytes_CheckExact"(PyObject* o) noexcept
    Py_ssize_t _bytes_size "PyBytes_GET_SIZE"(PyObject* o) noexcept
    const char* _bytes_chars "PyBytes_AS_STRING"(PyObject* o) noexcept

cdef int* _armed = cxl_crash_armed_ptr()
cdef enum:
    HOME_BATCH = 8  # home lines a lookup observes, and checks, together
    SMALL_HIT = 32  # keys a Hit's spare allocation (_spares) holds
    # A lookup or release of at most this many keys on a direct mapping runs with the
    # GIL held (about 2 us at most): dropping and taking the GIL back cost 7 % of a
    # 32-block lookup and 23 % of a 1-block one. It only tries the pin mutex there;
    # busy, it starts again without the GIL, so a thread that holds the pin mutex
    # never waits for the GIL (Hit.__dealloc__ relies on that, see _try_unpin).
    GIL_HELD_KEYS = 64
    PIN_BUSY = 1  # _lookup, _unpin with wait=False: the pin mutex was not free, nothing done
    AT_HOME = 0x7fffffff  # _probe_homes: the key is in its home line (no walk)

cdef kv_entry _proto
# offsetof by address difference (Cython has no offsetof): the enum constants of
# kvcache.pxd must name the fields of layout.pxd's structs.
cdef kv_stats _ks
if (sizeof(kv_stats) != KV_ST_WORDS * sizeof(uint64_t)
        or <char*>&_ks.evictions - <char*>&_ks != KV_ST_EVICTIONS * sizeof(uint64_t)
        or <char*>&_ks.bytes_loaded - <char*>&_ks != KV_ST_BYTES_LOADED * sizeof(uint64_t)):
    raise ImportError("cxlrt.kvcache: kv_stats and the KV_ST_* word numbers disagree")
cdef kv_payload_header _kp
if (KV_HEADER != sizeof(kv_header) or KV_PAYLOAD_HDR != sizeof(kv_payload_header)
        or KV_PROGRESS != <char*>&_kp.progress - <char*>&_kp):
    raise ImportError("cxlrt.kvcache: KV_HEADER/KV_PAYLOAD_HDR/KV_PROGRESS disagree with "
                      "the structs of layout.pxd")
if (<char*>&_proto.meta - <char*>&_proto != KV_ENTRY_META or sizeof(kv_entry) != 64
        or KV_KEY_BYTES != KEY_BYTES):
    raise ImportError("cxlrt.kvcache: kv_entry layout and KV_ENTRY_META/KV_KEY_BYTES disagree")


STATE_NAMES = {KV_EMPTY: "empty", KV_WRITING: "writing", KV_READY: "ready",
               KV_TOMBSTONE: "tombstone", KV_EVICTING: "evicting"}


cdef dict _stats_dict(const kv_stats* ks):
    return ks[0]  # Cython makes a dict of a struct's fields, in declaration order


STAT_NAMES = tuple(_stats_dict(&_ks))  # the fields of kv_stats (kvcache.pxd)
RECORD_NAMES = {KV_REC_EVICT: "evicting", KV_REC_TAKE: "taking over",
                KV_REC_QUARANTINE: "quarantined", KV_REC_DEFERRED: "deferred"}
QUARANTINE_LEASES = KV_QUARANTINE_LEASES
COPY_CHUNK = KV_COPY_CHUNK


# --- the cache ----------------------------------------------------------------------

cdef class KVCache:
    """A prefix-aware KV block cache shared by every node of a region.

    ``KVCache(region, name, *, block_bytes, capacity_blocks, block_tokens=16,
    algorithm="blake2b", salt=b"", create=True)`` creates the cache or attaches
    to it by name. Keys are :meth:`block_hashes` of token ids; a lookup returns
    the leading run of keys that are cached, pinned against eviction until the
    :class:`Hit` is released. Crashes and stalls: :mod:`cxlrt.kvclaim`.
    """

    cdef const cxl_region* r
    cdef cxl_lockctx* L
    cdef LockService _locks              # keeps L alive
    cdef Allocator _heap                 # payloads are freed through its C entry point
    cdef readonly Region region
    cdef readonly str name
    cdef readonly uint64_t offset        # the cache object in the region
    cdef readonly uint64_t block_bytes
    cdef readonly uint64_t capacity      # blocks held at most
    cdef readonly uint64_t slots         # hash-table slots (a power of two)
    cdef readonly uint32_t block_tokens
    cdef readonly str algorithm
    cdef readonly bytes salt_digest
    cdef object _salt
    cdef uint32_t _pin_lock              # its node-local mutex guards our pins and stats
    cdef kv_index K                      # what the C layer (kvindex, kvevict) works on
    cdef kv_geometry G                   # its geometry line (kvformat.pyx)
    cdef bint _closed
    cdef PinTable _pt                    # our node's pins, and which process holds them
    cdef Claims _claims                  # its writers' claims and the records (kvclaim.pyx)
    cdef Writer _w                       # its stores and the eviction they need (kvwrite.pyx)
    cdef uint64_t _pend[KV_ST_WORDS]     # counters not yet in the region (see _pending)
    cdef int _pend_pid                   # the process they belong to
    cdef list _orphans                   # slot arrays of hits dropped unreleased (bytes)
    cdef int _orphans_pid                # the process whose pins those are
    cdef object __weakref__              # Region._closing holds us weakly

    def __init__(self, Region region not None, str name not None, *, block_bytes=None,
                 capacity_blocks=None, block_tokens=16, algorithm="blake2b", salt=b"",
                 create=True):
        for what, v in (("block_bytes", block_bytes), ("capacity_blocks", capacity_blocks),
                        ("block_tokens", block_tokens)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        if block_tokens is None or block_tokens >= 1 << 32:
            raise ValueError(f"block_tokens must be a positive int below 2**32, "
                             f"got {block_tokens!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
        raw = name.encode("utf-8", "surrogatepass")
        if not 1 <= len(raw) <= 48:
            raise ValueError(f"KV cache names are 1..48 bytes of UTF-8, got {name!r:.60}")
        self._closed = True  # until attached: close() and __dealloc__ have nothing to do
        self.region = region
        self.r = region.backend.region()
        self.K.r = self.r
        self.name = name
        self.block_tokens = block_tokens
        self.algorithm = algorithm
        self._salt = salt
        self.salt_digest = salt_digest(salt, algorithm)
        self.K.nodes = region.nodes
        self.K.node = region.node
        self.K.heap_lo, heap_len = region.heap
        self.K.heap_hi = self.K.heap_lo + heap_len
        self._claims = Claims(region, name)
        self._claims.K = &self.K
        self._orphans = []
        self._orphans_pid = cxl_pid()
        self._pend_pid = cxl_pid()
        tag = name if len(raw) <= 36 else hashlib.blake2b(raw, digest_size=8).hexdigest()
        lock = region.lock(f"kv:{tag}")  # the cache lock: entries, claims, records, counters
        self._pin_lock = region.lock(f"kvp:{tag}").index
        self._locks = region.locks
        self.L = &self._locks.L
        self.K.L = self.L
        self._heap = region._allocator
        self.K.A = &self._heap.A
        memset(&self.G, 0, sizeof(kv_geometry))
        self.G.key_bytes = KEY_BYTES
        self.G.block_tokens = block_tokens
        self.G.algorithm = ALGORITHMS[algorithm]
        memcpy(self.G.salt_digest, PyBytes_AS_STRING(self.salt_digest),
               sizeof(self.G.salt_digest))
        kv_attach(region, name, &self.K, &self.G, create, block_bytes, capacity_blocks)
        self.block_bytes, self.capacity = self.G.block_bytes, self.G.capacity
        self.slots, self.offset = self.G.slots, self.K.offset
        from cxlrt.nodelocal import local_dir
        path = os.path.join(local_dir(), f"cxlrt-{region.uuid:016x}-node{self.K.node}"
                                         f"-kv{self.offset:x}.pins")
        self._pt = PinTable(region, self._locks, self._pin_lock, self.K.pins, self.slots, path)
        self._w = Writer(region, name, self._claims, lock, self._pt, self.capacity)
        self._closed = False
        region._closing.add(self)  # closed (counters published, pins given back) before the region
        self._pt.recover()  # a restarted worker heals what its dead predecessor pinned

    # --- entries ------------------------------------------------------------------------

    cdef int _io(self, int rc, str what) except -1:
        if rc != 0:
            self._raise(rc, what)
        return 0

    # --- counters (line 2, cache lock held) -----------------------------------------------

    # --- pins ------------------------------------------------------------------------------

    def recover(self):
        """Give back what dead or stalled owners left; returns the pins given back.

        Gives back pins held by this node's dead processes (a node's pins are
        written only by the node itself, so each node heals its own; this also
        runs at attach, at a process's first pin, and when eviction finds nothing
        to evict; meanwhile eviction treats the pins of a gone node as void).
        Then, under the cache lock, finishes interrupted evictions, releases
        quarantined payloads whose writer has stopped, and retries frees that
        failed (store() does the same).
        """
        self._need_open()
        n = self._pt.recover()
        self._claims.ident()
        self._w.hold(None)
        try:
            self._claims.settle()
        finally:
            self._w.release_quietly()
        return n

    cdef int _stat_add(self, uint64_t* d) noexcept nogil:
        """Add d[0..KV_ST_WORDS) to our node's stats line (pin mutex held), and zero d
        once the store is issued, whatever the medium then reports: the caller adds d
        back to the pending counters, so a counter is published at most once (lost,
        never doubled, where a failing medium kept the store)."""
        cdef uint64_t at = kv_stats_at(&self.K, self.K.node), any = 0
        cdef uint64_t w[KV_ST_WORDS]
        cdef int rc, i
        for i in range(KV_ST_WORDS):
            any |= d[i]
        if any == 0:  # a pin pass right after a release usually has nothing to add
            return 0
        rc = cxl_load(self.r, at, w, sizeof(kv_stats))
        if rc != 0:
            return rc
        for i in range(KV_ST_WORDS):
            w[i] += d[i]
        memset(d, 0, KV_ST_WORDS * sizeof(uint64_t))
        rc = cxl_store(self.r, at, w, sizeof(kv_stats))
        if rc == 0:
            rc = cxl_flush_nodrain(self.r, at, sizeof(kv_stats))
        return rc

    cdef int _stats_locked(self, uint64_t* d) noexcept nogil:
        cdef int rc = self._pt.enter()
        if rc != 0:
            return rc
        rc = self._stat_add(d)
        if rc == 0:
            rc = cxl_fence(self.r)
        self._pt.leave()
        return rc

    cdef int _raise(self, int rc, str what) except -1:
        return kv_raise(self.region, self.name, &self.K, rc, what)

    cdef void _need_open(self) except *:
        if self._closed:
            raise ValueError(f"KV cache {self.name!r} is closed")
        if self.r.closed:
            self.region._rc(CXLRT_E_CLOSED, "KV cache", 0, 0)
        if self._orphans:
            self._reap()

    cdef void _need_hit(self, Hit hit) except *:
        """An open cache, and a hit of it whose pins still hold its blocks."""
        self._need_open()
        if hit.cache is not self:
            raise ValueError("this Hit came from another KV cache")
        if hit.released:
            raise ValueError("this Hit was released: its blocks may be gone")

    # --- hits dropped without release() ------------------------------------------------
    # Hit.__dealloc__ may run anywhere the GIL is held, also while another thread of
    # this process holds the pin mutex and waits for the GIL: it must not wait for the
    # mutex. It gives its pins back if the mutex is free this instant (_try_unpin),
    # else leaves its slots here: the next call of this cache, close(), or the
    # cache's own __dealloc__ (again only if the mutex is free) gives them back. Until
    # then they pin their blocks: too many pins, never too few. Pins still here when
    # the cache goes stay in this process's pin-table record, which its next attach
    # of the cache, or the node's other processes once it exits, give back.

    cdef int _try_unpin(self, const uint64_t* slots, uint64_t n, bint* held) noexcept nogil:
        """_unpin if the pin mutex is free this instant and needs no repair (that is
        long, and the GIL is held here): -EBUSY if not (see _unpin)."""
        cdef int rc = self._pt.try_enter_clean()
        held[0] = rc != 0
        if rc != 0:
            return rc
        rc = self._pt.add_locked(slots, n, -1)
        self._pt.leave()
        return rc

    cdef void _orphan(self, const uint64_t* slots, uint64_t n) noexcept:
        if self._orphans_pid != cxl_pid():  # a forked child: those are its parent's
            self._orphans = []
            self._orphans_pid = cxl_pid()
        try:
            self._orphans.append(
                PyBytes_FromStringAndSize(<const char*>slots, n * sizeof(uint64_t)))
        except MemoryError:
            pass  # they stay pinned until close() gives every pin of ours back

    cdef int _reap(self) except -1:
        cdef bytes b
        cdef int rc
        cdef bint held = False
        cdef const uint64_t* slots
        cdef uint64_t n
        if self._orphans_pid != cxl_pid():
            self._orphans = []
            self._orphans_pid = cxl_pid()
            return 0
        while self._orphans:
            b = self._orphans.pop()
            slots = <const uint64_t*>PyBytes_AS_STRING(b)
            n = <uint64_t>PyBytes_GET_SIZE(b) // sizeof(uint64_t)
            with nogil:
                rc = self._unpin(slots, n, NULL, &held, True)
            if rc != 0:
                if held:  # nothing given back: the next call tries again
                    self._orphans.append(b)
                self._raise(rc, "release")
        return 0

    # --- keys ------------------------------------------------------------------------------

    def block_hashes(self, tokens, *, parent=None):
        """Keys of `tokens` under this cache's scheme (block_tokens, salt, algorithm)."""
        return block_hashes(tokens, self.block_tokens, salt=self._salt, parent=parent,
                            algorithm=self.algorithm)

    # --- lookup ----------------------------------------------------------------------------

    def lookup(self, keys):
        """Pin the leading run of `keys` that are cached and ready; returns a Hit.

        Takes no global lock: entries are read as consistent snapshots and pins
        are this node's own counters. ``len(hit)`` blocks are pinned until
        ``hit.release()`` or the end of a ``with`` block.
        """
        self._need_open()
        cdef int pid = cxl_pid()  # cached, reset at fork: getpid() is a system call
        if self._pt._rec < 0 or self._pt._rec_pid != pid:
            self._pt.claim()
        cdef Hit hit = Hit.__new__(Hit)
        hit._fill(keys)
        hit.cache = self
        hit.owner_pid = pid
        cdef uint64_t n = hit.n, m = 0, stuck = 0
        cdef uint64_t st[KV_ST_WORDS]
        cdef int rc, rc2 = 0
        self._take_pending(st)  # rides on the pin pass, if there is one
        self.region._busy += 1  # Region.close() refuses while we run without the GIL
        try:
            rc = PIN_BUSY
            if n <= GIL_HELD_KEYS and (self.r.flags & CXL_F_DIRECT):
                rc = self._lookup(hit, st, &m, &stuck, False)
            if rc == PIN_BUSY:
                with nogil:
                    rc = self._lookup(hit, st, &m, &stuck, True)
            if stuck:  # pins on entries that changed: off now, waiting for the mutex
                with nogil:
                    rc2 = self._pt.enter()
                    if rc2 == 0:
                        self._pt.add_locked(hit.slots + m, stuck, -1)  # off, whatever rc
                        self._pt.leave()
                if rc2 == 0:
                    stuck = 0
        finally:
            self.region._busy -= 1
        if stuck:
            self._orphan(hit.slots + m, stuck)  # the cache's next call gives them back
        hit.n = m
        self._add_pending(st)  # what no pin pass published (zeroed where one did)
        cdef uint64_t* pend = self._pending()
        pend[KV_ST_LOOKUPS] += 1
        pend[KV_ST_HITS] += m
        pend[KV_ST_MISSES] += n - m
        if rc != 0:
            self._raise(rc, "lookup")
        return hit

    cdef int _pins_held(self, const uint64_t* slots, const uint64_t* gens, uint64_t m,
                          uint64_t* keep) noexcept nogil:
        """_lookup's second look at the pinned entries' state words, PIN_BATCH of them
        at a time in one gather; *keep: how many lead the hit unchanged."""
        cdef uint64_t offs[PIN_BATCH]
        cdef uint64_t w[PIN_BATCH]
        cdef uint64_t base = 0, j, k
        cdef int rc
        while base < m:
            k = m - base if m - base < PIN_BATCH else PIN_BATCH
            for j in range(k):
                offs[j] = kv_entry_at(&self.K, slots[base + j]) + KV_ENTRY_META
            if kv_repeats(slots + base, k):
                # A block named twice: its second load would hit the copy the first
                # filled, not one observed after the fence. One word at a time.
                rc = 0
                for j in range(k):
                    if rc == 0:
                        rc = cxl_observe64(self.r, offs[j], &w[j])
            else:
                rc = cxl_observe_gather64(self.r, <uint32_t>k, offs, w)
            if rc != 0:
                return rc
            for j in range(k):
                if w[j] != kv_meta(gens[base + j], KV_READY):
                    keep[0] = base + j
                    return 0
            base += k
        keep[0] = m
        return 0

    cdef int _probe_homes(self, Hit hit, uint64_t* out) noexcept nogil:
        """_lookup's probe off a direct mapping: the leading ready run of hit's keys
        (*out of them) into hit.slots/gens/offs. A key's entry is most often in its
        home line, so HOME_BATCH home lines are observed first and their check words
        computed in one loop: the seven dependent multiplies of one line's check
        overlap the other lines' instead of waiting for the last key's. A key that is
        not whole and ready at home walks on in kv_probe_from: past a line that holds
        another key or a tombstone from the next slot, else (a torn, corrupt or all
        zero line) from the home slot, which it reads again and judges.
        (Tried: walking the displaced keys in rounds the same way; it was slower.)"""
        cdef kv_entry lines[HOME_BATCH]
        cdef uint64_t mix[HOME_BATCH]
        cdef uint64_t home[HOME_BATCH]
        cdef uint64_t base = 0, k, i, h, s = 0, free_slot, m = 0, first
        cdef uint32_t st
        cdef kv_entry* e
        cdef kv_entry walked
        cdef int rc, found
        out[0] = 0
        while base < hit.n:
            k = hit.n - base if hit.n - base < HOME_BATCH else HOME_BATCH
            for i in range(k):
                memcpy(&h, hit.key(base + i), 8)
                home[i] = h & self.K.mask
                rc = cxl_observe(self.r, kv_entry_at(&self.K, home[i]), &lines[i],
                                 sizeof(kv_entry))
                if rc != 0:
                    return rc
            for i in range(k):
                mix[i] = kv_mix(&lines[i])
            for i in range(k):
                e = &lines[i]
                s = home[i]
                st = kv_state(e)
                if e.check != mix[i] or st > KV_EVICTING:
                    first = 0  # torn (or all zero: then empty) or corrupt: kv_probe judges
                elif st == KV_EMPTY:
                    return 0
                elif st != KV_TOMBSTONE and kv_same_key(e, hit.key(base + i)):
                    first = AT_HOME
                else:
                    first = 1  # kv_probe's first step, taken here
                if first != AT_HOME:
                    found = kv_probe_from(&self.K, hit.key(base + i), first, &s, &walked,
                                          &free_slot)
                    if found < 0:
                        return found
                    if found == 0:
                        return 0
                    e = &walked
                if kv_state(e) != KV_READY:
                    return 0
                if not kv_payload_ok(&self.K, e):
                    self.K.bad_slot = s
                    return CXLRT_E_KVCORRUPT
                hit.slots[m] = s
                hit.gens[m] = kv_gen(e)
                hit.offs[m] = e.off
                m += 1
                out[0] = m
            base += k
        return 0

    cdef int _lookup(self, Hit hit, uint64_t* st, uint64_t* out,
                     uint64_t* stuck, bint wait) noexcept nogil:
        """Probe the keys, pin the leading ready run in one pass of the pin mutex
        (with the pending counters `st`), then observe each pinned entry's state
        word once more; `out` gets how many stay pinned, `stuck` how many after them
        it pinned but could not give back (the mutex could not be taken again).
        Budget for a hit of n blocks: n probes (one line each), one mutex pass and
        one fence, n 8-byte observes; a miss of the first key takes no mutex.
        `st` is zeroed once published (_stat_add). Not `wait` (the GIL held): the mutex is only
        tried (try_enter_clean), PIN_BUSY means it was not free and nothing was pinned
        or counted, and changed entries' pins it cannot give back at once are `stuck`
        for the caller to give back without the GIL."""
        cdef kv_entry e
        cdef uint64_t j, m = 0, free_slot, s = 0, keep, want, w, h
        cdef int rc = 0, found
        out[0] = 0
        stuck[0] = 0
        if (self.r.flags & CXL_F_DIRECT) and (self.r.flags & CXL_F_NOFLUSH):
            # Every home line first, so their misses overlap (not where _read flushes
            # the line before it loads it: the prefetch would be thrown away).
            # The next line too: a key displaced by a collision (one in five at the
            # table's load of 1/2) is there.
            for j in range(hit.n):
                memcpy(&h, hit.key(j), 8)
                cxl_prefetch(self.r.base + kv_entry_at(&self.K, h & self.K.mask))
                cxl_prefetch(self.r.base + kv_entry_at(&self.K, (h + 1) & self.K.mask))
        if self.r.flags & CXL_F_DIRECT:
            rc = self._probe_homes(hit, &m)
            if rc != 0:
                return rc
        else:  # a line a request (rdma:): none read past the first miss
            for j in range(hit.n):
                found = kv_probe(&self.K, hit.key(j), &s, &e, &free_slot)
                if found < 0:
                    return found
                if found == 0 or kv_state(&e) != KV_READY:
                    break
                if not kv_payload_ok(&self.K, &e):
                    self.K.bad_slot = s
                    return CXLRT_E_KVCORRUPT
                hit.slots[m] = s
                hit.gens[m] = kv_gen(&e)
                hit.offs[m] = e.off
                m += 1
        if m == 0:
            return 0
        self._pt.prefetch(hit.slots, m)
        rc = self._pt.enter() if wait else self._pt.try_enter_clean()
        if rc != 0:
            return rc if wait else PIN_BUSY
        rc = self._stat_add(st)  # zeroes st: published
        if rc == 0:
            rc = self._pt.add_locked(hit.slots, m, 1)  # ends with a full fence
            if rc == CXLRT_E_KVPINS:  # a block pinned 65535 times by us: the hit ends there
                m = self._pt.done
                rc = 0
        self._pt.leave()
        if rc != 0:
            return rc
        if m and unlikely(_armed[0]):
            cxl_crash_hit(b"kv.pin")
        # Observe each state word after the fence (pairs with the evictor's fence
        # between marking an entry EVICTING, or giving it a new generation, and
        # reading the pins): an evictor that missed our pin has changed the word.
        # One word suffices: the offset changes only with the generation.
        keep = m
        if self.r.flags & CXL_F_DIRECT:
            for j in range(m):
                w = 0
                rc = cxl_observe64(self.r, kv_entry_at(&self.K, hit.slots[j]) + KV_ENTRY_META, &w)
                want = kv_meta(hit.gens[j], KV_READY)
                if rc != 0 or w != want:
                    keep = j
                    break
        else:
            rc = self._pins_held(hit.slots, hit.gens, m, &keep)  # one gather a batch (a request over rdma:)
        if rc != 0:
            keep = 0
        if keep < m:
            if (self._pt.enter() if wait else self._pt.try_enter_clean()) == 0:
                self._pt.add_locked(hit.slots + keep, m - keep, -1)  # comes off, whatever rc
                self._pt.leave()
            else:
                stuck[0] = m - keep
        out[0] = keep
        return rc

    cdef int _unpin(self, const uint64_t* slots, uint64_t n, uint64_t* st,
                    bint* held, bint wait) noexcept nogil:
        """Give back our pins on `slots`, publishing the pending counters `st`
        (NULL: none; zeroed once published) in the same pass of the pin mutex. Once the mutex is ours the
        pins come off whatever the medium does (our record is the truth; an error
        leaves the words for the next taker to rebuild). *held: the mutex could not be
        taken, so nothing was given back and the caller still owes these pins.
        Not `wait` (the GIL held): the mutex is only tried, and PIN_BUSY (with *held)
        means it was not free."""
        cdef int rc = self._pt.enter() if wait else self._pt.try_enter_clean(), rc2
        held[0] = rc != 0
        if rc != 0:
            return rc if wait else PIN_BUSY
        if st != NULL:
            rc = self._stat_add(st)  # flushed here, drained by add_locked's fence
        rc2 = self._pt.add_locked(slots, n, -1)
        self._pt.leave()
        return rc if rc != 0 else rc2

    # --- process-local counters ------------------------------------------------------------
    # Lookups and loads count into _pend (GIL held) instead of taking the pin mutex
    # for a counter: the next pass of the mutex (a pin, a release, a store, stats(),
    # close()) publishes them. Counters of a process that dies unpublished are lost;
    # they are statistics, never a basis for a decision.

    cdef uint64_t* _pending(self) noexcept:
        """This process's pending counters (GIL held)."""
        if self._pend_pid != cxl_pid():  # a forked child: its parent publishes those
            memset(self._pend, 0, sizeof(self._pend))
            if self._w is not None:
                self._w.evicted = 0
            self._pend_pid = cxl_pid()
        return self._pend

    cdef void _take_pending(self, uint64_t* st) noexcept:
        """Move the pending counters into `st` (GIL held)."""
        memcpy(st, self._pending(), sizeof(self._pend))
        memset(self._pend, 0, sizeof(self._pend))

    cdef void _add_pending(self, const uint64_t* st) noexcept:
        """Put counters a failed or skipped pass did not publish back (GIL held)."""
        cdef uint64_t* pend = self._pending()
        cdef int i
        for i in range(KV_ST_WORDS):
            pend[i] += st[i]

    cdef int _publish_pending(self) except -1:
        """One pass of the pin mutex that publishes the pending counters."""
        cdef uint64_t st[KV_ST_WORDS]
        cdef int rc
        self._take_pending(st)
        with nogil:
            rc = self._stats_locked(st)
        if rc != 0:
            self._add_pending(st)
            self._raise(rc, "stats")
        return 0

    # --- load ------------------------------------------------------------------------------

    cdef int _check_payload(self, Hit hit, uint64_t i) noexcept nogil:
        """The pinned payload's header must still name this key and generation."""
        cdef kv_payload_header h
        cdef int rc = cxl_dma_read(self.r, hit.offs[i], &h, sizeof(h))
        if rc != 0:
            return rc
        if h.magic != KV_PAYLOAD_MAGIC or h.generation != hit.gens[i] \
                or h.block_bytes != self.block_bytes \
                or h.cache != self.offset or memcmp(h.key, hit.key(i), KV_KEY_BYTES) != 0:
            self.K.bad_slot = hit.slots[i]
            return CXLRT_E_KVCORRUPT
        return 0

    cdef int _raise_stale(self, Hit hit, uint64_t i, int rc, str what) except -1:
        """Raise for a failed check of a hit's block i: LeaseLost when its entry no
        longer holds that payload (the pins were void: this node was judged dead or
        detached while the hit was held), else the error `rc` names."""
        cdef kv_entry e
        cdef int rr
        if rc == CXLRT_E_KVCORRUPT:
            with nogil:
                rr = kv_read(&self.K, hit.slots[i], &e)
            if rr == 0 and not ((kv_state(&e) == KV_READY or kv_state(&e) == KV_EVICTING)
                                and kv_gen(&e) == hit.gens[i] and e.off == hit.offs[i]):
                raise LeaseLost(
                    f"KV cache {self.name!r}: {what}: block {i} of this hit was evicted: "
                    "this node was silent for longer than the "
                    f"{self.region.lease_ms / 1000.0:g} s lease (or left the region), so "
                    "its pins no longer counted. Release the hit and look the keys up again")
        return self._raise(rc, what)

    def prefetch(self, Hit hit not None, window=None, *, start=0):
        """Issue the hit's blocks ``[start:]``, in order, for a later ``load(hit)``,
        which consumes them as they land (the copy of block i overlaps the staging of
        block i+1). Releasing the hit releases what load() did not consume.
        HyMCache's request-level prefetch.

        `window` is a StagingWindow over this cache's region (in this process's memory,
        or ``device=True``: in the device's; it then needs room for a block and its
        64-byte header per object). None asks the device itself
        (``Region.prefetch``) with no window here: any process's read of the blocks
        then finds them in device memory, which is how a serving engine's scheduler
        prefetches for its workers. Returns the number of blocks the device took
        (None: 0 where it takes no prefetch; a window: every block issued)."""
        from cxlrt.staging import StagingWindow
        self._need_hit(hit)
        if window is not None and not isinstance(window, StagingWindow):
            raise TypeError(f"window must be a StagingWindow or None, not {type(window).__name__}")
        if window is not None and window.region is not self.region:
            raise ValueError("the window must read this cache's region")
        if hit._staged is not None:
            raise ValueError("this hit's blocks were prefetched already")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= hit.n:
            raise ValueError(f"start must be an int in 0..{hit.n}, got {start!r}")
        cdef uint64_t i, bb = self.block_bytes
        cdef int rc = 0
        if window is not None and not window.device:
            for i in range(start, hit.n):  # each payload is checked before its staging copy
                rc = self._check_busy(hit, i)
                if rc != 0:
                    self._raise_stale(hit, i, rc, "prefetch")
            objs = [(hit.offs[i] + KV_PAYLOAD_HDR, bb) for i in range(start, hit.n)]
        else:
            # In device memory the load reads the region itself, checking the header before
            # and after its copy as every direct load does: nothing to check here. The
            # header is staged with its payload, so that check reads DRAM too.
            objs = [(hit.offs[i], KV_PAYLOAD_HDR + bb) for i in range(start, hit.n)]
        if window is not None:
            hs = window.prefetch_many(objs)
        else:
            hs = []
            try:
                for o, n in objs:
                    hs.append(int(self.region.prefetch(o, n)))
            except BaseException:
                for (o, n), took in zip(objs, hs):  # the holds taken before the error
                    if took:
                        try:
                            self.region.prefetch_release(o, n)
                        except Exception:
                            pass  # they lapse after the device's pin time
                raise
        hit._staged = (window, [0] * start + hs)
        return len(hs) if window is not None else sum(hs)

    cdef int _check_busy(self, Hit hit, uint64_t i) except? -1:
        """_check_payload without the GIL, counted in region._busy as every copy is:
        Region.close() must not unmap under it."""
        cdef int rc
        self.region._busy += 1
        try:
            with nogil:
                rc = self._check_payload(hit, i)
        finally:
            self.region._busy -= 1
        return rc

    cdef int _load_staged(self, Hit hit, uint64_t i, char* p) except -1:
        """Block i of a prefetched hit into p: wait for its staged copy, take it, and
        check the payload once more (prefetch checked it before the staging copy);
        0, or 1 when the caller must copy it directly: not staged, or the window
        cannot deliver it (stalled by another consumer, closed, inherited over fork)."""
        w, hs = hit._staged
        cdef uint64_t h = hs[i]
        cdef const unsigned char[::1] v
        cdef int rc = 0
        if h == 0:
            return 1
        hs[i] = 0
        if w is None or w.device:  # staged in device memory: read the region, then let go
            try:
                if w is not None:
                    try:
                        w.wait(h)
                    except Exception:
                        pass  # advice only: whatever the prefetch met, read the region
                rc = self._copy_direct(hit, i, p)
            finally:
                self._unstage_one(hit, w, h, i)
            if rc != 0:
                self._raise_stale(hit, i, rc, "load")
            return 0
        try:
            try:
                v = w.wait(h)
            except (StagingError, RegionClosedError):
                return 1
            with nogil:  # window to caller: no region memory, nothing for _busy
                memcpy(p, &v[0], self.block_bytes)
            del v
            rc = self._check_busy(hit, i)
        finally:
            try:
                w.release(h)
            except (StagingError, RegionClosedError, BufferError):
                pass
        if rc != 0:
            self._raise_stale(hit, i, rc, "load")
        return 0

    cdef void _unstage_one(self, Hit hit, w, uint64_t h, uint64_t i) except *:
        """Give back block i's staging: its window handle h, or (no window) the
        device's hold on its payload."""
        try:
            if w is not None:
                w.release(h)
            else:
                self.region.prefetch_release(hit.offs[i], KV_PAYLOAD_HDR + self.block_bytes)
        except (StagingError, RegionClosedError):
            pass

    cdef void _unstage_range(self, Hit hit, uint64_t a, uint64_t b) except *:
        """Release the staging of blocks [a, b) that nobody will consume."""
        if hit._staged is None:
            return
        w, hs = hit._staged
        for i in range(a, b):
            if hs[i]:
                h, hs[i] = hs[i], 0
                self._unstage_one(hit, w, h, i)

    cdef int _copy_direct(self, Hit hit, uint64_t i, char* p) except? -1:
        """Block i from the region into p, its payload checked before and after the
        copy (so no reuse slipped in): 0, or the check's status."""
        cdef int rc
        cdef uint64_t bb = self.block_bytes
        self.region._busy += 1  # Region.close() refuses while we copy without the GIL
        try:
            with nogil:
                rc = self._check_payload(hit, i)
                if rc == 0:
                    rc = cxl_dma_read(self.r, hit.offs[i] + KV_PAYLOAD_HDR, p, bb)
                if rc == 0:
                    rc = self._check_payload(hit, i)
        finally:
            self.region._busy -= 1
        return rc

    def load(self, Hit hit not None, out=None, *, start=0, stop=None):
        """Copy the hit's blocks ``[start:stop]`` into `out` and return it.

        `out` is one writable C-contiguous buffer (numpy array, CPU torch tensor,
        bytearray) of at least n * block_bytes bytes, or a sequence of n such
        buffers of at least block_bytes each; None allocates a numpy uint8 array
        of shape (n, block_bytes). A CUDA tensor (or a sequence of n) is filled by
        asynchronous copies: from the payloads themselves once the region is
        registered (``Region.register_cuda()``, done on first use), else through a
        pinned bounce buffer kept per cache; the call waits for them, then checks
        every payload again.
        The payload header is checked before and after each copy, so a block
        that is not the stored one raises instead of being returned. Blocks that
        ``prefetch(hit, window)`` issued come from the window as it stages them.
        """
        self._need_hit(hit)
        start, stop = _range(start, stop, hit.n)
        cdef uint64_t first = start
        cdef uint64_t n = stop - start, bb = self.block_bytes, i
        if out is None:
            import numpy as np
            out = np.empty((n, bb), dtype=np.uint8)
        if n == 0:  # a miss, or start == len(hit): nothing to copy, nothing to check
            return out
        from cxlrt._buffers import cuda_buffers, destinations
        if cuda_buffers(out):
            # The CUDA path reads the region: a host window's copies are of no use to it;
            # blocks held in device memory stay held until it has read them.
            in_device = hit._staged is not None and (hit._staged[0] is None
                                                     or hit._staged[0].device)
            self._unstage_range(hit, 0, first if in_device else first + n)
            from cxlrt._cuda import load_cuda
            try:
                load_cuda(self, hit, out, start, stop)
            finally:
                self._unstage_range(hit, first, first + n)
            return out
        cdef list dst = destinations(out, n, bb)
        cdef unsigned char[::1] mv
        cdef char* p
        cdef int rc = 0
        # Staged blocks before `start` would hold the window's room while we wait for
        # later ones, in a window that refills in order: let them go.
        self._unstage_range(hit, 0, first)
        for i in range(n):
            mv = dst[i]
            p = <char*>&mv[0]
            if hit._staged is not None and self._load_staged(hit, first + i, p) == 0:
                continue
            rc = self._copy_direct(hit, first + i, p)
            if rc != 0:
                self._raise_stale(hit, first + i, rc, "load")
        self._pending()[KV_ST_BYTES_LOADED] += n * bb
        return out

    def _recheck(self, Hit hit not None, start, stop):
        """The post-copy check of load(), for a path that copied blocks ``[start:stop]``
        by other means (the CUDA one): raise if any payload is no longer the stored one."""
        self._need_hit(hit)
        start, stop = _range(start, stop, hit.n)
        cdef uint64_t i
        cdef int rc
        for i in range(start, stop):
            rc = self._check_busy(hit, i)
            if rc != 0:
                self._raise_stale(hit, i, rc, "load")

    def _count_loaded(self, uint64_t nbytes):
        """Count bytes a load path outside load() copied (the CUDA one)."""
        self._pending()[KV_ST_BYTES_LOADED] += nbytes

    def views(self, Hit hit not None, *, start=0, stop=None):
        """Zero-copy read-only views of the hit's blocks ``[start:stop]`` (mappable
        backends only).

        Valid while the hit is pinned. On a non-coherent mapping the payload's
        lines are flushed first, so the CPU reads what the writer's DMA left.
        """
        self._need_hit(hit)
        if not self.r.caps & CXL_CAP_MAPPABLE:
            from cxlrt.errors import UnsupportedError
            raise UnsupportedError(f"views: {self.region.backend.scheme}: memory is not "
                                   "mappable; use load()")
        start, stop = _range(start, stop, hit.n)
        cdef uint64_t i
        cdef int rc
        out = []
        for i in range(start, stop):
            self.region._busy += 1  # Region.close() refuses while we run without the GIL
            try:
                with nogil:
                    rc = self._check_payload(hit, i)
                    if rc == 0 and not self.r.caps & CXL_CAP_COHERENT:
                        rc = cxl_flush(self.r, hit.offs[i] + KV_PAYLOAD_HDR,
                                       self.block_bytes)
            finally:
                self.region._busy -= 1
            if rc != 0:
                self._raise_stale(hit, i, rc, "views")
            out.append(self.region.view(hit.offs[i] + KV_PAYLOAD_HDR,
                                        self.block_bytes).toreadonly())
        return out

    # --- store -----------------------------------------------------------------------------

    def store(self, keys, blocks):
        """Store `blocks` under `keys`; returns the keys this call stored.

        `blocks` is a sequence of len(keys) buffers of block_bytes each, or one
        contiguous buffer of len(keys) * block_bytes. CUDA tensors come to a pinned
        bounce buffer kept per cache by asynchronous copies, chunk by chunk, the
        next chunk's copy overlapping this one's store. Keys already present or
        being written by another live writer are skipped (exactly one copy wins).
        When slots or heap run out, least-recently-used unpinned blocks are
        evicted; keys that still find no room are left out of the result, not an
        error.

        Raises
        ------
        ClaimLost
            This process stalled for longer than the lease mid-store and another
            node took some of its blocks over: those were not stored (the error
            lists them, and the keys that were).
        """
        self._need_open()
        cdef list ks = _keys(keys)
        cdef uint64_t n = len(ks), bb = self.block_bytes
        from cxlrt._buffers import cuda_buffers, sources
        if cuda_buffers(blocks):
            from cxlrt._cuda import store_cuda
            return store_cuda(self, ks, blocks)
        srcs = sources(blocks, n, bb)
        cdef uint64_t st[KV_ST_WORDS]
        memset(st, 0, sizeof(st))
        try:
            published, lost, skipped, nres = self._w.store(ks, srcs)
        finally:
            self._count_evictions()
        st[KV_ST_SKIPPED] = skipped
        st[KV_ST_STORES] = len(published)
        st[KV_ST_BYTES_STORED] = len(published) * bb
        self._add_pending(st)
        self._publish_pending()
        stored = [ks[j] for j in published]
        if lost:
            raise ClaimLost(
                f"KV cache {self.name!r}: store: {len(lost)} of {nres} blocks were "
                f"taken over by another node while this process made no progress for longer "
                f"than the {self.region.lease_ms / 1000.0:g} s lease (stopped or stalled?); they "
                f"were not stored and their payloads went back to the allocator. "
                f"{len(stored)} blocks were stored.", stored, [ks[j] for j in lost])
        return stored

    def admit(self, keys, blocks):
        """Store `blocks` under `keys` if the device's write buffer has room for them
        now (HyMCache's write isolation): True when admitted, and then stored as
        store() stores; False when the buffer is full, with nothing stored and nothing
        waited for, so the request goes on without this store. New KV is a cache's to
        skip: a store that stalled behind the capacity tier would slow the reads that
        serve hits. Where the backend has no write buffer this is store(), and True.

        Raises ValueError when the blocks are more than the whole buffer could take.
        """
        self._need_open()
        cdef list ks = _keys(keys)
        from cxlrt._buffers import cuda_buffers, sources
        if ks and not cuda_buffers(blocks):
            sources(blocks, len(ks), self.block_bytes)  # bad blocks: an error, room or not
        if ks and not self.region.admit(len(ks) * (self.block_bytes + KV_PAYLOAD_HDR),
                                        len(ks)):
            return False
        self.store(ks, blocks)
        return True

    cdef void _count_evictions(self) noexcept:
        """Move the writer's evictions into our pending counters."""
        cdef uint64_t* pend = self._pending()  # first: in a forked child it drops both
        pend[KV_ST_EVICTIONS] += self._w.evicted
        self._w.evicted = 0

    def delete(self, keys):
        """Drop the blocks of `keys` now; returns the keys this call dropped.

        For callers that run their own eviction policy on top (LMCache's L2
        eviction controller). A key that is absent, still being written, or
        pinned by any node stays: the same mark-then-read-pins step as LRU
        eviction, so a block a reader holds is never freed under it.
        """
        self._need_open()
        cdef list ks = _keys(keys)
        cdef kv_entry e
        cdef uint64_t s = 0, free_slot = 0
        cdef int rc
        cdef const char* kp
        dropped = []
        if not ks:
            return dropped
        self._claims.ident()
        self._w.hold(None)
        try:
            self._claims.settle()
            for k in ks:
                kp = PyBytes_AS_STRING(k)
                with nogil:
                    rc = kv_probe(&self.K, kp, &s, &e, &free_slot)
                if rc < 0:
                    self._raise(rc, "delete")
                if rc == 1 and kv_state(&e) == KV_READY and self._w.evict_one(s, 0):
                    dropped.append(k)
            if dropped:
                self._w.sweep_tombstones()
        finally:
            self._count_evictions()
            self._w.release_quietly()
        return dropped

    # --- figures ---------------------------------------------------------------------------

    @property
    def occupancy(self):
        """Blocks held now, by every node: one shared counter, far cheaper than stats()."""
        self._need_open()
        cdef kv_counters w
        self._io(kv_get_counters(&self.K, &w), "occupancy")
        return w.occupancy

    def stats(self):
        """Counters summed over nodes, plus occupancy (blocks), capacity, and the
        payloads on their way back to the allocator (quarantined, deferred)."""
        self._need_open()
        self._publish_pending()
        cdef kv_stats ks
        cdef kv_counters w
        cdef uint64_t j
        cdef int rc
        tot = dict.fromkeys(STAT_NAMES, 0)
        for j in range(self.K.nodes):
            with nogil:
                rc = cxl_observe(self.r, kv_stats_at(&self.K, j), &ks, sizeof(ks))
            self._io(rc, "stats")
            for k, v in _stats_dict(&ks).items():
                tot[k] += v
        self._io(kv_get_counters(&self.K, &w), "stats")
        tot["occupancy"] = w.occupancy
        tot["payload_bytes"] = w.payload_bytes
        tot["capacity"] = self.capacity
        tot["block_bytes"] = self.block_bytes
        tot["slots"] = self.slots
        kinds = [rec["kind"] for rec in self.records()]
        tot["quarantined"] = kinds.count("quarantined")
        tot["deferred"] = kinds.count("deferred")
        return tot

    def records(self):
        """Payloads on their way back to the allocator, as dicts (inspection; no lock)."""
        self._need_open()
        cdef kv_claim c
        cdef uint64_t i
        out = []
        for i in range(self._claims.rec_top()):
            self._claims.rec_get(i, &c)
            if kv_zero(&c):
                continue
            out.append({"record": i, "kind": RECORD_NAMES.get(kv_kind(&c), str(kv_kind(&c))),
                        "offset": c.off, "slot": c.slot, "epoch": c.epoch,
                        "node": kv_cnode(&c), "pid": kv_cpid(&c), "valid": kv_line_ok(&c)})
        return out

    def entries(self):
        """Every occupied slot as a dict (inspection and `cxlrt check`; no lock taken)."""
        self._need_open()
        cdef kv_entry e
        cdef uint64_t s
        cdef int rc
        out = []
        for s in range(self.slots):
            with nogil:
                rc = kv_read(&self.K, s, &e)
            if rc != 0:
                self._raise(rc, "entries")
            st = kv_state(&e)
            if st in (KV_EMPTY, KV_TOMBSTONE):
                continue
            out.append({"slot": s, "state": STATE_NAMES.get(st, str(st)), "generation": kv_gen(&e),
                        "key": (<char*>e.key)[:16], "offset": e.off, "length": e.len,
                        "node": kv_owner_node(e.owner), "pid": kv_owner_pid(e.owner)})
        return out

    def slot_offset(self, uint64_t s):
        """Region offset of entry `s` (for tools and tests that inspect the table)."""
        if s >= self.slots:
            raise IndexError(f"slot {s} of {self.slots}")
        return kv_entry_at(&self.K, s)

    @property
    def closed(self):
        """True once close() ran (or the region closed, which closes its caches first)."""
        return self._closed

    def close(self):
        """Detach: give this process's pins and pin-table record back. Idempotent.

        Hits still open are forgotten (their pins are given back here). The region's
        close() closes its caches first.
        """
        if self._closed:
            return
        if self._pt is not None and not self.r.closed:
            try:
                self._publish_pending()
            except Exception:  # noqa: BLE001  (counters only: closing must go on)
                pass
        self._closed = True
        self._orphans = []  # the pin table's close gives back every pin of ours
        if self._pt is not None:
            self._pt.close()

    def __dealloc__(self):
        # Pins of hits dropped while the pin mutex was busy: one more try, without
        # waiting (a __dealloc__ never waits for a lock). A cache the garbage
        # collector cleared has no region to follow.
        cdef bytes b
        cdef bint held = False
        if (not self._orphans or self._closed or self._orphans_pid != cxl_pid()
                or self._pt is None or self.region is None or self.region.backend is None
                or self.r.closed):
            return
        for b in self._orphans:
            self._try_unpin(<const uint64_t*>PyBytes_AS_STRING(b),
                            <uint64_t>PyBytes_GET_SIZE(b) // sizeof(uint64_t), &held)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"<KVCache {self.name!r} block_bytes={self.block_bytes} "
                f"capacity={self.capacity} on {self.region.spec}>")


# A Hit's allocation for up to SMALL_HIT keys is taken from, and given back to, a
# few spares (GIL held in _fill and dealloc): a lookup then neither allocates nor
# frees one. Process-private memory, so a forked child may keep what it inherits.
cdef void* _spares[8]
cdef int _nspares = 0


@cython.no_gc  # refers only to its cache, bytes and staged handles (a window, a list of
# ints): it cannot be part of a cycle, so the collector never clears it before dealloc
@cython.freelist(8)  # one made and dropped per lookup
cdef class Hit:
    """Pinned leading blocks of a lookup: ``len(hit)``, ``hit.keys``, ``release()``.

    Made by :meth:`KVCache.lookup`. The pins belong to the process that looked up:
    in a forked child, ``release()`` only forgets them; after the cache is closed
    it only forgets them too (close() gave them back).
    """

    cdef readonly KVCache cache
    cdef uint64_t n
    cdef uint64_t* slots          # one allocation: slots, gens, offs, then the keys
    cdef uint64_t* gens
    cdef uint64_t* offs
    cdef char* kb                 # KEY_BYTES per key, copied: the caller's list may change
    cdef readonly bint released
    cdef int owner_pid
    cdef object _staged           # (StagingWindow or None, handle or device hold per block, 0:
    #                               none) after prefetch
    cdef bint _spare              # slots is a SMALL_HIT allocation: back to _spares at the end

    cdef int _fill(self, keys) except -1:
        """Validate `keys` (a sequence of 16-byte bytes) and copy them in."""
        if isinstance(keys, (bytes, bytearray, str)):
            raise TypeError("keys must be a sequence of 16-byte keys, not one bytes object")
        seq = PySequence_Fast(keys, "keys must be a sequence of 16-byte keys")
        cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), j
        cdef PyObject** items = PySequence_Fast_ITEMS(seq)
        cdef object k
        global _nspares
        cdef size_t total = <size_t>max(n, 1) * (24 + KV_KEY_BYTES)
        if n <= SMALL_HIT:
            total = SMALL_HIT * (24 + KV_KEY_BYTES)
            self._spare = True
            if _nspares > 0:
                _nspares -= 1
                self.slots = <uint64_t*>_spares[_nspares]
            else:
                self.slots = <uint64_t*>malloc(total)
        else:
            self.slots = <uint64_t*>malloc(total)
        if self.slots == NULL:
            raise MemoryError()
        self.gens = self.slots + max(n, 1)
        self.offs = self.gens + max(n, 1)
        self.kb = <char*>(self.offs + max(n, 1))
        for j in range(n):  # borrowed: seq holds them (no reference count written)
            if not _bytes_exact(items[j]) or _bytes_size(items[j]) != KV_KEY_BYTES:
                k = <object>items[j]
                raise ValueError(f"keys must be {KV_KEY_BYTES}-byte bytes (from block_hashes), "
                                 f"got {k!r:.40}")
            memcpy(self.kb + j * KV_KEY_BYTES, _bytes_chars(items[j]), KV_KEY_BYTES)
        self.n = n
        return 0

    cdef inline const char* key(self, uint64_t i) noexcept nogil:
        return self.kb + i * KV_KEY_BYTES

    def __len__(self):
        return self.n

    @property
    def keys(self):
        """The pinned blocks' keys, in order (a tuple of bytes)."""
        return tuple([PyBytes_FromStringAndSize(self.kb + i * KV_KEY_BYTES, KV_KEY_BYTES)
                      for i in range(self.n)])

    @property
    def nbytes(self):
        return self.n * self.cache.block_bytes if self.cache is not None else 0

    cdef bint _mine(self):
        # A cache the garbage collector cleared (a cycle through a frame that held it
        # and this hit) has lost its pin table and region: nothing to give back, and
        # its region pointer must not be followed.
        return (not self.released and self.cache is not None and self.n > 0
                and self.owner_pid == cxl_pid() and not self.cache._closed
                and self.cache._pt is not None and self.cache.region is not None
                and self.cache.region.backend is not None and not self.cache.r.closed)

    cdef void _drop_staged(self) noexcept:
        """Release what a prefetch staged and load() did not consume, before the pins
        go: a window must not copy a block another writer may then own (best effort:
        a window closed or inherited over fork has nothing left to stop)."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        w, hs = staged
        for i, h in enumerate(hs):
            if h:
                try:
                    if w is not None:
                        w.release(h)
                    elif (self.owner_pid == cxl_pid() and self.cache is not None
                          and self.cache.region is not None):  # a forked child's are not its
                        self.cache.region.prefetch_release(
                            self.offs[i], KV_PAYLOAD_HDR + self.cache.block_bytes)
                except Exception:
                    pass

    def release(self):
        """Unpin the blocks (idempotent), after releasing any staged copies of them."""
        self._release()

    cdef int _release(self) except -1:
        cdef int rc = 0
        cdef bint held = False
        cdef uint64_t st[KV_ST_WORDS]
        if self._staged is not None:
            self._drop_staged()
        mine = self._mine()
        self.released = True
        if mine:
            self.cache._take_pending(st)  # the lookup's own counters go with the unpin
            rc = PIN_BUSY
            if self.n <= GIL_HELD_KEYS and (self.cache.r.flags & CXL_F_DIRECT):
                rc = self.cache._unpin(self.slots, self.n, st, &held, False)
            if rc == PIN_BUSY:
                with nogil:
                    rc = self.cache._unpin(self.slots, self.n, st, &held, True)
            self.cache._add_pending(st)  # what was not published (zeroed where it was)
            if rc != 0:
                if held:  # nothing given back: the cache's next call tries again
                    self.cache._orphan(self.slots, self.n)
                self.cache._raise(rc, "release")
        return 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._release()  # not through the method's name: this is every lookup's exit

    def __dealloc__(self):
        # Never waits for a lock (see KVCache._try_unpin); an error is dropped, as
        # release() would have raised it to nobody.
        cdef bint held = False
        if not self.released or self._staged is not None:
            self._drop_staged()
            if self._mine():
                self.cache._try_unpin(self.slots, self.n, &held)
                if held:
                    self.cache._orphan(self.slots, self.n)
        global _nspares
        if self._spare and self.slots != NULL and _nspares < 8:
            _spares[_nspares] = self.slots
            _nspares += 1
        else:
            free(self.slots)

    def __repr__(self):
        return f"<Hit {self.n} blocks{' released' if self.released else ''}>"


cdef tuple _range(start, stop, uint64_t n):
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= n:
        raise ValueError(f"start must be an int in 0..{n}, got {start!r}")
    if stop is None:
        stop = n
    if isinstance(stop, bool) or not isinstance(stop, int) or not start <= stop <= n:
        raise ValueError(f"stop must be an int in {start}..{n}, got {stop!r}")
    return start, stop


cdef list _keys(keys):
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError("keys must be a sequence of 16-byte keys, not one bytes object")
    out = []
    for k in keys:
        if not PyBytes_CheckExact(k) or PyBytes_GET_SIZE(k) != KV_KEY_BYTES:
            raise ValueError(f"keys must be {KV_KEY_BYTES}-byte bytes (from block_hashes), "
                             f"got {k!r:.40}")
        out.append(k)
    return out


def _break_pin_protocol(KVCache cache):
    """Make `cache` evict pinned blocks: the broken protocol the tests must catch."""
    if not CXLRT_DEBUG:
        raise DebugBuildRequired()
    cache.K.ignore_pins = True


def _as_if_on_another_host(KVCache cache):
    """Make `cache` treat every writer as one on another host: judged by its progress
    word and its node's liveness, never by looking its process up (tests of the
    cross-host paths)."""
    if not CXLRT_DEBUG:
        raise DebugBuildRequired()
    cache._claims.foreign = True


def _break_quarantine(KVCache cache):
    """Make `cache` free a stalled writer's payload at once: the broken protocol the
    tests must catch (the writer, resumed, scribbles over whoever got the memory)."""
    if not CXLRT_DEBUG:
        raise DebugBuildRequired()
    cache.K.no_quarantine = True


def line_check(line):
    """The check word (the eighth word) an entry, claim or record line with these
    first 56 bytes carries: how a reader tells a whole line from a torn one."""
    cdef bytes raw = bytes(line)
    cdef uint64_t w[8]
    if len(raw) < 56:
        raise ValueError(f"a line's check covers 56 bytes, got {len(raw)}")
    memset(w, 0, sizeof(w))
    memcpy(w, PyBytes_AS_STRING(raw), 56)
    return 0 if kv_zero(w) else kv_mix(w)


PIN_COUNT_MASK = KV_PIN_MAX  # a pin word's count bits
