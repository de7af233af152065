/*
 * cxl_copy.h - bulk copies into a medium that this CPU will not read back soon.
 *
 * A KV block is stored by one host and loaded by another, so the storing core
 * gains nothing from keeping its lines. From CXL_NT_MIN bytes up, non-temporal
 * stores skip the read-for-ownership of every destination line and leave the
 * caches to the caller's working set: on the 2-vCPU EPYC the perf figures come
 * from, 16 KiB to 32 MiB copies into a shared tmpfs mapping ran 1.2-1.5x faster
 * than memcpy, while 4 KiB copies ran about 10% slower (perf/README.md, "Stores
 * with non-temporal copies"). CXL memory gains more: the RFO is a link round trip.
 *
 * Invariants:
 *  - cxl_copy_out() returns with every byte ordered before the caller's later
 *    stores (sfence drains the write-combining buffers), as memcpy + sfence would.
 *  - It never leaves a destination line of [dst, dst+n) stale in this CPU's
 *    caches: a non-temporal store to a cached line evicts that line.
 *  - CXLRT_NT_STORES=0 in the environment turns it into memcpy, and
 *    CXLRT_NT_STORES=sse2 keeps the 16-byte stores on a CPU that has AVX; read once
 *    per module, so every way can be measured from one build.
 *
 * Width: 32-byte stores (AVX: vmovntdq ymm) where the CPU and OS have them, else
 * 16-byte (SSE2, every x86-64); any other CXLRT_NT_STORES value is the default. Other
 * CPUs copy with memcpy and a fence (mode 0). On the 2-vCPU EPYC of 2026-12-07 (AVX-512, about 25 GB/s to
 * tmpfs) 32-byte streams copied 2 MiB blocks 9-13% faster than 16-byte ones, and
 * 64-byte ones no faster than 32 (perf/README.md, "Wider non-temporal stores").
 */
#ifndef CXL_COPY_H
#define CXL_COPY_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define CXL_NT_MIN 16384

/* The copy each module uses, chosen at its first copy (each extension module holds
 * its own copy of this state; all read the same environment and CPU). */
enum { CXL_NT_UNKNOWN = -1, CXL_NT_OFF = 0, CXL_NT_SSE2 = 1, CXL_NT_AVX = 2 };
static int cxl_nt_state __attribute__((unused)) = CXL_NT_UNKNOWN;

static inline int cxl_nt_choose(void)
{
#if defined(__x86_64__)
    const char *e = getenv("CXLRT_NT_STORES");
    if (e && strcmp(e, "0") == 0)
        return CXL_NT_OFF;
    if (!(e && strcasecmp(e, "sse2") == 0) && __builtin_cpu_supports("avx"))
        return CXL_NT_AVX;  /* libgcc checks that the OS saves the AVX state too */
    return CXL_NT_SSE2;
#else
    return CXL_NT_OFF;  /* the copy below is memcpy whatever the environment says */
#endif
}

/* 0: memcpy; 1: 16-byte non-temporal stores; 2: 32-byte ones. */
static inline int cxl_nt_enabled(void)
{
    int s = __atomic_load_n(&cxl_nt_state, __ATOMIC_RELAXED);
    if (s < 0) {
        s = cxl_nt_choose();
        __atomic_store_n(&cxl_nt_state, s, __ATOMIC_RELAXED);
    }
    return s;
}

#if defined(__x86_64__)
#include <immintrin.h>

static inline void cxl_stream_sse2(char *d, const char *s, uint64_t body)
{
    for (uint64_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

/* Built for AVX whatever the module's flags; only called once the CPU said it has it. */
__attribute__((target("avx"))) static inline void cxl_stream_avx(char *d, const char *s,
                                                                 uint64_t body)
{
    uint64_t i = 0;
    for (; i + 128 <= body; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    for (; i < body; i += 32)  /* body is whole lines: an odd one left over */
        _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
}

static inline void cxl_copy_out(void *dst, const void *src, uint64_t n)
{
    char *d = (char *)dst;
    const char *s = (const char *)src;
    uint64_t head, body;
    int mode = n < CXL_NT_MIN ? CXL_NT_OFF : cxl_nt_enabled();
    if (mode == CXL_NT_OFF) {
        memcpy(d, s, n);
        return;
    }
    /* Whole aligned lines through the write-combining buffers; the ragged ends
     * go through the cache like any other small store. */
    head = (64 - ((uintptr_t)d & 63)) & 63;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    body = n & ~(uint64_t)63;
    if (mode == CXL_NT_AVX)
        cxl_stream_avx(d, s, body);
    else
        cxl_stream_sse2(d, s, body);
    memcpy(d + body, s + body, n - body);
    _mm_sfence();
}

#else
/* No non-temporal store in portable C: the ordering promise is kept by a fence. */
static inline void cxl_copy_out(void *dst, const void *src, uint64_t n)
{
    memcpy(dst, src, n);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
#endif

#endif /* CXL_COPY_H */
