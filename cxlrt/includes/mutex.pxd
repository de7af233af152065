# Externs for cxl_mutex.h: robust process-shared mutexes (see the header).

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass


cdef extern from "cxl_mutex.h" nogil:
    int cxl_mutex_init_shared(pthread_mutex_t* m)
    int cxl_mutex_lock(pthread_mutex_t* m)
    int cxl_mutex_timedlock(pthread_mutex_t* m, unsigned long long timeout_ns)
    int cxl_mutex_trylock(pthread_mutex_t* m)
    void cxl_mutex_unlock(pthread_mutex_t* m)
