"""KV store bandwidth with non-temporal copies on and off, each against numpy's copy.

cxlrt's dma_write copies large pieces with non-temporal stores (cxlrt/includes/
cxl_copy.h), 32 bytes at a time where the CPU has AVX; CXLRT_NT_STORES=sse2 keeps
them 16 bytes wide and CXLRT_NT_STORES=0 makes the copy memcpy. The mode is fixed per
process, so each mode runs in its own child, the modes alternate, and every child
times the numpy baseline and the store in paired rounds (one of each, in turn), as
perf/'s ratios are everywhere else:

    python perf/copy_modes.py --backend file --block-kib 2048 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SPECS = {"file": "file:{d}/r", "emu": "emu:{d}/r?seed=1&evict=0&delay=0&lat=0&check=0"}
MODES = {"nt": "1", "nt-sse2": "sse2", "memcpy": "0"}  # CXLRT_NT_STORES of each


def child(backend: str, kib: int, blocks: int, rounds: int) -> dict:
    """Paired rounds in this process: ratio of store to numpy copy throughput."""
    import numpy as np

    import cxlrt
    from cxlrt.backend import copy_mode

    bb = kib * 1024
    rng = np.random.default_rng(4)
    src = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(blocks)]
    dst = np.ones((blocks, bb), np.uint8)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        r = cxlrt.open(SPECS[backend].format(d=d), node=0, create=True,
                       size=f"{max(64, (4 * blocks * bb >> 20) + 16)}M", nodes=1)
        c = cxlrt.KVCache(r, "copy-modes", block_bytes=bb, capacity_blocks=2 * blocks)
        ratios, gbs = [], []
        for i in range(rounds + 2):  # two stores fill the cache: every timed one evicts
            keys = cxlrt.block_hashes([i] * 16 * blocks, 16, salt=b"copy-modes")
            t0 = time.perf_counter()
            for j, b in enumerate(src):
                np.copyto(dst[j], b)
            t1 = time.perf_counter()
            if len(c.store(keys, src)) != blocks:
                raise SystemExit(f"store {i} did not store every block")
            t2 = time.perf_counter()
            if i >= 2:
                ratios.append((t1 - t0) / (t2 - t1))
                gbs.append(blocks * bb / (t2 - t1) / 1e9)
        c.close()
        r.close()
    return {"mode": copy_mode(), "ratio": statistics.median(ratios),
            "gbs": statistics.median(gbs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=sorted(SPECS), default="file")
    ap.add_argument("--block-kib", type=int, default=2048, help="block size (KiB, default 2048)")
    ap.add_argument("--blocks", type=int, default=16, help="blocks a store (default 16)")
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds a child (default 15)")
    ap.add_argument("--runs", type=int, default=3, help="children per mode, alternating")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.backend, a.block_kib, a.blocks, a.rounds)))
        return
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(a.runs):
        for mode, env in MODES.items():
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--backend", a.backend,
                 "--block-kib", str(a.block_kib), "--blocks", str(a.blocks),
                 "--rounds", str(a.rounds)],
                env=dict(os.environ, CXLRT_NT_STORES=env), capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{mode} child failed:\n{out.stderr}")
            res = json.loads(out.stdout)
            if res["mode"]["nt_stores"] != (env != "0") or (
                    env == "sse2" and res["mode"]["nt_width"] != 16):
                raise SystemExit(f"{mode} child copied in the wrong mode: {res['mode']}")
            got[mode].append(res)
    for mode, runs in got.items():
        print(f"{a.backend} {a.block_kib} KiB x {a.blocks}, {mode:7s} "
              f"({runs[0]['mode']['nt_width']:2d}-byte): "
              + ", ".join(f"{r['ratio']:.2f}x numpy ({r['gbs']:.1f} GB/s)" for r in runs))


if __name__ == "__main__":
    main()
