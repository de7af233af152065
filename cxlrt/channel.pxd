# Single-producer / single-consumer message channel in a region.
#
# On-media object, layout version 2 (one allocation, 64-byte aligned, named
# "chan/<name>" in the region directory):
#   line 0              header, immutable once the magic is set (cxl_chan_header)
#   line 1              producer claim line (cxl_chan_claim)
#   line 2              consumer claim line
#   lines 3 .. 3+R-1    producer run lines (cxl_chan_run); run x lives on line x % R
#   lines 3+R .. 3+2R-1 consumer run lines
#   ring                `slots` slots of `slot_bytes`: length (8), message number (8),
#                       payload, rounded up to whole lines; message t is in slot t % slots
# with R = CXL_CHAN_RUNS. The line structs are declared in layout.pxd.
#
# Roles, claims and runs (issue 9):
#  - A claim line holds who owns the role (node, incarnation, pid, start time, pid
#    namespace, boot) and the fencing epoch; it is written only under the
#    "cxlrt.channel" region lock, by a claimant, or by its owner letting go while it
#    still names the owner's epoch. Its counter is never on it: one writer at a time.
#  - The counter (tail or head) lives on the line of the owner's *run*, written only by
#    that owner. A takeover bumps the epoch. It also starts a new run on the next line
#    unless the old owner is certainly dead on our own node: a stalled owner that
#    resumes (or a dead one's dirty cache line on another node) can only write its old
#    run's line, which nobody reads as current any more.
#  - A new run's base is the old run's counter read after the new claim is published;
#    it is the old run's end for everyone. After publishing its counter the owner
#    makes sure its epoch is still its own: its own timestamps vouch for it while its
#    node kept beating (no gap over the lease since it last saw the epoch: nobody can
#    have judged it gone); after a silence it observes the epoch. If the epoch is
#    still its own, the taker's later read includes the publish; if not, the new run's
#    base says whether it did (the call succeeds, the next one raises) or not (the
#    call raises). An owner whose silence is already on record checks before it
#    writes anything and stops there with CXLRT_E_CHANLOST.
#  - Readers validate a counter against the claim: a counter read from run x's line
#    counts only if the claim names x after the read (pairs with the taker, which
#    publishes its claim before reading x's counter).
#  - A producer run taken over from an owner that may still run begins with a hole at
#    its base: the old owner's one in-flight message lands in that slot, which no
#    consumer reads, and the new owner leaves the slot alone for a lease.
#  - A run's line is reused by the run R later. A stalled owner's late write lands
#    there only after R takeovers (at least R - 1 leases when they are by liveness).
#    A new producer run may replace a run the consumer has not finished only when the
#    consumer has received past that run's end; until then the takeover is refused
#    with ChannelBusyError.
#  - tail and head are monotonic message counts; 0 <= tail - head <= slots. Slot
#    bytes move only by DMA. Each slot carries its message number; a consumer that
#    finds another number raises instead of delivering it.
#  - Multi-word records are written key-last (a claim's epoch, a run line's run) and
#    read key-first, so a record seen through a partial write-back is never mixed.
#  - Every word read from the region is checked before use; a bad one is
#    CXLRT_E_CHANCORRUPT, never a wild access.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport cxl_region
from cxlrt.layout cimport cxl_chan_claim, cxl_chan_header, cxl_chan_run
from cxlrt.liveness cimport cxl_live
from cxlrt.region cimport Region


cdef enum:
    CXL_CHAN_VERSION = 2
    CXL_CHAN_RUNS = 8           # run lines per role
    CXL_CHAN_HEADER = 1216      # (3 + 2 * CXL_CHAN_RUNS) lines before the ring
    CXL_CHAN_LEN = 16           # length and message number at the start of each slot
    CXL_CHAN_INLINE = 48        # payload bytes in a slot's first line
    CXL_CHAN_MAX_SLOTS = 1 << 24
    CXL_CHAN_MAX_MSG = 1 << 30
    CXL_CHAN_COPY_MAX = 1024    # send: up to this many bytes go out as one DMA via a copy
    CXL_CHAN_AGAIN = 1          # status: ring full (send) or empty (recv); not an error


cdef enum:
    CXL_CHAN_BAD_TAIL = 1       # tail - head outside 0..slots
    CXL_CHAN_BAD_HEAD = 2       # head ahead of tail, or more than slots behind
    CXL_CHAN_BAD_LEN = 3        # a slot's length word > msg_bytes
    CXL_CHAN_BAD_NUM = 4        # a slot holds another message number than expected
    CXL_CHAN_BAD_RUN = 5        # a run line or claim that breaks the run chain


cdef enum:
    CXL_CHAN_RUN_HOLE = 1       # run flag: the message number at base is a hole


ctypedef struct cxl_chan:
    const cxl_region* r         # the region's C view (Region.r)
    cxl_live* live              # our node's liveness (silence checks); NULL for none
    uint64_t pclaim             # producer claim line offset
    uint64_t cclaim             # consumer claim line offset
    uint64_t pruns              # producer run line 0 offset
    uint64_t cruns              # consumer run line 0 offset
    uint64_t ring               # slot 0 offset
    uint64_t slots
    uint64_t msg_bytes
    uint64_t slot_bytes
    # producer (touched only by the sending thread)
    uint64_t tail               # our tail (our run line's value; we are its writer)
    uint64_t seen_head          # head as last validated (a lower bound)
    uint64_t p_epoch            # our producer claim's epoch
    uint64_t p_run              # our producer run
    uint64_t p_line             # our producer run line
    uint64_t p_ok_ns            # monotonic ns when our producer epoch was last seen
    uint64_t c_run_seen         # consumer run whose line we read head from (-1: none yet)
    uint64_t q_slot             # slot left alone until q_until (the hole's slot)
    uint64_t q_until            # monotonic ns; 0 = no quarantine
    uint32_t p_hole             # a hole to publish before our next message
    uint32_t p_lost_phase       # on CXLRT_E_CHANLOST: 0 nothing written, 1 tail published
    # consumer (touched only by the receiving thread)
    uint64_t head               # our head
    uint64_t seen_tail          # tail as last validated (a lower bound)
    uint64_t c_epoch            # our consumer claim's epoch
    uint64_t c_run              # our consumer run
    uint64_t c_line             # our consumer run line
    uint64_t c_ok_ns            # monotonic ns when our consumer epoch was last seen
    uint64_t p_run_seen         # producer run holding message `head`
    uint64_t p_end              # where that run ends (its successor's base); -1 = open
    uint64_t p_next             # that successor
    uint64_t hole_at            # a message number to skip; -1 = none
    uint64_t cur_len            # length of the message at head (after a peek)
    uint32_t c_lost_phase       # on CXLRT_E_CHANLOST: 0 nothing written, 1 head published
    uint32_t bad_kind           # CXL_CHAN_BAD_* of the last CXLRT_E_CHANCORRUPT
    uint64_t bad_value          # the word that was wrong
    uint64_t bad_off            # where it was read
    char first[64]              # consumer: the first line of the slot at head


cdef class Channel:
    cdef cxl_chan C             # the C state the fast paths run on
    cdef readonly Region region  # the Region the channel lives in
    cdef readonly str name      # the caller's name (directory key "chan/<name>")
    cdef readonly uint64_t offset  # object offset in the region
    cdef object _live           # the Liveness C.live points into (kept alive with us)
    cdef int _prod_pid          # pid that holds the producer role through us, 0 = none
    cdef int _cons_pid          # pid that holds the consumer role through us, 0 = none
    cdef object _prod_lost      # ChannelRoleLostError for the next send(), or None
    cdef object _cons_lost      # ChannelRoleLostError for the next recv(), or None
    cdef bint _closed
    cdef bint _in_send          # a thread of ours is inside send()
    cdef bint _in_recv          # a thread of ours is inside recv()/try_recv()
    cdef object __weakref__

    cdef _claim(self, str role)
    cdef _claim_locked(self, str role, me)
    cdef _release(self, str role)
    cdef int _raise(self, int rc, str op) except -1
    cdef _lost(self, str role, str op)
    cdef _check_open(self)
    cdef int _wait(self, bint sending, const char* p, uint64_t n, uint64_t deadline) except -1
    cdef _recv(self, uint64_t deadline, bint block)
