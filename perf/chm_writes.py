#!/usr/bin/env python3
"""HyMCache observation 3 on the device model: reads with concurrent writes, with and
without write isolation.

    python perf/chm_writes.py                 # table on stdout, perf/chm_writes.png
    python perf/chm_writes.py --requests 20 --json out.json

A pool of KV blocks several times the device DRAM is stored once. A reader then runs
requests as a decode node would: each looks up ``--per`` random blocks, prefetches
them into a StagingWindow and consumes them block by block, spending ``--compute``
microseconds on each. It runs in rounds, alone and then while a writer process (another
node, as a prefill node) offers a new block every ``--every`` microseconds. Three
devices with the same DRAM and SSD, in one run:

  lru        the transparent cache: new KV fills DRAM and evicts, dirty victims are
             written back on the read path.
  staging    HyMCache's window with no write buffer: every store goes through to the
             SSD and queues with the reads.
  isolated   staging with a write buffer (``wbuf=``): the writer asks the device first
             (``KVCache.admit``), stores only what the buffer takes, and skips the rest;
             the buffer flushes in batches only while reads leave the SSD idle.

Per device: the read GB/s over all of a phase's requests, alone and with the writer, and what the
writer got stored. Every byte read is checked.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

import cxlrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _chm import check_request_args, device_spec, random_lists, request_parser, save, scratch  # noqa: E402

MIB = 1 << 20
DEVICES = ("lru", "staging", "isolated")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def spec_of(root: str, device: str, a: argparse.Namespace) -> str:
    policy = "lru" if device == "lru" else "staging"
    spec = device_spec(os.path.join(root, device), policy, a)
    return spec + (f"&wbuf={a.wbuf}M" if device == "isolated" else "")


RING = 32  # the writer's own blocks kept: it deletes older ones, so the cache never fills


def writer(spec: str, bb: int, n: int, every_us: float, isolated: bool, ready, go, stop,
           out) -> None:
    """Node 1: offer at most n new blocks, one every `every_us`, while `go` is set, until
    told to stop; keep only its last RING blocks (a cache evicting at steady state)."""
    with cxlrt.open(spec, node=1) as r:
        cache = cxlrt.KVCache(r, "obs3", create=False)
        keys = cache.block_hashes(range(10**6, 10**6 + 16 * n))
        block = np.full(bb, 0x5A, np.uint8)
        offered = stored = 0
        ready.set()
        t = time.perf_counter()
        for k in keys:
            while not go.wait(0.05) and not stop.is_set():
                t = time.perf_counter()  # paused: the pace restarts on resume
            if stop.is_set():
                break
            offered += 1
            if isolated:
                stored += cache.admit([k], block)
            else:
                stored += len(cache.store([k], block))
            if offered > RING:
                cache.delete([keys[offered - 1 - RING]])
            t += every_us / 1e6
            while time.perf_counter() < t and not stop.is_set():
                time.sleep(min(0.0005, max(0.0, t - time.perf_counter())))
        out.put((offered, stored))


def result_of(w, q) -> tuple[int, int]:
    """The writer's (offered, stored), or an error once it has died without them."""
    import queue
    while True:
        try:
            got = q.get(timeout=0.5)
            w.join(60)
            return got
        except queue.Empty:
            if not w.is_alive():
                raise RuntimeError(f"the writer process died (exit code {w.exitcode}); its "
                                   "traceback is above") from None


def read_requests(cache, window, keys, truth, lists, a, bb) -> float:
    """The requests of `lists`, one after another; the seconds they took. Each request's
    bytes are checked after its clock stops."""
    out = np.empty((a.per, bb), np.uint8)
    spent = 0.0
    for pick in lists:
        t0 = time.perf_counter()
        with cache.lookup([keys[j] for j in pick]) as hit:
            assert len(hit) == a.per, "a pool block was evicted: give the cache more room"
            cache.prefetch(hit, window)
            for b in range(a.per):
                cache.load(hit, out[b:b + 1], start=b, stop=b + 1)
                if a.compute:
                    spin(a.compute / 1e6)
        spent += time.perf_counter() - t0
        assert np.array_equal(out, truth[pick])
    return spent


def run_device(root: str, device: str, a: argparse.Namespace, lists) -> dict:
    bb = a.block * MIB
    spec = spec_of(root, device, a)
    cap = a.pool + 2 * RING
    r = cxlrt.open(spec, node=0, create=True, size=f"{2 * cap * a.block + 64}M", nodes=2)
    ctx = mp.get_context("spawn")
    try:
        cache = cxlrt.KVCache(r, "obs3", block_bytes=bb, capacity_blocks=cap)
        window = cxlrt.StagingWindow(r, size=a.window * bb, slots=a.window)
        keys = cache.block_hashes(range(16 * a.pool))
        truth = np.random.default_rng(a.seed).integers(0, 256, (a.pool, bb), dtype=np.uint8)
        assert cache.store(keys, truth) == keys
        r.drain()
        ready, go, stop, q = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        w = ctx.Process(target=writer, args=(spec, bb, a.writes, a.every, device == "isolated",
                                             ready, go, stop, q))
        w.start()
        if not ready.wait(120):  # its imports and open happen before the clock starts
            raise RuntimeError("the writer process did not start")
        # Paired rounds, the writer paused and running in turn, so that drift of this
        # shared machine falls on both alike; GB/s is all bytes over the summed time.
        spent = {False: 0.0, True: 0.0}
        s0 = r.backend.stats()
        step = max(1, len(lists) // (2 * a.rounds))
        for i in range(0, len(lists), step):
            writing = (i // step) % 2 == 1
            if writing:
                go.set()
            else:
                go.clear()
            spent[writing] += read_requests(cache, window, keys, truth, lists[i:i + step], a, bb)
        stop.set()
        n = {w: sum(len(lists[i:i + step]) for i in range(0, len(lists), step)
                    if ((i // step) % 2 == 1) == w) for w in (False, True)}
        alone, busy = (n[w] * a.per * bb / spent[w] / 1e9 for w in (False, True))
        offered, stored = result_of(w, q)
        s1 = r.backend.stats()
        window.close()
        cache.close()
    finally:
        r.close()
    return {"device": device, "alone": alone,
            "with_writes": busy, "offered": offered, "stored": stored,
            "ssd_write_mib": (s1["ssd_write_bytes"] - s0["ssd_write_bytes"]) / MIB,
            "writebacks": s1["writebacks"] - s0["writebacks"],
            "refusals": s1["refusals"] - s0["refusals"]}


def run(a: argparse.Namespace, progress=None) -> dict:
    lists = random_lists(a)
    rows = []
    with scratch("chm-writes") as root:
        for device in DEVICES:
            rows.append(run_device(root, device, a, lists))
            if progress:
                progress(rows[-1])
    return {"params": vars(a), "rows": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, p = result["rows"], result["params"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["alone"] for r in rows], 0.4, label="reads alone")
    ax.bar(x + 0.2, [r["with_writes"] for r in rows], 0.4, label="reads with a writer")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['stored']}/{r['offered']} stored", (i + 0.2, r["with_writes"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [r["device"] for r in rows])
    ax.set_ylabel("read GB/s over the phase")
    ax.legend(fontsize=8)
    fig.suptitle(f"chm: DRAM {p['dram']} MiB, SSD {p['lat'] / 1000:g} us + {p['bw']} GB/s read, "
                 f"{p['wbw']} GB/s write; a {p['block']} MiB block offered every "
                 f"{p['every']:g} us", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    ap, tail = request_parser(__doc__, requests=40, seed=13, png="chm_writes.png")
    ap.add_argument("--compute", type=float, default=100.0,
                    help="busy microseconds per consumed block (100)")
    ap.add_argument("--writes", type=int, default=100000,
                    help="most blocks the writer offers (100000)")
    ap.add_argument("--every", type=float, default=1000.0,
                    help="microseconds between the writer's blocks (1000)")
    ap.add_argument("--wbuf", type=int, default=4, help="isolated: write buffer MiB (4)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of reads alone then with the writer (5)")
    return tail()


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    check_request_args(ap, a, "writes", "wbuf", "rounds")
    if a.wbuf >= a.dram:
        ap.error("--wbuf must be smaller than --dram")
    if a.wbuf <= a.block:
        ap.error("--wbuf must be larger than --block (a block and the pages it straddles)")
    if a.compute < 0 or a.every < 0:
        ap.error("--compute and --every cannot be negative")
    print(f"{'device':>9} {'alone GB/s':>10} {'w/ writes':>9} {'ratio':>6} {'stored':>11} "
          f"{'SSD MiB w':>9}")

    def show(r: dict) -> None:
        print(f"{r['device']:>9} {r['alone']:>10.2f} {r['with_writes']:>9.2f} "
              f"{r['with_writes'] / r['alone']:>6.2f} {r['stored']:>5}/{r['offered']:<5} "
              f"{r['ssd_write_mib']:>9.0f}", flush=True)

    save(run(a, show), a, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
