"""The emulation's sidecar file: every node's software cache, shared by its processes.

Layout (little-endian): a 4 KiB header, then one block per node holding the set
locks (8 bytes a set), the tags (8 bytes a way) and the cached lines (64 bytes a
way). A sidecar is created under a temporary name and linked into place only
when complete, so a process never maps a half-written one.
"""

from __future__ import annotations

import os
import struct
import tempfile

from cxlrt.mapping import Mapping
from cxlrt.spec import parse_bool, parse_float_range, parse_int_range, parse_size

MAGIC = int.from_bytes(b"CXLEMU01", "little")
VERSION = 1
HEADER = struct.Struct("<QIIIIQQQ")  # magic, version, nodes, ways, pad, sets, region_size, uuid
HEADER_BYTES = 4096
PAGE = 4096

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
    x = (seed * 0x9E3779B97F4A7C15 + node * 0xBF58476D1CE4E5B9 + k * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
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
    meta = 8 * sets
    tags = _align(8 * sets * ways, 64)
    data = 64 * sets * ways
    block = _align(_align(meta, 64) + tags + data, PAGE)
    base = HEADER_BYTES + node * block
    return {"meta": base, "tags": base + _align(meta, 64), "data": base + _align(meta, 64) + tags,
            "block": block}


def _total(nodes: int, sets: int, ways: int) -> int:
    return HEADER_BYTES + nodes * node_offsets(0, sets, ways)["block"]


def read_geometry(m: Mapping) -> tuple[int, int]:
    """(sets, ways) recorded in a mapped sidecar."""
    _, _, _, ways, _, sets, _, _ = HEADER.unpack_from(m.mm, 0)
    return sets, ways


def _read_header(path: str):
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None
    if len(raw) < HEADER.size:
        return None
    magic, version, nodes, ways, _, sets, rsize, uuid = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or size != _total(nodes, sets, ways):
        return None
    return {"nodes": nodes, "ways": ways, "sets": sets, "region_size": rsize, "uuid": uuid}


def _build(path: str, nodes: int, uuid: int, region_size: int, sets: int, ways: int) -> str:
    """Write a complete, empty sidecar under a temporary name; return that name."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, _total(nodes, sets, ways))  # zero-filled = empty caches, free locks
        os.pwrite(fd, HEADER.pack(MAGIC, VERSION, nodes, ways, 0, sets, region_size, uuid), 0)
    finally:
        os.close(fd)
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
    for _ in range(8):
        hdr = None if fresh else _read_header(path)
        if hdr is not None and (hdr["uuid"], hdr["nodes"], hdr["region_size"]) == (uuid, nodes, region_size):
            m = Mapping(path, _total(nodes, hdr["sets"], hdr["ways"]))
            if read_geometry(m) == (hdr["sets"], hdr["ways"]):
                return m
            m.close()
            continue
        tmp = _build(path, nodes, uuid, region_size, *geometry)
        if fresh or hdr is not None or os.path.exists(path):
            os.replace(tmp, path)  # stale or reformatted: new caches for everyone from now on
            fresh = False
        else:
            try:
                os.link(tmp, path)  # first attach: lose gracefully to a concurrent creator
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
    raise RuntimeError(f"emulation sidecar {path!r} keeps changing under us; is another "
                       "process reformatting the region in a loop?")
