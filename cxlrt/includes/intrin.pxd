# Externs for cxl_intrin.h and debug.h; semantics are documented in the header.
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "cxl_intrin.h" nogil:
    const char* CXL_ARCH_NAME
    int CXL_LINE
    void cxl_clflush(const void* p)
    void cxl_clflushopt(const void* p)
    void cxl_fence_full()
    void cxl_fence_drain()
    void cxl_fence_release()
    void cxl_fence_sc()
    int cxl_pid()
    void cxl_cpu_relax()
    void cxl_prefetch(const void* p)
    void cxl_prefetch_w(const void* p)
    int cxl_ctz64(uint64_t x)
    int cxl_popcount64(uint64_t x)
    uint64_t cxl_fnv1a64(const void* p, size_t n)
    uint64_t cxl_load64_volatile(const void* p)
    void cxl_store64_volatile(void* p, uint64_t v)
    void cxl_flush_range(const void* p, uint64_t n)
    void cxl_flushopt_range(const void* p, uint64_t n)
    uint32_t cxl_atomic_load_acquire32(const uint32_t* p)
    void cxl_atomic_store_release32(uint32_t* p, uint32_t v)
    int cxl_atomic_cas_acq32(uint32_t* p, uint32_t expect, uint32_t desired)
    uint64_t cxl_atomic_load_relaxed64(const uint64_t* p)
    void cxl_atomic_store_relaxed64(uint64_t* p, uint64_t v)
    uint64_t cxl_atomic_add_relaxed64(uint64_t* p, uint64_t v)
    uint32_t cxl_thread_id()
    uint64_t cxl_now_ns()
    uint64_t cxl_now_coarse_ns()
    uint64_t cxl_coarse_slack_ns()
    uint64_t cxl_wall_ns()
    void cxl_backoff(uint64_t* spins)
    void cxl_spin_ns(uint64_t ns)


cdef extern from "cxl_copy.h" nogil:
    uint64_t CXL_NT_MIN
    int cxl_nt_enabled()
    void cxl_copy_out(void* dst, const void* src, uint64_t n)


cdef extern from "debug.h" nogil:
    int CXLRT_DEBUG
    # Test-only branch: `if CXLRT_TEST_HOOK(flag):` is constant false in release builds.
    bint CXLRT_TEST_HOOK(bint x)
    # Level 1 (cheap, process-local) and level 2 (expensive walks) asserts: abort on failure.
    void CXL_ASSERT(bint cond, const char* what)
    void CXL_ASSERT2(bint cond, const char* what)


cdef extern from *:
    """
    #define cxl_likely(x) __builtin_expect(!!(x), 1)
    #define cxl_unlikely(x) __builtin_expect(!!(x), 0)
    """
    bint likely "cxl_likely"(bint x) nogil
    bint unlikely "cxl_unlikely"(bint x) nogil
