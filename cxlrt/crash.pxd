# Named crash points (issue 9): a protocol step calls its point; a harness arms one
# point by name and the process SIGKILLs or SIGSTOPs itself there.
#
# Cost when nothing is armed: one load of a process-wide flag and one predictable
# branch. Use from Cython:
#     from cxlrt.crash cimport cxl_crash_armed_ptr, cxl_crash_hit
#     cdef int* _armed = cxl_crash_armed_ptr()
#     ...
#     if unlikely(_armed[0]): cxl_crash_hit(b"lock.acquire.ticket")
# and from Python: ``from cxlrt.crash import point`` then ``point("dir.put.odd")``.

cdef int* cxl_crash_armed_ptr() noexcept nogil      # the process-wide "armed" flag
cdef void cxl_crash_hit(const char* name) noexcept nogil  # act if `name` is the armed point
