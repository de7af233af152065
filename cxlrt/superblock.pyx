# cython: language_level=3
"""Superblock encoding, checksum and validation (layout version 1).

Pure functions over bytes: the region reads and writes them with DMA, so the
superblock never depends on a node's cached view.
"""

import os
import socket
import time

from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy, memset

from cxlrt.layout cimport (CXL_LAYOUT_VERSION, CXL_LINE_SIZE, CXL_MAX_NODES, CXL_MAX_SECTIONS,
                           CXL_MIN_HEAP, CXL_NODE_AREA, CXL_NSECTIONS_V1, CXL_SB_PAGE,
                           CXL_SEC_HEAP, CXL_SEC_NODES, cxl_node_area, cxl_superblock)

from cxlrt.errors import (ChecksumError, LayoutVersionError, NodeRangeError, NotARegionError,
                          RegionError, RegionSizeError)

MAGIC = 0x31475254524C5843  # b"CXLRTRG1" little-endian
VERSION = CXL_LAYOUT_VERSION
SB_BYTES = sizeof(cxl_superblock)
NODE_AREA = CXL_NODE_AREA
PAGE = CXL_SB_PAGE
MAX_NODES = CXL_MAX_NODES
SECTION_NAMES = {CXL_SEC_NODES: "nodes", CXL_SEC_HEAP: "heap"}

# Sizes are part of the on-media format; a change here must bump the version.
assert sizeof(cxl_superblock) == 184, sizeof(cxl_superblock)
assert sizeof(cxl_node_area) == CXL_NODE_AREA, sizeof(cxl_node_area)


cdef uint64_t _fnv1a(const uint8_t* p, size_t n) noexcept nogil:
    """FNV-1a 64: detects torn or scribbled superblocks; not a security hash."""
    cdef uint64_t h = <uint64_t>0xcbf29ce484222325ULL
    cdef uint64_t prime = <uint64_t>0x100000001b3ULL
    cdef size_t i
    for i in range(n):
        h ^= p[i]
        h *= prime
    return h


def checksum(bytes raw):
    """Checksum of a packed superblock: FNV-1a 64 over every byte before the field."""
    if len(raw) < SB_BYTES:
        raise ValueError("short superblock")
    return _fnv1a(<const uint8_t*><const char*>raw, SB_BYTES - 8)


def _align(n, a):
    return (n + a - 1) // a * a


def min_size(int nodes):
    """Smallest region that holds the superblock, `nodes` node areas and a minimal heap."""
    return PAGE + _align(nodes * NODE_AREA, PAGE) + CXL_MIN_HEAP


def layout(unsigned long long size, int nodes):
    """Section table for a new region: {name: (offset, size)}."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be between 1 and {MAX_NODES}, got {nodes}")
    need = min_size(nodes)
    if size < need:
        raise RegionSizeError(
            f"region size {size} bytes is too small for {nodes} node(s): "
            f"need at least {need} bytes ({need // 1024} KiB)")
    nodes_off = PAGE
    heap_off = _align(nodes_off + nodes * NODE_AREA, PAGE)
    return {"nodes": (nodes_off, nodes * NODE_AREA), "heap": (heap_off, size - heap_off)}


def pack(unsigned long long size, int nodes, unsigned long long uuid, bint with_magic=True):
    """A superblock as bytes, checksummed as it will read once the magic is published."""
    cdef cxl_superblock sb
    sec = layout(size, nodes)
    memset(&sb, 0, sizeof(sb))
    sb.magic = MAGIC
    sb.version = CXL_LAYOUT_VERSION
    sb.line_size = CXL_LINE_SIZE
    sb.size = size
    sb.nodes = nodes
    sb.nsections = CXL_NSECTIONS_V1
    sb.uuid = uuid
    sb.created_ns = time.time_ns()
    sb.sections[CXL_SEC_NODES].off, sb.sections[CXL_SEC_NODES].size = sec["nodes"]
    sb.sections[CXL_SEC_HEAP].off, sb.sections[CXL_SEC_HEAP].size = sec["heap"]
    sb.checksum = _fnv1a(<const uint8_t*>&sb, sizeof(sb) - 8)
    if not with_magic:
        sb.magic = 0
    return (<char*>&sb)[:sizeof(sb)]


def unpack(bytes raw, unsigned long long medium_size, str where):
    """Validate a superblock read from a medium of `medium_size` bytes.

    Returns
    -------
    dict
        version, size, nodes, uuid, created_ns, sections {name: (off, size)}.

    Raises
    ------
    NotARegionError, LayoutVersionError, ChecksumError, RegionSizeError
        Each with a message naming `where` and what differs.
    """
    cdef cxl_superblock sb
    if len(raw) < SB_BYTES:
        raise RegionSizeError(f"{where}: only {len(raw)} bytes, too short to hold a region "
                              "superblock (truncated file?)")
    memcpy(&sb, <const char*>raw, sizeof(sb))
    if sb.magic != MAGIC:
        if raw[:SB_BYTES].count(0) == SB_BYTES:
            hint = "all zero: never formatted, or formatting never finished"
        elif sb.magic == 0:
            hint = "no magic yet: formatting never finished"
        else:
            hint = "foreign or corrupt data"
        raise NotARegionError(f"{where} is not a cxlrt region: bad magic 0x{sb.magic:016x} "
                              f"({hint}); format it with `cxlrt format`")
    if sb.version != CXL_LAYOUT_VERSION:
        raise LayoutVersionError(
            f"{where}: layout version {sb.version}, but this cxlrt reads version "
            f"{CXL_LAYOUT_VERSION}; use the cxlrt release that formatted it or reformat")
    want = _fnv1a(<const uint8_t*>&sb, sizeof(sb) - 8)
    if sb.checksum != want:
        raise ChecksumError(f"{where}: superblock checksum 0x{sb.checksum:016x} does not match "
                            f"its contents (0x{want:016x}): the superblock is corrupt")
    if sb.line_size != CXL_LINE_SIZE:
        raise RegionError(f"{where}: line size {sb.line_size}, expected {CXL_LINE_SIZE}")
    if sb.size != medium_size:
        raise RegionSizeError(
            f"{where}: superblock says the region is {sb.size} bytes but the medium has "
            f"{medium_size} (truncated or resized after formatting?)")
    if not 1 <= sb.nodes <= MAX_NODES:
        raise RegionError(f"{where}: node count {sb.nodes} outside 1..{MAX_NODES}")
    if sb.nsections != CXL_NSECTIONS_V1 or sb.nsections > CXL_MAX_SECTIONS:
        raise RegionError(f"{where}: {sb.nsections} sections, expected {CXL_NSECTIONS_V1}")
    sections = {}
    for i in range(sb.nsections):
        off, n = sb.sections[i].off, sb.sections[i].size
        if off < PAGE or n > sb.size or off > sb.size - n:
            raise RegionError(f"{where}: section {SECTION_NAMES[i]} [{off}, {off + n}) lies "
                              f"outside the region of {sb.size} bytes")
        sections[SECTION_NAMES[i]] = (off, n)
    nodes_off, nodes_len = sections["nodes"]
    heap_off, heap_len = sections["heap"]
    if any(off % PAGE for off, _ in sections.values()):
        raise RegionError(f"{where}: a section does not start on a {PAGE}-byte boundary")
    if nodes_len != sb.nodes * NODE_AREA:
        raise RegionError(f"{where}: node section holds {nodes_len} bytes, expected "
                          f"{sb.nodes * NODE_AREA} for {sb.nodes} nodes")
    if heap_off < nodes_off + nodes_len or heap_off + heap_len != sb.size \
            or heap_len < CXL_MIN_HEAP:
        raise RegionError(f"{where}: heap [{heap_off}, {heap_off + heap_len}) overlaps the "
                          f"node areas or does not run to the end of the region")
    return {"version": sb.version, "size": sb.size, "nodes": sb.nodes, "uuid": sb.uuid,
            "created_ns": sb.created_ns, "sections": sections}


def check_node(int node, int nodes, str where):
    """NodeRangeError unless 0 <= node < nodes."""
    if not 0 <= node < nodes:
        raise NodeRangeError(f"{where}: node {node} is out of range: this region has "
                             f"{nodes} node(s), ids 0..{nodes - 1}")


def new_uuid():
    """A random non-zero 64-bit format id."""
    while True:
        u = int.from_bytes(os.urandom(8), "little")
        if u:
            return u


def host_id():
    """A stable 64-bit id of this host's name, shown by `cxlrt info`."""
    cdef bytes h = socket.gethostname().encode()
    return _fnv1a(<const uint8_t*><const char*>h, len(h))
