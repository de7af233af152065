# A KV cache's pins: per-node counters in the region, and the node-local table of
# which live process holds which of its node's pins.
#
# Invariants:
#  - Node n's pin words (one per slot: recency ms << 16 | count) are written only
#    by node n's processes, under the node-local mutex of the cache's pin lock.
#  - A process's record in the node-local table counts the pins it holds; the
#    shared count is raised before the record and lowered after it, so a crash
#    in between leaves a pin too many (a block kept), never one too few.
#  - A holder of the pin mutex that died leaves the mutex marked until one of the
#    cache's users has rebuilt the node's pin words from the records: the heartbeat's
#    sweep may take the robust mutex's dead-owner signal first, and it cannot rebuild.
#  - A record names its process by pid and start time; the node's other
#    processes give back the pins of a record whose process is gone. A process
#    gives its record back when it closes the cache; a record of a live process
#    that none of its open PinTables holds (the region was closed first) is
#    given back by that process's next claim or recover.
from libc.stdint cimport uint16_t, uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.layout cimport CXL_LINE_SIZE
from cxlrt.lock cimport LockService, cxl_lockctx
from cxlrt.mapping cimport Mapping


cdef enum:
    PIN_BATCH = 64             # pin words per gather and scatter (not a direct mapping)
    REBUILD_WORDS = 512        # pin words per read of a rebuild
    KV_PIN_MAX = 0xffff        # pins of one node on one slot (low 16 bits of a pin word)


# The node-local table (a file in the node-local folder, never in the region): one
# header line, then RECORDS records of one head line and the record's pin counts
# (one uint16_t a slot, padded to whole lines).
ctypedef struct kv_pin_file_header:
    uint64_t magic
    uint64_t pins              # the cache's pin words in the region, and its slots: a
    uint64_t slots             # table of another cache at this path is rebuilt
    char boot_id[16]           # the boot that built it: a reboot leaves no live pins
    uint64_t pidns             # the pid namespace every process of the node must share
    uint64_t reserved[2]


ctypedef struct kv_pin_record_head:
    uint64_t pid               # 0 = a free record
    uint64_t start             # the process's start time (clock ticks after boot)
    uint64_t reserved[6]


cdef inline uint64_t kv_pin_record_bytes(uint64_t slots) noexcept nogil:
    """One record of the node-local table: its head line, then its counts in whole lines."""
    cdef uint64_t counts = slots * sizeof(uint16_t)
    return sizeof(kv_pin_record_head) + (counts + CXL_LINE_SIZE - 1) // CXL_LINE_SIZE * CXL_LINE_SIZE


cdef inline uint64_t kv_pin_record_off(uint64_t slots, uint64_t k) noexcept nogil:
    """File offset of record k's head."""
    return sizeof(kv_pin_file_header) + k * kv_pin_record_bytes(slots)


cdef inline uint64_t kv_pin_word(uint64_t pins, uint64_t slots, uint64_t node,
                                 uint64_t s) noexcept nogil:
    """Region offset of node `node`'s pin word for slot `s` (node-major words)."""
    return pins + (node * slots + s) * sizeof(uint64_t)


cdef bint kv_repeats(const uint64_t* slots, uint64_t n) noexcept nogil


cdef class PinTable:
    cdef const cxl_region* r
    cdef cxl_lockctx* L
    cdef LockService _locks        # keeps L alive
    cdef uint32_t lock_id          # the pin lock: only its node-local mutex is used
    cdef uint32_t node
    cdef uint32_t nodes
    cdef readonly uint64_t pins    # region offset of node 0's pin words
    cdef readonly uint64_t slots
    cdef Mapping _map              # the node-local table
    cdef char* _base
    cdef int _rec                  # our record, and the pid that claimed it
    cdef int _rec_pid
    cdef object _region
    cdef str _path                 # the node-local table's file (names our record in _HELD)
    cdef uint64_t done             # slots the last add_locked() changed

    cdef inline uint64_t at(self, uint64_t node, uint64_t s) noexcept nogil:
        return kv_pin_word(self.pins, self.slots, node, s)

    cdef int enter(self) noexcept nogil
    cdef int try_enter(self) noexcept nogil
    cdef int try_enter_clean(self) noexcept nogil
    cdef int _entered(self, int rc) noexcept nogil
    cdef void leave(self) noexcept nogil
    cdef int add(self, const uint64_t* slots, uint64_t n, int delta) noexcept nogil
    cdef int add_locked(self, const uint64_t* slots, uint64_t n, int delta) noexcept nogil
    cdef int _lower(self, const uint64_t* slots, uint64_t n, uint16_t* mine) noexcept nogil
    cdef int _add_each(self, const uint64_t* slots, uint64_t n, int delta, uint16_t* mine,
                       uint64_t stamp, uint64_t* did) noexcept nogil
    cdef int _add_batch(self, const uint64_t* slots, uint64_t n, int delta, uint16_t* mine,
                        uint64_t stamp, uint64_t* did) noexcept nogil
    cdef void prefetch(self, const uint64_t* slots, uint64_t n) noexcept nogil
    cdef int _rebuild(self) noexcept nogil
    cdef int _release(self, int k) noexcept nogil
    cdef void _unsound(self) noexcept nogil
    cdef uint16_t* _record(self, int k) noexcept nogil
    cdef uint64_t* _head(self, int k) noexcept nogil
