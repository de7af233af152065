/* cxl_thread.h - a plain C thread for work that must run without the GIL.
 *
 * The heartbeat must keep beating while the interpreter is busy (a long call
 * holding the GIL, a garbage collection): only a thread that never takes the
 * GIL can promise that. Signals stay with the interpreter's threads. */
#ifndef CXL_THREAD_H
#define CXL_THREAD_H

#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdint.h>
#include <time.h>

typedef void *(*cxl_thread_fn)(void *);

/* Start fn(arg) with every blockable signal blocked (Python handles signals in
 * its main thread); 0 or a negative errno. */
static inline int cxl_thread_start(unsigned long *tid, cxl_thread_fn fn, void *arg)
{
    pthread_t t;
    sigset_t all, old;
    int rc;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0)
        *tid = (unsigned long)t;
    return -rc;
}

static inline int cxl_thread_join(unsigned long tid) { return -pthread_join((pthread_t)tid, NULL); }

static inline void cxl_sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    nanosleep(&ts, NULL);
}

/* A thread that sleeps in short naps (the lock manager) wants them short: the
 * default 50 us timer slack would stretch every 20 us sleep. */
static inline void cxl_set_timerslack_1ns(void) { prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); }

static inline void cxl_plain_mutex_init(pthread_mutex_t *m) { pthread_mutex_init(m, NULL); }
static inline void cxl_plain_mutex_lock(pthread_mutex_t *m) { pthread_mutex_lock(m); }
static inline void cxl_plain_mutex_unlock(pthread_mutex_t *m) { pthread_mutex_unlock(m); }

/* Ordered accesses between the beat thread and the threads that judge their own
 * silence: gap_end is stored before last_beat (release) and read after it (acquire). */
static inline uint64_t cxl_atomic_load_acquire64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void cxl_atomic_store_release64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
/* Dekker-style publish: the store is globally visible before any later load of
 * this thread (paired with the same sequence on the other side). */
static inline void cxl_atomic_store_seqcst_fence64(uint64_t *p, uint64_t v)
{
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
static inline int cxl_atomic_load_acquire_int(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void cxl_atomic_store_release_int(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

#endif /* CXL_THREAD_H */
