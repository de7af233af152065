# Prefix KV cache: a hash index of chained block keys and a block store, in a region.
#
# On-media object (one allocation, registered by name in the directory):
#   line 0   geometry, immutable: magic, version, slots, capacity, block_bytes,
#            block_tokens, algorithm, salt digest
#   line 1   layout, immutable: nodes, section offsets, created, checksum
#   line 2   counters written under the cache lock: occupancy, payload bytes
#   entries  `slots` lines, one per slot; written only under the cache lock
#   pins     `slots` words per node; node n's words are written only by node n
#   stats    one line per node, written only by that node
# Every payload is an allocator object: a 64-byte header (magic, key, generation,
# length, owning index) then block_bytes of KV, written by DMA before the entry
# that points at it is published ready.
#
# Invariants:
#  - An entry's words change only under the cache lock, each change written as
#    a whole line with a check word, so a lock-free reader detects a torn copy.
#  - A slot's generation grows whenever the slot is given to another key or
#    emptied: (slot, generation) names one payload for as long as it is pinned.
#  - Eviction marks an entry EVICTING, fences, then reads every node's pin; a
#    reader pins, fences, then re-reads the entry. One of the two sees the other
#    (store-fence-load on both sides), so a pinned payload is never freed.
from libc.stdint cimport uint64_t


cdef enum:
    KV_EMPTY = 0
    KV_WRITING = 1
    KV_READY = 2
    KV_TOMBSTONE = 3
    KV_EVICTING = 4
    KV_HEADER = 192            # three lines before the entries
    KV_PAYLOAD_HDR = 64        # payload header ahead of the block bytes
    CXLRT_E_KVCORRUPT = -1030  # an entry or payload header that cannot be right


ctypedef struct kv_entry:
    uint64_t key[2]
    uint64_t meta              # generation << 8 | state
    uint64_t off               # payload (header) offset in the region
    uint64_t len               # payload bytes: KV_PAYLOAD_HDR + block_bytes
    uint64_t owner             # writer: node | pid << 16
    uint64_t stamp_ns          # wall clock when stored (recency before any hit)
    uint64_t check             # mix of the words above; 0 for an all-zero entry
