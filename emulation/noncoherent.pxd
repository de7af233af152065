# The non-coherent emulation: one software cache of 64-byte lines per node.
#
# Invariants:
#  - Node n's cache lives in the sidecar file, so every process that attaches as
#    node n shares it (a node's processes are coherent with each other, as on
#    real hardware). Each cache set has a robust process-shared mutex, so a
#    process killed inside an emulated access never wedges its node.
#  - A tag is 0 (empty) or (line + 1) << 2 | state, state EMU_CLEAN or EMU_DIRTY.
#  - Only write-backs (flush, capacity victim, injected eviction, delayed flush at
#    fence) move cached bytes to the medium, and always a whole line.
#  - dma_read/dma_write touch only the medium.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport Backend
from cxlrt.includes.mutex cimport pthread_mutex_t
from cxlrt.mapping cimport Mapping


cdef enum:
    EMU_CLEAN = 1
    EMU_DIRTY = 2
    EMU_STATE_MASK = 3
    EMU_PENDING_MAX = 256   # delayed flushes held before a forced drain
    EMU_RECENT = 64         # recently dirtied lines, the eviction fault's victims


# Access kinds that EmuBackend.fail_access can fail.
cdef enum:
    EMU_F_LOAD = 1
    EMU_F_STORE = 2
    EMU_F_FLUSH = 4
    EMU_F_FENCE = 8
    EMU_F_DMA = 16

cdef enum:
    EMU_V_NONE = 0
    EMU_V_DIRTY_TWO = 1     # a line dirty in two nodes at once
    EMU_V_STALE_READ = 2    # a load served from a clean copy that no longer matches
    EMU_V_STORE_STALE = 3   # a store into a clean copy that no longer matches
    EMU_V_DMA_OVER_DIRTY = 4  # a DMA write over a line some node holds dirty
    EMU_V_DMA_READ_DIRTY = 5  # a DMA read of a line some node holds dirty


cdef enum:
    EMU_META_BYTES = 64     # per set: pthread mutex, then the u32 victim pointer


ctypedef struct emu_stats:
    uint64_t loads         # load/load64 calls
    uint64_t stores        # store/store64 calls
    uint64_t misses        # line fills from the medium
    uint64_t writebacks    # lines written back by flush or fence
    uint64_t capacity_wb   # dirty victims written back to make room
    uint64_t evictions     # injected spontaneous write-backs
    uint64_t delayed       # flushes deferred to the next fence
    uint64_t violations    # checker errors raised
    uint64_t recovered     # set locks taken over from a dead holder
    uint64_t injected      # accesses failed on purpose (EmuBackend.fail_access)


ctypedef struct emu_ctx:
    char* medium              # shared mapping of the region file
    uint64_t size             # region bytes
    uint32_t node             # this view's node
    uint32_t nodes            # nodes sharing the sidecar
    uint32_t ways             # associativity
    uint64_t sets             # sets per node (power of two)
    char* meta                # this node's set metadata, EMU_META_BYTES a set
    uint32_t victim_off       # offset of the victim pointer in a set's metadata
    uint64_t* tags            # this node's tags [sets * ways]
    char* data                # this node's lines [sets * ways * 64]
    uint64_t** peer_tags      # every node's tags, for the checker's peeks
    uint64_t rng              # xorshift state of the fault injector
    uint64_t evict_threshold  # P(evict) * 2**64 per access
    uint32_t delay            # defer flush_nodrain write-backs to fence
    uint32_t check            # raise on violations
    uint64_t lat_ns           # modelled device latency per line transfer
    double bytes_per_ns       # modelled DMA bandwidth (GB/s), 0 = unlimited
    pthread_mutex_t pending_lock  # guards pending[] between this process's threads
    uint64_t pending[EMU_PENDING_MAX]  # lines awaiting a delayed write-back
    uint32_t npending
    uint64_t recent[EMU_RECENT]  # line + 1 of recently dirtied lines
    uint32_t recent_pos
    int v_kind                # last violation (EMU_V_*)
    uint64_t v_off
    int v_other
    emu_stats st              # this process's counters
    uint64_t fail_in          # armed: the fail_in-th access of fail_kinds fails (0: off)
    uint64_t fail_more        # accesses of fail_kinds after it that fail too
    uint32_t fail_kinds       # EMU_F_* bits
    uint32_t fail_tid         # only this thread's accesses count (not a beat thread's)
    bint fail_effect          # the failed access takes effect first (a lost reply)


cdef class EmuBackend(Backend):
    cdef emu_ctx* c                # per-process state, malloc'ed
    cdef readonly Mapping mapping  # the medium
    cdef readonly Mapping sidecar  # the per-node caches
    cdef readonly str sidecar_path
