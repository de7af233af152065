"""Read-only views of the KV caches in a region, for operators (`cxlrt info`).

Reads by DMA without attaching (no lock, no pin), through the compiled layout
(cxlrt.layoutinfo / cxlrt.formats) and the cache module's own checksum, so a
reader here never keeps a copy of the format.
"""

from __future__ import annotations

import struct
import time
from typing import Any

from cxlrt import layoutinfo
from cxlrt.errors import RegionError
from cxlrt.formats import Format
from cxlrt.hashing import ALGORITHM_NAMES
from cxlrt.kvcache import PIN_COUNT_MASK, RECORD_NAMES, STAT_NAMES, STATE_NAMES, line_check
from cxlrt.kvformat import DIR_PREFIX, FORMAT_MAGIC, FORMAT_VERSION, REC_CLAIM, header_checksum

_GEOMETRY, _LAYOUT, _COUNTERS = Format("kv_geometry"), Format("kv_layout"), Format("kv_counters")
_STATS = Format("kv_stats")
_AT = {m.name: m.offset for m in layoutinfo.fields("kv_header")}
_HEADER = layoutinfo.size("kv_header")
_PIN = struct.Struct("<Q").size
CONFIRM_S = 0.05  # between the two reads of a cache's tables whose first found a problem
_LINE = layoutinfo.size("kv_entry")
_E = {m.name: m.offset for m in layoutinfo.fields("kv_entry")}
_C = {m.name: m.offset for m in layoutinfo.fields("kv_claim")}
_STATE = {v: k for k, v in STATE_NAMES.items()}
_HOLDING = {_STATE["writing"], _STATE["ready"], _STATE["evicting"]}
_REC = {v: k for k, v in RECORD_NAMES.items()}


def describe(region: Any, dir_off: int) -> list[dict[str, Any]]:
    """Every KV cache named in a region's directory, read by DMA without attaching.

    Geometry, occupancy, pins and the counters summed over nodes. A cache whose
    header cannot be right is listed with an "error".
    """
    from cxlrt.directory import dma_items
    out = []
    for name, off in dma_items(region, dir_off):
        if not name.startswith(DIR_PREFIX):
            continue
        item: dict[str, Any] = {"name": name[len(DIR_PREFIX):], "offset": off}
        try:
            item.update(_describe_one(region, off))
        except (RegionError, IndexError, ValueError, struct.error) as e:
            item["error"] = str(e)
        out.append(item)
    return out


def _header(region: Any, off: int) -> tuple[bytes, Any, Any]:
    """The header bytes, geometry and layout of the cache object at `off`, checked."""
    head = region.dma_read(off, _HEADER)
    g = _GEOMETRY.unpack(head, _AT["geometry"])
    lay = _LAYOUT.unpack(head, _AT["layout"])
    if g.magic != FORMAT_MAGIC or header_checksum(head) != lay.checksum:
        raise RegionError("not a KV cache header")
    if g.version != FORMAT_VERSION:
        raise RegionError(f"on-media format {g.version}; this build reads {FORMAT_VERSION}")
    return head, g, lay


def _describe_one(region: Any, off: int) -> dict[str, Any]:
    head, g, lay = _header(region, off)
    item: dict[str, Any] = dict(
        slots=g.slots, capacity_blocks=g.capacity, block_bytes=g.block_bytes,
        block_tokens=g.block_tokens, algorithm=ALGORITHM_NAMES.get(g.algorithm, str(g.algorithm)),
        salt_digest=g.salt_digest.hex(),
        occupancy=_COUNTERS.unpack(head, _AT["counters"]).occupancy)
    totals = dict.fromkeys(STAT_NAMES, 0)
    for j in range(lay.nodes):
        line = _STATS.unpack(region.dma_read(lay.stats + j * _STATS.size, _STATS.size))
        for k in STAT_NAMES:
            totals[k] += getattr(line, k)
    item.update(totals)
    # Pin words: one per node and slot, the count in the low bits. A block pinned
    # anywhere cannot be evicted: what an operator wants to see.
    slots, nodes = g.slots, lay.nodes
    if slots > (1 << 24) or nodes > 64:
        raise RegionError(f"{slots} slots x {nodes} nodes is not a KV cache's shape")
    per_node, pinned = [], set()
    for j in range(nodes):
        raw = region.dma_read(lay.pins + j * slots * _PIN, slots * _PIN)
        counts = [v & PIN_COUNT_MASK for v in struct.unpack(f"<{slots}Q", raw)]
        per_node.append(sum(counts))
        pinned.update(k for k, c in enumerate(counts) if c)
    item.update(pins=sum(per_node), pins_by_node=per_node, pinned_blocks=len(pinned))
    return item


def audit(region: Any, dir_off: int) -> list[str]:
    """What cannot be right in the KV caches of a region, read by DMA: a payload that
    two holders name (entries, claim lines of unfinished reserves, records of
    evictions, quarantines and deferred frees), which is one block served with
    another's bytes once both are written; and torn lines. For `cxlrt check`."""
    from cxlrt.directory import dma_items
    problems = []
    for name, off in dma_items(region, dir_off):
        if name.startswith(DIR_PREFIX):
            try:
                problems += _audit_one(region, name[len(DIR_PREFIX):], off)
            except (RegionError, IndexError, ValueError, struct.error) as e:
                problems.append(f"KV cache {name[len(DIR_PREFIX):]!r}: {e}")
    return problems


def line_states(raw: bytes) -> list[int]:
    """Per 64-byte line: 0 all zero, 1 whole (its check word is right), -1 torn."""
    out = []
    for at in range(0, len(raw), _LINE):
        line = raw[at:at + _LINE]
        check = int.from_bytes(line[_LINE - 8:], "little")
        out.append(0 if not any(line) else 1 if line_check(line[:_LINE - 8]) == check else -1)
    return out


def _words(raw: bytes, at: int, fields: dict[str, int], *names: str) -> tuple[int, ...]:
    return tuple(struct.unpack_from("<Q", raw, at + fields[n])[0] for n in names)


def _audit_one(region: Any, name: str, off: int) -> list[str]:
    """The problems of one cache that two reads of its tables, a moment apart, agree
    on: `cxlrt check` may run beside live traffic, where a line being written reads
    torn, and a payload freed and handed out again between the reads of two tables
    looks named twice."""
    _, g, lay = _header(region, off)
    slots = g.slots
    records = lay.claims + slots * _LINE  # the records follow the claim lines
    nrec = (off + lay.total - records) // _LINE
    if slots > (1 << 24) or not 0 <= nrec <= (1 << 24):
        raise RegionError(f"{slots} slots and {nrec} records is not a KV cache's shape")
    first = _audit_pass(region, name, lay, slots, records, nrec)
    if not first:
        return first
    time.sleep(CONFIRM_S)
    again = set(_audit_pass(region, name, lay, slots, records, nrec))
    return [p for p in first if p in again]


def _audit_pass(region: Any, name: str, lay: Any, slots: int, records: int,
                nrec: int) -> list[str]:
    entries = region.dma_read(lay.entries, slots * _LINE)
    claims = region.dma_read(lay.claims, slots * _LINE)
    recs = region.dma_read(records, nrec * _LINE)
    problems, holders = [], {}  # payload offset -> who names it
    gens = {}
    for s, st in enumerate(line_states(entries)):
        if st < 0:
            problems.append(f"KV cache {name!r}: entry {s} is torn or corrupt")
            continue
        meta, poff = _words(entries, s * _LINE, _E, "meta", "off")
        gens[s] = (meta >> 8, meta & 0xFF, poff)
        if st and meta & 0xFF in _HOLDING:
            holders.setdefault(poff, []).append(f"entry {s} ({STATE_NAMES[meta & 0xFF]})")
    for s, st in enumerate(line_states(claims)):
        if st <= 0:
            continue
        tag, poff, epoch = _words(claims, s * _LINE, _C, "tag", "off", "epoch")
        gen, state, _ = gens.get(s, (0, 0, 0))
        # A claim line for the next epoch of a free entry: a reserve that stopped
        # between its claim line and its entry; the next reserve of the slot frees it.
        if tag & 0xFF == REC_CLAIM and poff and state not in _HOLDING and epoch == gen + 1:
            holders.setdefault(poff, []).append(f"the claim line of slot {s}")
    for i, st in enumerate(line_states(recs)):
        if st < 0:
            problems.append(f"KV cache {name!r}: record {i} is torn or corrupt")
            continue
        if not st:
            continue
        tag, poff, epoch, slot = _words(recs, i * _LINE, _C, "tag", "off", "epoch", "slot")
        kind = tag & 0xFF
        gen, state, held = gens.get(slot, (0, 0, 0))
        if (kind in (_REC["evicting"], _REC["taking over"]) and state in _HOLDING
                and gen == epoch and held == poff):
            continue  # its entry still holds the payload: the tombstone never came
        holders.setdefault(poff, []).append(
            f"record {i} ({RECORD_NAMES.get(kind, kind)})")
    for poff, who in sorted(holders.items()):
        if len(who) > 1:
            problems.append(f"KV cache {name!r}: payload {poff:#x} is named by "
                            f"{' and '.join(who)} (given out twice)")
    return problems
