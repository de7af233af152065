# The KV cache's on-media object (the object map in kvcache.pxd): where its sections
# lie for a geometry, how a node creates it (zeroed, the layout line, then the
# magic last), and what an attaching node checks before it trusts any offset in it.
"""Create and attach the on-media object of a KV cache.

A cache's geometry line (line 0) says what its keys mean (hash algorithm, salt
digest, tokens per block) and how big it is; the layout line (line 1) where its
sections lie, with a checksum over both. A node creating a cache zeroes the whole
object by DMA, writes the layout line, and publishes the magic last, under the
"kv:create" lock; a node attaching it reads both lines, checks the checksum and
the version, and refuses a cache whose scheme differs from the one it asked for
(keys that can never match would be a silent zero hit rate).
"""
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from cpython.bytes cimport PyBytes_AS_STRING

from cxlrt.includes.intrin cimport cxl_fnv1a64, cxl_wall_ns
from cxlrt.kvcache cimport KV_HEADER, KV_REC_CLAIM, kv_claim, kv_entry, kv_stats
from cxlrt.kvindex cimport kv_index
from cxlrt.layout cimport kv_geometry, kv_header, kv_layout
from cxlrt.region cimport Region

from cxlrt.errors import OutOfMemory, RegionError, SchemeMismatchError
from cxlrt.hashing import ALGORITHM_NAMES

cdef uint64_t MAGIC = 0x31304356_4B4C5843   # "CXLKVC01" (the version word says the format)
cdef uint32_t VERSION = 2                   # 2: claim lines, records, progress word

# offsetof by address difference (Cython has no offsetof)
cdef kv_header _kh
cdef uint64_t KV_AT_LAYOUT = <char*>&_kh.layout - <char*>&_kh
cdef uint64_t KV_AT_COUNTERS = <char*>&_kh.counters - <char*>&_kh
# what the header checksum covers: the geometry line and the layout words before it
cdef uint64_t KV_SUMMED = <char*>&_kh.layout.checksum - <char*>&_kh

DIR_PREFIX = "kv/"         # directory names of KV caches
FORMAT_MAGIC = MAGIC       # kv_geometry.magic of a complete cache object
FORMAT_VERSION = VERSION   # the on-media format this build reads and writes
REC_CLAIM = KV_REC_CLAIM   # the kind of a claim line (kv_claim.tag's low byte)


def header_checksum(head):
    """The checksum a cache header with these first bytes carries (kv_layout.checksum:
    FNV-1a 64 over the geometry line and the layout words before it)."""
    cdef bytes raw = bytes(head)
    if <uint64_t>len(raw) < KV_SUMMED:
        raise ValueError(f"a KV cache header's checksum covers {KV_SUMMED} bytes, got {len(raw)}")
    return cxl_fnv1a64(<const unsigned char*>PyBytes_AS_STRING(raw), KV_SUMMED)


cdef void _shape(kv_index* K, kv_geometry* G, uint64_t block_bytes, uint64_t capacity) noexcept:
    """Size the table for `capacity` blocks: a load factor <= 1/2 keeps probe runs short."""
    cdef uint64_t slots = 8
    while slots < 2 * capacity:
        slots <<= 1
    G.magic = MAGIC
    G.version = VERSION
    G.block_bytes = K.block_bytes = block_bytes
    G.capacity = capacity
    G.slots = K.slots = slots
    K.mask = slots - 1
    K.nrec = max(64, slots // 8)


cdef uint64_t _sections(const kv_index* K, uint64_t base, kv_layout* lay) noexcept:
    """Fill the section offsets of a cache object at `base` (the object map in
    kvcache.pxd) into `lay`; returns where the records start."""
    lay.nodes = K.nodes
    lay.entries = base + sizeof(kv_header)
    lay.pins = lay.entries + K.slots * sizeof(kv_entry)
    lay.stats = lay.pins + K.nodes * K.slots * sizeof(uint64_t)
    lay.claims = lay.stats + K.nodes * sizeof(kv_stats)
    cdef uint64_t records = lay.claims + K.slots * sizeof(kv_claim)
    lay.total = records + K.nrec * sizeof(kv_claim) - base
    return records


cdef int _read_header(Region region, str name, const kv_index* K, uint64_t base,
                      kv_header* h) except -1:
    """The geometry and layout lines of the cache object at `base`, checked."""
    if base % 64 or base < K.heap_lo or base + KV_HEADER > K.heap_hi:
        raise RegionError(f"KV cache {name!r}: directory offset {base} is not a "
                          "cache object (corrupt)")
    region.flush(base, KV_AT_COUNTERS)
    cdef bytes raw = bytes(region.load(base, KV_AT_COUNTERS))
    memcpy(h, PyBytes_AS_STRING(raw), KV_AT_COUNTERS)
    if h.geometry.magic != MAGIC:
        raise RegionError(f"{name!r} in the directory is not a KV cache")
    version = h.geometry.version
    if version != VERSION:
        raise RegionError(
            f"KV cache {name!r} has on-media format {version}; this build reads "
            f"format {VERSION}" + (" only (format 1 has no claim lines or records, so its "
                                   "writers cannot be fenced). Recreate the cache under "
                                   "another name, or delete it with "
                                   f"region.delete({DIR_PREFIX + name!r}) once no "
                                   "process uses it" if version < VERSION else ""))
    if cxl_fnv1a64(<const unsigned char*>h, KV_SUMMED) != h.layout.checksum:
        raise RegionError(f"KV cache {name!r}: header checksum mismatch (corrupt)")
    return 0


cdef uint64_t _create(Region region, str key, const kv_index* K,
                      const kv_geometry* G) except? 0:
    """Allocate, zero and publish a cache object; register it as `key`."""
    cdef kv_header h
    cdef uint64_t total, base
    h.geometry = G[0]
    _sections(K, 0, &h.layout)
    total = h.layout.total
    try:
        base = region.alloc(total, 64)
    except OutOfMemory as e:
        raise OutOfMemory(f"KV cache {key!r}: its index needs {total} bytes: {e}") from None
    region.flush(base, total)  # no stale line of the memory's last use may land later
    zeros = bytes(min(total, 1 << 20))
    pos = 0
    while pos < total:  # the heap keeps old bytes; DMA bypasses every cache
        n = min(len(zeros), total - pos)
        region.dma_write(base + pos, zeros[:n])
        pos += n
    _sections(K, base, &h.layout)
    h.layout.created_ns = cxl_wall_ns()
    h.layout.checksum = cxl_fnv1a64(<const unsigned char*>&h, KV_SUMMED)
    region.store(base + KV_AT_LAYOUT, (<char*>&h.layout)[:sizeof(kv_layout)])
    region.persist(base + KV_AT_LAYOUT, sizeof(kv_layout))
    # the magic goes last: attachers wait for it
    region.store(base, (<char*>&h.geometry)[:sizeof(kv_geometry)])
    region.persist(base, sizeof(kv_geometry))
    region.put(key, base)
    return base


cdef int _check_scheme(Region region, str name, const kv_geometry* ours,
                       const kv_geometry* g) except -1:
    if memcmp(g, ours, sizeof(kv_geometry)) == 0:
        return 0
    diffs = []
    if g.algorithm != ours.algorithm:
        diffs.append(f"hash algorithm {ALGORITHM_NAMES.get(g.algorithm, g.algorithm)!r} "
                     f"(you asked for {ALGORITHM_NAMES.get(ours.algorithm)!r})")
    salt = (<const char*>g.salt_digest)[:sizeof(g.salt_digest)]
    mine = (<const char*>ours.salt_digest)[:sizeof(ours.salt_digest)]
    if salt != mine:
        diffs.append(f"salt digest {salt[:8].hex()}... (yours is {mine[:8].hex()}...: "
                     "another model, dtype, layout or tenant salt)")
    for label, theirs, asked in (("block_tokens", g.block_tokens, ours.block_tokens),
                                 ("block_bytes", g.block_bytes, ours.block_bytes),
                                 ("capacity_blocks", g.capacity, ours.capacity),
                                 ("key bytes", g.key_bytes, ours.key_bytes)):
        if theirs != asked:
            diffs.append(f"{label} {theirs} (you asked for {asked})")
    raise SchemeMismatchError(
        f"KV cache {name!r} in {region.spec} was created with a different scheme: "
        + "; ".join(diffs or ["geometry words differ"])
        + ". Attach with the same parameters or use another name (with another salt or "
          "block size, keys would never match: a silent zero hit rate)")


cdef int _validate(Region region, str name, kv_index* K, const kv_geometry* G,
                   uint64_t base) except -1:
    cdef kv_header h
    cdef kv_layout ours
    _read_header(region, name, K, base, &h)
    _check_scheme(region, name, G, &h.geometry)
    K.records = _sections(K, base, &ours)
    if h.layout.nodes != K.nodes or h.layout.total != ours.total or \
            base + h.layout.total > K.heap_hi:
        raise RegionError(f"KV cache {name!r}: layout does not fit this region (corrupt)")
    if (h.layout.entries, h.layout.pins, h.layout.stats, h.layout.claims) != \
            (ours.entries, ours.pins, ours.stats, ours.claims):
        raise RegionError(f"KV cache {name!r}: section offsets are corrupt")
    K.entries, K.pins, K.stats, K.claims = ours.entries, ours.pins, ours.stats, ours.claims
    return 0


cdef int kv_attach(Region region, str name, kv_index* K, kv_geometry* G, bint create,
                   block_bytes, capacity) except -1:
    """Find cache `name` (creating it if `create`), then check it and point K at it.

    G holds the scheme asked for (key bytes, tokens, algorithm, salt digest); its
    size fields come from `block_bytes` and `capacity`, or from the object when
    either is None. K needs nodes and the heap bounds; this sets its geometry,
    offset and sections.
    """
    cdef kv_header h
    cdef uint64_t heap = K.heap_hi - K.heap_lo
    # No heap holds more blocks than it has bytes (nor a block larger than itself);
    # the table's sizing would also overflow past 2**62 blocks.
    for what, v in (("capacity_blocks", capacity), ("block_bytes", block_bytes)):
        if v is not None and v > heap:
            raise ValueError(f"{what}={v} is more than this region's heap ({heap} bytes) "
                             "could hold")
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
        _shape(K, G, block_bytes, capacity)
        with region.lock("kv:create"):
            try:
                off = region.get(key)
            except KeyError:
                off = _create(region, key, K, G)
    if block_bytes is None or capacity is None:  # attach with the recorded geometry
        _read_header(region, name, K, off, &h)
        block_bytes = block_bytes or h.geometry.block_bytes
        capacity = capacity or h.geometry.capacity
        if block_bytes < 1 or capacity < 1 or capacity > K.heap_hi:
            raise RegionError(f"KV cache {name!r}: recorded geometry is corrupt")
    _shape(K, G, block_bytes, capacity)
    K.offset = off
    _validate(region, name, K, G, off)
    return 0
