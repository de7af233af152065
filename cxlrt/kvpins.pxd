# A KV cache's pins: per-node counters in the region, and the node-local table of
# which live process holds which of its node's pins.
#
# Invariants:
#  - Node n's pin words (one per slot: recency ms << 16 | count) are written only
#    by node n's processes, under the node-local mutex of the cache's pin lock.
#  - A process's record in the node-local table counts the pins it holds; the
#    shared count is raised before the record and lowered after it, so a crash
#    in between leaves a pin too many (a block kept), never one too few.
#  - A record names its process by pid and start time; the node's other
#    processes give back the pins of a record whose process is gone. A process
#    gives its record back when it closes the cache; a record of a live process
#    that none of its open PinTables holds (the region was closed first) is
#    given back by that process's next claim or recover.
from libc.stdint cimport uint16_t, uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.lock cimport LockService, cxl_lockctx
from cxlrt.mapping cimport Mapping


cdef enum:
    KV_PIN_MAX = 0xffff        # pins of one node on one slot (low 16 bits of a pin word)


cdef inline uint64_t kv_pin_word(uint64_t pins, uint64_t slots, uint64_t node,
                                 uint64_t s) noexcept nogil:
    """Region offset of node `node`'s pin word for slot `s` (node-major words)."""
    return pins + (node * slots + s) * sizeof(uint64_t)


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
    cdef uint64_t _stride
    cdef int _rec                  # our record, and the pid that claimed it
    cdef int _rec_pid
    cdef object _region
    cdef str _path                 # the node-local table's file (names our record in _HELD)
    cdef uint64_t done             # slots the last add_locked() changed

    cdef inline uint64_t at(self, uint64_t node, uint64_t s) noexcept nogil:
        return kv_pin_word(self.pins, self.slots, node, s)

    cdef int enter(self) noexcept nogil
    cdef int try_enter(self) noexcept nogil
    cdef int _entered(self, int rc) noexcept nogil
    cdef void leave(self) noexcept nogil
    cdef int add(self, const uint64_t* slots, uint64_t n, int delta) noexcept nogil
    cdef int add_locked(self, const uint64_t* slots, uint64_t n, int delta) noexcept nogil
    cdef void prefetch(self, const uint64_t* slots, uint64_t n) noexcept nogil
    cdef int _rebuild(self) noexcept nogil
    cdef int _release(self, int k) noexcept nogil
    cdef uint16_t* _record(self, int k) noexcept nogil
    cdef uint64_t* _head(self, int k) noexcept nogil
