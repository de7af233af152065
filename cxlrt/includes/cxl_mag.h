/* Which magazine record (alloc.pyx) this thread uses for each Allocator: a few
 * entries per thread, keyed by the Allocator's owner id (never reused in a process)
 * and the pid (a forked child's copy of its parent's entries must not match). */
#ifndef CXL_MAG_H
#define CXL_MAG_H
#include <stdint.h>
#include <signal.h>
#include <errno.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <pthread.h>

#define CXL_MAG_TLS 4

/* initial-exec: a few dozen bytes of the static TLS surplus, and no __tls_get_addr
 * call per lookup (which cost a fifth of an alloc+free pair in a shared object). */
#ifndef CXL_TLS_IE
#define CXL_TLS_IE __attribute__((tls_model("initial-exec")))
#endif
typedef struct { uint64_t owner; void *rec; int pid; uint64_t tok; } cxl_mag_entry;
static __thread cxl_mag_entry cxl_mag_tls[CXL_MAG_TLS] CXL_TLS_IE;
static __thread unsigned cxl_mag_tls_next CXL_TLS_IE;

/* A fork's child starts with an empty cache and a new process token: a pid does not
 * tell parent from child (a child forked into a new pid namespace by that
 * namespace's pid 1 is pid 1 too, with tid 1), and a reused pid could name another. */
static uint64_t cxl_mag_ptok;
static void cxl_mag_after_fork(void)
{
    int i;
    for (i = 0; i < CXL_MAG_TLS; i++)
        cxl_mag_tls[i].owner = 0;
    cxl_mag_tls_next = 0;
    cxl_mag_ptok = 0;
}

static inline void cxl_mag_watch_forks(void)
{
    static int registered;
    if (!__atomic_exchange_n(&registered, 1, __ATOMIC_ACQ_REL))
        pthread_atfork(NULL, NULL, cxl_mag_after_fork);
}

/* A number naming this process among those a pid could name, drawn once per process
 * (and again in a fork's child); 0 never. */
static inline uint64_t cxl_mag_process_token(uint64_t seed)
{
    uint64_t t = __atomic_load_n(&cxl_mag_ptok, __ATOMIC_ACQUIRE), zero = 0;
    if (t)
        return t;
    cxl_mag_watch_forks();
    t = (seed * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)syscall(SYS_gettid);
    if (!t)
        t = 1;
    if (!__atomic_compare_exchange_n(&cxl_mag_ptok, &zero, t, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        t = zero;  /* another thread drew first */
    return t;
}

static uint64_t cxl_mag_claims;
static inline uint64_t cxl_mag_next_claim(void)
{
    return __atomic_add_fetch(&cxl_mag_claims, 1, __ATOMIC_RELAXED);
}

static inline void *cxl_mag_find(uint64_t owner, int pid, uint64_t *tok)
{
    int i;
    for (i = 0; i < CXL_MAG_TLS; i++)
        if (cxl_mag_tls[i].owner == owner && cxl_mag_tls[i].pid == pid) {
            *tok = cxl_mag_tls[i].tok;
            return cxl_mag_tls[i].rec;
        }
    return 0;
}

static inline void cxl_mag_remember(uint64_t owner, int pid, void *rec, uint64_t tok)
{
    int i;
    for (i = 0; i < CXL_MAG_TLS; i++)
        if (cxl_mag_tls[i].owner == owner || cxl_mag_tls[i].pid != pid)
            break;
    if (i == CXL_MAG_TLS)
        i = (int)(cxl_mag_tls_next++ % CXL_MAG_TLS);
    cxl_mag_tls[i].owner = owner; cxl_mag_tls[i].rec = rec;
    cxl_mag_tls[i].pid = pid; cxl_mag_tls[i].tok = tok;
}

static inline void cxl_mag_forget(uint64_t owner)
{
    int i;
    for (i = 0; i < CXL_MAG_TLS; i++)
        if (cxl_mag_tls[i].owner == owner)
            cxl_mag_tls[i].owner = 0;
}

/* 1 when thread tid of process pid (of our pid namespace) surely no longer runs: the
 * process is gone, or the thread is. Anything else (EPERM, success) is alive. */
static inline int cxl_thread_gone(int pid, int tid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 1;
    return syscall(SYS_tgkill, pid, tid, 0) != 0 && errno == ESRCH;
}

/* Inode of this process's pid namespace now (a process may move a child into a new
 * one after it opened a region), 0 when it cannot be read. */
static inline uint64_t cxl_pidns_now(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static inline void cxl_compiler_barrier(void) { __asm__ __volatile__("" ::: "memory"); }
#endif
