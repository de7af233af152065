/* cxl_layout.h - on-media constants too wide for a Cython enum (a C int).
 * The structures they live in are declared in layout.pxd and alloc.pxd. */
#ifndef CXL_LAYOUT_H
#define CXL_LAYOUT_H

/* A remote-free journal entry's mark, xor its object's offset: queued, then applied. */
#define CXL_RFREE_PENDING 0x52465245452D5051ULL
#define CXL_RFREE_APPLIED 0x52465245452D4150ULL
/* Journal words carry offsets below 2**48. */
#define CXL_OFF_MASK 0x0000FFFFFFFFFFFFULL

#endif /* CXL_LAYOUT_H */
