"""Read-only views of the KV caches in a region, for operators (`cxlrt info`).

Reads by DMA without attaching (no lock, no pin), through the compiled layout
(cxlrt.layoutinfo / cxlrt.formats) and the cache module's own checksum, so a
reader here never keeps a copy of the format.
"""

from __future__ import annotations

import struct
from typing import Any

from cxlrt import layoutinfo
from cxlrt.errors import RegionError
from cxlrt.formats import Format
from cxlrt.hashing import ALGORITHM_NAMES
from cxlrt.kvcache import PIN_COUNT_MASK, STAT_NAMES
from cxlrt.kvformat import DIR_PREFIX, FORMAT_MAGIC, FORMAT_VERSION, header_checksum

_GEOMETRY, _LAYOUT, _COUNTERS = Format("kv_geometry"), Format("kv_layout"), Format("kv_counters")
_STATS = Format("kv_stats")
_AT = {m.name: m.offset for m in layoutinfo.fields("kv_header")}
_HEADER = layoutinfo.size("kv_header")
_PIN = struct.Struct("<Q").size


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


def _describe_one(region: Any, off: int) -> dict[str, Any]:
    head = region.dma_read(off, _HEADER)
    g = _GEOMETRY.unpack(head, _AT["geometry"])
    lay = _LAYOUT.unpack(head, _AT["layout"])
    if g.magic != FORMAT_MAGIC or header_checksum(head) != lay.checksum:
        raise RegionError("not a KV cache header")
    if g.version != FORMAT_VERSION:
        raise RegionError(f"on-media format {g.version}; this build reads {FORMAT_VERSION}")
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
