/* debug.h - compile-time debug level (uvloop/mimalloc style).
 * 0: release; 1: asserts and counters checked; 2: expensive walks.
 * setup.py --debug (or CXLRT_DEBUG=1 in the environment) defines it. */
#ifndef CXLRT_DEBUG
#define CXLRT_DEBUG 0
#endif
