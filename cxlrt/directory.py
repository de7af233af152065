"""The directory: a small table of named root objects in the region.

Entries are written only under lock 0 (the meta lock) and published with a
seqlock generation (odd while being changed), so readers look names up without
the lock and never see a torn entry.
"""

from __future__ import annotations

import struct

from cxlrt.errors import RegionError

ENTRIES = 128
ENTRY = 128
NAME_BYTES = 64
_HDR = struct.Struct("<QQQQ")  # state, off, name_len, generation


def check_name(name: str, what: str = "directory", limit: int = NAME_BYTES) -> bytes:
    """The UTF-8 bytes of a name of 1..`limit` bytes; TypeError/ValueError otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"{what} names are str, not {type(name).__name__}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} name {name!r} is not valid UTF-8") from None
    if not 1 <= len(raw) <= limit:
        raise ValueError(f"{what} names are 1..{limit} bytes of UTF-8; "
                         f"{name[:20]!r}... is {len(raw)}")
    return raw


_name = check_name


class Directory:
    def __init__(self, region):
        self.region = region
        self.base = region.sections["directory"][0]

    def _entry(self, i):
        """(state, off, name) of entry i, as one consistent snapshot, or None if busy."""
        r = self.region
        at = self.base + i * ENTRY
        for _ in range(1000):
            r.flush(at, ENTRY)
            raw = r.load(at, ENTRY)
            state, off, n, gen = _HDR.unpack_from(raw)
            if gen & 1:
                continue  # a writer is mid-change: look again
            if n > NAME_BYTES:
                raise RegionError(f"directory entry {i} is corrupt (name length {n})")
            name = raw[64:64 + n]
            r.flush(at, 64)
            if _HDR.unpack_from(r.load(at, 32))[3] == gen:
                return state, off, name
        raise RegionError(f"directory entry {i} stays busy: a writer died mid-change? "
                          "(`cxlrt check`)")

    def _find(self, raw):
        free = None
        for i in range(ENTRIES):
            state, off, name = self._entry(i)
            if state == 1 and name == raw:
                return i, off
            if state != 1 and free is None:
                free = i
        return free, None

    def _write(self, i, state, off, raw):
        """Seqlock write (meta lock held): generation odd, body, generation even."""
        r = self.region
        at = self.base + i * ENTRY
        r.flush(at, ENTRY)
        gen = r.load64(at + 24)
        r.store64(at + 24, gen + 1)
        r.persist(at, 64)
        if raw is not None:
            r.store(at + 64, raw.ljust(NAME_BYTES, b"\0"))
            r.store64(at + 16, len(raw))
        r.store64(at + 8, off)
        r.store64(at, state)
        r.persist(at, ENTRY)
        r.store64(at + 24, gen + 2)
        r.persist(at, 64)

    def _check_off(self, off):
        if isinstance(off, bool) or not isinstance(off, int) or not 0 < off < self.region.size:
            raise ValueError(f"directory offsets must lie inside the region (1.."
                             f"{self.region.size - 1}), got {off!r}")

    def put(self, name, off):
        raw = _name(name)
        self._check_off(off)
        with self.region.locks.builtin(0):
            i, _ = self._find(raw)
            if i is None:
                raise RegionError(f"the directory is full ({ENTRIES} names)")
            self._write(i, 1, off, raw)

    def get(self, name):
        raw = _name(name)
        i, off = self._find(raw)
        if off is None:
            raise KeyError(name)
        if not 0 < off < self.region.size:
            raise RegionError(f"directory entry {name!r} holds offset {off}, outside the "
                              f"region of {self.region.size} bytes (corrupt)")
        return off

    def delete(self, name):
        raw = _name(name)
        with self.region.locks.builtin(0):
            i, off = self._find(raw)
            if off is None:
                raise KeyError(name)
            self._write(i, 0, 0, None)

    def names(self):
        out = []
        for i in range(ENTRIES):
            state, _, name = self._entry(i)
            if state == 1:
                out.append(name.decode("utf-8", "replace"))
        return out

    def items(self):
        out = []
        for i in range(ENTRIES):
            state, off, name = self._entry(i)
            if state == 1:
                out.append((name.decode("utf-8", "replace"), off))
        return out
