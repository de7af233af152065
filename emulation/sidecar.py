"""The emulation's sidecar file: every node's software cache, shared by its processes.

Layout (little-endian): a 4 KiB header, then one block per node holding the set
metadata (one 64-byte line a set: a robust process-shared mutex and the victim
pointer), the tags (8 bytes a way) and the cached lines (64 bytes a way). A
sidecar is built under a temporary name and linked into place only when complete,
so a process never maps a half-written one; deciding to replace a stale one is
serialised by an flock on the region file, so every process of a region ends up
on the same sidecar.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import tempfile

from cxlrt.mapping import Mapping
from cxlrt.shm import MUTEX_BYTES, init_robust_mutexes
from cxlrt.spec import parse_bool, parse_float_range, parse_int_range, parse_size

MAGIC = int.from_bytes(b"CXLEMU01", "little")
VERSION = 1
HEADER = struct.Struct("<QIIIIQQQ")  # magic, version, nodes, ways, pad, sets, region_size, uuid
HEADER_BYTES = 4096
PAGE = 4096
META_BYTES = 64  # per set: mutex + victim pointer, one line so sets never share one
VICTIM_OFFSET = MUTEX_BYTES  # byte offset of the u32 victim pointer in a set's line
MAX_WAYS = 64
assert VICTIM_OFFSET + 4 <= META_BYTES

PARAMS = {
    "seed": (parse_int_range(0, 2**64 - 1), 0, "seed of the fault injector (replays a run)"),
    "evict": (parse_float_range(0.0, 1.0), 0.0,
              "probability per access of writing back a recently dirtied line early"),
    "delay": (parse_bool, False, "1: flushes without drain complete only at the next fence"),
    "check": (parse_bool, False, "1: raise CoherenceError on protocol violations"),
    "lat": (parse_int_range(0, 10**9), 0, "modelled device latency per line transfer, ns"),
    "bw": (parse_float_range(0.0, 10**4), 0.0, "modelled DMA bandwidth, GB/s (0 = unlimited)"),
    "cache": (parse_size, 1 << 20, "cache size per node, bytes (K/M/G suffixes)"),
    "ways": (parse_int_range(1, 64), 8, "cache associativity"),
}
"""Spec parameters of ``emu:``: name -> (parser, default, description)."""


def mix_seed(seed: int, node: int, k: int) -> int:
    """A non-zero 64-bit RNG state from (seed, node, k) by splitmix64."""
    mask = 2**64 - 1
    x = (seed * 0x9E3779B97F4A7C15 + node * 0xBF58476D1CE4E5B9 + k * 0x94D049BB133111EB) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return x or 0x2545F4914F6CDD1D


def probability_threshold(p: float) -> int:
    """P as a threshold on a uniform 64-bit draw."""
    return min(int(p * 2.0**64), 2**64 - 1)


def geometry(region_size: int, cache_bytes: int, ways: int) -> tuple[int, int]:
    """(sets, ways) for a cache of about cache_bytes, no larger than the region."""
    lines = max(1, min(cache_bytes, region_size) // 64)
    sets = max(1, lines // ways)
    sets = 1 << (sets.bit_length() - 1)  # a power of two: set = line & (sets - 1)
    return sets, ways


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def node_offsets(node: int, sets: int, ways: int) -> dict[str, int]:
    """Byte offsets of node `node`'s set locks, tags and lines in the sidecar."""
    meta = META_BYTES * sets
    tags = _align(8 * sets * ways, 64)
    data = 64 * sets * ways
    block = _align(_align(meta, 64) + tags + data, PAGE)
    base = HEADER_BYTES + node * block
    return {"meta": base, "tags": base + _align(meta, 64), "data": base + _align(meta, 64) + tags,
            "block": block}


def _total(nodes: int, sets: int, ways: int) -> int:
    return HEADER_BYTES + nodes * node_offsets(0, sets, ways)["block"]


def _valid_geometry(sets: int, ways: int) -> bool:
    return 1 <= ways <= MAX_WAYS and sets >= 1 and sets & (sets - 1) == 0 and sets < 2**40


def read_geometry(m: Mapping) -> tuple[int, int]:
    """(sets, ways) recorded in a mapped sidecar; ValueError if they are not sane."""
    _, _, _, ways, _, sets, _, _ = HEADER.unpack_from(m, 0)
    if not _valid_geometry(sets, ways) or _total(1, sets, ways) > m.size:
        raise ValueError(f"emulation sidecar {m.path!r} is corrupt (sets={sets}, ways={ways})")
    return sets, ways


def read_head(path: str, n: int) -> tuple[bytes, int] | None:
    """The first n bytes of a sidecar and its size; None if it is missing or shorter."""
    try:
        with open(path, "rb") as f:
            raw = f.read(n)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None
    return (raw, size) if len(raw) == n else None


def if_sidecar(path: str, magic: int) -> list[str]:
    """[path] when the file there starts with a sidecar's `magic`, else [] (missing, or
    something else of that name: a region may be called rack.emu)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return []  # not even a file (opening a FIFO would wait for a writer)
        head = read_head(path, 8)
    except OSError:
        return []
    return [path] if head is not None and int.from_bytes(head[0], "little") == magic else []


def _read_header(path: str):
    head = read_head(path, HEADER.size)
    if head is None:
        return None
    raw, size = head
    magic, version, nodes, ways, _, sets, rsize, uuid = HEADER.unpack(raw)
    if (magic != MAGIC or version != VERSION or not _valid_geometry(sets, ways)
            or size != _total(nodes, sets, ways)):
        return None
    return {"nodes": nodes, "ways": ways, "sets": sets, "region_size": rsize, "uuid": uuid}


def _build(path: str, nodes: int, uuid: int, region_size: int, sets: int, ways: int) -> str:
    """Write a complete, empty sidecar under a temporary name; return that name."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, _total(nodes, sets, ways))  # zero-filled = empty caches
    finally:
        os.close(fd)
    m = Mapping(tmp, _total(nodes, sets, ways))
    try:
        for n in range(nodes):
            init_robust_mutexes(m, node_offsets(n, sets, ways)["meta"], sets, META_BYTES)
        HEADER.pack_into(m, 0, MAGIC, VERSION, nodes, ways, 0, sets, region_size, uuid)
    finally:
        m.close()
    return tmp


def attach(path: str, *, nodes: int, uuid: int, region_size: int, geometry: tuple[int, int],
           fresh: bool) -> Mapping:
    """Map the sidecar for a region, creating it or replacing a stale one.

    Parameters
    ----------
    path : str
        Sidecar path (the region file + ``.emu``).
    nodes, uuid, region_size : int
        What the superblock says; a sidecar that disagrees is stale.
    geometry : (int, int)
        (sets, ways) to use when creating.
    fresh : bool
        The region was just formatted: replace whatever is there.
    """
    # The flock serialises read-decide-replace-map among this region's processes:
    # nobody replaces the sidecar between another process's check and its mmap.
    lock_fd = os.open(path[:-len(".emu")] if path.endswith(".emu") else path,
                      os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        hdr = None if fresh else _read_header(path)
        if hdr is None or (hdr["uuid"], hdr["nodes"], hdr["region_size"]) != (uuid, nodes,
                                                                            region_size):
            tmp = _build(path, nodes, uuid, region_size, *geometry)
            os.replace(tmp, path)  # fresh, stale or missing: new caches from now on
            hdr = _read_header(path)
            if hdr is None:
                raise RuntimeError(f"emulation sidecar {path!r} vanished while being created")
        m = Mapping(path, _total(nodes, hdr["sets"], hdr["ways"]))
        read_geometry(m)
        return m
    finally:
        os.close(lock_fd)  # closing the descriptor releases the flock
