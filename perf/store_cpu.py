"""CPU time per block of cache.store() into a full cache (every block evicts one).

Thread CPU time, not wall time: on a shared machine it is what a change to the
store and eviction path moves, and other processes barely do. Run it on two
checkouts one after the other to compare them (issue 11: before and after the
eviction pass went under one release of the GIL):

    PYTHONPATH=/path/to/checkout python perf/store_cpu.py --backend file
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import cxlrt

SPECS = {"file": "file:{d}/r", "emu": "emu:{d}/r?seed=1&evict=0&delay=0&lat=0&check=0"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=sorted(SPECS), default="file")
    ap.add_argument("--block-kib", type=int, default=4, help="block size (KiB, default 4)")
    ap.add_argument("--blocks", type=int, default=1024, help="blocks a store and the capacity")
    ap.add_argument("--stores", type=int, default=40, help="timed stores (the minimum is shown)")
    a = ap.parse_args(argv)
    bb, n = a.block_kib * 1024, a.blocks
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        r = cxlrt.open(SPECS[a.backend].format(d=d), node=0, create=True,
                       size=f"{max(64, 4 * n * bb >> 20)}M", nodes=1)
        c = cxlrt.KVCache(r, "store-cpu", block_bytes=bb, capacity_blocks=n)
        rng = np.random.default_rng(1)
        src = [rng.integers(0, 255, bb, dtype=np.uint8) for _ in range(n)]
        times = []
        for i in range(a.stores + 2):  # two to fill the cache
            keys = cxlrt.block_hashes([i] * 16 * n, 16, salt=b"store-cpu")
            t = time.thread_time()
            stored = c.store(keys, src)
            times.append(time.thread_time() - t)
            if len(stored) != n:
                raise SystemExit(f"store {i} stored {len(stored)} of {n} blocks")
        best = min(times[2:])
        print(f"{a.backend}: store of {n} x {a.block_kib} KiB into a full cache: "
              f"{best * 1e3:.2f} ms CPU, {best / n * 1e6:.2f} us/block "
              f"({c.stats()['evictions']} evictions)")
        c.close()
        r.close()


if __name__ == "__main__":
    main()
