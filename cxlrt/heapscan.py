"""Read-only walks of the allocator's metadata: usage figures and consistency checks.

Everything here observes (flush, then load) through a Region, so it sees what
other nodes published; it never writes.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field

from cxlrt import layoutinfo
from cxlrt.alloc import class_geometry, table_word, table_word_pack
from cxlrt.formats import Format
from cxlrt.superblock import rfree_offset

_C = layoutinfo.CONSTANTS
CHUNK = _C["CXL_CHUNK"]
SMALL, LARGE, TAIL = _C["CXL_CK_SMALL"], _C["CXL_CK_LARGE"], _C["CXL_CK_TAIL"]
KIND = {SMALL: "small", LARGE: "large", TAIL: "tail"}
SMALL_MAGIC = _C["CXL_SMALL_MAGIC"]
RFREE_BYTES = layoutinfo.size("cxl_rfree_queue")
_TABLE_WORD = 8  # a chunk-table word: uint64_t (layout.pxd)
_SMALL = Format("cxl_small_header", "magic", "size_class", "owner", "nslots", "data_start",
                "reserved0")
_BITMAP = layoutinfo.size("cxl_small_header")  # the slot bitmap follows the header line
_LINK = Format("cxl_rfree_link")
_QUEUE = Format("cxl_rfree_queue", "head", "count", "seq")
_JWORD = layoutinfo.offset("cxl_rfree_queue", "jword")
RFREE_PENDING = _C["CXL_RFREE_PENDING"]  # a queued object's mark ^ its offset
RFREE_APPLIED = _C["CXL_RFREE_APPLIED"]  # an applied one's
OFF_MASK = _C["CXL_OFF_MASK"]


def footprint(nbytes: int) -> float:
    """Heap bytes one live object of `nbytes` takes: its size class's share of a
    chunk, or whole chunks for a large one (for sizing caches to a heap)."""
    for size, slots, _ in class_geometry():
        if nbytes <= size:
            return CHUNK / slots
    return -(-nbytes // CHUNK) * CHUNK


@dataclass
class HeapScan:
    """What the chunk table, small-chunk headers and bitmaps say."""

    nchunks: int = 0
    free_chunks: int = 0
    small_chunks: int = 0
    large_chunks: int = 0
    small_objects: int = 0
    small_bytes: int = 0
    large_objects: int = 0
    large_bytes: int = 0
    by_node: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    empty_small: list = field(default_factory=list)      # (chunk, owner)
    uncarved_small: list = field(default_factory=list)   # (chunk, owner): carve interrupted
    orphan_tails: list = field(default_factory=list)     # (chunk, owner): its head is gone
    live_ranges: list = field(default_factory=list)      # (start, end) of live chunks
    queued: dict = field(default_factory=dict)           # node -> [offsets] not yet applied
    cached_objects: int = 0   # in live threads' magazines (freed; nodes of this host only)
    cached_bytes: int = 0
    dead_cached: list = field(default_factory=list)      # (node, pid, tid, [offsets])

    def usage(self) -> dict:
        return {"chunk_bytes": CHUNK, "chunks": self.nchunks, "free_chunks": self.free_chunks,
                "small_chunks": self.small_chunks, "large_chunks": self.large_chunks,
                "small_objects": self.small_objects, "small_bytes": self.small_bytes,
                "large_objects": self.large_objects, "large_bytes": self.large_bytes,
                "live_bytes": self.small_bytes + self.large_bytes,
                "cached_objects": self.cached_objects, "cached_bytes": self.cached_bytes,
                "free_bytes": self.free_chunks * CHUNK, "by_node": self.by_node}


def _table(region):
    alloc_off, _ = region.sections["alloc"]
    heap_off, heap_len = region.sections["heap"]
    n = heap_len // CHUNK
    region.flush(alloc_off, n * _TABLE_WORD)
    raw = region.load(alloc_off, n * _TABLE_WORD)
    return alloc_off, heap_off, n, struct.unpack(f"<{n}Q", raw)


def scan(region) -> HeapScan:
    """Walk the chunk table and every small chunk; collect figures and problems."""
    alloc_off, heap_off, n, words = _table(region)
    geo = class_geometry()
    s = HeapScan(nchunks=n)
    node_stats = {i: {"small_chunks": 0, "large_chunks": 0, "live_bytes": 0}
                  for i in range(region.nodes)}
    k = 0
    while k < n:
        w = words[k]
        if w == 0:
            s.free_chunks += 1
            k += 1
            continue
        kind, owner, low = table_word(w)
        where = f"chunk {k} (offset {heap_off + k * CHUNK:#x})"
        if owner >= region.nodes:
            s.problems.append(f"{where}: owner node {owner} does not exist")
            k += 1
            continue
        if kind == LARGE:
            if low == 0 or k + low > n:
                s.problems.append(f"{where}: large run of {low} chunks overruns the heap")
                k += 1
                continue
            tail = table_word_pack(TAIL, owner, k)
            tails_ok = all(words[k + i] == tail for i in range(1, low))
            if not tails_ok:
                s.problems.append(f"{where}: large run of {low} chunks has broken tail words")
            s.large_chunks += low
            s.large_objects += 1
            s.large_bytes += low * CHUNK
            node_stats[owner]["large_chunks"] += low
            node_stats[owner]["live_bytes"] += low * CHUNK
            s.live_ranges.append((heap_off + k * CHUNK, heap_off + (k + low) * CHUNK))
            k += low
            continue
        if kind == TAIL:  # no head covers it (_orphan_tails reads the table again)
            k += 1
            continue
        if kind != SMALL or low >= len(geo):
            s.problems.append(f"{where}: table word {w:#018x} is not valid")
            k += 1
            continue
        size, nslots, start = geo[low]
        base = heap_off + k * CHUNK
        h, bitmap = small_chunk(region, base, nslots)
        s.small_chunks += 1
        node_stats[owner]["small_chunks"] += 1
        if h.magic != SMALL_MAGIC:
            s.uncarved_small.append((k, owner))
            k += 1
            continue
        if (h.size_class, h.owner, h.nslots, h.data_start, h.reserved0) != \
                (size, owner, nslots, start, 0):
            s.problems.append(f"{where}: small-chunk header disagrees with the table")
        live = sum(bin(x).count("1") for x in bitmap)
        extra = nslots % 64
        if extra and bitmap[-1] >> extra:
            s.problems.append(f"{where}: bitmap has bits set past its {nslots} slots")
        if live == 0:
            s.empty_small.append((k, owner))
        s.small_objects += live
        s.small_bytes += live * size
        node_stats[owner]["live_bytes"] += live * size
        s.live_ranges.append((base, base + CHUNK))
        k += 1
    s.by_node = node_stats
    _magazines(region, s, words, heap_off, geo)
    first = _orphan_tails(words)
    if first:  # or a large alloc under way: only those a second read still shows alone
        s.orphan_tails = sorted(set(first) & set(_orphan_tails(_table(region)[3])))
    rfree = alloc_off + rfree_offset(n)
    for node in range(region.nodes):
        _scan_queue(region, s, node, rfree + node * RFREE_BYTES, heap_off, n)
    return s


def _gone(pid: int, tid: int) -> str:
    """"process" when process `pid` (of our pid namespace) is gone, "thread" when only
    its thread `tid` is, "" while it runs (or we may not ask)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "process"
    except PermissionError:
        return ""
    return "" if os.path.exists(f"/proc/{pid}/task/{tid}") else "thread"


def _magazines(region, s, words, heap_off, geo) -> None:
    """The objects threads of this host keep in their magazines (alloc.pyx), read from
    each node's node-local file here. Other hosts' files are not readable from here,
    nor is the liveness of another pid namespace's process: theirs stay counted as
    live. A running process's are free to the application, its gone threads' too (its
    next thread to start, its trim() or attach gives them back): they leave the live
    figures for `cached_*`. A gone process's are a leak until a process of that node
    attaches here. Each must be a set bit of its node's chunk of the class, or a free
    slot would be handed out twice: a suspect is read again, the bitmap before the
    record, as a give-back or a carve may be under way between our reads (only one
    that every read shows is reported)."""
    from cxlrt.nodelocal import local_path, mag_records
    try:
        ours = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ours = 0
    suspects = []
    for node in range(region.nodes):
        for _, pid, tid, ns, offs in mag_records(local_path(region.uuid, node)):
            sizes = []
            for off in offs:
                size = _cached_size(region, words, heap_off, geo, node, off)
                if size is None:
                    suspects.append((node, pid, tid, off))
                else:
                    sizes.append(size)
            gone = _gone(pid, tid) if ns and ns == ours else ""
            if gone == "process":
                s.dead_cached.append((node, pid, tid, offs))
                continue
            if not (ns and ns == ours):
                continue  # liveness unknown here: live, as far as we can tell
            for size in sizes:
                s.cached_objects += 1
                s.cached_bytes += size
                s.small_objects -= 1
                s.small_bytes -= size
                s.by_node[node]["live_bytes"] -= size
    for _ in range(5):  # a busy thread pops, pushes and gives back between our reads
        if not suspects:
            break
        time.sleep(0.002)  # out of step with a thread that loops as fast as we read
        words = _table(region)[3]
        suspects = [(node, pid, tid, off) for node, pid, tid, off in suspects
                    if _cached_size(region, words, heap_off, geo, node, off) is None
                    and any(p == pid and t == tid and off in offs for _, p, t, _, offs
                            in mag_records(local_path(region.uuid, node)))]
    for node, pid, tid, off in suspects:
        s.problems.append(f"node {node}: thread {tid} of process {pid} keeps object "
                          f"{off:#x} in its magazine, but it is no allocated slot "
                          "of that node: it could be handed out twice")


def _cached_size(region, words, heap_off, geo, node, off):
    """The class size of `off` when it is an allocated slot of `node`'s, else None."""
    k = (off - heap_off) // CHUNK
    if not 0 <= k < len(words):
        return None
    kind, owner, low = table_word(words[k])
    if kind != SMALL or owner != node or low >= len(geo):
        return None
    size, nslots, start = geo[low]
    i, rem = divmod(off - heap_off - k * CHUNK - start, size)
    if rem or not 0 <= i < nslots:
        return None
    _, bitmap = small_chunk(region, heap_off + k * CHUNK, nslots)
    return size if bitmap[i // 64] >> (i % 64) & 1 else None


def _orphan_tails(words) -> list:
    """(chunk, owner) of each tail word that no large head covers.

    A large alloc writes its tails just before its head, under the allocator lock;
    so a tail seen alone in one read and again in a later one was left by a step
    cut short (the caller reads twice), and only `Allocator.reclaim` frees it."""
    out, end = [], 0
    for k, w in enumerate(words):
        kind, owner, low = table_word(w)
        if kind == LARGE:
            end = max(end, k + low)  # a wrong tail inside a run is the run's problem
        elif kind == TAIL and k >= end:
            out.append((k, owner))
    return out


def small_chunk(region, base, nslots):
    """(header, bitmap words) of the small chunk of `nslots` slots at `base`, observed."""
    words_n = (nslots + 63) // 64
    region.flush(base, _BITMAP + words_n * _TABLE_WORD)
    h = _SMALL.unpack(region.load(base + _SMALL.offset, _SMALL.size))
    raw = region.load(base + _BITMAP, words_n * _TABLE_WORD)
    return h, struct.unpack(f"<{words_n}Q", raw)


def _walk(region, problems, node, first, heap_off, nchunks, batch, what) -> list:
    """Objects of one remote-free list that are still to be applied.

    The queue's list holds PENDING objects only; a batch being applied (`batch` is
    its seq) holds APPLIED ones up to where its drainer got. A link that cannot be
    an object, or a loop, is a problem.
    """
    heap_end = heap_off + nchunks * CHUNK
    out, seen, x = [], set(), first
    while x:
        where = f"node {node}'s remote-free {what} at {x:#x}"
        if x in seen:
            problems.append(f"{where}: the list loops")
            break
        if not (heap_off <= x < heap_end and x % 64 == 0):
            problems.append(f"{where}: not an object in the heap")
            break
        seen.add(x)
        region.flush(x, _LINK.size)
        link = _LINK.unpack(region.load(x, _LINK.size))
        if link.mark == RFREE_PENDING ^ x:
            out.append(x)
        elif batch is None or link.mark != RFREE_APPLIED ^ x or link.batch != batch:
            problems.append(f"{where}: the object does not carry the list's mark")
            break
        x = link.next
    return out


def _queue_lines(region, q) -> tuple[int, int, int]:
    """(head, seq, jword) of a remote-free queue, observed."""
    region.flush(q, _JWORD + 8)
    line = _QUEUE.unpack(region.load(q + _QUEUE.offset, _QUEUE.size))
    return line.head, line.seq, region.load64(q + _JWORD)


def _scan_queue(region, s, node, q, heap_off, nchunks) -> None:
    """Node `node`'s remote-free queue and the batch its owner is applying.

    The owner may drain while we walk: the walk counts only if the queue's lines
    did not move meanwhile (a few tries; a queue that never holds still is busy, not
    broken, so its problems are not reported).
    """
    for _ in range(5):
        lines = _queue_lines(region, q)
        head, seq, jword = lines
        if jword >> 48 != seq & 0xFFFF:
            head = 0  # a detach its owner died in: the list is the journal's (alloc.pyx)
        problems: list = []
        offs = _walk(region, problems, node, head, heap_off, nchunks, None, "queue")
        offs += _walk(region, problems, node, jword & OFF_MASK, heap_off, nchunks,
                      jword >> 48, "batch")
        if _queue_lines(region, q) == lines:
            s.problems += problems
            break
    if offs:
        s.queued[node] = offs


def in_live_chunk(scan_result: HeapScan, off: int) -> bool:
    return any(a <= off < b for a, b in scan_result.live_ranges)
