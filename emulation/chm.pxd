# The CXL hybrid-memory (CXL-HM) device model: device DRAM in front of an SSD tier.
#
# Invariants:
#  - All device state (page map, frame table, frames, the SSD timeline) lives in the
#    sidecar <region>.chm, shared by every process of every node: the device is one.
#  - The region file is the SSD. A page's bytes are in its frame when the page map
#    names a frame whose entry names the page back; otherwise they are in the file.
#  - Every access takes the device lock (robust, timed): the controller's tables
#    change only under it, in an order _repair() can finish after a holder dies.
#  - One exception for bytes, never for tables: a DMA read whose pages are all in DRAM
#    copies them outside the lock, then checks under it that no frame's gen moved (a
#    writer or a reuse bumps it, under the lock, before touching the frame); a read that
#    raced one is done again under the lock. Reads are atomic as before.
#  - A frame entry is 0 (free) or (page + 1) << 8 | CHM_F_* flags.
#  - Under staging with wbuf=, the last frames are a write buffer that only DMA writes
#    of pages not in DRAM fill; the clock never evicts them. A dirty buffer frame
#    leaves DRAM only after its write-back, so nothing buffered is lost while the
#    sidecar persists. wb_dirty counts them (under the lock; _repair recounts).
#  - Under staging, CXL_HINT_PREFETCH pins cache frames (chm_pin): the clock passes over
#    a pinned frame until its holders release it or its pin time lapses. Pins and
#    landing times are advice about placement and timing only: every access still
#    reads the page's one copy, so no pin state can make a read wrong.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.backend cimport Backend
from cxlrt.includes.mutex cimport pthread_mutex_t
from cxlrt.mapping cimport Mapping


cdef enum:
    CHM_F_VALID = 1   # the frame holds its page
    CHM_F_DIRTY = 2   # newer than the SSD: written back before the frame is reused
    CHM_F_REF = 4     # touched since the clock hand last passed
    CHM_F_FILL = 8    # being filled: not yet the page's bytes (repair drops it)


cdef enum:
    CHM_LRU = 0       # transparent cache: every access goes through DRAM
    CHM_STAGING = 1   # DMA reads and writes of pages not in DRAM go straight to the SSD


cdef enum:
    CHM_ST_HITS = 0           # page accesses served from DRAM
    CHM_ST_FILLS = 1          # pages read from the SSD into a frame
    CHM_ST_WRITEBACKS = 2     # dirty frames written back to the SSD
    CHM_ST_DIRECT_READS = 3   # SSD reads that bypassed DRAM (staging DMA)
    CHM_ST_DIRECT_WRITES = 4  # SSD writes that bypassed DRAM (staging DMA)
    CHM_ST_SSD_READ_BYTES = 5
    CHM_ST_SSD_WRITE_BYTES = 6
    CHM_ST_DRAM_BYTES = 7     # bytes copied to or from frames
    CHM_ST_BUSY_NS = 8        # modelled SSD time
    CHM_ST_REPAIRS = 9        # device locks taken over from a dead holder
    CHM_ST_BUFFERED = 10      # pages a DMA write put in the write buffer
    CHM_ST_FLUSHES = 11       # write-buffer batches written back to the SSD
    CHM_ST_ADMITS = 12        # CXL_HINT_ADMIT answered yes
    CHM_ST_REFUSALS = 13      # CXL_HINT_ADMIT answered no (the buffer was full)
    CHM_ST_PREFETCHED = 14    # pages CXL_HINT_PREFETCH read from the SSD into a frame
    CHM_ST_PF_REFUSALS = 15   # CXL_HINT_PREFETCH answered no (too few frames unpinned)
    CHM_NSTATS = 16


cdef enum:
    CHM_LOCK_OFFSET = 1024    # the device lock's byte offset in the sidecar header
    CHM_HEADER_BYTES = 4096


ctypedef struct chm_hdr:
    # written once when the sidecar is built (chmside.HEADER mirrors these 112 bytes)
    uint64_t magic
    uint32_t version
    uint32_t policy
    uint64_t page             # bytes per page, a power of two
    uint64_t frames           # DRAM frames
    uint64_t pages            # capacity pages: ceil(region_size / page)
    uint64_t region_size
    uint64_t dev              # identity of the region file the tables describe
    uint64_t ino
    uint64_t lat_ns           # the SSD model, device-wide (chmside.HEADER)
    double bw
    double wbw
    uint64_t wb_frames        # the last wb_frames frames are the write buffer (staging)
    uint64_t wb_idle_ns       # the SSD idle this long: the write buffer may flush
    uint64_t pin_ns           # a prefetch pin lapses this long after it was taken
    # the controller's state, under the device lock
    uint64_t ssd_free_ns      # when the modelled SSD finishes the work queued so far
    uint64_t hand             # clock hand over the cache frames
    uint64_t wb_hand          # where the next look for a write-buffer frame starts
    uint64_t wb_dirty         # write-buffer frames newer than the SSD (repair recounts)
    uint64_t bg_free_ns       # when the SSD finishes the flushes queued so far (background)
    uint64_t bg_pages         # pages in those flushes: not yet free for new writes
    uint64_t st[CHM_NSTATS]


ctypedef struct chm_pin:
    # One per frame (the sidecar's pin table), under the device lock. ready, until and
    # count are meaningful only while the frame holds a page a prefetch staged; _victim
    # resets them on reuse.
    uint64_t ready_ns         # when the prefetch's modelled SSD read of the page ends
    uint64_t until_ns         # the pin lapses then (a dead holder never releases)
    uint64_t count            # prefetches not yet released
    uint64_t gen              # bumped before the frame's bytes change or it is reused:
    #                           a read that copied outside the lock checks it (a seqlock)


ctypedef struct chm_ctx:
    chm_hdr* h
    # The geometry, copied at open: never read back from shared memory, which a
    # close retires to zeros under a thread still inside an access.
    uint64_t page
    uint64_t frames
    uint64_t cpu_frames       # frames [0, cpu_frames) are the cache the clock runs over
    uint64_t wb_frames        # frames [cpu_frames, frames) are the write buffer
    uint64_t wb_idle_ns
    uint64_t bg_grain_ns      # one page's write: how long a read waits for a flush
    uint64_t pages
    uint64_t region_size
    uint32_t policy
    const uint32_t* closed    # the region's closed flag
    uint64_t inflight         # this process's threads inside the device (close waits)
    pthread_mutex_t* lock
    uint32_t* pmap            # [pages]: frame + 1, 0 = not in DRAM
    uint64_t* ftab            # [frames]
    chm_pin* pins             # [frames]
    uint64_t pin_ns
    char* dram                # the frames' bytes [frames * page]
    int fd                    # the region file, this process's descriptor
    uint64_t lat_ns           # modelled SSD latency per request
    double read_bpns          # modelled SSD read bandwidth, bytes/ns (0 = unlimited)
    double write_bpns         # modelled SSD write bandwidth, bytes/ns (0 = unlimited)
    uint64_t lock_timeout_ns  # a device lock not had in this long is an error
    int no_seqlock            # test hook (debug builds): reads outside the lock go unchecked


cdef class ChmBackend(Backend):
    cdef chm_ctx c
    cdef readonly Mapping sidecar  # the device: tables and DRAM frames
    cdef readonly str sidecar_path
