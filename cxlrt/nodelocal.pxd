# Node-local shared memory: state that only the processes of ONE node share.
#
# It lives in a host file (not in the region) named after the region's format id
# and the node, so it is coherent, may use host atomics and robust pthread
# mutexes, and never crosses hosts. Everything in it is either a lock or a cache
# that can be rebuilt from the region, so losing it (host reboot) loses nothing.
from libc.stdint cimport uint32_t, uint64_t

from cxlrt.includes.mutex cimport pthread_mutex_t
from cxlrt.mapping cimport Mapping


cdef enum:
    CXL_LOCAL_LOCK_BYTES = 128
    CXL_LOCAL_CLASSES = 16
    CXL_LOCAL_COUNTER_OFF = 64   # the node's heartbeat counter (host atomics)
    CXL_LOCAL_INC_OFF = 72       # the node's incarnation this file belongs to
    CXL_LOCAL_PROCS_OFF = 128    # process table: who of this node is attached
    CXL_LOCAL_PROC_BYTES = 32
    CXL_LOCAL_PROCS = 124        # (4096 - 128) / 32 processes of one node at once
    CXL_MAG_CLASSES = 5          # size classes with magazines: 64 B .. 1 KiB, where the heap
                                 # mutex is most of what an alloc and a free cost
    CXL_MAG_SLOTS = 16           # objects a thread keeps per class
    CXL_LOCAL_MAGS = 64          # threads of one node with a magazine at once (more go without)
    CXL_LOCAL_MAG_BYTES = 768


ctypedef struct cxl_local_header:  # at 0: whose file this is
    uint64_t magic            # "CXLLOCL3"
    uint64_t uuid             # the region format it serves
    uint32_t node
    uint32_t max_locks        # CXL_MAX_LOCKS of the build that made it


ctypedef struct cxl_local_proc:
    uint64_t pid              # 0 = free slot
    uint64_t start            # its start time (clock ticks after boot): pid reuse tells
    uint64_t pidns            # inode of its pid namespace
    uint64_t reserved


ctypedef struct cxl_local_lock:
    pthread_mutex_t m         # tier 1: one thread of the node competes globally
    uint32_t holder_pid       # process holding m (0 when free)
    uint32_t holder_tid       # thread holding m
    uint32_t global_held      # this node holds the global tier
    uint32_t repair           # a node-local-only lock's holder died: the next taker
                              # repairs what m guards (see cxl_local_enter)
    uint64_t seq              # manager mode: the request this node holds or waits on
    uint64_t recovered        # times m was taken over from a dead holder


ctypedef struct cxl_local_heap:
    pthread_mutex_t m         # guards the node's small-object chunks
    uint32_t holder_pid
    uint32_t pad0
    uint64_t current[16]      # per size class: chunk index + 1 being carved, 0 none
    uint64_t spare[16]        # per size class: an empty chunk kept to avoid churn, +1
    uint64_t rebuilds         # times the state was rebuilt after a dead holder
    # A large alloc of this node that may have written table words and handed out
    # nothing yet: [owed_k, owed_k + owed_n), 0 none. Written under the allocator lock
    # (not m), so whichever process of the node takes that lock next gives it back.
    uint64_t owed_k
    uint64_t owed_n
    uint32_t owed_pid         # the process that wrote it, and a token of that process
    uint32_t pad1             # (a pid alone names a new process after reuse or in
    uint64_t owed_tok         # another pid namespace)
    # A magazine slot being given back under m: its object, then the record, class
    # and index it held. Set before the count is lowered and cleared once the bit
    # is, so the next holder after a dead one finishes it (alloc.pyx, _mag_drop).
    uint64_t drop_x           # 0: none
    uint32_t drop_rec
    uint32_t drop_c
    uint32_t drop_i
    uint32_t pad2


# A thread's magazine (alloc.pyx): objects of our node that it freed and keeps for its
# next allocs, their bits still set. Only that thread pushes and pops, without a lock;
# others write the record only under the heap mutex, once its thread is gone.
ctypedef struct cxl_local_mag:
    uint32_t pid              # the thread that owns it (0: a free record); written last
    uint32_t tid
    uint64_t pidns            # inode of its pid namespace: liveness is asked only there
    uint64_t owner            # which Allocator of that process it serves (never reused)
    uint64_t ptok             # names that process (a pid may name two, in two namespaces)
    uint64_t ctok             # this claim (0 once given back): its thread's cache checks it
    uint32_t n[8]             # per class: how many of slot[c] are cached
    uint64_t slot[5][16]


cdef class NodeLocal:
    cdef readonly Mapping mapping  # the node-local file
    cdef readonly str path
    cdef readonly bint fresh       # we created the file: no process of this node held anything
    cdef readonly bint closed      # its Region closed (the mapping stays while users remain)
    cdef int user_fd               # holds the "in use" read lock on the file (see _use); -1
    cdef cxl_local_lock* locks     # CXL_MAX_LOCKS slots, CXL_LOCAL_LOCK_BYTES apart
    cdef cxl_local_heap* heap
    cdef uint64_t* counter         # heartbeat counter of the node (atomic add)
    cdef uint64_t* inc             # incarnation of the node's life this file serves
    cdef cxl_local_proc* procs     # CXL_LOCAL_PROCS records, edited under the file's flock
    cdef cxl_local_mag* mags       # CXL_LOCAL_MAGS records, CXL_LOCAL_MAG_BYTES apart
