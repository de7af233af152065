# Prefix KV cache: a hash index of chained block keys and a block store, in a region.
#
# On-media object, format 2 (one allocation, registered by name in the directory):
#   line 0   geometry, immutable: magic, version, key bytes, slots, capacity,
#            block_bytes, block_tokens, algorithm, salt digest
#   line 1   layout, immutable: nodes, entries, pins, stats, created, total,
#            claims, checksum (records follow the claims)
#   line 2   counters written under the cache lock: occupancy, payload bytes,
#            records in use (high-water mark of the record table)
#   entries  `slots` lines, one per slot; written only under the cache lock
#   pins     `slots` words per node; node n's words are written only by node n
#   stats    one line per node, written only by that node
#   claims   `slots` lines: who writes slot s's payload (kv_claim); written only
#            under the cache lock, never by the writer's copy
#   records  kv_records(slots) lines: payloads on their way back to the allocator
#            (an eviction or takeover in progress, a quarantine, a free to retry);
#            written only under the cache lock
# Every payload is an allocator object: a 64-byte header (magic, key, generation,
# block_bytes, cache offset, progress word, writer) then block_bytes of KV. Only
# the payload's writer writes it, by DMA, before the entry is published ready.
#
# Invariants:
#  - An entry's words change only under the cache lock, each change written as
#    a whole line with a check word, so a lock-free reader detects a torn copy.
#  - A slot's generation grows whenever the slot is given to another key or
#    emptied: (slot, generation) names one payload for as long as it is pinned,
#    and it is the epoch of a WRITING claim. A takeover buries the entry (the
#    generation moves on); the writer re-checks (state, generation) before it
#    publishes and fails instead of writing.
#  - A claim's owner (node, incarnation, process) and epoch live on the slot's
#    claim line; the writer's only shared word while it copies is the progress
#    word in its own payload header (KV_PROGRESS), never beside the claim.
#  - A payload leaves an entry only through a record written before the entry's
#    tombstone: a crash between the two is finished (or undone) by the next lock
#    holder. A payload taken from a writer that may still run is quarantined
#    (KV_REC_QUARANTINE) until the writer is known to have stopped.
#  - Eviction marks an entry EVICTING, fences, then reads every node's pin; a
#    reader pins, fences, then re-reads the entry. One of the two sees the other
#    (store-fence-load on both sides), so a pinned payload is never freed.
#  - Pins count only while their node is alive (cxlrt/liveness.pyx): the pins of
#    a detached, dead or never-attached node are void to eviction and delete. A
#    payload evicted despite void pins is quarantined (KV_REC_TAKE, then
#    KV_REC_QUARANTINE; `where` is KV_PIN_WHERE, in cxl_kv.h, and `start` the
#    mask of those nodes), since a stalled node may resume and read it; its header
#    is wiped before it is freed, so a stale hit's load fails its header check
#    after any reuse.
from libc.stdint cimport uint64_t


cdef enum:
    KV_EMPTY = 0
    KV_WRITING = 1
    KV_READY = 2
    KV_TOMBSTONE = 3
    KV_EVICTING = 4
    KV_HEADER = 192            # three lines before the entries
    KV_PAYLOAD_HDR = 64        # payload header ahead of the block bytes
    KV_PROGRESS = 48           # the writer's progress word in the payload header
    KV_REC_FREE = 0            # an unused record (all-zero line)
    KV_REC_CLAIM = 1           # a claim line (claims section only)
    KV_REC_EVICT = 2           # bury (slot, epoch), then free the payload
    KV_REC_TAKE = 3            # bury (slot, epoch), then quarantine the payload
    KV_REC_QUARANTINE = 4      # a payload whose writer may still be copying into it
    KV_REC_DEFERRED = 5        # a payload nobody references, whose free() failed: retry
    KV_QUARANTINE_LEASES = 8   # see kvclaim.pyx: release of a dead node's quarantine
    KV_COPY_CHUNK = 1048576    # bytes copied between two progress/epoch checks
    KV_ENTRY_META = 16         # offset of kv_entry.meta (checked at import)
    KV_KEY_BYTES = 16          # a chained block key (cxlrt.hashing.KEY_BYTES)


cdef enum:                     # the words of a node's stats line, in STAT_NAMES order
    KV_ST_LOOKUPS = 0
    KV_ST_HITS = 1             # blocks a lookup pinned
    KV_ST_MISSES = 2           # keys a lookup asked for and did not pin
    KV_ST_STORES = 3           # blocks stored
    KV_ST_SKIPPED = 4          # keys a store found present or being written
    KV_ST_EVICTIONS = 5
    KV_ST_BYTES_STORED = 6
    KV_ST_BYTES_LOADED = 7
    KV_ST_WORDS = 8            # one 64-byte line per node


ctypedef struct kv_stats:      # a node's stats line: the words the KV_ST_* above number
    uint64_t lookups
    uint64_t hits
    uint64_t misses
    uint64_t stores
    uint64_t skipped
    uint64_t evictions
    uint64_t bytes_stored
    uint64_t bytes_loaded


ctypedef struct kv_entry:
    uint64_t key[2]
    uint64_t meta              # generation << 8 | state
    uint64_t off               # payload (header) offset in the region
    uint64_t len               # payload bytes: KV_PAYLOAD_HDR + block_bytes
    uint64_t owner             # writer: node | pid << 16 (for people; the claim line judges)
    uint64_t stamp_ns          # wall clock when stored: an LRU hint only, never a liveness test
    uint64_t check             # mix of the words above; 0 for an all-zero entry


ctypedef struct kv_claim:      # a claim line, and a record (same line format)
    uint64_t tag               # KV_REC_* | node << 8 | pid << 24
    uint64_t off               # the payload
    uint64_t epoch             # the slot generation the payload belongs (belonged) to
    uint64_t slot
    uint64_t inc               # incarnation of the writer's node when it claimed
    uint64_t start             # the writer process's start time (clock ticks after boot);
                               # for void pins: the mask of the nodes whose pins were void
    uint64_t where             # hash of the writer's boot id and pid namespace, or
                               # KV_PIN_WHERE: a payload evicted despite void pins
    uint64_t check             # mix of the words above; 0 for an all-zero line


ctypedef struct kv_job:        # one payload a store() copies (process memory only)
    uint64_t slot
    uint64_t gen
    uint64_t off
    const unsigned char* src
    const char* key
    int lost                   # its claim was taken over: stop writing it
