# cython: language_level=3
"""``numa:`` — a region whose pages live on one NUMA node of this host.

A CXL memory expander appears to Linux as a CPU-less NUMA node. The region is a
shared tmpfs file whose mapping is bound to that node with mbind(MPOL_BIND)
before anything touches it; placement is then verified with move_pages (query
mode), not assumed. Memory of one host is coherent, so the fast path is the
same as ``file:``: volatile loads and stores, flush a no-op, fence a real one.

Specs: ``numa:NODE/NAME`` (the file is $CXLRT_NUMA_DIR or /dev/shm, plus NAME),
``numa:NODE//abs/path``, and ``numa:auto/NAME`` (the CPU-less node with the most
free memory).
"""

import os

from libc.stdlib cimport free, malloc

from cxlrt.backend cimport (CXL_CAP_COHERENT, CXL_CAP_DMA_REGISTRABLE, CXL_CAP_MAPPABLE,
                            CXL_F_DIRECT, CXL_F_NOFLUSH, MappedBackend, cxl_ops)
from cxlrt.direct cimport direct_ops_init
from cxlrt.includes.intrin cimport cxl_load64_volatile
from cxlrt.mapping cimport Mapping

from cxlrt.errors import RegionError

cdef extern from "<sys/syscall.h>" nogil:
    long syscall(long number, ...)
    long SYS_mbind
    long SYS_move_pages

cdef extern from "<errno.h>" nogil:
    int errno

cdef enum:
    MPOL_BIND = 2
    MPOL_MF_STRICT = 1
    MPOL_MF_MOVE = 2
    MAX_NODE_BITS = 1024

NODE_ROOT = "/sys/devices/system/node"
PARAMS = {}
"""Spec parameters accepted by ``numa:`` (none; the node is part of the path)."""


# --- node discovery ---------------------------------------------------------------

def _read(path):
    with open(path) as f:
        return f.read().strip()


def nodes():
    """{node: {"cpus": str, "mem_total": bytes, "mem_free": bytes}} of this host."""
    out = {}
    try:
        names = os.listdir(NODE_ROOT)
    except FileNotFoundError:
        return out
    for name in names:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        n = int(name[4:])
        info = {"cpus": _read(f"{NODE_ROOT}/{name}/cpulist"), "mem_total": 0, "mem_free": 0}
        for line in _read(f"{NODE_ROOT}/{name}/meminfo").splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[2] in ("MemTotal:", "MemFree:"):
                key = "mem_total" if parts[2] == "MemTotal:" else "mem_free"
                info[key] = int(parts[3]) * 1024
        out[n] = info
    return out


def pick_auto():
    """The CPU-less node with the most free memory; RegionError if there is none."""
    cands = {n: i for n, i in nodes().items() if not i["cpus"] and i["mem_total"] > 0}
    if not cands:
        raise RegionError("numa:auto found no CPU-less NUMA node with memory on this host "
                          "(a CXL expander shows up as one); name a node, e.g. numa:0/NAME")
    return max(cands, key=lambda n: cands[n]["mem_free"])


def parse_path(str spec_path):
    """(numa node, file path) from the spec path ``NODE/NAME`` or ``auto/NAME``."""
    head, sep, name = spec_path.partition("/")
    if not sep or not name:
        raise ValueError(f"numa spec path {spec_path!r} must be NODE/NAME (e.g. numa:1/rack0) "
                         "or auto/NAME")
    if head == "auto":
        node = pick_auto()
    elif head.isdigit():
        node = int(head)
    else:
        raise ValueError(f"numa node {head!r} is not a number or 'auto'")
    known = nodes()
    if node not in known:
        raise RegionError(f"NUMA node {node} does not exist on this host (nodes: "
                          f"{', '.join(map(str, sorted(known))) or 'none'})")
    if known[node]["mem_total"] <= 0:
        raise RegionError(f"NUMA node {node} has no memory")
    if name.startswith("/"):
        path = name
    else:
        path = os.path.join(os.environ.get("CXLRT_NUMA_DIR", "/dev/shm"), name)
    return node, path


def medium_path(str spec_path):
    """The file behind a ``numa:`` spec path (used by cxlrt.open before the backend)."""
    return parse_path(spec_path)[1]


cdef cxl_ops NUMA_OPS
# One host's memory is coherent, whichever node it sits on: the file: slots.
direct_ops_init(&NUMA_OPS)


cdef class NumaBackend(MappedBackend):
    """A shared tmpfs mapping bound to one NUMA node (see the module docstring)."""

    def __init__(self, str path, dict params, int node, unsigned long long size):
        cdef unsigned long mask[16]
        cdef long rc
        numa_node, fs_path = parse_path(path)
        if numa_node >= MAX_NODE_BITS:
            raise RegionError(f"NUMA node {numa_node} is beyond what cxlrt can bind")
        self.scheme = "numa"
        self.path = path
        self.params = dict(params)
        self.numa_node = numa_node
        m = Mapping(fs_path, size)
        for i in range(16):
            mask[i] = 0
        mask[numa_node // 64] = 1UL << (numa_node % 64)
        # Bind before first touch: for a shared tmpfs mapping the policy is kept by
        # the file, so pages any process faults in later land on this node too.
        rc = syscall(SYS_mbind, <void*>(<Mapping>m).base, <unsigned long>size, MPOL_BIND,
                     &mask[0], <unsigned long>(MAX_NODE_BITS + 1), MPOL_MF_STRICT | MPOL_MF_MOVE)
        if rc != 0:
            err = errno
            m.close()
            raise RegionError(f"numa:{path}: cannot bind the region to NUMA node {numa_node}: "
                              f"{os.strerror(err)}")
        self._use_mapping(m, CXL_CAP_COHERENT | CXL_CAP_MAPPABLE | CXL_CAP_DMA_REGISTRABLE,
                          CXL_F_DIRECT | CXL_F_NOFLUSH, node, &NUMA_OPS)

    def placement(self, unsigned long long off=0, unsigned long long n=0, bint touch=False):
        """{numa node: pages} of [off, off+n) (default: the whole region).

        move_pages only sees pages mapped in this process, so with ``touch`` each
        page is read first (on tmpfs that allocates a hole, so touch only ranges
        that were written, such as the metadata before the heap). Pages with no
        node yet are counted under -1.
        """
        cdef unsigned long long page = 4096, first, count, i
        cdef void** pages
        cdef int* status
        cdef long rc
        if n == 0:
            n = self.reg.size - off
        if off + n > self.reg.size:
            raise ValueError("placement range outside the region")
        first = off // page
        count = (off + n + page - 1) // page - first
        pages = <void**>malloc(count * sizeof(void*))
        status = <int*>malloc(count * sizeof(int))
        if pages == NULL or status == NULL:
            free(pages)
            free(status)
            raise MemoryError()
        try:
            for i in range(count):
                pages[i] = self.mapping.base + (first + i) * page
                if touch:
                    cxl_load64_volatile(pages[i])
            rc = syscall(SYS_move_pages, 0, <unsigned long>count, pages, NULL, status, 0)
            if rc < 0:
                raise OSError(errno, f"move_pages: {os.strerror(errno)}")
            out = {}
            for i in range(count):
                key = status[i] if status[i] >= 0 else -1
                out[key] = out.get(key, 0) + 1
            return out
        finally:
            free(pages)
            free(status)

    def verify_placement(self):
        """RegionError unless every touched page of the region is on our node."""
        where = self.placement()
        wrong = {k: v for k, v in where.items() if k not in (-1, self.numa_node)}
        if wrong:
            raise RegionError(f"numa:{self.path}: {sum(wrong.values())} page(s) are on node(s) "
                              f"{sorted(wrong)} instead of {self.numa_node}")
        return where

    def stats(self):
        where = self.placement()
        return {"numa_node": self.numa_node,
                "pages_on_node": where.get(self.numa_node, 0),
                "pages_untouched": where.get(-1, 0),
                "pages_elsewhere": sum(v for k, v in where.items()
                                       if k not in (-1, self.numa_node))}
