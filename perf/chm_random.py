#!/usr/bin/env python3
"""HyMCache observation 2 on the device model: random reads with prefetch on and off.

    python perf/chm_random.py                  # table on stdout, perf/chm_random.png
    python perf/chm_random.py --requests 60 --json out.json

A pool of KV blocks several times the device DRAM is stored once. Each request then
reads ``--per`` blocks of it, chosen at random and in random order (what a batch of
unrelated requests asks of a shared tier), through the runtime: ``lookup`` and
``load``. With prefetch off, ``load`` reads block by block: each block is one device
request and the host copy waits for it. With prefetch on, ``KVCache.prefetch`` issues
the whole list to a StagingWindow first and ``load`` consumes the blocks as they are
staged, so the device request for block i+1 overlaps the consumption of block i. A
request may also spend ``--compute`` microseconds per block once it has it (the layer
that uses that block's KV); prefetch hides the device behind that time too.

Requests alternate between the two modes, each reading its own random list once (a
list read twice would find its blocks in the lru device's DRAM the second time), on
each policy's device, in one run; the figure per mode is the median request's GB/s. The
SSD is modelled (latency, bandwidth), so the gain is a consequence of its
parameters: prefetch can hide at most the shorter of device time and consumption.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import cxlrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _chm import check_request_args, device_spec, random_lists, request_parser, save, scratch  # noqa: E402

MIB = 1 << 20


def spin(seconds: float) -> None:
    """Busy time, as a layer's compute would be (a sleep would free the core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run_device(root: str, policy: str, a: argparse.Namespace, lists, progress=None) -> list:
    """One device: for each --compute value, the median request GB/s with prefetch off
    and on, and the gain."""
    bb = a.block * MIB
    spec = device_spec(os.path.join(root, policy), policy, a)
    r = cxlrt.open(spec, node=0, create=True, size=f"{2 * a.pool * a.block + 64}M", nodes=1)
    try:
        cache = cxlrt.KVCache(r, "random", block_bytes=bb, capacity_blocks=a.pool)
        window = cxlrt.StagingWindow(r, size=a.window * bb, slots=a.window)
        keys = cache.block_hashes(range(16 * a.pool))
        rng = np.random.default_rng(a.seed)
        truth = rng.integers(0, 256, (a.pool, bb), dtype=np.uint8)
        assert cache.store(keys, truth) == keys
        out = np.empty((a.per, bb), np.uint8)
        rows = []
        for compute in a.compute:
            gbps = {"off": [], "on": []}
            for i, pick in enumerate(lists):
                for mode in ("on" if i % 2 else "off",):  # every list read once: no re-read hits
                    out[:] = 0
                    ks = [keys[j] for j in pick]
                    t0 = time.perf_counter()
                    with cache.lookup(ks) as hit:
                        if mode == "on":
                            cache.prefetch(hit, window)
                        for b in range(a.per):  # consume block by block, as layers do
                            cache.load(hit, out[b:b + 1], start=b, stop=b + 1)
                            if compute:
                                spin(compute / 1e6)
                    dt = time.perf_counter() - t0
                    assert np.array_equal(out, truth[pick]), (policy, mode, i)
                    gbps[mode].append(a.per * bb / dt / 1e9)
            row = {"policy": policy, "compute_us": compute}
            row.update({m: statistics.median(v) for m, v in gbps.items()})
            row["gain"] = row["on"] / row["off"] - 1
            rows.append(row)
            if progress:
                progress(row)
        window.close()
        cache.close()
        return rows
    finally:
        r.close()


def run(a: argparse.Namespace, progress=None) -> dict:
    lists = random_lists(a)
    with scratch("chm-random") as root:
        rows = [row for p in ("staging", "lru") for row in run_device(root, p, a, lists, progress)]
    return {"params": vars(a), "rows": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, p = result["rows"], result["params"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for i, pol in enumerate(("staging", "lru")):
        rs = [r for r in rows if r["policy"] == pol]
        x = [r["compute_us"] for r in rs]
        ax.plot(x, [r["off"] for r in rs], "o--", color=f"C{i}", label=f"{pol}, prefetch off")
        ax.plot(x, [r["on"] for r in rs], "s-", color=f"C{i}", label=f"{pol}, prefetch on")
        bx.plot(x, [r["gain"] * 100 for r in rs], "o-", color=f"C{i}", label=pol)
    ax.set_xlabel("compute per consumed block, us")
    ax.set_ylabel("read GB/s (median request)")
    ax.set_title(f"{p['per']} random blocks of {p['pool']} x {p['block']} MiB per request",
                 fontsize=9)
    ax.legend(fontsize=8)
    bx.axhline(37, color="grey", ls=":", label="HyMCache paper: +37%")
    bx.axhline(0, color="black", lw=0.5)
    bx.set_xlabel("compute per consumed block, us")
    bx.set_ylabel("prefetch on / off - 1, %")
    bx.set_title("gain from prefetch, same run", fontsize=9)
    bx.legend(fontsize=8)
    fig.suptitle(f"chm: DRAM {p['dram']} MiB, page {p['page']} KiB, SSD {p['lat'] / 1000:g} us + "
                 f"{p['bw']} GB/s; window {p['window']} blocks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    ap, tail = request_parser(__doc__, requests=40, seed=11, png="chm_random.png")
    ap.add_argument("--compute", default="0,100,200,400",
                    help="busy microseconds per consumed block, a comma list (0,100,200,400)")
    return tail()


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    check_request_args(ap, a)
    try:
        a.compute = [float(c) for c in a.compute.split(",")]
    except ValueError:
        ap.error(f"--compute: a comma list of microseconds, got {a.compute!r}")
    if any(c < 0 for c in a.compute):
        ap.error("--compute cannot be negative")
    print(f"{'policy':>8} {'compute us':>10} {'off GB/s':>9} {'on GB/s':>8} {'gain':>7}")

    def show(r: dict) -> None:
        print(f"{r['policy']:>8} {r['compute_us']:>10g} {r['off']:>9.2f} {r['on']:>8.2f} "
              f"{r['gain'] * 100:>+6.0f}%", flush=True)

    save(run(a, show), a, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
