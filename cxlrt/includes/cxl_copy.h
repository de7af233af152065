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
 *  - CXLRT_NT_STORES=0 in the environment turns it into memcpy, read once per
 *    module, so both ways can be measured from one build.
 */
#ifndef CXL_COPY_H
#define CXL_COPY_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CXL_NT_MIN 16384

/* -1 until first use; each extension module holds its own copy, all read the same env. */
static int cxl_nt_state __attribute__((unused)) = -1;

static inline int cxl_nt_enabled(void)
{
    int s = __atomic_load_n(&cxl_nt_state, __ATOMIC_RELAXED);
    if (s < 0) {
        const char *e = getenv("CXLRT_NT_STORES");
        s = !(e && e[0] == '0' && e[1] == '\0');
        __atomic_store_n(&cxl_nt_state, s, __ATOMIC_RELAXED);
    }
    return s;
}

#if defined(__x86_64__)
#include <immintrin.h>

static inline void cxl_copy_out(void *dst, const void *src, uint64_t n)
{
    char *d = (char *)dst;
    const char *s = (const char *)src;
    uint64_t head, body, i;
    if (n < CXL_NT_MIN || !cxl_nt_enabled()) {
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
    for (i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
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
