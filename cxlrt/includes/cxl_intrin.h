/*
 * cxl_intrin.h - the only place that knows the CPU: cache-line flushes, fences,
 * volatile 8-byte accesses, spin hints and host-local atomics.
 *
 * Invariants:
 *  - cxl_clflush(p) returns only after the line holding p is written back and
 *    invalidated (x86 clflush, aarch64 DC CIVAC + DSB); it is the "publish" and
 *    the "observe" primitive of the memory model (DESIGN.md rule 4).
 *  - cxl_clflushopt(p) may complete late; only a following cxl_fence_drain()
 *    guarantees its write-back (clflushopt/clwb + sfence).
 *  - cxl_fence_full() orders every earlier load and store before every later one.
 *  - The cxl_atomic_* helpers act on memory shared by processes of ONE host
 *    (emulator bookkeeping, node-local locks). They are never used on region
 *    memory that another host reads: the memory model has no cross-node atomics.
 */
#ifndef CXL_INTRIN_H
#define CXL_INTRIN_H

#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sched.h>
#include <pthread.h>

#define CXL_LINE 64

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CXL_ARCH_NAME "x86_64"

/* clflush is synchronous with respect to later fenced stores; the mfence after
 * the loop in callers pairs with it (see cxl_flush_range). */
static inline void cxl_clflush(const void *p) { _mm_clflush(p); }

#if defined(__CLFLUSHOPT__)
static inline void cxl_clflushopt(const void *p) { _mm_clflushopt((void *)p); }
#else
/* Without -mclflushopt we fall back to the stronger clflush: correct, slower. */
static inline void cxl_clflushopt(const void *p) { _mm_clflush(p); }
#endif

static inline void cxl_fence_full(void) { _mm_mfence(); }
static inline void cxl_fence_drain(void) { _mm_sfence(); }
/* x86 is TSO: stores are never reordered with older stores, so ordering a
 * publication after earlier stores needs only the compiler to keep the order. */
static inline void cxl_fence_release(void) { __asm__ volatile("" ::: "memory"); }
/* Store->load ordering for ordinary write-back memory: a locked RMW on our own
 * stack line is a full barrier for plain loads and stores and costs less than
 * mfence (Linux uses it for smp_mb on x86-64). Not a drain for clflushopt or
 * non-temporal stores: those still need cxl_fence_full. */
static inline void cxl_fence_sc(void) { __asm__ volatile("lock; addl $0,-4(%%rsp)" ::: "memory", "cc"); }
static inline void cxl_cpu_relax(void) { _mm_pause(); }

#elif defined(__aarch64__)
#define CXL_ARCH_NAME "aarch64"

/* DC CIVAC cleans and invalidates to the point of coherence; the DSB makes the
 * maintenance complete before we return, matching x86 clflush. */
static inline void cxl_clflush(const void *p)
{
    __asm__ volatile("dc civac, %0" ::"r"(p) : "memory");
    __asm__ volatile("dsb ish" ::: "memory");
}
/* The deferred flavour leaves completion to the next drain (DSB). */
static inline void cxl_clflushopt(const void *p)
{
    __asm__ volatile("dc civac, %0" ::"r"(p) : "memory");
}
/* DSB, not DMB: the fence must also wait for earlier DC CIVAC to complete, so
 * flush_nodrain + fence publishes as clflushopt + mfence does on x86. */
static inline void cxl_fence_full(void) { __asm__ volatile("dsb ish" ::: "memory"); }
static inline void cxl_fence_release(void) { __asm__ volatile("dmb ish" ::: "memory"); }
static inline void cxl_fence_sc(void) { __asm__ volatile("dmb ish" ::: "memory"); }
static inline void cxl_fence_drain(void) { __asm__ volatile("dsb ish" ::: "memory"); }
static inline void cxl_cpu_relax(void) { __asm__ volatile("yield" ::: "memory"); }

#else
#define CXL_ARCH_NAME "generic"
/* No cache maintenance instructions known: only correct for coherent memory,
 * which is all the emulation needs (its caches are software). */
static inline void cxl_clflush(const void *p) { (void)p; __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void cxl_clflushopt(const void *p) { (void)p; }
static inline void cxl_fence_full(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void cxl_fence_drain(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void cxl_fence_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
static inline void cxl_fence_sc(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void cxl_cpu_relax(void) { }
#endif

/* Aligned 8-byte accesses are single instructions on both architectures, so
 * they are never torn (DESIGN.md rule 3); volatile stops the compiler from
 * caching or merging them. */
static inline uint64_t cxl_load64_volatile(const void *p) { return *(const volatile uint64_t *)p; }
static inline void cxl_store64_volatile(void *p, uint64_t v) { *(volatile uint64_t *)p = v; }

/* Write back and drop every line of [p, p+n); the trailing full fence orders
 * the flushes before the caller's next access (publish/observe). */
static inline void cxl_flush_range(const void *p, uint64_t n)
{
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(CXL_LINE - 1);
    uintptr_t end = (uintptr_t)p + n;
    for (; a < end; a += CXL_LINE)
        cxl_clflush((const void *)a);
    cxl_fence_full();
}

/* Same, but completion is only guaranteed by the caller's later drain. */
static inline void cxl_flushopt_range(const void *p, uint64_t n)
{
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(CXL_LINE - 1);
    uintptr_t end = (uintptr_t)p + n;
    for (; a < end; a += CXL_LINE)
        cxl_clflushopt((const void *)a);
}

/* Host-local atomics, named by memory order (mimalloc style). */
static inline uint32_t cxl_atomic_load_acquire32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void cxl_atomic_store_release32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline int cxl_atomic_cas_acq32(uint32_t *p, uint32_t expect, uint32_t desired)
{
    return __atomic_compare_exchange_n(p, &expect, desired, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}
static inline uint64_t cxl_atomic_load_relaxed64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void cxl_atomic_store_relaxed64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline uint64_t cxl_atomic_add_relaxed64(uint64_t *p, uint64_t v) { return __atomic_add_fetch(p, v, __ATOMIC_RELAXED); }

/* Process id without a system call per use (getpid is a real syscall in glibc
 * >= 2.25); the fork handler keeps it right in children. */
static int cxl_pid_cached;
static void cxl_pid_reset(void) { cxl_pid_cached = 0; }
static inline int cxl_pid(void)
{
    if (!cxl_pid_cached) {
        static int registered;
        if (!registered) {
            registered = 1;
            pthread_atfork(NULL, NULL, cxl_pid_reset);
        }
        cxl_pid_cached = (int)getpid();
    }
    return cxl_pid_cached;
}

/* Kernel thread id, cached per thread: unique across the host, so it names the
 * holder of a host-local lock and lets a waiter test whether it died. */
#ifndef CXL_TLS_IE
/* initial-exec: a few bytes of the static TLS surplus, and no __tls_get_addr call
 * per use (a lock acquire asks for its thread id: 4 % of an uncontended pair). */
#define CXL_TLS_IE __attribute__((tls_model("initial-exec")))
#endif
static __thread uint32_t cxl_tid_cached CXL_TLS_IE;
static void cxl_tid_reset(void) { cxl_tid_cached = 0; }
static inline uint32_t cxl_thread_id(void)
{
    if (!cxl_tid_cached) {
        static int registered;
        if (!registered) {
            registered = 1;
            pthread_atfork(NULL, NULL, cxl_tid_reset);  /* the child's thread is new */
        }
        cxl_tid_cached = (uint32_t)syscall(SYS_gettid);
    }
    return cxl_tid_cached;
}

static inline uint64_t cxl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The clock at the latest kernel tick: a few ns a read against ~25 for the fine
 * clock. Never ahead of it; usually behind by under a tick, but by several when the
 * timekeeping CPU has not ticked (a guest just resumed), so it may only ever make a
 * verdict more cautious, never decide that a deadline has not passed. */
static inline uint64_t cxl_now_coarse_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC_COARSE, &ts) != 0)
        return cxl_now_ns();
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The coarse clock's usual lag: two of its ticks. Only for telling a false alarm
 * from a real one (cxl_live_t0), where an unusual lag errs on the cautious side. */
static inline uint64_t cxl_coarse_slack_ns(void)
{
    struct timespec ts;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &ts) != 0)
        return UINT64_MAX;  /* no coarse clock: every check falls through to the fine one */
    return 2 * ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
}

/* Wall clock: shown to people and stamped for statistics; never used to judge
 * liveness (clocks of different hosts disagree: liveness.pxd). */
static inline uint64_t cxl_wall_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Back off politely while another process (maybe on our own core) holds what we
 * wait for: spin briefly, then yield, then sleep up to ~50 us. */
static inline void cxl_backoff(uint64_t *spins)
{
    uint64_t s = ++*spins;
    if (s < 64) {
        cxl_cpu_relax();
    } else if (s < 256) {
        sched_yield();
    } else {
        struct timespec ts = {0, (long)(s < 4096 ? 2000 : 50000)};
        nanosleep(&ts, NULL);
    }
}

/* Busy-wait: device latencies are hundreds of ns, far below any sleep. */
static inline void cxl_spin_ns(uint64_t ns)
{
    if (!ns)
        return;
    uint64_t end = cxl_now_ns() + ns;
    while (cxl_now_ns() < end)
        cxl_cpu_relax();
}

/* Start fetching p's line (cxl_prefetch_w: for a write). A hint that never faults:
 * a lookup names all its lines first, so their misses overlap instead of queueing
 * one behind the other through the probe loop. */
static inline void cxl_prefetch(const void *p) { __builtin_prefetch(p, 0, 3); }
static inline void cxl_prefetch_w(const void *p) { __builtin_prefetch(p, 1, 3); }

/* Bit scans of a 64-bit word (an allocator bitmap): x != 0 for ctz. */
static inline int cxl_ctz64(uint64_t x) { return __builtin_ctzll(x); }
static inline int cxl_popcount64(uint64_t x) { return __builtin_popcountll(x); }

/* FNV-1a 64 over n bytes: the checksum of the superblock and of a KV cache header
 * (detects torn or scribbled headers; not a security hash). */
static inline uint64_t cxl_fnv1a64(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

#endif /* CXL_INTRIN_H */
