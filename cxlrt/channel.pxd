# Single-producer / single-consumer message channel in a region.
#
# On-media object (one allocation, 64-byte aligned, named "chan/<name>" in the
# region directory):
#   line 0   header, immutable once the magic is set (cxl_chan_header)
#   line 1   producer line: tail, owner; written only by the producer's node
#   line 2   consumer line: head, owner; written only by the consumer's node
#   ring     `slots` slots of `slot_bytes` (8-byte length + msg_bytes, rounded up
#            to whole lines); slot i holds message number i mod slots
#
# Invariants:
#  - tail and head are monotonic message counts; 0 <= tail - head <= slots.
#  - Slot bytes move only by DMA (dma_write by the producer, dma_read by the
#    consumer); no node ever caches a slot line, so no node holds one dirty.
#  - Message t is written (DMA, complete on return) before tail = t + 1 is
#    published, and read before head = t + 1 is published: a slot is owned by
#    the producer for t in [head, head + slots) - [head, tail) and by the
#    consumer for t in [head, tail).
#  - The owner words of a line change only under the "cxlrt.channel" lock, or
#    by the owner itself when it lets go; a node writes a role's line only
#    while it owns that role, so each line has one writer at a time.
#  - Every word read from the region (header, tail, head, length) is checked
#    before it is used; a bad one is CXLRT_E_CHANCORRUPT, never a wild access.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.region cimport Region


cdef enum:
    CXL_CHAN_VERSION = 1
    CXL_CHAN_HEADER = 192       # header, producer and consumer lines before the ring
    CXL_CHAN_LEN = 8            # the length word at the start of each slot
    CXL_CHAN_INLINE = 56        # payload bytes in a slot's first line
    CXL_CHAN_MAX_SLOTS = 1 << 24
    CXL_CHAN_MAX_MSG = 1 << 30
    CXL_CHAN_COPY_MAX = 1024    # send: up to this many bytes go out as one DMA via a copy
    CXL_CHAN_AGAIN = 1          # status: ring full (send) or empty (recv); not an error
    CXLRT_E_CHANCORRUPT = -1040  # a counter or length word that cannot be right


cdef enum:
    CXL_CHAN_BAD_TAIL = 1       # tail - head outside 0..slots
    CXL_CHAN_BAD_HEAD = 2       # head ahead of tail, or more than slots behind
    CXL_CHAN_BAD_LEN = 3        # a slot's length word > msg_bytes


ctypedef struct cxl_chan_header:
    uint64_t magic              # CXL_CHAN_MAGIC once the object is complete, else 0
    uint64_t version            # CXL_CHAN_VERSION
    uint64_t slots              # ring slots, 1 .. CXL_CHAN_MAX_SLOTS
    uint64_t msg_bytes          # largest message, 1 .. CXL_CHAN_MAX_MSG
    uint64_t slot_bytes         # (8 + msg_bytes) rounded up to 64
    uint64_t ring               # ring offset from the object start (CXL_CHAN_HEADER)
    uint64_t created_ns         # wall clock at creation (informational)
    uint64_t reserved


ctypedef struct cxl_chan_end:
    uint64_t seq                # producer: tail (messages sent); consumer: head (received)
    uint64_t owner_node         # owning node + 1; 0 = no owner
    uint64_t owner_pid          # owning process
    uint64_t owner_host         # superblock.host_id() of the owner's host
    uint64_t claimed_ns         # wall clock of the claim (informational)
    uint64_t reserved[3]


ctypedef struct cxl_chan:
    const cxl_region* r         # the region's C view (Region.r)
    uint64_t prod               # producer line offset
    uint64_t cons               # consumer line offset
    uint64_t ring               # slot 0 offset
    uint64_t slots
    uint64_t msg_bytes
    uint64_t slot_bytes
    uint64_t tail               # producer: our tail (the line's value; we are its writer)
    uint64_t seen_head          # producer: head as last observed (a lower bound)
    uint64_t head               # consumer: our head
    uint64_t seen_tail          # consumer: tail as last observed (a lower bound)
    uint64_t cur_len            # consumer: length of the message at head (after a peek)
    uint32_t bad_kind           # CXL_CHAN_BAD_* of the last CXLRT_E_CHANCORRUPT
    uint64_t bad_value          # the word that was wrong
    uint64_t bad_off            # where it was read
    char first[64]              # consumer: the first line of the slot at head


cdef class Channel:
    cdef cxl_chan C             # the C state the fast paths run on
    cdef readonly Region region  # the Region the channel lives in
    cdef readonly str name      # the caller's name (directory key "chan/<name>")
    cdef readonly uint64_t offset  # object offset in the region
    cdef int _prod_pid          # pid that holds the producer role through us, 0 = none
    cdef int _cons_pid          # pid that holds the consumer role through us, 0 = none
    cdef bint _closed
    cdef bint _in_send          # a thread of ours is inside send()
    cdef bint _in_recv          # a thread of ours is inside recv()/try_recv()
    cdef object __weakref__

    cdef _claim(self, str role)
    cdef _release(self, str role)
    cdef int _raise(self, int rc, str op) except -1
    cdef _check_open(self)
    cdef int _wait(self, bint sending, const char* p, uint64_t n, uint64_t deadline) except -1
    cdef _recv(self, uint64_t deadline, bint block)
