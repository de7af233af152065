#!/usr/bin/env python3
"""How many round trips an operation makes over rdma:, with and without a line cache.

    python perf/round_trips.py               # 4 nodes, prints a markdown table
    python perf/round_trips.py --nodes 8 --json out.json

The question (issue 14): would a per-node cache of 64-byte lines on an ``rdma:`` client
(DESIGN.md's "cached view" over one-sided READ/WRITE) save round trips? ``rdma:`` today
has no cache: each load or store call is one READ or WRITE. ``emu:`` is exactly such a
cache over a shared file, and it counts what the same algorithm code does through it:

- ``load``/``store`` calls: the requests ``rdma:`` makes today (one READ or WRITE each; a
  gather or scatter of words, ``cxl_gather64``/``cxl_scatter64``, is one call, its
  READs or WRITEs posted together and waited for together, up to 16 in flight; a scan
  of a lock record's node lines is one load);
- line fills (``misses``) plus write-backs: the round trips a write-allocate line
  cache would make, one 64-byte READ or WRITE each;
- load calls plus write-backs: a cache that never fills on a store and writes back
  only the bytes stored, if every load still misses (they follow an observe).

The counts are per operation, averaged over ``--reps`` after one warm-up, on one node of
an ``emu:`` region with faults off (so nothing is written back early) and a 60 s lease
(the heartbeat thread, every lease/8, stays out of the counts). DMA is not counted: it
is one request per call either way. No RDMA needed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile

import numpy as np

import cxlrt
from cxlrt import nodelocal

BLOCK = 4096


def _counts(backend, fn, reps: int) -> dict[str, float]:
    """Per-call means of the emulation's counters over `reps` calls of fn (after one)."""
    fn()
    s0 = backend.stats()
    for _ in range(reps):
        fn()
    s1 = backend.stats()
    d = {k: (s1[k] - s0[k]) / reps for k in s0}
    wb = d["writebacks"] + d["capacity_writebacks"]
    return {"now": d["loads"] + d["stores"], "cache": d["misses"] + wb,
            "nofill": d["loads"] + wb,
            "loads": d["loads"], "stores": d["stores"], "fills": d["misses"],
            "writebacks": d["writebacks"] + d["capacity_writebacks"]}


def _operations(r: cxlrt.Region):
    """(name, callable) for each operation measured."""
    lock = r.lock("round-trips")
    word = r.alloc(64)
    cache = cxlrt.KVCache(r, "round-trips", block_bytes=BLOCK, capacity_blocks=512)
    chain = {n: cxlrt.block_hashes(list(range(16 * n)), 16, salt=b"rt%d" % n) for n in (8, 32)}
    for keys in chain.values():
        cache.store(keys, np.zeros((len(keys), BLOCK), np.uint8))
    out = np.zeros((1, BLOCK), np.uint8)
    fresh = itertools.count()
    r.put("round-trips", word)

    def observe():
        r.flush(word, 8)
        r.load64(word)

    def publish():
        r.store64(word, 1)
        r.flush(word, 8)
        r.fence()

    def lock_cycle():
        lock.acquire()
        lock.release()

    def lookup(n):
        def go():
            with cache.lookup(chain[n]) as hit:
                assert len(hit) == n
        return go

    def store():
        keys = cxlrt.block_hashes([next(fresh)] * 16, 16, salt=b"rt-store")
        assert len(cache.store(keys, out)) == 1

    def alloc_free():
        r.free(r.alloc(256))

    return [("observe (flush + 8-byte load)", observe),
            ("publish (8-byte store + flush + fence)", publish),
            ("bakery lock acquire + release", lock_cycle),
            ("KV lookup, 8-block chain", lookup(8)),
            ("KV lookup, 32-block chain", lookup(32)),
            ("KV store, 1 block (cache full: evicts)", store),
            ("alloc + free, 256 B", alloc_free),
            ("directory get", lambda: r.get("round-trips"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--nodes", type=int, default=4, help="nodes in the region (default 4)")
    ap.add_argument("--reps", type=int, default=200, help="calls averaged per row (default 200)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if not 2 <= args.nodes <= 64 or args.reps < 1:
        ap.error("--nodes takes 2..64 and --reps at least 1")
    fd, path = tempfile.mkstemp(prefix="cxlrt-round-trips-", dir="/dev/shm")
    os.close(fd)
    os.unlink(path)
    rows = []
    r = None
    try:
        r = cxlrt.open(f"emu:{path}", node=0, create=True, size="64M", nodes=args.nodes,
                       lease=60)
        for name, fn in _operations(r):
            rows.append({"op": name, **_counts(r.backend, fn, args.reps)})
    finally:
        if r is not None:
            r.close()
            nodelocal.remove_files(r.uuid, r.nodes)  # the lock service's, in /dev/shm
        for p in (path, path + ".emu"):
            if os.path.exists(p):
                os.unlink(p)
    print(f"{args.nodes} nodes, {args.reps} calls a row\n")
    print("| operation | round trips now (loads + stores) | write-allocate line cache "
          "(fills + write-backs) | no fill on a store (loads + write-backs) |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['op']} | {row['now']:.1f} ({row['loads']:.1f} + {row['stores']:.1f}) | "
              f"{row['cache']:.1f} ({row['fills']:.1f} + {row['writebacks']:.1f}) | "
              f"{row['nofill']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nodes": args.nodes, "reps": args.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
