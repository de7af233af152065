# cython: language_level=3
"""Superblock encoding, checksum and validation (layout version 1).

Pure functions over bytes: the region reads and writes them with DMA, so the
superblock never depends on a node's cached view.
"""

import os
import socket
import time

from libc.stdint cimport uint8_t, uint64_t

from cxlrt.includes.intrin cimport cxl_fnv1a64
from libc.string cimport memcpy, memset

from cxlrt.layout cimport (CXL_CHUNK, CXL_DIR_ENTRIES, CXL_DIR_ENTRY, CXL_LAYOUT_VERSION,
                           CXL_LINE_SIZE, CXL_MAX_LOCKS, CXL_MAX_NODES, CXL_MAX_SECTIONS,
                           CXL_MIN_CHUNKS, CXL_NODE_AREA, CXL_NSECTIONS, CXL_SB_PAGE,
                           CXL_SEC_ALLOC, CXL_SEC_DIR, CXL_SEC_HEAP, CXL_SEC_LOCKS, CXL_SEC_NODES,
                           cxl_dir_entry, cxl_lock_grant_line, cxl_lock_header,
                           cxl_lock_node_line, cxl_mgr_claim, cxl_node_area, cxl_rfree_queue,
                           cxl_rfree_queues_rel,
                           cxl_small_header, cxl_superblock)

from cxlrt.errors import (ChecksumError, LayoutVersionError, NodeRangeError, NotARegionError,
                          RegionError, RegionSizeError)

MAGIC = 0x31475254524C5843  # b"CXLRTRG1" little-endian
VERSION = CXL_LAYOUT_VERSION
SB_BYTES = sizeof(cxl_superblock)
# the checksum covers every byte before its own field, the struct's last
cdef size_t _SUMMED = <size_t>&(<cxl_superblock*>NULL).checksum
assert _SUMMED + sizeof((<cxl_superblock*>NULL).checksum) == SB_BYTES
NODE_AREA = CXL_NODE_AREA
PAGE = CXL_SB_PAGE
MAX_NODES = CXL_MAX_NODES
CHUNK = CXL_CHUNK
MAX_LOCKS = CXL_MAX_LOCKS
DIR_ENTRIES = CXL_DIR_ENTRIES
DIR_ENTRY = CXL_DIR_ENTRY
RFREE_BYTES = sizeof(cxl_rfree_queue)
DEFAULT_LEASE_MS = 2000
SECTION_NAMES = {CXL_SEC_NODES: "nodes", CXL_SEC_LOCKS: "locks", CXL_SEC_DIR: "directory",
                 CXL_SEC_ALLOC: "alloc", CXL_SEC_HEAP: "heap"}

# Sizes are part of the on-media format; a change here must bump the version.
assert sizeof(cxl_superblock) == 192, sizeof(cxl_superblock)
assert sizeof(cxl_node_area) == CXL_NODE_AREA, sizeof(cxl_node_area)
assert sizeof(cxl_lock_header) == 64 and sizeof(cxl_lock_node_line) == 64
assert sizeof(cxl_lock_grant_line) == 64 and sizeof(cxl_mgr_claim) == 64
assert sizeof(cxl_dir_entry) == CXL_DIR_ENTRY and sizeof(cxl_small_header) == 64
assert sizeof(cxl_rfree_queue) == 4096


def checksum(bytes raw):
    """Checksum of a packed superblock: FNV-1a 64 over every byte before the field."""
    if len(raw) < SB_BYTES:
        raise ValueError("short superblock")
    return cxl_fnv1a64(<const uint8_t*><const char*>raw, _SUMMED)


def _align(n, a):
    return (n + a - 1) // a * a


def lock_record_bytes(int nodes):
    """Bytes of one lock record: header, one line per node, grant line."""
    return (nodes + 2) * CXL_LINE_SIZE


def _fixed(int nodes):
    """Offsets of the sections before the allocator's: (nodes, locks, directory, alloc)."""
    nodes_off = PAGE
    locks_off = _align(nodes_off + nodes * NODE_AREA, PAGE)
    locks_len = CXL_LINE_SIZE + CXL_MAX_LOCKS * lock_record_bytes(nodes)
    dir_off = _align(locks_off + locks_len, PAGE)
    alloc_off = _align(dir_off + CXL_DIR_ENTRIES * CXL_DIR_ENTRY, PAGE)
    return nodes_off, locks_off, locks_len, dir_off, alloc_off


def rfree_offset(nchunks):
    """Where node 0's remote-free queue starts in the alloc section: after the chunk table."""
    return cxl_rfree_queues_rel(nchunks)


def _alloc_bytes(nchunks, int nodes):
    return rfree_offset(nchunks) + nodes * RFREE_BYTES


def min_size(int nodes):
    """Smallest region that holds the fixed sections and CXL_MIN_CHUNKS heap chunks."""
    alloc_off = _fixed(nodes)[4]
    return _align(alloc_off + _alloc_bytes(CXL_MIN_CHUNKS, nodes), CHUNK) + CXL_MIN_CHUNKS * CHUNK


def layout(unsigned long long size, int nodes):
    """Section table for a new region: {name: (offset, size)}."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be between 1 and {MAX_NODES}, got {nodes}")
    need = min_size(nodes)
    if size < need:
        raise RegionSizeError(
            f"region size {size} bytes is too small for {nodes} node(s): "
            f"need at least {need} bytes ({need // 1024} KiB)")
    nodes_off, locks_off, locks_len, dir_off, alloc_off = _fixed(nodes)
    nchunks = (size - alloc_off) // CHUNK
    while _align(alloc_off + _alloc_bytes(nchunks, nodes), CHUNK) + nchunks * CHUNK > size:
        nchunks -= 1
    heap_off = _align(alloc_off + _alloc_bytes(nchunks, nodes), CHUNK)
    return {"nodes": (nodes_off, nodes * NODE_AREA), "locks": (locks_off, locks_len),
            "directory": (dir_off, CXL_DIR_ENTRIES * CXL_DIR_ENTRY),
            "alloc": (alloc_off, _alloc_bytes(nchunks, nodes)),
            "heap": (heap_off, nchunks * CHUNK)}


def pack(unsigned long long size, int nodes, unsigned long long uuid, bint with_magic=True,
         unsigned int lease_ms=DEFAULT_LEASE_MS):
    """A superblock as bytes, checksummed as it will read once the magic is published."""
    cdef cxl_superblock sb
    sec = layout(size, nodes)
    memset(&sb, 0, sizeof(sb))
    sb.magic = MAGIC
    sb.version = CXL_LAYOUT_VERSION
    sb.line_size = CXL_LINE_SIZE
    sb.size = size
    sb.nodes = nodes
    sb.nsections = CXL_NSECTIONS
    sb.uuid = uuid
    sb.created_ns = time.time_ns()
    for i, name in SECTION_NAMES.items():
        sb.sections[i].off, sb.sections[i].size = sec[name]
    sb.lease_ms = lease_ms
    sb.chunk_size = CXL_CHUNK
    sb.checksum = cxl_fnv1a64(<const uint8_t*>&sb, _SUMMED)
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
    want = cxl_fnv1a64(<const uint8_t*>&sb, _SUMMED)
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
    if sb.nsections != CXL_NSECTIONS:
        raise RegionError(f"{where}: {sb.nsections} sections, expected {CXL_NSECTIONS}")
    if sb.chunk_size != CXL_CHUNK or not 1 <= sb.lease_ms <= 3_600_000:
        raise RegionError(f"{where}: chunk size {sb.chunk_size} / lease {sb.lease_ms} ms "
                          "out of range")
    sections = {}
    for i in range(sb.nsections):
        off, n = sb.sections[i].off, sb.sections[i].size
        if off < PAGE or n > sb.size or off > sb.size - n:
            raise RegionError(f"{where}: section {SECTION_NAMES[i]} [{off}, {off + n}) lies "
                              f"outside the region of {sb.size} bytes")
        if off % PAGE:
            raise RegionError(f"{where}: section {SECTION_NAMES[i]} does not start on a "
                              f"{PAGE}-byte boundary")
        sections[SECTION_NAMES[i]] = (off, n)
    try:
        want_layout = layout(sb.size, sb.nodes)
    except (ValueError, RegionError) as e:
        raise RegionError(f"{where}: geometry is not valid: {e}") from None
    if sections != want_layout:
        bad = [k for k in want_layout if sections[k] != want_layout[k]]
        raise RegionError(f"{where}: section(s) {', '.join(bad)} are not where layout version "
                          f"{CXL_LAYOUT_VERSION} puts them for {sb.size} bytes and {sb.nodes} "
                          "nodes (overlapping, misplaced or resized)")
    return {"version": sb.version, "size": sb.size, "nodes": sb.nodes, "uuid": sb.uuid,
            "created_ns": sb.created_ns, "sections": sections, "lease_ms": sb.lease_ms,
            "chunk_size": sb.chunk_size}


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
    return cxl_fnv1a64(<const uint8_t*><const char*>h, len(h))
