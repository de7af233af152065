"""`cxlrt check`: verify a region's invariants and repair what a dead node left.

Checks: superblock (at attach), node heartbeats, lock records and who holds or
waits on them, the chunk table against small-chunk headers and bitmaps, the
remote-free queues, the directory against live chunks and for entries left
mid-change. Repair runs AS the dead node (after confirming it is silent past
its lease), so every line it writes keeps its single writer; torn directory
entries it finishes under the meta lock, as any directory writer would.
"""

from __future__ import annotations

from typing import Any

import cxlrt
from cxlrt import heapscan
from cxlrt.liveness import survey
from cxlrt.lock import MAX_LOCKS, MODE_NAMES, node_busy, read_header


def _nodes(region, window: float | None = None) -> list[dict[str, Any]]:
    """Every node's state, judged by its heartbeat counter over a lease (liveness.survey)."""
    out = []
    for a in survey(region, -1.0 if window is None else window):
        a["dead"] = a["state"] == "dead"
        a["attached"] = a["state"] in ("alive", "dead")
        a["heartbeat_age_s"] = a.pop("beat_age_s")
        out.append(a)
    return out


def _locks(region, nodes) -> tuple[list[dict], list[str]]:
    found, problems = [], []
    for i in range(MAX_LOCKS):
        try:
            h = read_header(region, i)
        except cxlrt.RegionError as e:
            problems.append(str(e))
            continue
        if h is None:
            continue
        name, mode = h
        holders = []
        for j in range(region.nodes):
            if node_busy(region, i, j, mode):
                holders.append(j)
                if nodes[j]["dead"]:
                    problems.append(f"lock {name!r}: dead node {j} still holds or waits on it "
                                    f"(repair with `cxlrt check SPEC --repair --node {j}`)")
        found.append({"index": i, "name": name, "mode": MODE_NAMES[mode],
                      "nodes_holding_or_waiting": holders})
    return found, problems


def check(spec: str) -> dict[str, Any]:
    """Inspect a region; returns a report with ``problems`` (empty when clean)."""
    with cxlrt.open(spec, node=0, observer=True) as region:
        nodes = _nodes(region)
        locks, problems = _locks(region, nodes)
        s = heapscan.scan(region)
        problems += s.problems
        for k, owner in s.uncarved_small:
            problems.append(f"leak: chunk {k} is marked small for node {owner} but was never "
                            "carved (a crash mid-carve)")
        for k, owner in s.orphan_tails:
            problems.append(f"leak: chunk {k} is a tail of node {owner}'s large run whose head "
                            "is gone (an alloc or free cut short); --repair frees it. A "
                            "process killed between a table store and its publish can "
                            "leave the same picture over a live run, when its host writes "
                            "the stale line back late: know that no node holds a run there")
        for node, pid, tid, offs in s.dead_cached:
            if offs:
                problems.append(f"leak: thread {tid} of process {pid}, gone, left {len(offs)} "
                                f"freed object(s) of node {node} in its magazine; the next "
                                f"process of node {node} to attach gives them back, as do its "
                                "trim() and --repair")
        for node, offs in s.queued.items():
            if nodes[node]["dead"]:
                problems.append(f"node {node} is dead with {len(offs)} queued remote frees")
        dead_empty = [(k, o) for k, o in s.empty_small if nodes[o]["dead"]]
        for k, owner in dead_empty:
            problems.append(f"leak: empty chunk {k} is held by dead node {owner}")
        directory, torn = region.directory.scan()
        problems += torn
        for name, off in directory:
            if off >= region.heap[0] and not heapscan.in_live_chunk(s, off):
                problems.append(f"directory {name!r} -> {off:#x} points into free heap")
        from cxlrt.kvinspect import audit
        problems += audit(region, region.sections["directory"][0])
        dead = [n["node"] for n in nodes if n["dead"]]
        for n in dead:
            problems.append(f"node {n} is dead: its heartbeat counter stood still for a "
                            f"{region.lease_ms / 1000} s lease")
        return {"spec": spec, "nodes": nodes, "locks": locks, "usage": s.usage(),
                "directory": dict(directory), "dead_nodes": dead, "problems": problems}


def repair(spec: str, node: int, *, force: bool = False) -> dict[str, Any]:
    """Break a dead node's lock holds, finish torn directory entries, reclaim chunks."""
    info = cxlrt.inspect(spec)
    if not 0 <= node < info["nodes"]:
        raise ValueError(f"--node {node} is out of range (0..{info['nodes'] - 1})")
    if not force:
        with cxlrt.open(spec, node=0, observer=True) as region:
            state = _nodes(region)[node]["state"]
        if state == "alive":
            raise cxlrt.RegionError(
                f"node {node} is alive (its heartbeat counter moved within the "
                f"{info['lease_ms'] / 1000} s lease); repairing a live node would give its "
                "lines two writers. Pass --force only if you know it is gone.")
    actions = []
    with cxlrt.open(spec, node=0, observer=True) as region:
        nodes = _nodes(region, 0)
        held = [x["name"] for x in _locks(region, nodes)[0]
                if node in x["nodes_holding_or_waiting"]]
    with cxlrt.open(spec, node=node) as region:  # we ARE node `node` from here on
        # Attaching started our heartbeat, whose first sweep already withdraws holds
        # that dead processes of this node left behind; this catches the rest.
        svc = region.locks
        from cxlrt.lock import _reset_node_line
        for i in range(MAX_LOCKS):
            h = svc._read_header(i)
            if h is not None:
                _reset_node_line(svc, i, h[1])
        still = [x["name"] for x in _locks(region, _nodes(region, 0))[0]
                 if node in x["nodes_holding_or_waiting"]]
        for name in held:
            if name not in still:
                actions.append(f"released node {node}'s hold/request on lock {name!r}")
        # Torn directory entries (a writer killed mid-change, of any node) are
        # finished under the meta lock (taking it waits only on a live holder).
        actions += region.directory.repair()
        swept = region._allocator.swept_at_attach + region._allocator.sweep()
        if swept:
            actions.append(f"gave back {swept} magazine(s) of node {node}'s threads that are gone")
        applied = region._allocator.drain()
        if applied:
            actions.append(f"applied {applied} queued remote frees")
        before = heapscan.scan(region)
        region.trim()
        tails = region._allocator.reclaim()
        if tails:
            actions.append(f"freed {tails} tail chunk(s) whose large head was gone")
        for k, owner in before.uncarved_small:
            if owner == node:
                region._allocator.release_chunk(k)
                actions.append(f"reclaimed chunk {k} (carve interrupted)")
        after = heapscan.scan(region)
        freed = after.free_chunks - before.free_chunks - tails
        if freed:
            actions.append(f"returned {freed} chunk(s) of node {node} to the region")
        kept = after.by_node.get(node, {})
        if kept.get("live_bytes"):
            actions.append(f"kept node {node}'s {kept['live_bytes']} bytes of live objects "
                           "(any node may still free them)")
    return {"node": node, "actions": actions}
