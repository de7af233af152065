"""The directory: a small table of named root objects in the region.

An entry is two 64-byte lines::

    line 0  state (0 free, 1 used) · off · name_len · generation
            redo: new state | name_len << 8 | (writer node + 1) << 16 · new off ·
                  tag (the odd generation the record belongs to) · seal (checksum)
    line 1  the name (NAME_BYTES of UTF-8)

Entries are changed only under lock 0 (the meta lock), in steps that each
leave a valid state behind, so a writer killed between any two of them never
wedges the directory and never loses an acknowledged name:

1. a new name goes into a free entry's name line first (readers ignore the
   name of a free entry);
2. the redo record, the complete new value, is published while the generation
   is still even (readers ignore it);
3. the generation goes odd: the change is decided from here on (its
   linearisation point), and readers return the redo record's value;
4. the body (state, off, name_len) is written from the redo record;
5. the generation goes even again.

Readers take no lock and never wait on a dead writer: they read both lines and
re-read the generation (a seqlock). An odd generation whose redo record is
sealed for it is read as the new value; a moving generation (a live writer
between steps) makes them read again, with backoff. A torn entry (odd, left by
a killed writer) is finished by the next put/delete, which settles every torn
entry under the lock before it writes, or by ``cxlrt check --repair``. Finishing
is idempotent (a repairer killed halfway leaves the same work to the next) and
gives what readers already saw, so an interrupted overwrite shows the old value
or the new one, never a torn one and never neither.

A writer stalled past its lease and then resumed may have had its meta lock
broken and its change finished or overwritten by others. Before each of its
stores it re-reads the entry's generation and stops with LeaseLost if someone
else moved it, and its ``release()`` raises LeaseLost as well. What it can
still damage is bounded by one store made after that check: its own entry's
name line (only while it saw the entry free), redo record (harmless unless
another writer is between steps 2 and 3 on that entry), body or generation.
It cannot touch any other entry, and nothing older than that one entry's last
change.
"""

from __future__ import annotations

import time

from cxlrt import layoutinfo
from cxlrt.crash import point
from cxlrt.errors import RegionError
from cxlrt.formats import Format
from cxlrt.lock import LeaseLost

ENTRIES = layoutinfo.CONSTANTS["CXL_DIR_ENTRIES"]
ENTRY = layoutinfo.size("cxl_dir_entry")
NAME_BYTES = layoutinfo.field("cxl_dir_entry", "name").width
_BODY = Format("cxl_dir_entry", "state", "off", "name_len")
_REDO = Format("cxl_dir_entry", "redo", "redo_off", "redo_tag", "redo_seal")
_LINE0 = Format("cxl_dir_entry", *_BODY.names, "generation", *_REDO.names)
_GEN = layoutinfo.offset("cxl_dir_entry", "generation")
_NAME = layoutinfo.offset("cxl_dir_entry", "name")
_MASK = (1 << 64) - 1
_PATIENCE_S = 2.0  # a reader gives up on an entry whose generation keeps moving this long


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


def _seal(redo: int, off: int, tag: int) -> int:
    """FNV-1a over the redo words: a zeroed or scribbled record never passes as sealed."""
    h = 0xCBF29CE484222325
    for w in (redo, off, tag):
        h = ((h ^ w) * 0x100000001B3) & _MASK
    return h ^ 0x6469722E7265646F  # "dir.redo": all-zero words do not seal to zero


def _redo(w) -> tuple[int, int, int, int] | None:
    """(state, off, name_len, writer node) of a sealed redo record for w's odd generation."""
    redo, off, tag = w.redo, w.redo_off, w.redo_tag
    if not w.generation & 1 or tag != w.generation or w.redo_seal != _seal(redo, off, tag):
        return None
    return redo & 0xFF, off, (redo >> 8) & 0xFF, ((redo >> 16) & 0xFFFF) - 1


def _no_redo(i: int, gen: int) -> RegionError:
    return RegionError(f"directory entry {i} is mid-change (generation {gen}) without a "
                       "valid redo record (corrupt; `cxlrt check --repair` settles it)")


def _backoff(attempt: int) -> None:
    """Spin three times, then sleep 1 µs, doubling up to about 1 ms."""
    if attempt >= 3:
        time.sleep(1e-6 * (1 << min(attempt - 3, 10)))


def dma_items(region, base: int) -> list[tuple[str, int]]:
    """(name, offset) of every settled used entry, read by DMA without attaching.

    For ``cxlrt info``, which reads a region it has not joined: no lock, no cached
    view, and an entry that is mid-change is left out rather than waited for.
    """
    out = []
    for i in range(ENTRIES):
        raw = region.dma_read(base + i * ENTRY, ENTRY)
        w = _LINE0.unpack(raw, _LINE0.offset)
        if w.state != 1 or w.generation & 1 or not 1 <= w.name_len <= NAME_BYTES:
            continue
        out.append((raw[_NAME:_NAME + w.name_len].decode("utf-8", "replace"), w.off))
    return out


class Directory:
    def __init__(self, region):
        self.region = region
        self.base = region.sections["directory"][0]

    # --- reading (no lock) ----------------------------------------------------------

    def _read(self, i):
        """(line-0 words, name line) of entry i, read consistently (a seqlock read).

        Retries, with backoff, while a live writer moves the generation under us;
        a stopped or dead writer does not move it, so this never waits on one.
        """
        r = self.region
        at = self.base + i * ENTRY
        t_end = None
        attempt = 0
        while True:
            r.flush(at, ENTRY)  # observe: drop our copies of both lines, then load
            w = _LINE0.unpack(r.load(at + _LINE0.offset, _LINE0.size))
            line1 = r.load(at + _NAME, NAME_BYTES)
            r.flush(at + _GEN, 8)  # and the generation afresh: unchanged = the name was stable
            if r.load64(at + _GEN) == w.generation:
                return w, line1
            if t_end is None:
                t_end = time.monotonic() + _PATIENCE_S
            elif time.monotonic() > t_end:
                raise RegionError(f"directory entry {i} keeps changing (generation "
                                  f"{w.generation}); "
                                  "is a writer looping on it?")
            _backoff(attempt)
            attempt += 1

    @staticmethod
    def _view(i, w, line1):
        """(state, off, name) of entry i as readers see it; RegionError if it is damaged."""
        state, off, n, gen = w.state, w.off, w.name_len, w.generation
        if gen & 1:
            redo = _redo(w)
            if redo is None:
                raise _no_redo(i, gen)
            state, off, n, _ = redo
        if state != 1:
            return 0, 0, b""
        if not 1 <= n <= NAME_BYTES:
            raise RegionError(f"directory entry {i} is corrupt (name length {n})")
        return 1, off, line1[:n]

    def _entry(self, i):
        """(state, off, name) of entry i, as one consistent snapshot."""
        return self._view(i, *self._read(i))

    @staticmethod
    def _label(w, line1) -> str:
        """The name an entry holds or is getting, for messages (whatever its state)."""
        redo = _redo(w)
        n = min(NAME_BYTES, max(w.name_len, redo[2] if redo else 0))
        return line1[:n].rstrip(b"\0").decode("utf-8", "replace")

    # --- writing (meta lock held) ----------------------------------------------------

    def _fence(self, at, i, gen):
        """Stop a writer whose entry someone else moved past `gen` (it lost its lock)."""
        r = self.region
        r.flush(at + _GEN, 8)  # observe: once our lease ran out, a repairer may have written it
        now = r.load64(at + _GEN)
        if now != gen:
            raise LeaseLost(f"directory entry {i}: generation {now}, not {gen}; someone "
                            "finished or replaced this change while this writer was silent "
                            "past its lease (it may or may not have taken effect)")

    def _apply(self, i, gen, state, off, n, step):
        """Steps 4-5: write the body of entry i (generation `gen`, odd), then even it."""
        r = self.region
        at = self.base + i * ENTRY
        self._fence(at, i, gen)
        r.store(at + _BODY.offset, _BODY.pack(state=state, off=off, name_len=n))
        r.persist(at + _BODY.offset, _BODY.size)  # durable before the even generation vouches
        point(step)
        self._fence(at, i, gen)
        r.store64(at + _GEN, gen + 1)
        r.persist(at + _GEN, 8)  # publish: readers now read the body, not the redo record

    def _change(self, i, w, state, off, raw, op):
        """Steps 1-5 of a put (`raw` = the name) or delete (`raw` None) of entry i."""
        r = self.region
        at = self.base + i * ENTRY
        gen = w.generation
        if raw is not None and w.state != 1:  # a new name into a free entry
            self._fence(at, i, gen)
            r.store(at + _NAME, raw.ljust(NAME_BYTES, b"\0"))
            r.persist(at + _NAME, NAME_BYTES)  # in place before any record points at it
            point("dir.put.name")
        n = len(raw) if raw is not None else w.name_len  # a delete keeps the name, for messages
        redo = state | n << 8 | (self.region.node + 1) << 16
        self._fence(at, i, gen)
        r.store(at + _REDO.offset, _REDO.pack(redo=redo, redo_off=off, redo_tag=gen + 1,
                                              redo_seal=_seal(redo, off, gen + 1)))
        r.persist(at + _REDO.offset, _REDO.size)  # the new value is durable before it is decided
        point(f"dir.{op}.redo")
        self._fence(at, i, gen)
        r.store64(at + _GEN, gen + 1)
        r.persist(at + _GEN, 8)  # decided: from here every reader returns the new value
        point(f"dir.{op}.odd")
        self._apply(i, gen + 1, state, off, n, f"dir.{op}.body")

    def _settle(self, i, salvage=False):
        """(words, name line, what was done) of entry i once no change is left halfway.

        Lock held: whoever changed an odd entry is dead or lost its lease, so
        finish its change from the redo record. An odd entry without one is
        damage: an error, unless `salvage` (``cxlrt check --repair``) keeps its
        body when that names a valid object and frees the entry otherwise.
        """
        w, line1 = self._read(i)
        if not w.generation & 1:
            return w, line1, None
        label = self._label(w, line1)
        redo = _redo(w)
        if redo is not None:
            state, off, n, node = redo
            action = (f"directory entry {i} ({label!r}): finished the change that a writer "
                      f"of node {node} left halfway")
        elif salvage:
            state, off, n = w.state, w.off, w.name_len
            if state != 1 or not 1 <= n <= NAME_BYTES or not 0 < off < self.region.size:
                state, off, n = 0, 0, 0
            action = (f"directory entry {i} ({label!r}) was mid-change without a redo record: "
                      + ("kept its old body" if state else "freed it (its body is not valid)"))
        else:
            raise _no_redo(i, w.generation)
        self._apply(i, w.generation, state, off, n, "dir.repair.body")
        w, line1 = self._read(i)
        return w, line1, action

    def _find_locked(self, raw):
        """((i, words) of `raw` or None, (i, words) of the first free entry or None).

        Settles every entry it reads: all of them up to `raw`'s, or all for a new name.
        """
        free = None
        for i in range(ENTRIES):
            w, line1, _ = self._settle(i)
            state, _, name = self._view(i, w, line1)
            if state == 1 and name == raw:
                return (i, w), free
            if state != 1 and free is None:
                free = (i, w)
        return None, free

    def _check_off(self, off):
        if isinstance(off, bool) or not isinstance(off, int) or not 0 < off < self.region.size:
            raise ValueError(f"directory offsets must lie inside the region (1.."
                             f"{self.region.size - 1}), got {off!r}")

    # --- public ------------------------------------------------------------------------

    def put(self, name, off):
        raw = _name(name)
        self._check_off(off)
        with self.region.locks.builtin(0):
            found, free = self._find_locked(raw)
            at = found or free
            if at is None:
                raise RegionError(f"the directory is full ({ENTRIES} names)")
            self._change(*at, 1, off, raw, "put")

    def get(self, name):
        raw = _name(name)
        for i in range(ENTRIES):
            state, off, got = self._entry(i)
            if state == 1 and got == raw:
                break
        else:
            raise KeyError(name)
        if not 0 < off < self.region.size:
            raise RegionError(f"directory entry {name!r} holds offset {off}, outside the "
                              f"region of {self.region.size} bytes (corrupt)")
        return off

    def delete(self, name):
        raw = _name(name)
        with self.region.locks.builtin(0):
            found, _ = self._find_locked(raw)
            if found is None:
                raise KeyError(name)
            self._change(*found, 0, 0, None, "delete")

    def names(self):
        return [name for name, _ in self.items()]

    def items(self):
        out = []
        for i in range(ENTRIES):
            state, off, name = self._entry(i)
            if state == 1:
                out.append((name.decode("utf-8", "replace"), off))
        return out

    # --- `cxlrt check` -----------------------------------------------------------------

    def scan(self, patience_s=0.05):
        """(items, problems) for ``cxlrt check``: takes no lock and raises for no entry.

        An entry still mid-change after `patience_s` (a live writer has long
        finished by then) is reported as torn; readers already see its new value.
        """
        items, problems = [], []
        for i in range(ENTRIES):
            try:
                w, line1 = self._read(i)
                t_end = time.monotonic() + patience_s
                attempt = 0
                while w.generation & 1 and time.monotonic() < t_end:
                    _backoff(attempt + 3)
                    attempt += 1
                    w, line1 = self._read(i)
                state, off, name = self._view(i, w, line1)
            except RegionError as e:
                problems.append(f"directory: {e}")
                continue
            if w.generation & 1:
                node = _redo(w)[3]
                problems.append(
                    f"directory entry {i} ({self._label(w, line1)!r}) is mid-change: a writer of "
                    f"node {node} stopped halfway (readers see its new value); the next put or "
                    f"delete finishes it, or `cxlrt check SPEC --repair --node N` (N dead)")
            if state == 1:
                items.append((name.decode("utf-8", "replace"), off))
        return items, problems

    def repair(self):
        """Settle every torn entry under the meta lock; returns what was done."""
        with self.region.locks.builtin(0):
            return [a for i in range(ENTRIES) if (a := self._settle(i, salvage=True)[2])]
