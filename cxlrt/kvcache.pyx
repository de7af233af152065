# Prefix KV cache (TraCT's rack-wide prefix cache): lookups and pins without the
# global lock, stores that copy payloads outside it, LRU eviction of unpinned
# blocks. Layout and invariants: kvcache.pxd.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_MAPPABLE, cxl_check_range, cxl_dma_read,
                            cxl_dma_write, cxl_fence, cxl_flush, cxl_flush_nodrain, cxl_load,
                            cxl_load64, cxl_persist, cxl_region, cxl_store, cxl_store64)
from cxlrt.includes.intrin cimport cxl_backoff, cxl_pid, cxl_wall_ns
from cxlrt.kvpins cimport CXLRT_E_KVNOREC, CXLRT_E_KVPINS, KV_PIN_MAX, PinTable
from cxlrt.lock cimport cxl_lockctx, cxl_node_dead
from cxlrt.region cimport Region


import hashlib
import os

from cxlrt.errors import OutOfMemory, RegionError
from cxlrt.hashing import ALGORITHM_NAMES, ALGORITHMS, KEY_BYTES, block_hashes, salt_digest
from cxlrt.kvpins import process_alive

cdef uint64_t MAGIC = 0x31304356_4B4C5843   # "CXLKVC01"
cdef uint64_t PMAGIC = 0x31304256_4B4C5843  # "CXLKVB01"
cdef uint32_t VERSION = 1
cdef uint64_t STATS_WORDS = 8



DIR_PREFIX = "kv/"  # directory names of KV caches
STATE_NAMES = {KV_EMPTY: "empty", KV_WRITING: "writing", KV_READY: "ready",
               KV_TOMBSTONE: "tombstone", KV_EVICTING: "evicting"}
STAT_NAMES = ("lookups", "hits", "misses", "stores", "skipped", "evictions", "bytes_stored",
              "bytes_loaded")


class SchemeMismatchError(RegionError, ValueError):
    """A KV cache exists under this name with another hash scheme or geometry."""


# --- entries ------------------------------------------------------------------------

cdef inline uint64_t _mix(const kv_entry* e) noexcept nogil:
    cdef const uint64_t* w = <const uint64_t*>e
    cdef uint64_t h = <uint64_t>0x9E3779B97F4A7C15ULL
    cdef int i
    for i in range(7):
        h = (h ^ w[i]) * <uint64_t>0xff51afd7ed558ccdULL
        h ^= h >> 29
    return h | 1  # never 0: an all-zero line is the only entry with check 0


cdef inline bint _zero(const kv_entry* e) noexcept nogil:
    cdef const uint64_t* w = <const uint64_t*>e
    cdef int i
    for i in range(8):
        if w[i] != 0:
            return False
    return True


cdef inline uint32_t _state(const kv_entry* e) noexcept nogil:
    return <uint32_t>(e.meta & 0xff)


cdef inline uint64_t _gen(const kv_entry* e) noexcept nogil:
    return e.meta >> 8


cdef inline bint _same_key(const kv_entry* e, const char* k) noexcept nogil:
    return memcmp(<const void*>e.key, k, 16) == 0


# --- the cache ----------------------------------------------------------------------

cdef class KVCache:
    """A prefix-aware KV block cache shared by every node of a region.

    ``KVCache(region, name, *, block_bytes, capacity_blocks, block_tokens=16,
    algorithm="blake2b", salt=b"", create=True)`` creates the cache or attaches
    to it by name. Keys are :meth:`block_hashes` of token ids; a lookup returns
    the leading run of keys that are cached, pinned against eviction until the
    :class:`Hit` is released.
    """

    cdef const cxl_region* r
    cdef cxl_lockctx* L
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
    cdef object _lock                    # the cache lock (entries, occupancy)
    cdef uint32_t _pin_lock              # its node-local mutex guards our pins and stats
    cdef uint64_t _entries, _pins, _stats, _mask, _heap_lo, _heap_hi, _nodes
    cdef uint32_t _node
    cdef uint64_t _bad_slot              # set with CXLRT_E_KVCORRUPT, for the message
    cdef bint _closed
    cdef PinTable _pt                    # our node's pins, and which process holds them
    cdef bint _ignore_pins               # test hook: a broken evictor the tests must catch

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
        self.region = region
        self.r = region.backend.region()
        self.name = name
        self.block_tokens = block_tokens
        self.algorithm = algorithm
        self._salt = salt
        self.salt_digest = salt_digest(salt, algorithm)
        self._nodes = region.nodes
        self._node = region.node
        self._heap_lo, heap_len = region.heap
        self._heap_hi = self._heap_lo + heap_len
        tag = name if len(raw) <= 36 else hashlib.blake2b(raw, digest_size=8).hexdigest()
        self._lock = region.lock(f"kv:{tag}")
        self._pin_lock = region.lock(f"kvp:{tag}").index
        from cxlrt.lock import _ctx_address
        self.L = <cxl_lockctx*><size_t>_ctx_address(region.locks)
        self._attach(name, create, block_bytes, capacity_blocks)
        from cxlrt.nodelocal import local_dir
        path = os.path.join(local_dir(), f"cxlrt-{region.uuid:016x}-node{self._node}"
                                         f"-kv{self.offset:x}.pins")
        self._pt = PinTable(region, <size_t>self.L, self._pin_lock, self._pins, self.slots, path)
        self._pt.recover()  # a restarted worker heals what its dead predecessor pinned

    def _set_geometry(self, uint64_t block_bytes, uint64_t capacity):
        self.block_bytes = block_bytes
        self.capacity = capacity
        self.slots = 8
        while self.slots < 2 * capacity:  # load factor <= 1/2 keeps probe runs short
            self.slots <<= 1
        self._mask = self.slots - 1

    # --- creation and attach ------------------------------------------------------------

    def _total(self):
        return (KV_HEADER + self.slots * 64 + self._nodes * self.slots * 8
                + self._nodes * STATS_WORDS * 8)

    def _geometry(self):
        cdef bytearray g = bytearray(64)
        g[0:8] = MAGIC.to_bytes(8, "little")
        g[8:12] = VERSION.to_bytes(4, "little")
        g[12:16] = KEY_BYTES.to_bytes(4, "little")
        g[16:24] = self.slots.to_bytes(8, "little")
        g[24:32] = self.capacity.to_bytes(8, "little")
        g[32:40] = self.block_bytes.to_bytes(8, "little")
        g[40:44] = self.block_tokens.to_bytes(4, "little")
        g[44:48] = ALGORITHMS[self.algorithm].to_bytes(4, "little")
        g[48:64] = self.salt_digest
        return bytes(g)

    def _layout(self, uint64_t base, uint64_t created):
        words = [self._nodes, base + KV_HEADER, base + KV_HEADER + self.slots * 64,
                 base + KV_HEADER + self.slots * 64 + self._nodes * self.slots * 8,
                 created, self._total(), 0]
        body = b"".join(w.to_bytes(8, "little") for w in words)
        return body + _fnv(self._geometry() + body).to_bytes(8, "little")

    def _attach(self, str name, bint create, block_bytes, capacity):
        region = self.region
        key = DIR_PREFIX + name
        try:
            off = region.get(key)
        except KeyError:
            off = None
        if off is None:
            if not create:
                raise KeyError(f"no KV cache named {name!r} in {region.spec}")
            if block_bytes is None or capacity is None:
                raise ValueError(f"KV cache {name!r} does not exist yet: creating it needs "
                                 "block_bytes and capacity_blocks")
            self._set_geometry(block_bytes, capacity)
            with region.lock("kv:create"):
                try:
                    off = region.get(key)
                except KeyError:
                    off = self._create(key)
        if block_bytes is None or capacity is None:  # attach with the recorded geometry
            geo = self._header(off)[0]
            block_bytes = block_bytes or int.from_bytes(geo[32:40], "little")
            capacity = capacity or int.from_bytes(geo[24:32], "little")
            if block_bytes < 1 or capacity < 1 or capacity > self._heap_hi:
                raise RegionError(f"KV cache {name!r}: recorded geometry is corrupt")
        self._set_geometry(block_bytes, capacity)
        self.offset = off
        self._validate(off)

    def _header(self, uint64_t base):
        """(geometry line, layout line) of the cache object at `base`, checked."""
        region = self.region
        if base % 64 or base < self._heap_lo or base + KV_HEADER > self._heap_hi:
            raise RegionError(f"KV cache {self.name!r}: directory offset {base} is not a "
                              "cache object (corrupt)")
        region.flush(base, 128)
        geo = region.load(base, 64)
        lay = region.load(base + 64, 64)
        if int.from_bytes(geo[0:8], "little") != MAGIC:
            raise RegionError(f"{self.name!r} in the directory is not a KV cache")
        if int.from_bytes(geo[8:12], "little") != VERSION:
            raise RegionError(f"KV cache {self.name!r} has version "
                              f"{int.from_bytes(geo[8:12], 'little')}; this build reads {VERSION}")
        if _fnv(geo + lay[:56]) != int.from_bytes(lay[56:64], "little"):
            raise RegionError(f"KV cache {self.name!r}: header checksum mismatch (corrupt)")
        return geo, lay

    def _create(self, str name):
        region = self.region
        total = self._total()
        try:
            base = region.alloc(total, 64)
        except OutOfMemory as e:
            raise OutOfMemory(f"KV cache {name!r}: its index needs {total} bytes: {e}") from None
        region.flush(base, total)  # no stale line of the memory's last use may land later
        zeros = bytes(min(total, 1 << 20))
        pos = 0
        while pos < total:  # the heap keeps old bytes; DMA bypasses every cache
            n = min(len(zeros), total - pos)
            region.dma_write(base + pos, zeros[:n])
            pos += n
        region.store(base + 64, self._layout(base, cxl_wall_ns()))
        region.persist(base + 64, 64)
        region.store(base, self._geometry())  # the magic goes last: attachers wait for it
        region.persist(base, 64)
        region.put(name, base)
        return base

    def _validate(self, uint64_t base):
        geo, lay = self._header(base)
        self._check_scheme(geo)
        words = [int.from_bytes(lay[i:i + 8], "little") for i in range(0, 56, 8)]
        if words[0] != self._nodes or words[5] != self._total() or \
                base + words[5] > self._heap_hi:
            raise RegionError(f"KV cache {self.name!r}: layout does not fit this region (corrupt)")
        self._entries, self._pins, self._stats = words[1], words[2], words[3]
        if (self._entries, self._pins, self._stats) != (
                base + KV_HEADER, base + KV_HEADER + self.slots * 64,
                base + KV_HEADER + self.slots * 64 + self._nodes * self.slots * 8):
            raise RegionError(f"KV cache {self.name!r}: section offsets are corrupt")

    def _check_scheme(self, bytes geo):
        ours = self._geometry()
        if geo == ours:
            return
        def f(g, a, b):
            return int.from_bytes(g[a:b], "little")
        diffs = []
        alg = f(geo, 44, 48)
        if alg != ALGORITHMS[self.algorithm]:
            diffs.append(f"hash algorithm {ALGORITHM_NAMES.get(alg, alg)!r} "
                         f"(you asked for {self.algorithm!r})")
        if geo[48:64] != self.salt_digest:
            diffs.append(f"salt digest {geo[48:56].hex()}... (yours is "
                         f"{self.salt_digest[:8].hex()}...: another model, dtype, layout or "
                         "tenant salt)")
        for label, a, b, mine in (("block_tokens", 40, 44, self.block_tokens),
                                  ("block_bytes", 32, 40, self.block_bytes),
                                  ("capacity_blocks", 24, 32, self.capacity),
                                  ("key bytes", 12, 16, KEY_BYTES)):
            if f(geo, a, b) != mine:
                diffs.append(f"{label} {f(geo, a, b)} (you asked for {mine})")
        raise SchemeMismatchError(
            f"KV cache {self.name!r} in {self.region.spec} was created with a different scheme: "
            + "; ".join(diffs or ["geometry words differ"])
            + ". Attach with the same parameters or use another name (with another salt or "
              "block size, keys would never match: a silent zero hit rate)")

    # --- helpers ------------------------------------------------------------------------

    cdef int _read(self, uint64_t s, kv_entry* e) noexcept nogil:
        """Observe entry `s` as one consistent line (a torn copy is read again)."""
        cdef uint64_t at = self._entries + s * 64, spins = 0
        cdef int rc, tries
        for tries in range(1000):
            rc = cxl_flush(self.r, at, 64)
            if rc == 0:
                rc = cxl_load(self.r, at, e, 64)
            if rc != 0:
                return rc
            if e.check == _mix(e) or (e.check == 0 and _zero(e)):
                return 0
            cxl_backoff(&spins)
        self._bad_slot = s
        return CXLRT_E_KVCORRUPT

    cdef int _write(self, uint64_t s, kv_entry* e) noexcept nogil:
        """Replace entry `s` (cache lock held) and publish it."""
        cdef uint64_t at = self._entries + s * 64
        cdef int rc
        e.check = _mix(e)
        rc = cxl_flush(self.r, at, 64)  # drop a stale copy before writing the line
        if rc == 0:
            rc = cxl_store(self.r, at, e, 64)
        if rc == 0:
            rc = cxl_persist(self.r, at, 64)
        return rc

    cdef bint _payload_ok(self, const kv_entry* e) noexcept nogil:
        return (e.len == KV_PAYLOAD_HDR + self.block_bytes and e.off % 64 == 0
                and e.off >= self._heap_lo and e.off <= self._heap_hi
                and e.len <= self._heap_hi - e.off)

    cdef int _probe(self, const char* key, uint64_t* slot, kv_entry* e,
                    uint64_t* free_slot) noexcept nogil:
        """Find `key`: 1 with its slot and entry, or 0 (absent) with the slot an
        insert would take (the first tombstone, else the empty slot ending the run)
        in free_slot (-1 when the table is full). Negative: an error."""
        cdef uint64_t h, s, i
        cdef uint32_t st
        cdef int rc
        memcpy(&h, key, 8)
        free_slot[0] = <uint64_t>-1
        for i in range(self.slots):
            s = (h + i) & self._mask
            rc = self._read(s, e)
            if rc != 0:
                return rc
            st = _state(e)
            if st == KV_EMPTY:
                if free_slot[0] == <uint64_t>-1:
                    free_slot[0] = s
                return 0
            if st == KV_TOMBSTONE:
                if free_slot[0] == <uint64_t>-1:
                    free_slot[0] = s
                continue
            if st > KV_EVICTING:
                self._bad_slot = s
                return CXLRT_E_KVCORRUPT
            if _same_key(e, key):
                slot[0] = s
                return 1
        return 0

    def recover(self):
        """Give back pins held by this node's dead processes; returns how many.

        Runs when a process attaches, when it first pins, and when eviction finds
        nothing to evict; a node's pins are written only by the node itself, so
        each node heals its own.
        """
        self._need_open()
        return self._pt.recover()

    cdef int _stat_add(self, const uint64_t* d) noexcept nogil:
        """Add d[0..STATS_WORDS) to our node's stats line (pin mutex held)."""
        cdef uint64_t at = self._stats + self._node * STATS_WORDS * 8
        cdef uint64_t w[8]
        cdef int rc = cxl_load(self.r, at, w, 64), i
        if rc != 0:
            return rc
        for i in range(8):
            w[i] += d[i]
        rc = cxl_store(self.r, at, w, 64)
        if rc == 0:
            rc = cxl_flush_nodrain(self.r, at, 64)
        return rc

    cdef int _stats_locked(self, const uint64_t* d) noexcept nogil:
        cdef int rc = self._pt.enter()
        if rc != 0:
            return rc
        rc = self._stat_add(d)
        if rc == 0:
            rc = cxl_fence(self.r)
        self._pt.leave()
        return rc

    cdef int _raise(self, int rc, str what) except -1:
        if rc == CXLRT_E_KVCORRUPT:
            raise RegionError(
                f"KV cache {self.name!r}: {what}: slot {self._bad_slot} holds an entry or "
                "payload that cannot be right (corrupt region; run `cxlrt check`)")
        if rc == CXLRT_E_KVNOREC:
            raise RuntimeError(f"KV cache {self.name!r}: {what}: this process has no record "
                               "in the node's pin table")
        if rc == CXLRT_E_KVPINS:
            raise RuntimeError(f"KV cache {self.name!r}: {what}: this node holds {KV_PIN_MAX} "
                               "pins on one block; release hits")
        if rc < 0 and rc > -1000:
            raise OSError(-rc, f"KV cache {self.name!r}: {what}: {os.strerror(-rc)}")
        return self.region._rc(rc, f"KV cache {self.name!r}: {what}", 0, 0)

    cdef void _need_open(self) except *:
        if self._closed:
            raise ValueError(f"KV cache {self.name!r} is closed")
        if self.r.closed:
            self.region._rc(-1003, "KV cache", 0, 0)

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
        cdef tuple ks = tuple(_keys(keys))
        cdef uint64_t n = len(ks), m = 0, j
        cdef int pid = cxl_pid()  # cached, reset at fork: getpid() is a system call
        if self._pt._rec < 0 or self._pt._rec_pid != pid:
            self._pt.claim()
        cdef Hit hit = Hit.__new__(Hit)
        hit.cache = self
        hit.owner_pid = pid
        hit._alloc(n)
        for j in range(n):
            hit.keyp[j] = PyBytes_AS_STRING(ks[j])  # ks outlives the Hit: hit.keys keeps it
        hit.keys = ks
        cdef int rc
        self.region._busy += 1  # Region.close() refuses while we run without the GIL
        try:
            with nogil:
                rc = self._lookup(hit.keyp, n, hit, &m)
        finally:
            self.region._busy -= 1
        hit.n = m
        hit.keys = ks[:m] if m < n else ks
        for j in range(m):
            hit.keyp[j] = PyBytes_AS_STRING(hit.keys[j])
        if rc != 0:
            self._raise(rc, "lookup")
        return hit

    cdef int _lookup(self, const char** kp, uint64_t n, Hit hit, uint64_t* out) noexcept nogil:
        cdef kv_entry e
        cdef uint64_t j, m = 0, free_slot, s = 0, keep
        cdef uint64_t st[8]
        cdef int rc = 0, found
        for j in range(n):
            found = self._probe(kp[j], &s, &e, &free_slot)
            if found < 0:
                return found
            if found == 0 or _state(&e) != KV_READY:
                break
            if not self._payload_ok(&e):
                self._bad_slot = s
                return CXLRT_E_KVCORRUPT
            hit.slots[m] = s
            hit.gens[m] = _gen(&e)
            hit.offs[m] = e.off
            m += 1
        memset(st, 0, sizeof(st))
        rc = self._pt.enter()
        if rc != 0:
            return rc
        if m:
            rc = self._pt.add_locked(hit.slots, m, 1)  # ends with a full fence
            if rc == CXLRT_E_KVPINS:  # a block pinned 65535 times by us: the hit ends there
                m = self._pt.done
                rc = 0
        self._pt.leave()
        if rc != 0:
            return rc
        # Re-read after the fence: an evictor that missed our pin has marked the
        # entry (EVICTING or a new generation) before reading pins, so we see it.
        keep = m
        for j in range(m):
            rc = self._read(hit.slots[j], &e)
            if rc != 0:
                break
            if _state(&e) != KV_READY or _gen(&e) != hit.gens[j] or e.off != hit.offs[j]:
                keep = j
                break
        if rc != 0:
            keep = 0
        st[0] = 1
        st[1] = keep
        st[2] = n - keep
        if self._pt.enter() == 0:
            if keep < m:
                self._pt.add_locked(hit.slots + keep, m - keep, -1)
            self._stat_add(st)
            cxl_fence(self.r)
            self._pt.leave()
        out[0] = keep
        return rc

    cdef int _unpin(self, const uint64_t* slots, uint64_t n) noexcept nogil:
        return self._pt.add(slots, n, -1)

    # --- load ------------------------------------------------------------------------------

    cdef int _check_payload(self, Hit hit, uint64_t i) noexcept nogil:
        """The pinned payload's header must still name this key and generation."""
        cdef uint64_t h[8]
        cdef int rc = cxl_dma_read(self.r, hit.offs[i], h, 64)
        if rc != 0:
            return rc
        if h[0] != PMAGIC or h[3] != hit.gens[i] or h[4] != self.block_bytes \
                or h[5] != self.offset or memcmp(&h[1], hit.keyp[i], 16) != 0:
            self._bad_slot = hit.slots[i]
            return CXLRT_E_KVCORRUPT
        return 0

    def load(self, Hit hit not None, out=None, *, start=0):
        """Copy the hit's blocks ``[start:]`` into `out` and return it.

        `out` is one writable C-contiguous buffer (numpy array, CPU torch tensor,
        bytearray) of at least n * block_bytes bytes, or a sequence of n such
        buffers of at least block_bytes each; None allocates a numpy uint8 array
        of shape (n, block_bytes). A CUDA tensor is filled by asynchronous copies
        from host-registered memory (the call waits for them before returning).
        """
        self._need_open()
        if hit.cache is not self:
            raise ValueError("this Hit came from another KV cache")
        if hit.released:
            raise ValueError("this Hit was released: its blocks may be gone")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= hit.n:
            raise ValueError(f"start must be an int in 0..{hit.n}, got {start!r}")
        cdef uint64_t first = start
        cdef uint64_t n = hit.n - first, bb = self.block_bytes, i
        if out is None:
            import numpy as np
            out = np.empty((n, bb), dtype=np.uint8)
        from cxlrt._buffers import cuda_target, destinations
        if cuda_target(out):
            from cxlrt._cuda import load_cuda
            load_cuda(self, hit, out, start)
            return out
        cdef list dst = destinations(out, n, bb)
        cdef unsigned char[::1] mv
        cdef char* p
        cdef int rc = 0
        cdef uint64_t st[8]
        for i in range(n):
            mv = dst[i]
            p = <char*>&mv[0]
            self.region._busy += 1  # Region.close() refuses while we copy without the GIL
            try:
                with nogil:
                    rc = self._check_payload(hit, first + i)
                    if rc == 0:
                        rc = cxl_dma_read(self.r, hit.offs[first + i] + KV_PAYLOAD_HDR, p, bb)
                    if rc == 0:  # and still ours after the copy: no reuse slipped in
                        rc = self._check_payload(hit, first + i)
            finally:
                self.region._busy -= 1
            if rc != 0:
                self._raise(rc, "load")
        memset(st, 0, sizeof(st))
        st[7] = n * bb
        with nogil:
            rc = self._stats_locked(st)
        if rc != 0:
            self._raise(rc, "load")
        return out

    def _count_loaded(self, uint64_t nbytes):
        """Count bytes a load path outside load() copied (the CUDA one)."""
        cdef uint64_t st[8]
        cdef int rc
        memset(st, 0, sizeof(st))
        st[7] = nbytes
        with nogil:
            rc = self._stats_locked(st)
        if rc != 0:
            self._raise(rc, "load")

    def views(self, Hit hit not None):
        """Zero-copy read-only views of the hit's blocks (mappable backends only).

        Valid while the hit is pinned. On a non-coherent mapping the payload's
        lines are flushed first, so the CPU reads what the writer's DMA left.
        """
        self._need_open()
        if hit.cache is not self:
            raise ValueError("this Hit came from another KV cache")
        if hit.released:
            raise ValueError("this Hit was released: its blocks may be gone")
        if not self.r.caps & CXL_CAP_MAPPABLE:
            from cxlrt.errors import UnsupportedError
            raise UnsupportedError(f"views: {self.region.backend.scheme}: memory is not "
                                   "mappable; use load()")
        cdef uint64_t i
        cdef int rc
        out = []
        for i in range(hit.n):
            with nogil:
                rc = self._check_payload(hit, i)
                if rc == 0 and not self.r.caps & CXL_CAP_COHERENT:
                    rc = cxl_flush(self.r, hit.offs[i] + KV_PAYLOAD_HDR, self.block_bytes)
            if rc != 0:
                self._raise(rc, "views")
            out.append(self.region.view(hit.offs[i] + KV_PAYLOAD_HDR,
                                        self.block_bytes).toreadonly())
        return out

    # --- store -----------------------------------------------------------------------------

    def store(self, keys, blocks):
        """Store `blocks` under `keys`; returns the keys this call stored.

        `blocks` is a sequence of len(keys) buffers of block_bytes each, or one
        contiguous buffer of len(keys) * block_bytes. Keys already present or
        being written by another node are skipped (exactly one copy wins). When
        slots or heap run out, least-recently-used unpinned blocks are evicted;
        keys that still find no room are left out of the result, not an error.
        """
        self._need_open()
        cdef list ks = _keys(keys)
        cdef uint64_t n = len(ks), bb = self.block_bytes
        from cxlrt._buffers import sources
        srcs = sources(blocks, n, bb)
        cdef list reserved = []          # (slot, gen, off, index)
        cdef uint64_t st[8]
        memset(st, 0, sizeof(st))
        with self._lock:
            try:
                for j in range(n):
                    got = self._reserve(ks[j])
                    if got is None:
                        st[4] += 1
                        continue
                    if got is False:
                        break  # no room even after eviction: store what we have
                    reserved.append(got + (j,))
            except BaseException:
                self._finish(reserved, ks, False)  # nothing half-reserved stays behind
                raise
        done = False
        published = []
        try:
            self.region._busy += 1  # Region.close() refuses while we copy without the GIL
            try:
                self._copy(reserved, ks, srcs)
            finally:
                self.region._busy -= 1
            done = True
        finally:
            with self._lock:
                published = self._finish(reserved, ks, done)
        st[3] = len(published)
        st[6] = len(published) * bb
        cdef int rc
        with nogil:
            rc = self._stats_locked(st)
        if rc != 0:
            self._raise(rc, "store")
        return [ks[j] for j in published]

    def _reserve(self, bytes key):
        """Claim a slot and a payload for `key` (cache lock held).

        (slot, gen, off) claimed; None when the key is present or being written;
        False when there is no room even after evicting.
        """
        cdef kv_entry e
        cdef uint64_t s = 0, free_slot = 0, off = 0
        cdef int rc
        cdef const char* kp = PyBytes_AS_STRING(key)
        with nogil:
            rc = self._probe(kp, &s, &e, &free_slot)
        if rc < 0:
            self._raise(rc, "store")
        if rc == 1:
            if _state(&e) != KV_WRITING or not self._writer_dead(e.owner, e.stamp_ns):
                return None  # present, or being written: exactly one copy wins
            self._evict_one(s, True)  # its writer died: the key is free to store again
            with nogil:
                rc = self._probe(kp, &s, &e, &free_slot)
            if rc != 0:
                if rc < 0:
                    self._raise(rc, "store")
                return None
        if self._occupancy() >= self.capacity:
            if not self._evict(max(1, self.capacity // 16)):
                return False
            with nogil:
                rc = self._probe(kp, &s, &e, &free_slot)
            if rc < 0:
                self._raise(rc, "store")
        if free_slot == <uint64_t>-1:
            return False
        try:
            off = self.region.alloc(KV_PAYLOAD_HDR + self.block_bytes, 64)
        except OutOfMemory:
            off = 0
            while off == 0 and self._evict(max(1, self.capacity // 16)):
                try:
                    off = self.region.alloc(KV_PAYLOAD_HDR + self.block_bytes, 64)
                except OutOfMemory:
                    off = 0
            if off == 0:
                return False
            with nogil:
                rc = self._probe(kp, &s, &e, &free_slot)  # eviction may free an earlier slot
            if rc < 0:
                self.region.free(off)
                self._raise(rc, "store")
            if free_slot == <uint64_t>-1:
                self.region.free(off)
                return False
        s = free_slot
        with nogil:
            rc = self._read(s, &e)
        if rc != 0:
            self.region.free(off)
            self._raise(rc, "store")
        cdef uint64_t gen = _gen(&e) + 1
        memcpy(<void*>e.key, kp, 16)
        e.meta = (gen << 8) | KV_WRITING
        e.off = off
        e.len = KV_PAYLOAD_HDR + self.block_bytes
        e.owner = self._node | (<uint64_t>os.getpid() << 16)
        e.stamp_ns = cxl_wall_ns()
        with nogil:
            rc = self._write(s, &e)
        if rc != 0:
            self.region.free(off)
            self._raise(rc, "store")
        self._add_occupancy(1, <long long>self.block_bytes)
        return (s, gen, off)

    def _copy(self, list reserved, list ks, list srcs):
        """DMA each reserved payload (no lock held): header, then the block."""
        cdef uint64_t h[8]
        cdef const unsigned char[::1] src
        cdef uint64_t off, bb = self.block_bytes
        cdef int rc
        for s, gen, off, j in reserved:
            src = srcs[j]
            memset(h, 0, sizeof(h))
            h[0] = PMAGIC
            memcpy(&h[1], PyBytes_AS_STRING(ks[j]), 16)
            h[3] = gen
            h[4] = bb
            h[5] = self.offset
            with nogil:
                rc = cxl_dma_write(self.r, off, h, 64)
                if rc == 0:
                    rc = cxl_dma_write(self.r, off + KV_PAYLOAD_HDR, &src[0], bb)
            if rc != 0:
                self._raise(rc, "store")

    def _finish(self, list reserved, list ks, bint ok):
        """Publish the reserved entries ready, or give them back (cache lock held).

        Returns the indexes (into `ks`) of the entries published.
        """
        cdef kv_entry e
        cdef uint64_t s, gen
        cdef int rc
        published = []
        for s, gen, off, j in reserved:
            with nogil:
                rc = self._read(s, &e)
            if rc != 0:
                self._raise(rc, "store")
            if _state(&e) != KV_WRITING or _gen(&e) != gen:
                continue  # reclaimed meanwhile (we were presumed dead): not ours now
            if not ok:
                self._bury(s, &e, "store")
                continue
            e.meta = (gen << 8) | KV_READY
            e.stamp_ns = cxl_wall_ns()
            with nogil:
                rc = self._write(s, &e)
            if rc != 0:
                self._raise(rc, "store")
            published.append(j)
        return published

    cdef _bury(self, uint64_t s, kv_entry* e, str what):
        """Turn entry `s` (held in `e`) into a tombstone of the next generation and
        free its payload (cache lock held): the slot's old (slot, generation) pair
        is dead for every reader from here on."""
        cdef uint64_t off = e.off
        cdef int rc
        memset(<void*>e.key, 0, 16)
        e.meta = ((_gen(e) + 1) << 8) | KV_TOMBSTONE
        e.off = e.len = e.owner = 0
        with nogil:
            rc = self._write(s, e)
        if rc != 0:
            self._raise(rc, what)
        self.region.free(off)
        self._add_occupancy(-1, -<long long>self.block_bytes)

    # --- occupancy and eviction ----------------------------------------------------------

    def _occupancy(self):
        self.region.flush(self.offset + 128, 64)
        return self.region.load64(self.offset + 128)

    def _add_occupancy(self, long long d, long long nbytes):
        at = self.offset + 128
        self.region.flush(at, 64)
        occ = self.region.load64(at)
        pb = self.region.load64(at + 8)
        self._set_occupancy(max(0, occ + d), max(0, pb + nbytes))

    def _set_occupancy(self, uint64_t occ, uint64_t nbytes):
        at = self.offset + 128
        self.region.flush(at, 64)
        self.region.store64(at, occ)
        self.region.store64(at + 8, nbytes)
        self.region.persist(at, 64)

    cdef int _pinned(self, uint64_t s, uint64_t* recency_ms) noexcept nogil:
        """1 if any node pins slot s, else 0; recency_ms gets the latest use."""
        cdef uint64_t j, w = 0, at
        cdef int rc, pinned = 0
        for j in range(self._nodes):
            at = self._pt.at(j, s)
            rc = cxl_flush(self.r, at, 8)
            if rc == 0:
                rc = cxl_load64(self.r, at, &w)
            if rc != 0:
                return rc
            if w & KV_PIN_MAX:
                pinned = 1
            if (w >> 16) > recency_ms[0]:
                recency_ms[0] = w >> 16
        return pinned

    def _evict(self, uint64_t want):
        """Evict up to `want` least-recently-used unpinned blocks (cache lock held).

        Also reclaims entries whose writer died mid-store. Returns the number freed.
        """
        cdef kv_entry e
        cdef uint64_t s, rec, owner_node
        cdef int rc
        cdef list cands = []
        used = 0
        for s in range(self.slots):
            with nogil:
                rc = self._read(s, &e)
            if rc != 0:
                self._raise(rc, "evict")
            st = _state(&e)
            if st in (KV_WRITING, KV_READY, KV_EVICTING):
                used += 1
            if st == KV_WRITING:
                if self._writer_dead(e.owner, e.stamp_ns):
                    cands.append((-1, s))
                continue
            if st != KV_READY and st != KV_EVICTING:
                continue
            rec = e.stamp_ns // 1000000
            with nogil:
                rc = self._pinned(s, &rec)
            if rc < 0:
                self._raise(rc, "evict")
            if rc == 0 or self._ignore_pins:
                cands.append((rec, s))
        # The scan saw every entry under the lock: the exact count, whatever a crash
        # between an entry write and a counter update left behind.
        self._set_occupancy(used, used * self.block_bytes)
        cands.sort()
        freed = 0
        for prio, slot in cands:
            if freed >= want:
                break
            if self._evict_one(slot, prio == -1):
                freed += 1
        if freed:
            self._sweep_tombstones()
        elif self.recover():
            return self._evict(want)  # our node's dead processes held the pins
        return freed

    def _writer_dead(self, uint64_t owner, uint64_t stamp_ns):
        """Whether the writer of a `writing` entry is gone for good.

        On our node the kernel knows. Another node is judged by its heartbeat,
        as the locks judge it, but only once the entry is four leases old: a
        writer wrongly presumed dead would go on copying into a payload we had
        handed to someone else.
        """
        cdef uint64_t node = owner & 0xffff, pid = owner >> 16
        if node >= self._nodes:
            return True
        if node != self._node:
            old = cxl_wall_ns() > stamp_ns + 4 * self.region.lease_ms * 1000000
            return old and bool(cxl_node_dead(self.L, <uint32_t>node))
        if pid == <uint64_t>os.getpid():
            return False
        return not process_alive(pid, 0)

    def _evict_one(self, uint64_t s, bint writing):
        cdef kv_entry e
        cdef uint64_t rec = 0, gen
        cdef int rc
        with nogil:
            rc = self._read(s, &e)
        if rc != 0:
            self._raise(rc, "evict")
        gen = _gen(&e)
        if not writing:
            if _state(&e) not in (KV_READY, KV_EVICTING):
                return False
            e.meta = (gen << 8) | KV_EVICTING
            with nogil:
                rc = self._write(s, &e)  # ends with a full fence: then read the pins
                if rc == 0:
                    rc = self._pinned(s, &rec)
            if rc < 0:
                self._raise(rc, "evict")
            if rc == 1 and not self._ignore_pins:  # a reader pinned it meanwhile: it stays
                e.meta = (gen << 8) | KV_READY
                with nogil:
                    rc = self._write(s, &e)
                if rc != 0:
                    self._raise(rc, "evict")
                return False
        if not self._payload_ok(&e):
            self._bad_slot = s
            self._raise(CXLRT_E_KVCORRUPT, "evict")
        self._bury(s, &e, "evict")
        cdef uint64_t st[8]
        memset(st, 0, sizeof(st))
        st[5] = 1
        with nogil:
            rc = self._stats_locked(st)
        return True

    def _sweep_tombstones(self):
        """Turn tombstones that end a probe run into empty slots (cache lock held).

        A tombstone followed by an empty slot ends every run through it, so it can
        be empty itself; walking down from each empty slot clears whole tails.
        """
        cdef kv_entry e, nxt
        cdef uint64_t s, i
        cdef int rc
        for i in range(self.slots):
            s = self._mask - i
            with nogil:
                rc = self._read(s, &e)
                if rc == 0 and _state(&e) == KV_TOMBSTONE:
                    rc = self._read((s + 1) & self._mask, &nxt)
                    if rc == 0 and _state(&nxt) == KV_EMPTY:
                        e.meta = (_gen(&e) << 8) | KV_EMPTY
                        rc = self._write(s, &e)
            if rc != 0:
                self._raise(rc, "evict")

    # --- figures ---------------------------------------------------------------------------

    def stats(self):
        """Counters summed over nodes, plus occupancy (blocks) and capacity."""
        self._need_open()
        tot = dict.fromkeys(STAT_NAMES, 0)
        r = self.region
        for j in range(self._nodes):
            at = self._stats + j * STATS_WORDS * 8
            r.flush(at, 64)
            raw = r.load(at, 64)
            for i, k in enumerate(STAT_NAMES):
                tot[k] += int.from_bytes(raw[i * 8:i * 8 + 8], "little")
        r.flush(self.offset + 128, 64)
        tot["occupancy"] = r.load64(self.offset + 128)
        tot["payload_bytes"] = r.load64(self.offset + 136)
        tot["capacity"] = self.capacity
        tot["block_bytes"] = self.block_bytes
        tot["slots"] = self.slots
        return tot

    def entries(self):
        """Every occupied slot as a dict (inspection and `cxlrt check`; no lock taken)."""
        self._need_open()
        cdef kv_entry e
        cdef uint64_t s
        cdef int rc
        out = []
        for s in range(self.slots):
            with nogil:
                rc = self._read(s, &e)
            if rc != 0:
                self._raise(rc, "entries")
            st = _state(&e)
            if st in (KV_EMPTY, KV_TOMBSTONE):
                continue
            out.append({"slot": s, "state": STATE_NAMES.get(st, str(st)), "generation": _gen(&e),
                        "key": (<char*>e.key)[:16], "offset": e.off, "length": e.len,
                        "node": e.owner & 0xffff, "pid": e.owner >> 16})
        return out

    def slot_offset(self, uint64_t s):
        """Region offset of entry `s` (for tools and tests that inspect the table)."""
        if s >= self.slots:
            raise IndexError(f"slot {s} of {self.slots}")
        return self._entries + s * 64

    def close(self):
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"<KVCache {self.name!r} block_bytes={self.block_bytes} "
                f"capacity={self.capacity} on {self.region.spec}>")


cdef class Hit:
    """Pinned leading blocks of a lookup: ``len(hit)``, ``hit.keys``, ``release()``.

    Made by :meth:`KVCache.lookup`. The pins belong to the process that looked up:
    in a forked child, ``release()`` only forgets them.
    """

    cdef readonly KVCache cache
    cdef readonly tuple keys
    cdef uint64_t n
    cdef uint64_t* slots
    cdef uint64_t* gens
    cdef uint64_t* offs
    cdef const char** keyp
    cdef readonly bint released
    cdef int owner_pid

    def __cinit__(self):
        self.keys = ()

    cdef _alloc(self, uint64_t n):
        cdef uint64_t k = max(n, 1)
        self.slots = <uint64_t*>malloc(k * 8)
        self.gens = <uint64_t*>malloc(k * 8)
        self.offs = <uint64_t*>malloc(k * 8)
        self.keyp = <const char**>malloc(k * sizeof(char*))
        if self.slots == NULL or self.gens == NULL or self.offs == NULL or self.keyp == NULL:
            raise MemoryError()

    def __len__(self):
        return self.n

    @property
    def nbytes(self):
        return self.n * self.cache.block_bytes if self.cache is not None else 0

    cdef bint _mine(self):
        return (not self.released and self.cache is not None and self.n > 0
                and self.owner_pid == cxl_pid() and not self.cache.r.closed)

    def release(self):
        """Unpin the blocks (idempotent)."""
        cdef int rc = 0
        mine = self._mine()
        self.released = True
        if mine:
            with nogil:
                rc = self.cache._unpin(self.slots, self.n)
            if rc != 0:
                self.cache._raise(rc, "release")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __dealloc__(self):
        if self._mine():
            self.cache._unpin(self.slots, self.n)
        free(self.slots)
        free(self.gens)
        free(self.offs)
        free(self.keyp)

    def __repr__(self):
        return f"<Hit {self.n} blocks{' released' if self.released else ''}>"


cdef list _keys(keys):
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError("keys must be a sequence of 16-byte keys, not one bytes object")
    out = []
    for k in keys:
        if not isinstance(k, bytes) or PyBytes_GET_SIZE(k) != KEY_BYTES:
            raise ValueError(f"keys must be {KEY_BYTES}-byte bytes (from block_hashes), "
                             f"got {k!r:.40}")
        out.append(k)
    return out


cdef uint64_t _fnv(bytes b):
    cdef uint64_t h = <uint64_t>0xcbf29ce484222325ULL
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(b)
    cdef Py_ssize_t i
    for i in range(PyBytes_GET_SIZE(b)):
        h = (h ^ p[i]) * <uint64_t>0x100000001b3ULL
    return h


def _break_pin_protocol(KVCache cache):
    """Make `cache` evict pinned blocks: the broken protocol the tests must catch."""
    cache._ignore_pins = True


def _forge_entry(bytes key, uint32_t state, uint64_t gen, uint64_t off, uint64_t length,
                uint64_t owner=0, uint64_t stamp_ns=0):
    """The 64 bytes of an entry with a valid check word (tests forge corrupt entries)."""
    cdef kv_entry e
    if len(key) != 16:
        raise ValueError("key must be 16 bytes")
    memcpy(<void*>e.key, PyBytes_AS_STRING(key), 16)
    e.meta = (gen << 8) | state
    e.off = off
    e.len = length
    e.owner = owner
    e.stamp_ns = stamp_ns
    e.check = _mix(&e)
    return (<char*>&e)[:64]


def describe(region, uint64_t dir_off):
    """Every KV cache named in a region's directory, read by DMA without attaching.

    For `cxlrt info`: geometry, occupancy and the counters summed over nodes. A
    cache whose header cannot be right is listed with an "error".
    """
    import struct
    out = []
    for i in range(128):
        raw = region.dma_read(dir_off + i * 128, 128)
        state, off, n, gen = struct.unpack_from("<QQQQ", raw)
        if state != 1 or gen & 1 or n > 64:
            continue
        name = raw[64:64 + n].decode("utf-8", "replace")
        if not name.startswith(DIR_PREFIX):
            continue
        item = {"name": name[len(DIR_PREFIX):], "offset": off}
        try:
            head = region.dma_read(off, KV_HEADER)
            w = struct.unpack_from("<QIIQQQII", head)
            lay = struct.unpack_from("<8Q", head, 64)
            if w[0] != MAGIC or _fnv(head[:120]) != lay[7]:
                raise RegionError("not a KV cache header")
            item.update(slots=w[3], capacity_blocks=w[4], block_bytes=w[5], block_tokens=w[6],
                        algorithm=ALGORITHM_NAMES.get(w[7], str(w[7])),
                        salt_digest=head[48:64].hex(),
                        occupancy=struct.unpack_from("<Q", head, 128)[0])
            totals = dict.fromkeys(STAT_NAMES, 0)
            for j in range(lay[0]):
                words = struct.unpack("<8Q", region.dma_read(lay[3] + j * STATS_WORDS * 8, 64))
                for k, v in zip(STAT_NAMES, words, strict=True):
                    totals[k] += v
            item.update(totals)
        except (RegionError, IndexError, struct.error) as e:
            item["error"] = str(e)
        out.append(item)
    return out
