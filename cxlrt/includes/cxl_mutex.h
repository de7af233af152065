/*
 * cxl_mutex.h - robust, process-shared mutexes in host-local shared memory.
 *
 * Used where several processes of ONE host (one node) must exclude each other:
 * the emulation's cache sets, and the node-local tier of the two-tier lock. The
 * kernel marks a robust mutex whose owner thread died, so a crashed holder never
 * blocks the node forever (DESIGN.md: "a holder that dies must not stop the rack").
 */
#ifndef CXL_MUTEX_H
#define CXL_MUTEX_H

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

/* Initialise *m in place as robust + process-shared. 0 or -errno. */
static inline int cxl_mutex_init_shared(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    int rc;
    memset(m, 0, sizeof(*m));
    if ((rc = pthread_mutexattr_init(&a)))
        return -rc;
    rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (!rc)
        rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (!rc)
        rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return -rc;
}

/* Lock. 0: acquired; 1: acquired, but the previous owner died holding it (the
 * protected state may be half-updated: the caller repairs it); -errno else. */
static inline int cxl_mutex_lock(pthread_mutex_t *m)
{
    int rc = pthread_mutex_lock(m);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return 1;
    }
    return -rc;
}

/* As cxl_mutex_lock, giving up after timeout_ns (-ETIMEDOUT). */
static inline int cxl_mutex_timedlock(pthread_mutex_t *m, unsigned long long timeout_ns)
{
    struct timespec ts;
    int rc;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)(timeout_ns / 1000000000ull);
    ts.tv_nsec += (long)(timeout_ns % 1000000000ull);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    rc = pthread_mutex_timedlock(m, &ts);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return 1;
    }
    return -rc;
}

static inline int cxl_mutex_trylock(pthread_mutex_t *m)
{
    int rc = pthread_mutex_trylock(m);
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return 1;
    }
    return -rc;
}

static inline void cxl_mutex_unlock(pthread_mutex_t *m) { pthread_mutex_unlock(m); }

#endif /* CXL_MUTEX_H */
