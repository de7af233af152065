"""`cxlrt demo`: an emulated rack, several nodes in separate processes, and the
checker catching a protocol that forgets to flush.

Every node increments one shared counter many times under cxlrt's two-tier
cross-node lock (Lamport's bakery over single-writer lines). Done right (observe
before the load, publish before the unlock) the count is exact even with faults
injected; done without flushes, the emulation loses updates and its checker
names the offset and the nodes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
from typing import Any

import cxlrt
from cxlrt.progress import Progress

_CTX = mp.get_context("fork")


def _worker(spec: str, node: int, iters: int, correct: bool, done) -> dict:
    r = cxlrt.open(spec, node=node)
    lock = r.lock("demo.counter")
    off = r.heap[0]
    err = None
    try:
        for i in range(iters):
            with lock:
                if correct:
                    r.flush(off, 8)     # observe: drop our copy, then load
                v = r.load64(off)
                r.store64(off, v + 1)
                if correct:
                    r.persist(off, 8)   # publish before anyone else may read
            if i % 64 == 63:
                with done.get_lock():
                    done.value += 64
    except cxlrt.CoherenceError as e:
        err = {"node": node, "message": str(e), "kind": e.kind, "offset": e.offset,
               "other": e.other}
    acquisitions = lock.acquisitions()[node]
    stats = r.stats()
    r.close()
    return {"node": node, "error": err, "stats": stats, "acquisitions": acquisitions}


def _child(q, *args) -> None:
    q.put(_worker(*args))


def _run_phase(spec: str, nodes: int, iters: int, correct: bool, label: str,
               show: bool) -> dict[str, Any]:
    with cxlrt.open(spec, node=0) as r0:  # reset the counter by DMA
        r0.dma_write(r0.heap[0], bytes(8))
    done = _CTX.Value("q", 0)
    q = _CTX.Queue()
    procs = [_CTX.Process(target=_child, args=(q, spec, n, iters, correct, done))
             for n in range(nodes)]
    for p in procs:
        p.start()
    bar = Progress(nodes * iters, label)
    bar.enabled = bar.enabled and show
    results = []
    while len(results) < nodes:
        try:
            results.append(q.get(timeout=0.1))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                raise RuntimeError("a demo node process died without reporting") from None
        bar.update(done.value)
    bar.close()
    for p in procs:
        p.join()
    path = spec.split(":", 1)[1].split("?", 1)[0]
    with cxlrt.open(f"file:{path}", node=0) as medium:  # the bytes, as the device holds them
        final = medium.load64(medium.heap[0])
    evictions = sum(x["stats"]["evictions"] for x in results)
    errors = [x["error"] for x in results if x["error"]]
    return {"correct_protocol": correct, "expected": nodes * iters, "final": final,
            "lost": nodes * iters - final, "injected_writebacks": evictions,
            "violations": errors,
            "acquisitions_per_node": {x["node"]: x["acquisitions"] for x in results}}


def run(*, nodes: int = 4, iters: int = 20000, seed: int = 7, evict: float = 0.02,
        path: str | None = None, keep: bool = False, show: bool = True,
        out=print) -> dict[str, Any]:
    """Run the demo; returns a JSON-able report. See the module docstring."""
    tmpdir = None
    if path is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        tmpdir = tempfile.mkdtemp(prefix="cxlrt-demo-", dir=base)
        path = os.path.join(tmpdir, "rack")
    spec = f"emu:{path}?seed={seed}&evict={evict}&delay=1&check=1"
    uuid = None
    try:
        uuid = int(cxlrt.format(spec, size="16M", nodes=nodes, force=True)["uuid"], 16)
        out(f"cxlrt demo: emulated rack {spec}")
        out(f"  {nodes} nodes in separate processes, 16 MiB region, faults: spontaneous "
            f"write-back p={evict}, delayed flushes, checker on (seed {seed})")
        out(f"[1/2] correct protocol: {nodes} x {iters} increments under cxlrt's cross-node "
            "lock, observe before load, publish before unlock")
        good = _run_phase(spec, nodes, iters, True, "correct", show)
        exact = good["final"] == good["expected"] and not good["violations"]
        verdict = "exact" if exact else "WRONG"
        out(f"  counter = {good['final']} (expected {good['expected']}): {verdict}; "
            f"{good['injected_writebacks']} spontaneous write-backs injected, "
            f"{len(good['violations'])} violations; lock acquisitions per node "
            f"{good['acquisitions_per_node']}")
        out("[2/2] broken protocol: the same, without the flushes")
        bad = _run_phase(spec, nodes, iters, False, "broken", show)
        for v in bad["violations"][:3]:
            out(f"  checker, node {v['node']}: {v['message']}")
        out(f"  counter = {bad['final']} (expected {bad['expected']}): "
            f"{bad['lost']} updates lost")
        caught = bool(bad["violations"]) or bad["lost"] > 0
        ok = verdict == "exact" and caught
        out("result: " + ("the correct protocol was exact under faults, and the emulation "
                          "caught the missing flush" if ok else "UNEXPECTED: see above"))
        return {"spec": spec, "nodes": nodes, "iters": iters, "seed": seed, "ok": ok,
                "correct": good, "broken": bad}
    finally:
        if uuid is not None and not keep:
            from cxlrt.nodelocal import remove_files
            remove_files(uuid, nodes)
        if not keep:
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            else:
                for p in (path, path + ".emu"):
                    if os.path.exists(p):
                        os.unlink(p)
