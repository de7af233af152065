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

#define CXL_MAG_TLS 4

/* initial-exec: a few dozen bytes of the static TLS surplus, and no __tls_get_addr
 * call per lookup (which cost a fifth of an alloc+free pair in a shared object). */
#define CXL_TLS_IE __attribute__((tls_model("initial-exec")))
typedef struct { uint64_t owner; void *rec; int pid; } cxl_mag_entry;
static __thread cxl_mag_entry cxl_mag_tls[CXL_MAG_TLS] CXL_TLS_IE;
static __thread unsigned cxl_mag_tls_next CXL_TLS_IE;

static inline void *cxl_mag_find(uint64_t owner, int pid)
{
    int i;
    for (i = 0; i < CXL_MAG_TLS; i++)
        if (cxl_mag_tls[i].owner == owner && cxl_mag_tls[i].pid == pid)
            return cxl_mag_tls[i].rec;
    return 0;
}

static inline void cxl_mag_remember(uint64_t owner, int pid, void *rec)
{
    int i;
    for (i = 0; i < CXL_MAG_TLS; i++)
        if (cxl_mag_tls[i].owner == owner || cxl_mag_tls[i].pid != pid) {
            cxl_mag_tls[i].owner = owner; cxl_mag_tls[i].rec = rec; cxl_mag_tls[i].pid = pid;
            return;
        }
    i = (int)(cxl_mag_tls_next++ % CXL_MAG_TLS);
    cxl_mag_tls[i].owner = owner; cxl_mag_tls[i].rec = rec; cxl_mag_tls[i].pid = pid;
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

static inline void cxl_compiler_barrier(void) { __asm__ __volatile__("" ::: "memory"); }
#endif
