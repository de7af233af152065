# Status codes: the one vocabulary every C path returns and every Python layer reads.
#
# 0 is success; -1 .. -999 is a negated errno from the OS (a mutex, a mapping); the
# CXLRT_E_* below are ours. A few fast paths also return small positive values that
# are not errors (CXL_CHAN_AGAIN, a recovered robust mutex); they are named where
# they are returned. status.pyx maps each code to one exception class.

cdef enum:
    CXLRT_E_BASE = -1000         # above it (to -1): a negated errno; below: the codes here
    # the backend contract (backend.pxd)
    CXLRT_E_RANGE = -1001        # offset/length outside the region or misaligned
    CXLRT_E_COHERENCE = -1002    # emulation checker saw a protocol violation
    CXLRT_E_CLOSED = -1003       # region already closed
    CXLRT_E_IO = -1004           # the medium failed (RDMA completion error, ...)
    CXLRT_E_UNSUPPORTED = -1005  # operation this backend cannot do
    # locks (lock.pxd)
    CXLRT_E_TIMEOUT = -1010
    CXLRT_E_LOCKSTATE = -1011    # a lock's own state is unusable (not created, bad mode)
    CXLRT_E_FENCED = -1012       # superseded (another life of the node, or another manager)
    CXLRT_E_NOMANAGER = -1013    # a manager-mode waiter saw no manager pass for mgr_wait_ns
    # allocator (alloc.pxd)
    CXLRT_E_NOMEM = -1020
    CXLRT_E_BADFREE = -1021      # not the start of a live object
    CXLRT_E_DOUBLEFREE = -1022
    CXLRT_E_CORRUPT = -1024      # a table word or header that cannot be right
    CXLRT_E_SUSPECT = -1025      # silent past the lease while publishing under the allocator lock
    # KV cache (kvcache.pxd, kvpins.pxd)
    CXLRT_E_KVCORRUPT = -1030    # an entry or payload header that cannot be right
    CXLRT_E_KVPINS = -1031       # this node holds KV_PIN_MAX pins on one slot
    CXLRT_E_KVNOREC = -1032      # this process has no record in the node-local pin table yet
    # channel (channel.pxd)
    CXLRT_E_CHANCORRUPT = -1040  # a counter, run or slot word that cannot be right
    CXLRT_E_CHANLOST = -1041     # our role was taken over (or our node's life ended)


# Raise the exception status.pyx maps `rc` to, "<where>: <detail or the code's meaning>",
# with `extra` as keyword arguments of the exception; return 0 when rc >= 0.
cdef int check_rc(int rc, str where, str detail=*, dict extra=*) except -1
