#!/usr/bin/env python3
"""HyMCache observation 1 on the device model: multi-turn KV reuse past device DRAM.

    python perf/chm_turns.py                   # table on stdout, perf/chm_turns.png
    python perf/chm_turns.py --json out.json --turns 10 --lat 20000

Two ``chm:`` devices with the same DRAM, page and SSD model, one under ``lru`` and one
under ``staging``, serve the same workload, turn by turn in one run. Each turn a
conversation's prefix grows by ``--grow`` KV blocks: the turn reads the whole prefix
back (KVCache lookup, ``prefetch`` into a StagingWindow, ``load``) and then stores its
new blocks. Read bandwidth per turn is prefix bytes over the load's wall time, the
median of ``--reps`` repetitions of the read. Under ``lru`` every read goes through
device DRAM: once the prefix outgrows it, each page is a miss (one SSD request each)
and the blocks stored last turn are written back in the middle of the reads. Under
``staging`` DMA reads of pages not in DRAM are one sequential SSD request per block
and nothing is filled, so reads stay at the SSD's streaming bandwidth. A third device,
``staging`` with the window in device DRAM (``StagingWindow(device=True)``, HyMCache's
own design: the device stages each block, header included, and the host reads it from
DRAM), serves the same turns.

The SSD is modelled (latency per request, bandwidth), so the ratio is this model's
consequence of its parameters, not a hardware figure: a longer latency or a smaller
page widens it, a larger page narrows it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import cxlrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _chm import add_device_args, add_output_args, device_spec, save  # noqa: E402

MIB = 1 << 20
DEVICES = ("lru", "staging", "staging_dev")


class Device:
    """One device, its KV cache and a staging window: the runtime, unchanged."""

    def __init__(self, root: str, name: str, a: argparse.Namespace, nblocks: int):
        self.policy = name
        policy, _, where = name.partition("_")
        mib = 2 * nblocks * a.block + 64  # blocks (a header each may round one up) + metadata
        self.region = cxlrt.open(device_spec(os.path.join(root, name), policy, a), node=0,
                                 create=True, size=f"{mib}M", nodes=1)
        self.bb = a.block * MIB
        self.cache = cxlrt.KVCache(self.region, "turns", block_bytes=self.bb,
                                   capacity_blocks=nblocks)
        # A device window stages each block with its header: a page more per slot.
        self.window = cxlrt.StagingWindow(
            self.region, size=a.window * (self.bb + (a.page << 10 if where else 0)),
            slots=a.window, device=where == "dev")

    def store(self, keys, blocks) -> None:
        assert self.cache.store(keys, blocks) == keys

    def read(self, keys, out) -> float:
        """Seconds to read the prefix `keys` into out, through the window."""
        t0 = time.perf_counter()
        with self.cache.lookup(keys) as hit:
            assert len(hit) == len(keys), (self.policy, len(hit), len(keys))
            self.cache.prefetch(hit, self.window)
            self.cache.load(hit, out[:len(keys)])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.window.close()
        self.cache.close()
        self.region.close()


def run(a: argparse.Namespace, progress=None) -> dict:
    """Every turn on the three devices; {"params", "turns": [{turn, prefix_mib, x_dram,
    lru_gbps, staging_gbps, staging_dev_gbps, ratio, ratio_dev}]}."""
    nblocks = a.turns * a.grow
    keys = cxlrt.block_hashes(range(16 * nblocks), 16, salt=b"chm-turns")
    rng = np.random.default_rng(a.seed)
    root = tempfile.mkdtemp(prefix="cxlrt-chm-turns-", dir="/dev/shm")
    os.environ["CXLRT_LOCAL_DIR"] = root  # node-local files go with it, not into /dev/shm
    devs = []
    try:
        devs = [Device(root, p, a, nblocks) for p in DEVICES]
        out = np.empty((nblocks, devs[0].bb), np.uint8)
        truth = np.empty_like(out)  # every block as stored
        rows = []
        for t in range(1, a.turns + 1):
            new = rng.integers(0, 256, (a.grow, devs[0].bb), dtype=np.uint8)
            lo, hi = (t - 1) * a.grow, t * a.grow
            prefix = keys[:lo]
            row = {"turn": t, "prefix_mib": lo * a.block, "x_dram": lo * a.block / a.dram}
            if prefix:
                for d in devs:
                    times = []
                    for _ in range(a.reps):
                        out[:lo] = 0
                        times.append(d.read(prefix, out))
                        # The bytes, not only the time: both devices must serve the truth.
                        assert np.array_equal(out[:lo], truth[:lo]), (d.policy, t)
                    row[f"{d.policy}_gbps"] = lo * d.bb / statistics.median(times) / 1e9
                row["ratio"] = row["staging_gbps"] / row["lru_gbps"]
                row["ratio_dev"] = row["staging_dev_gbps"] / row["lru_gbps"]
                rows.append(row)
                if progress:
                    progress(row)
            for d in devs:
                d.store(keys[lo:hi], list(new))
            truth[lo:hi] = new
        stats = {d.policy: d.region.backend.stats() for d in devs}
        return {"params": vars(a), "turns": rows, "device_stats": stats}
    finally:
        for d in devs:
            d.close()
        shutil.rmtree(root, ignore_errors=True)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["turns"]
    x = [r["x_dram"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(x, [r["lru_gbps"] for r in rows], "o-", label="lru (transparent DRAM cache)")
    ax.plot(x, [r["staging_gbps"] for r in rows], "s-", label="staging, window in host memory")
    ax.plot(x, [r["staging_dev_gbps"] for r in rows], "^-",
            label="staging, window in device DRAM (HyMCache)")
    p = result["params"]
    if p["bw"]:
        ax.axhline(p["bw"], color="grey", ls=":", label=f"SSD model {p['bw']} GB/s")
    ax.set_xlabel("reusable prefix / device DRAM")
    ax.set_ylabel("read GB/s (median of reps)")
    ax.set_title("read bandwidth per turn")
    ax.legend(fontsize=8)
    bx.plot(x, [r["ratio"] for r in rows], "s-", color="C1", label="host window")
    bx.plot(x, [r["ratio_dev"] for r in rows], "^-", color="C2", label="device window")
    bx.axhline(2.0, color="grey", ls=":", label="target 2x at 4x DRAM")
    bx.axvline(4.0, color="grey", ls="--", lw=0.8)
    bx.set_xlabel("reusable prefix / device DRAM")
    bx.set_ylabel("staging / lru")
    bx.set_title("ratio, same run")
    bx.legend(fontsize=8)
    fig.suptitle(f"chm: DRAM {p['dram']} MiB, page {p['page']} KiB, SSD {p['lat'] / 1000:g} us "
                 f"+ {p['bw']} GB/s read, {p['wbw']} GB/s write; {p['block']} MiB blocks",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8, help="turns (default 8)")
    ap.add_argument("--grow", type=int, default=12, help="KV blocks added per turn (12)")
    add_device_args(ap)
    ap.add_argument("--window", type=int, default=4, help="staging window, blocks (4)")
    ap.add_argument("--reps", type=int, default=3, help="reads of each prefix per turn (3)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the KV bytes (7)")
    add_output_args(ap, "chm_turns.png")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    for name in ("turns", "grow", "block", "dram", "page", "window", "reps"):
        if getattr(a, name) < 1:
            parser().error(f"--{name} must be at least 1")
    print(f"{'turn':>4} {'prefix MiB':>10} {'x DRAM':>7} {'lru GB/s':>9} {'staging GB/s':>12} "
          f"{'ratio':>6} {'device-window GB/s':>18} {'ratio':>6}")

    def show(r: dict) -> None:
        print(f"{r['turn']:>4} {r['prefix_mib']:>10} {r['x_dram']:>7.2f} {r['lru_gbps']:>9.2f} "
              f"{r['staging_gbps']:>12.2f} {r['ratio']:>6.2f} {r['staging_dev_gbps']:>18.2f} "
              f"{r['ratio_dev']:>6.2f}", flush=True)

    save(run(a, show), a, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
