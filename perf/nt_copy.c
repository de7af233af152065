/*
 * nt_copy.c - memcpy against non-temporal stores into a shared tmpfs mapping, the
 * medium file: regions use; how the 16 KiB threshold of cxlrt/includes/cxl_copy.h
 * was chosen (perf/README.md, "Stores with non-temporal copies").
 *
 *     gcc -O2 -Icxlrt/includes perf/nt_copy.c -o /tmp/nt_copy
 *     /tmp/nt_copy 2097152 64      # block bytes, blocks (the mapping is their product)
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cxl_copy.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s BLOCK_BYTES BLOCKS\n", argv[0]);
        return 2;
    }
    size_t bs = strtoull(argv[1], 0, 0), nblk = strtoull(argv[2], 0, 0), total = bs * nblk;
    char path[] = "/dev/shm/nt_copy.XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || ftruncate(fd, total) != 0) {
        perror("nt_copy");
        return 1;
    }
    unlink(path);
    char *dst = mmap(0, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    char *src = aligned_alloc(4096, bs * 16);
    if (dst == MAP_FAILED || src == NULL) {
        perror("nt_copy");
        return 1;
    }
    memset(src, 7, bs * 16);
    memset(dst, 1, total); /* every page faulted in before timing */
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        for (size_t i = 0; i < nblk; i++)
            memcpy(dst + i * bs, src + (i % 16) * bs, bs);
        double t1 = now();
        for (size_t i = 0; i < nblk; i++)
            cxl_copy_out(dst + i * bs, src + (i % 16) * bs, bs);
        double t2 = now();
        printf("%zu B blocks: memcpy %.2f GB/s, cxl_copy_out (%s) %.2f GB/s\n", bs,
               total / (t1 - t0) / 1e9, bs >= CXL_NT_MIN && cxl_nt_enabled() ? "nt" : "memcpy",
               total / (t2 - t1) / 1e9);
    }
    return 0;
}
