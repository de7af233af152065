# Externs for cxl_thread.h (a C thread that never takes the GIL, ordered atomics).
from libc.stdint cimport uint64_t

from cxlrt.includes.mutex cimport pthread_mutex_t


cdef extern from "cxl_thread.h" nogil:
    ctypedef void* (*cxl_thread_fn)(void*) noexcept nogil
    int cxl_thread_start(unsigned long* tid, cxl_thread_fn fn, void* arg)
    int cxl_thread_join(unsigned long tid)
    void cxl_sleep_ns(uint64_t ns)
    void cxl_set_timerslack_1ns()
    void cxl_plain_mutex_init(pthread_mutex_t* m)
    void cxl_plain_mutex_lock(pthread_mutex_t* m)
    void cxl_plain_mutex_unlock(pthread_mutex_t* m)
    uint64_t cxl_atomic_load_acquire64(const uint64_t* p)
    void cxl_atomic_store_release64(uint64_t* p, uint64_t v)
    void cxl_atomic_store_seqcst_fence64(uint64_t* p, uint64_t v)
    int cxl_atomic_load_acquire_int(const int* p)
    void cxl_atomic_store_release_int(int* p, int v)
