# On-media structures of a region. Sized types and offsets only, never pointers:
# every host maps the region at a different address.
#
# Region map (layout version 3), every section page-aligned:
#   superblock page   cxl_superblock at 0
#   nodes             CXL_NODE_AREA bytes a node, written only by that node
#   locks             one manager-claim line, then CXL_MAX_LOCKS lock records of
#                     (nodes + 2) lines: header, one line per node, grant line
#   directory         CXL_DIR_ENTRIES entries of CXL_DIR_ENTRY bytes (lock 0)
#   alloc             chunk table (8 bytes a chunk), then one remote-free queue a
#                     node (all written under lock 1, the allocator lock)
#   heap              chunks of CXL_CHUNK bytes, CXL_CHUNK-aligned
# The magic is published last at format time, so a half-formatted region never
# looks valid.
# Python code reads these structs through cxlrt.layoutinfo (offsets and widths
# from the compiler) and cxlrt.formats, never through copies of them; the golden
# images in tests/golden/ pin the format: a change to it bumps CXL_LAYOUT_VERSION.
from libc.stdint cimport uint32_t, uint64_t


# 64-bit on-media constants (a Cython enum is a C int): remote-free journal marks.
cdef extern from "cxl_layout.h":
    const uint64_t CXL_RFREE_PENDING   # a queued object's mark, xor its offset
    const uint64_t CXL_RFREE_APPLIED   # an applied one's
    const uint64_t CXL_OFF_MASK        # journal words carry offsets below 2**48


cdef enum:
    CXL_LAYOUT_VERSION = 3
    CXL_LINE_SIZE = 64
    CXL_SB_PAGE = 4096
    CXL_MAX_SECTIONS = 8
    CXL_MAX_NODES = 64
    CXL_NODE_AREA = 256       # four lines per node
    CXL_CHUNK = 65536         # allocation granule of the global chunk table
    CXL_MIN_CHUNKS = 4
    CXL_MAX_LOCKS = 64
    CXL_LOCK_NAME = 40        # bytes of a lock name
    CXL_DIR_ENTRIES = 128
    CXL_DIR_ENTRY = 128       # two lines: header + name
    CXL_DIR_NAME = 64         # bytes of a directory name (UTF-8)
    CXL_SEC_NODES = 0
    CXL_SEC_LOCKS = 1
    CXL_SEC_DIR = 2
    CXL_SEC_ALLOC = 3
    CXL_SEC_HEAP = 4
    CXL_NSECTIONS = 5
    CXL_NODE_NEVER = 0        # node area state: never attached since format
    CXL_NODE_ATTACHED = 1     # some process of the node is attached
    CXL_NODE_DETACHED = 2     # its last process detached cleanly (holds given back)


ctypedef struct cxl_section:
    uint64_t off              # from the region start; 0 = absent
    uint64_t size             # bytes


ctypedef struct cxl_superblock:
    uint64_t magic            # CXL_MAGIC once formatting is complete, else 0
    uint32_t version          # CXL_LAYOUT_VERSION
    uint32_t line_size        # 64: the unit of write-back and of single-writer lines
    uint64_t size             # region bytes; the medium must be exactly this big
    uint32_t nodes            # node ids are 0 .. nodes-1
    uint32_t nsections        # used entries of sections[]
    uint64_t uuid             # random per format; tells a reformatted region apart
    uint64_t created_ns       # wall clock at format (CLOCK_REALTIME, ns)
    cxl_section sections[8]   # indexed by CXL_SEC_*
    uint32_t lease_ms         # a node silent this long is dead (lock breaking)
    uint32_t chunk_size       # CXL_CHUNK
    uint64_t checksum         # FNV-1a 64 of every byte before this field


ctypedef struct cxl_node_area:
    # line 0: liveness, written by the node's attaches and heartbeats (liveness.pyx)
    uint64_t beat             # heartbeat counter: changes at every beat, never a clock
    uint64_t state            # CXL_NODE_NEVER, CXL_NODE_ATTACHED or CXL_NODE_DETACHED
    uint64_t incarnation      # bumped by each new life of the node (fresh node-local state)
    uint64_t host_id          # hash of the host name of this incarnation
    uint64_t boot_id          # hash of the kernel boot id of this incarnation
    uint64_t pid              # last process that attached (informational)
    uint64_t attaches         # attaches of this node (informational, wraps)
    uint64_t beat_wall_ns     # wall clock of the last beat: shown by `info`, never judged
    # line 1: the lock manager this node runs (lock.pyx)
    uint64_t mgr_epoch        # epoch of the manager claim it runs under, 0 = none
    uint64_t mgr_beat         # advanced by every manager pass
    uint64_t mgr_pid          # the manager's process (informational)
    uint64_t reserved[21]     # pads to CXL_NODE_AREA; later versions use it


# --- locks (one record: header line, one line per node, grant line) -----------

ctypedef struct cxl_lock_header:
    uint64_t state            # 0 free, CXL_LOCK_READY once published
    uint32_t mode             # CXL_LOCK_BAKERY or CXL_LOCK_MANAGER
    uint32_t name_len
    char name[40]             # CXL_LOCK_NAME bytes, not NUL-terminated
    uint64_t reserved


ctypedef struct cxl_lock_node_line:
    uint64_t choosing         # bakery: 1 while picking a ticket
    uint64_t number           # bakery: ticket, 0 = not competing
    uint64_t req_seq          # manager: requests made by this node
    uint64_t rel_seq          # manager: requests this node has released
    uint64_t acquisitions     # global acquisitions by this node (statistics)
    uint64_t accepted         # manager: the grant word this node took, less the node byte
    uint64_t reserved[2]


ctypedef struct cxl_lock_grant_line:
    uint64_t grant            # manager: (node + 1) << 56 | (epoch & 0xFFFF) << 40 | request, 0 = none
    uint64_t reserved[7]


ctypedef struct cxl_mgr_claim:
    # Written only by the holder of lock 0 when it takes the manager role over; the
    # manager itself beats in its own node area (mgr_epoch, mgr_beat), so a superseded
    # manager never writes this line again.
    uint64_t node_plus1       # node running the lock manager + 1, 0 = none
    uint64_t epoch            # bumped by every takeover; grants carry its low 16 bits
    uint64_t incarnation      # that node's incarnation when it took the role
    uint64_t pid              # its process (informational)
    uint64_t reserved[4]


# Offsets in the locks section, from the structs above: the lock code adds no numbers
# of its own. A member's offset is offsetof's classic definition, &((T*)0)->member,
# which the compiler folds to a constant.

cdef inline uint64_t cxl_lock_record_bytes(uint32_t nodes) noexcept nogil:
    """Bytes of one lock record: a header line, one line per node, the grant line."""
    return (sizeof(cxl_lock_header) + nodes * sizeof(cxl_lock_node_line)
            + sizeof(cxl_lock_grant_line))


cdef inline uint64_t cxl_lock_record_off(uint64_t locks, uint32_t nodes, uint32_t id) noexcept nogil:
    """Lock `id`'s record in the locks section at `locks`: records follow the claim line."""
    return locks + sizeof(cxl_mgr_claim) + id * cxl_lock_record_bytes(nodes)


cdef inline uint64_t cxl_lock_line_off(uint64_t rec, uint32_t node) noexcept nogil:
    """Node `node`'s line of the record at `rec` (written only by that node)."""
    return rec + sizeof(cxl_lock_header) + node * sizeof(cxl_lock_node_line)


cdef inline uint64_t cxl_lock_grant_off(uint64_t rec, uint32_t nodes) noexcept nogil:
    """The grant line of the record at `rec`: after its `nodes` node lines."""
    return rec + sizeof(cxl_lock_header) + nodes * sizeof(cxl_lock_node_line)


cdef inline uint64_t cxl_mgr_area_off(uint64_t nodes_off, uint32_t node) noexcept nogil:
    """The manager words (mgr_epoch, mgr_beat, mgr_pid) of node `node`'s area."""
    return nodes_off + node * sizeof(cxl_node_area) + <uint64_t>&(<cxl_node_area*>NULL).mgr_epoch


# The words of a node line at `ln`, of the claim line at `c` (the section's start)
# and of a node area's manager words at `m` (cxl_mgr_area_off).
cdef inline uint64_t cxl_ln_choosing(uint64_t ln) noexcept nogil: return ln + <uint64_t>&(<cxl_lock_node_line*>NULL).choosing
cdef inline uint64_t cxl_ln_number(uint64_t ln) noexcept nogil: return ln + <uint64_t>&(<cxl_lock_node_line*>NULL).number
cdef inline uint64_t cxl_ln_req(uint64_t ln) noexcept nogil: return ln + <uint64_t>&(<cxl_lock_node_line*>NULL).req_seq
cdef inline uint64_t cxl_ln_rel(uint64_t ln) noexcept nogil: return ln + <uint64_t>&(<cxl_lock_node_line*>NULL).rel_seq
cdef inline uint64_t cxl_ln_acq(uint64_t ln) noexcept nogil: return ln + <uint64_t>&(<cxl_lock_node_line*>NULL).acquisitions
cdef inline uint64_t cxl_ln_accepted(uint64_t ln) noexcept nogil: return ln + <uint64_t>&(<cxl_lock_node_line*>NULL).accepted

cdef inline uint64_t cxl_claim_epoch(uint64_t c) noexcept nogil: return c + <uint64_t>&(<cxl_mgr_claim*>NULL).epoch
cdef inline uint64_t cxl_mgr_beat(uint64_t m) noexcept nogil: return m + <uint64_t>&(<cxl_node_area*>NULL).mgr_beat - <uint64_t>&(<cxl_node_area*>NULL).mgr_epoch
cdef inline uint64_t cxl_mgr_pid(uint64_t m) noexcept nogil: return m + <uint64_t>&(<cxl_node_area*>NULL).mgr_pid - <uint64_t>&(<cxl_node_area*>NULL).mgr_epoch


# --- directory ------------------------------------------------------------------

ctypedef struct cxl_dir_entry:
    # line 0 (written under lock 0; protocol in directory.py)
    uint64_t state            # 0 free, 1 used
    uint64_t off              # the named object's offset
    uint64_t name_len
    uint64_t generation       # seqlock: odd while a change is being applied
    uint64_t redo             # the change: new state | name_len << 8 | (writer node + 1) << 16
    uint64_t redo_off         # the change: new offset
    uint64_t redo_tag         # the odd generation the redo record belongs to
    uint64_t redo_seal        # checksum of the redo record
    # line 1
    char name[64]             # CXL_DIR_NAME bytes of UTF-8


# --- allocator --------------------------------------------------------------------
# A chunk table word: 0 free; else kind in bits 62-63, owner node in bits 48-55,
# and per kind: small = size class in bits 0-7; large head = run length in
# chunks in bits 0-31; large tail = head chunk index in bits 0-31.

cdef enum:
    CXL_CK_SMALL = 1
    CXL_CK_LARGE = 2
    CXL_CK_TAIL = 3
    CXL_SMALL_MAGIC = 0x534D4C43  # "CLMS": a carved small chunk's header


cdef inline uint64_t cxl_ck_word(uint64_t kind, uint64_t owner, uint64_t low) noexcept nogil:
    """A chunk table word of `kind` (CXL_CK_*) owned by node `owner`."""
    return (kind << 62) | ((owner & 0xFF) << 48) | (low & <uint64_t>0xFFFFFFFFULL)


cdef inline uint32_t cxl_ck_kind(uint64_t w) noexcept nogil:
    """The kind of a chunk table word (CXL_CK_*; 0 for a free chunk)."""
    return <uint32_t>(w >> 62)


cdef inline uint32_t cxl_ck_owner(uint64_t w) noexcept nogil:
    """The owner node of a chunk table word."""
    return <uint32_t>((w >> 48) & 0xFF)


cdef inline uint32_t cxl_ck_low(uint64_t w) noexcept nogil:
    """The low field of a chunk table word: size class, run length or head chunk."""
    return <uint32_t>(w & <uint64_t>0xFFFFFFFFULL)


ctypedef struct cxl_small_header:
    uint32_t magic            # CXL_SMALL_MAGIC once carved
    uint32_t size_class       # object bytes
    uint32_t owner            # the only node that writes the bitmap
    uint32_t nslots
    uint32_t data_start       # offset of slot 0 from the chunk start
    uint32_t reserved0
    uint64_t reserved[5]


# A node's remote-free queue: objects other nodes freed, linked through their own
# (now free) first line, so it never fills. The link line of such an object is
# {next offset, mark, batch}: mark = RFREE_PENDING ^ offset while queued, then
# RFREE_APPLIED ^ offset with batch = the owner's journal seq once applied (alloc.pyx).
# Line 0 is written under lock 1 by any node; line 1 only by the owner node (heap
# mutex). A drain commits a batch in line 1 (jword) before it empties line 0; while
# jword's seq differs from seq, line 0's list belongs to the journal (see alloc.pyx).
ctypedef struct cxl_rfree_queue:
    uint64_t head             # newest queued object, 0 = empty (lock 1)
    uint64_t count            # objects on the list: a hint, may be off after a crash (lock 1)
    uint64_t seq              # batches detached so far, mod 2**16 (lock 1)
    uint64_t reserved0[5]
    uint64_t jword            # owner's journal: seq << 48 | first object of the batch being applied
    uint64_t jcount           # objects in that batch (a hint)
    uint64_t reserved1[6]
    uint64_t reserved[496]    # pads the queue to 4096 bytes


ctypedef struct cxl_rfree_link:
    # The first words of an object on a remote-free list; the rest of its line keeps
    # the object's old bytes.
    uint64_t next             # the next object of the list, 0 = end
    uint64_t mark             # RFREE_PENDING ^ offset while queued, then RFREE_APPLIED ^ offset
    uint64_t batch            # once applied: the owner's journal seq (alloc.pyx)


# Where the allocator's words are, from the structs above: alloc.pyx and superblock.pyx
# compute no offset of their own. &(<T*>NULL).member is offsetof(T, member), a
# constant the C compiler folds.

cdef inline uint64_t cxl_chunk_word_off(uint64_t table, uint64_t k) noexcept nogil:
    """Region offset of chunk k's word in the chunk table that starts at `table`."""
    return table + k * sizeof(uint64_t)


cdef inline uint64_t cxl_rfree_queues_rel(uint64_t nchunks) noexcept nogil:
    """Offset of node 0's remote-free queue from the alloc section's start: after the
    chunk table of `nchunks` words, page-aligned."""
    return (nchunks * sizeof(uint64_t) + CXL_SB_PAGE - 1) // CXL_SB_PAGE * CXL_SB_PAGE


cdef inline uint64_t cxl_rfree_queue_off(uint64_t queues, uint32_t node) noexcept nogil:
    """Region offset of `node`'s remote-free queue; `queues` is node 0's."""
    return queues + <uint64_t>node * sizeof(cxl_rfree_queue)


cdef inline uint64_t cxl_rq_head_off(uint64_t q) noexcept nogil:
    """Region offset of queue q's head (q: the queue's region offset); count and seq
    follow it on line 0 (cxl_rq_count_off, cxl_rq_seq_off)."""
    return q + <uint64_t>&(<cxl_rfree_queue*>NULL).head


cdef inline uint64_t cxl_rq_count_off(uint64_t q) noexcept nogil:
    """Region offset of queue q's count."""
    return q + <uint64_t>&(<cxl_rfree_queue*>NULL).count


cdef inline uint64_t cxl_rq_seq_off(uint64_t q) noexcept nogil:
    """Region offset of queue q's seq."""
    return q + <uint64_t>&(<cxl_rfree_queue*>NULL).seq


cdef inline uint64_t cxl_rq_jword_off(uint64_t q) noexcept nogil:
    """Region offset of queue q's journal word (the owner's line, with jcount)."""
    return q + <uint64_t>&(<cxl_rfree_queue*>NULL).jword


cdef inline uint64_t cxl_rq_jcount_off(uint64_t q) noexcept nogil:
    """Region offset of queue q's journal count."""
    return q + <uint64_t>&(<cxl_rfree_queue*>NULL).jcount


cdef inline uint64_t cxl_link_next_off(uint64_t x) noexcept nogil:
    """Region offset of the next word of remote-freed object x's link line."""
    return x + <uint64_t>&(<cxl_rfree_link*>NULL).next


cdef inline uint64_t cxl_link_mark_off(uint64_t x) noexcept nogil:
    """Region offset of the mark word of remote-freed object x's link line."""
    return x + <uint64_t>&(<cxl_rfree_link*>NULL).mark


cdef inline uint64_t cxl_link_batch_off(uint64_t x) noexcept nogil:
    """Region offset of the batch word of remote-freed object x's link line."""
    return x + <uint64_t>&(<cxl_rfree_link*>NULL).batch


cdef inline uint64_t cxl_rfree_jword(uint64_t seq, uint64_t first) noexcept nogil:
    """A journal word: the batch's seq above CXL_OFF_MASK, its first object (below
    2**48) under it."""
    return (seq << 48) | first


cdef inline uint64_t cxl_rfree_jseq(uint64_t jword) noexcept nogil:
    """The seq of a journal word."""
    return jword >> 48


cdef inline uint64_t cxl_small_magic_off(uint64_t chunk) noexcept nogil:
    """Region offset of a small chunk header's first word: magic, then size_class."""
    return chunk + <uint64_t>&(<cxl_small_header*>NULL).magic


cdef inline uint64_t cxl_small_owner_off(uint64_t chunk) noexcept nogil:
    """Region offset of the header word holding owner, then nslots."""
    return chunk + <uint64_t>&(<cxl_small_header*>NULL).owner


cdef inline uint64_t cxl_small_data_off(uint64_t chunk) noexcept nogil:
    """Region offset of the header word holding data_start, then reserved0."""
    return chunk + <uint64_t>&(<cxl_small_header*>NULL).data_start


cdef inline uint64_t cxl_small_bitmap_off(uint64_t chunk, uint64_t word) noexcept nogil:
    """Region offset of bitmap word `word` of a small chunk: right after its header."""
    return chunk + sizeof(cxl_small_header) + word * sizeof(uint64_t)


cdef inline uint64_t cxl_small_bitmap_bytes(uint64_t nslots) noexcept nogil:
    """Bytes of the bitmap of a chunk of `nslots` slots (whole 64-bit words)."""
    return cxl_bitmap_words(nslots) * sizeof(uint64_t)


# --- KV cache object (the object map and its invariants are in kvcache.pxd) -------
# kvformat.pyx writes these lines through the structs; Python readers and the layout
# tests read them through layoutinfo.

ctypedef struct kv_geometry:  # line 0, immutable
    uint64_t magic            # "CXLKVC01" once the object is complete
    uint32_t version          # the object's format (kvformat.pyx VERSION)
    uint32_t key_bytes        # KV_KEY_BYTES
    uint64_t slots            # entries of the hash table, a power of two
    uint64_t capacity         # blocks the cache holds at most
    uint64_t block_bytes      # KV bytes of one block
    uint32_t block_tokens
    uint32_t algorithm        # cxlrt.hashing.ALGORITHMS
    char salt_digest[16]      # digest of the salt (model, dtype, layout, tenant)


ctypedef struct kv_layout:    # line 1, immutable
    uint64_t nodes
    uint64_t entries          # region offset of the entry lines
    uint64_t pins             # region offset of node 0's pin words
    uint64_t stats            # region offset of node 0's stats line
    uint64_t created_ns       # wall clock at creation (informational)
    uint64_t total            # bytes of the whole object
    uint64_t claims           # region offset of the claim lines (records follow)
    uint64_t checksum         # FNV-1a 64 of line 0 and the words above


ctypedef struct kv_counters:  # line 2, written under the cache lock
    uint64_t occupancy        # blocks held
    uint64_t payload_bytes
    uint64_t records          # high-water mark of the record table
    uint64_t reserved[5]


ctypedef struct kv_header:
    kv_geometry geometry
    kv_layout layout
    kv_counters counters


ctypedef struct kv_payload_header:  # ahead of a block's bytes, written only by its writer
    uint64_t magic            # "CXLKVB02"
    uint64_t key[2]           # the block's chained key
    uint64_t generation       # the slot generation it was stored under
    uint64_t block_bytes
    uint64_t cache            # region offset of the cache object
    uint64_t progress         # the writer's progress word (KV_PROGRESS)
    uint64_t writer           # node | pid << 16


# --- channel object (the object map and its protocol are in channel.pxd) --------

ctypedef struct cxl_chan_header:
    uint64_t magic              # CXL_CHAN_MAGIC once the object is complete, else 0
    uint64_t version            # CXL_CHAN_VERSION
    uint64_t slots              # ring slots, 1 .. CXL_CHAN_MAX_SLOTS
    uint64_t msg_bytes          # largest message, 1 .. CXL_CHAN_MAX_MSG
    uint64_t slot_bytes         # (16 + msg_bytes) rounded up to 64
    uint64_t ring               # ring offset from the object start (CXL_CHAN_HEADER)
    uint64_t runs               # run lines per role (CXL_CHAN_RUNS)
    uint64_t created_ns         # wall clock at creation (informational)


ctypedef struct cxl_chan_claim:
    uint64_t epoch              # fencing token: bumped by every takeover (written last)
    uint64_t run                # the owner's run (its counter is on line run % R)
    uint64_t src                # the run `run` continued from (== run for run 0)
    uint64_t owner              # (node + 1) | pid << 32; 0 = no owner
    uint64_t incarnation        # the owner's node life
    uint64_t start              # the owner's process start time (clock ticks after boot)
    uint64_t pidns              # the owner's pid namespace (inode)
    uint64_t boot               # the owner's boot id, folded to 64 bits


ctypedef struct cxl_chan_run:
    uint64_t seq                # tail (producer) or head (consumer) of this run
    uint64_t run                # the run this line holds (written last: the line's key)
    uint64_t base               # seq when the run began; the end of its source run
    uint64_t src                # the run it continued from
    uint64_t flags              # CXL_CHAN_RUN_*
    uint64_t epoch              # the epoch that started the run (informational)
    uint64_t reserved[2]


# Where a channel's words are (object map in channel.pxd), from the structs above:
# channel.pyx computes no offset of its own. Role 0 is the producer, 1 the consumer.

cdef inline uint64_t cxl_chan_claim_off(uint64_t chan, uint32_t role) noexcept nogil:
    """Region offset of `role`'s claim line of the channel at `chan`: after the header."""
    return chan + sizeof(cxl_chan_header) + <uint64_t>role * sizeof(cxl_chan_claim)


cdef inline uint64_t cxl_chan_runs_off(uint64_t chan, uint32_t role, uint64_t nruns) noexcept nogil:
    """Region offset of `role`'s first run line: after both claim lines, the producer's
    `nruns` lines first."""
    return (chan + sizeof(cxl_chan_header) + 2 * sizeof(cxl_chan_claim)
            + <uint64_t>role * nruns * sizeof(cxl_chan_run))


cdef inline uint64_t cxl_chan_run_line(uint64_t runs, uint64_t x, uint64_t nruns) noexcept nogil:
    """Region offset of the line run `x` lives on (runs: the role's first run line)."""
    return runs + (x % nruns) * sizeof(cxl_chan_run)


cdef inline uint64_t cxl_chan_claim_run_off(uint64_t claim) noexcept nogil:
    """Region offset of a claim line's run word."""
    return claim + <uint64_t>&(<cxl_chan_claim*>NULL).run


cdef inline uint64_t cxl_chan_claim_src_off(uint64_t claim) noexcept nogil:
    """Region offset of a claim line's src word."""
    return claim + <uint64_t>&(<cxl_chan_claim*>NULL).src


cdef inline uint64_t cxl_chan_claim_owner_off(uint64_t claim) noexcept nogil:
    """Region offset of a claim line's owner word."""
    return claim + <uint64_t>&(<cxl_chan_claim*>NULL).owner


cdef inline uint64_t cxl_chan_claim_epoch_off(uint64_t claim) noexcept nogil:
    """Region offset of a claim line's epoch word."""
    return claim + <uint64_t>&(<cxl_chan_claim*>NULL).epoch


cdef inline uint64_t cxl_chan_run_seq_off(uint64_t line) noexcept nogil:
    """Region offset of a run line's counter (seq)."""
    return line + <uint64_t>&(<cxl_chan_run*>NULL).seq


cdef inline uint64_t cxl_chan_run_key_off(uint64_t line) noexcept nogil:
    """Region offset of a run line's key (the run it holds, written last)."""
    return line + <uint64_t>&(<cxl_chan_run*>NULL).run


cdef inline uint64_t cxl_chan_run_base_off(uint64_t line) noexcept nogil:
    """Region offset of a run line's base."""
    return line + <uint64_t>&(<cxl_chan_run*>NULL).base


cdef inline uint64_t cxl_chan_run_src_off(uint64_t line) noexcept nogil:
    """Region offset of a run line's src."""
    return line + <uint64_t>&(<cxl_chan_run*>NULL).src


cdef inline uint64_t cxl_chan_run_flags_off(uint64_t line) noexcept nogil:
    """Region offset of a run line's flags."""
    return line + <uint64_t>&(<cxl_chan_run*>NULL).flags


cdef inline uint64_t cxl_chan_slot_num_off(uint64_t slot) noexcept nogil:
    """Region offset of a ring slot's message number: a slot holds its length word, its
    message number, then the payload."""
    return slot + sizeof(uint64_t)


# --- words of bitmaps and table lines ------------------------------------------------
# A small chunk's bitmap is whole 64-bit words, slot s at bit s % 64 of word s // 64;
# the chunk table is read and written a whole line (CXL_LINE_WORDS words) at a time.

cdef enum:
    CXL_WORD_BITS = 64
    CXL_LINE_WORDS = CXL_LINE_SIZE // 8


cdef inline uint64_t cxl_bitmap_words(uint64_t nbits) noexcept nogil:
    """Words of a bitmap of `nbits` bits."""
    return (nbits + CXL_WORD_BITS - 1) // CXL_WORD_BITS


cdef inline uint64_t cxl_bitmap_word(uint64_t bit) noexcept nogil:
    """The word that holds bit `bit`."""
    return bit // CXL_WORD_BITS


cdef inline uint64_t cxl_bitmap_mask(uint64_t bit) noexcept nogil:
    """Bit `bit`'s mask within its word."""
    return <uint64_t>1 << (bit % CXL_WORD_BITS)


cdef inline uint64_t cxl_bitmap_bit(uint64_t word, uint64_t b) noexcept nogil:
    """Bit b of word `word`, counted from the bitmap's start."""
    return word * CXL_WORD_BITS + b


cdef inline uint64_t cxl_line_first_word(uint64_t k) noexcept nogil:
    """Index of the first word of the line that word k of a line-aligned array is in."""
    return k & ~(<uint64_t>CXL_LINE_WORDS - 1)


cdef inline uint64_t cxl_line_of(uint64_t off) noexcept nogil:
    """The line that byte `off` is in."""
    return off // CXL_LINE_SIZE


cdef inline uint64_t cxl_line_start(uint64_t line) noexcept nogil:
    """The offset of line `line`'s first byte."""
    return line * CXL_LINE_SIZE


cdef inline uint64_t cxl_line_pos(uint64_t off) noexcept nogil:
    """Byte `off`'s position within its line."""
    return off % CXL_LINE_SIZE


cdef inline bint cxl_line_aligned(uint64_t x) noexcept nogil:
    """An offset on a line boundary."""
    return (x & (CXL_LINE_SIZE - 1)) == 0
