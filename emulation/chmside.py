"""The CXL-HM device model's shared state, ``<region>.chm``: the device DRAM and tables.

Layout: a 4 KiB header (the fields below, the controller's counters, and its robust
mutex at LOCK_OFFSET), the page map (u32 a capacity page), the frame table (u64 a
frame), then the frames, page-aligned. A sidecar is built under a temporary name and
linked into place only when complete, and the decision to replace one is serialised
by an flock on the region file (as the non-coherent emulation's sidecar is).
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile

from cxlrt.emulation.sidecar import read_head
from cxlrt.mapping import Mapping
from cxlrt.shm import init_robust_mutexes
from cxlrt.spec import parse_float_range, parse_int_range, parse_size

MAGIC = int.from_bytes(b"CXLCHM01", "little")
VERSION = 4
HEADER = struct.Struct("<QIIQQQQQQQddQQQ")  # magic, version, policy, page, frames, pages,
#                              region_size, dev, ino, lat, bw, wbw, wb_frames, wb_idle, pin
HEADER_BYTES = 4096
LOCK_OFFSET = 1024
POLICIES = ("lru", "staging")
MIN_PAGE = 4096
MAX_PAGE = 16 << 20


def _policy(text: str) -> str:
    t = text.strip().lower()
    if t not in POLICIES:
        raise ValueError(f"expected one of {', '.join(POLICIES)}")
    return t


def _page(text: str) -> int:
    n = parse_size(text)
    if not MIN_PAGE <= n <= MAX_PAGE or n & (n - 1):
        raise ValueError(f"expected a power of two from {MIN_PAGE} to {MAX_PAGE} bytes")
    return n


WB_NEVER = 2**64 - 1
"""wbidle=never: the write buffer flushes only when asked (Region.drain)."""


def _idle_text(ns: int) -> str:
    return "never" if ns == WB_NEVER else str(ns)


def _idle(text: str) -> int:
    if text.strip().lower() == "never":
        return WB_NEVER
    try:
        return parse_int_range(0, 10**12)(text)
    except ValueError:
        raise ValueError("expected ns from 0 to 10**12, or never") from None


PARAMS = {
    "policy": (_policy, "lru",
               "lru: DRAM is a transparent page cache; staging: DMA bypasses it (HyMCache)"),
    "dram": (parse_size, 64 << 20, "device DRAM bytes (K/M/G suffixes), at least one page"),
    "page": (_page, 64 << 10, "device page: the unit of DRAM fills and write-backs"),
    "lat": (parse_int_range(0, 10**9), 0, "modelled SSD latency per request, ns"),
    "bw": (parse_float_range(0.0, 10**4), 0.0, "modelled SSD read bandwidth, GB/s (0 = unlimited)"),
    "wbw": (parse_float_range(0.0, 10**4), 0.0,
            "modelled SSD write bandwidth, GB/s (0 = the read bandwidth)"),
    "wbuf": (parse_size, 0, "staging: bytes of DRAM kept as the write buffer (0 = none)"),
    "wbidle": (_idle, 50000, "ns the SSD must have been idle (no reads) before the write "
               "buffer flushes; never: only drain() flushes it"),
    "pin": (parse_int_range(10**6, 10**12), 5 * 10**9,
            "staging: ns a prefetched page stays pinned in DRAM unless released first "
            "(the pins of a requester that died lapse then)"),
}
"""Spec parameters of ``chm:``: name -> (parser, default, description)."""


PIN_BYTES = 32
"""A frame's pin-table entry: ready, until, count, gen (chm.pxd chm_pin)."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def geometry(region_size: int, params: dict) -> dict[str, int]:
    """Pages, frames and the sidecar's offsets for a region and its parameters."""
    page = params["page"]
    if params["dram"] < page:
        raise ValueError(f"chm: dram={params['dram']} is smaller than one page ({page} bytes)")
    pages = (region_size + page - 1) // page
    frames = params["dram"] // page
    wbuf = params.get("wbuf", 0)
    wb_frames = (wbuf + page - 1) // page
    if wbuf and params["policy"] != "staging":
        raise ValueError("chm: wbuf= is the staging policy's write buffer; under "
                         f"policy={params['policy']} every write already goes through DRAM")
    if wb_frames >= frames:
        raise ValueError(f"chm: wbuf={wbuf} leaves no DRAM for the cache: it must be smaller "
                         f"than dram={params['dram']} by a page ({page} bytes) at least")
    if pages >= 2**32 - 1 or frames >= 2**31:  # u32 page map entries, int frame numbers
        raise ValueError(f"chm: {pages} pages and {frames} frames of {page} bytes are too "
                         "many; use a larger page=")
    pmap = HEADER_BYTES
    ftab = _align(pmap + 4 * pages, 64)
    pins = _align(ftab + 8 * frames, 64)
    data = _align(pins + PIN_BYTES * frames, max(page, MIN_PAGE))
    return {"page": page, "pages": pages, "frames": frames, "wb_frames": wb_frames,
            "pmap": pmap, "ftab": ftab, "pins": pins, "data": data,
            "total": data + frames * page}


def _read_header(path: str):
    head = read_head(path, HEADER.size)
    if head is None:
        return None
    raw, size = head
    (magic, version, policy, page, frames, pages, rsize, dev, ino, lat, bw, wbw, wb, idle,
     pin) = HEADER.unpack(raw)
    if magic != MAGIC or policy >= len(POLICIES):
        return None
    return {"version": version, "policy": POLICIES[policy], "page": page, "frames": frames,
            "pages": pages, "region_size": rsize, "dev": dev, "ino": ino, "lat": lat, "bw": bw,
            "wbw": wbw, "wb_frames": wb, "wbidle": idle, "pin": pin, "bytes": size}


def _build(path: str, geo: dict, params: dict, region_size: int, dev: int, ino: int) -> str:
    """Write a complete, empty device under a temporary name; return that name."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, geo["total"])  # zeros: no page in DRAM, every frame free
    finally:
        os.close(fd)
    m = Mapping(tmp, geo["total"])
    try:
        init_robust_mutexes(m, LOCK_OFFSET, 1, 64)
        HEADER.pack_into(m, 0, MAGIC, VERSION, POLICIES.index(params["policy"]), geo["page"],
                         geo["frames"], geo["pages"], region_size, dev, ino, params["lat"],
                         params["bw"], params["wbw"], geo["wb_frames"], params["wbidle"],
                         params["pin"])
    finally:
        m.close()
    return tmp


def attach(region_path: str, region_size: int, params: dict) -> tuple[Mapping, dict]:
    """Map the device of a region file, creating it, or replacing one built for another
    file (another device and inode, or another size: a region file deleted and made
    again). A device opened with other parameters is a clear error: its DRAM may hold
    the only copy of data. A file re-created with the same inode number and size (a
    filesystem that reuses inodes at once; tmpfs does not) keeps the old device:
    remove ``<path>.chm`` along with the region file."""
    geo = geometry(region_size, params)
    side = region_path + ".chm"
    lock_fd = os.open(region_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        st = os.fstat(lock_fd)
        hdr = _read_header(side)
        if hdr is None or (hdr["dev"], hdr["ino"], hdr["region_size"]) != (
                st.st_dev, st.st_ino, region_size):
            os.replace(_build(side, geo, params, region_size, st.st_dev, st.st_ino), side)
            hdr = _read_header(side)
            if hdr is None:
                raise RuntimeError(f"device state {side!r} vanished while being created")
        if hdr["version"] != VERSION:
            # Its DRAM may hold the only copy of data: never rebuilt behind the user's back.
            raise ValueError(f"device state {side!r} was built by another version of cxlrt "
                             f"(format {hdr['version']}, this one reads {VERSION}); remove it "
                             "to start empty")
        have = (hdr["policy"], hdr["page"], hdr["frames"], hdr["lat"], hdr["bw"], hdr["wbw"],
                hdr["wb_frames"], hdr["wbidle"], hdr["pin"])
        want = (params["policy"], geo["page"], geo["frames"], params["lat"], params["bw"],
                params["wbw"], geo["wb_frames"], params["wbidle"], params["pin"])
        if have != want:
            raise ValueError(
                f"chm:{region_path}: the device was set up with policy={have[0]}, "
                f"page={have[1]}, dram={have[1] * have[2]}, lat={have[3]}, bw={have[4]:g}, "
                f"wbw={have[5]:g}, wbuf={have[1] * have[6]}, wbidle={_idle_text(have[7])}, "
                f"pin={have[8]}; "
                "open it with those parameters (its DRAM may hold data not "
                f"yet on the SSD, and one device has one SSD), or remove {side!r} to start "
                "empty")
        if hdr["bytes"] != geo["total"]:
            raise ValueError(f"device state {side!r} is {hdr['bytes']} bytes, expected "
                             f"{geo['total']}: it is corrupt; remove it to start empty")
        return Mapping(side, geo["total"]), geo
    finally:
        os.close(lock_fd)  # releases the flock
