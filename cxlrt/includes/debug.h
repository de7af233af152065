/* debug.h - compile-time debug level (uvloop/mimalloc style).
 *
 * CXLRT_DEBUG, defined by setup.py from the environment (CXLRT_DEBUG=1 pip install -e .):
 *   0  release: no asserts, no test hooks; every macro below compiles to nothing.
 *   1  CXL_ASSERT checks the invariants the code relies on (O(1), process-local values
 *      only: a level-1 build touches the medium exactly as a release build does, so a
 *      --cxl-seed replays the same faults on both), and the test hooks exist.
 *   2  also CXL_ASSERT2: expensive walks (the chunk table after each change under the
 *      allocator lock), which read the medium and so change a seeded run.
 *
 * A failed assert prints what broke, the C file:line (the comment above that line in
 * the generated .c names the .pyx line) and the function (Cython's mangled name holds
 * the module and function), then abort()s: nogil-safe, no Python involved. */
#ifndef CXLRT_DEBUG_H
#define CXLRT_DEBUG_H

#ifndef CXLRT_DEBUG
#define CXLRT_DEBUG 0
#endif

#if CXLRT_DEBUG
#include <stdio.h>
#include <stdlib.h>

__attribute__((cold, noreturn, unused)) static void cxl_assert_fail(
        const char* what, const char* cond, const char* file, int line, const char* func) {
    fprintf(stderr, "cxlrt: CXL_ASSERT failed: %s\n  %s:%d in %s: %s\n", what, file, line,
            func, cond);
    fflush(stderr);
    abort();
}

#define CXL_ASSERT(cond, what) \
    (__builtin_expect(!!(cond), 1) ? (void)0 \
                                   : cxl_assert_fail((what), #cond, __FILE__, __LINE__, __func__))
/* A test-only branch: the hook's value in a debug build, constant 0 in a release build
 * (so `if CXLRT_TEST_HOOK(x):` leaves no code and no load in release hot paths). */
#define CXLRT_TEST_HOOK(x) (x)
#else
/* Neither the condition nor anything in it is evaluated; `what` is named only so that
 * its string constant does not count as unused. */
#define CXL_ASSERT(cond, what) ((void)(what))
#define CXLRT_TEST_HOOK(x) 0
#endif

#if CXLRT_DEBUG >= 2
#define CXL_ASSERT2(cond, what) CXL_ASSERT(cond, what)
#else
#define CXL_ASSERT2(cond, what) ((void)(what))
#endif

#endif /* CXLRT_DEBUG_H */
