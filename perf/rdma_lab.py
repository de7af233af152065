#!/usr/bin/env python3
"""rdma: against perftest on the same SoftRoCE link, in a lab guest.

    python perf/rdma_lab.py              # boots a guest (emulation/lab), prints the table
    python perf/rdma_lab.py --json out.json

In one TCG guest with SoftRoCE on lo: ``cxlrt serve`` serves a tmpfs region, and a
client moves 16 MiB per call through ``Region.dma_read`` / ``dma_write`` in requests
of 64 KiB and 1 MiB (rdma:'s ``chunk``), against ``ib_read_bw`` / ``ib_write_bw`` with
the same message sizes. Small operations (observe = flush + 8-byte load, publish =
8-byte store + flush + fence, an uncontended lock acquire + release, a lock handoff
between two client processes contending, a KV lookup of 32 blocks) are set against
``ib_read_lat`` of 8 bytes. Every figure is the median of ``--rounds`` runs, each
side's rounds interleaved, so the guest's noise lands on both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20
SIZES = (64 << 10, 1 << 20)


def _perftest(tool: str, args: list[str], port: int) -> str:
    server = subprocess.Popen([tool, "-d", "rxe-lo", "-x", "1", "-F", "-p", str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)
    try:
        client = subprocess.run([tool, "-d", "rxe-lo", "-x", "1", "-F", "-p", str(port), *args,
                                 "127.0.0.1"], capture_output=True, text=True, timeout=300)
    finally:
        out, _ = server.communicate(timeout=60)
    if client.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)}: {client.stdout}{client.stderr}")
    return client.stdout


def perftest_bw(write: bool, size: int, port: int) -> float:
    """MB/s (10^6) of ib_{read,write}_bw's average line."""
    tool = "ib_write_bw" if write else "ib_read_bw"
    n = max(50, (256 * MIB) // size // 4)
    out = _perftest(tool, ["-s", str(size), "-n", str(n)], port)
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0] == str(size):
            return float(f[3]) * (1 << 20) / 1e6  # perftest prints MiB/s
    raise RuntimeError(f"{tool}: no result line in\n{out}")


def perftest_lat(port: int) -> float:
    """ib_read_lat's typical (median) latency of an 8-byte READ, in microseconds."""
    out = _perftest("ib_read_lat", ["-s", "8", "-n", "1000"], port)
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 5 and f[0] == "8":
            return float(f[4])
    raise RuntimeError(f"ib_read_lat: no result line in\n{out}")


def cxlrt_bw(spec: str, write: bool, size: int, total: int = 16 * MIB) -> float:
    import cxlrt
    with cxlrt.open(f"{spec}?chunk={size}", node=1) as r:
        off = r.alloc(total)
        buf = bytearray(os.urandom(total))
        (r.dma_write if write else r.dma_read)(off, buf if write else total)  # warm
        t = time.perf_counter()
        for _ in range(4):
            if write:
                r.dma_write(off, buf)
            else:
                r.dma_read(off, total)
        dt = time.perf_counter() - t
        r.free(off)
    return 4 * total / dt / 1e6


def cxlrt_small(spec: str, iters: int = 400) -> dict[str, float]:
    import cxlrt
    from cxlrt import microbench as mb
    out = {}
    with cxlrt.open(spec, node=1) as r:
        off = r.alloc(64)
        for name, fn in (("observe", mb.load_after_flush), ("publish", mb.store_flush_fence)):
            t = time.perf_counter()
            fn(r, off, iters)
            out[name] = (time.perf_counter() - t) / iters * 1e6
        lock = r.lock("rdma-bench")
        t = time.perf_counter()
        mb.lock_bench(lock, iters // 4)
        out["lock acquire+release"] = (time.perf_counter() - t) / (iters // 4) * 1e6
        r.free(off)
        out["KV lookup + release, 32 blocks"] = _lookup_us(r, iters // 40)
    return out


def _lookup_us(r, n: int, blocks: int = 32) -> float:
    """Microseconds per `with cache.lookup(keys)` of a cached 32-block chain: 32 probes,
    the pins, the second look, the unpins (perf/round_trips.py counts the requests)."""
    import numpy as np

    import cxlrt
    cache = cxlrt.KVCache(r, "rdma-bench", block_bytes=4096, capacity_blocks=2 * blocks)
    keys = cxlrt.block_hashes(list(range(16 * blocks)), 16, salt=b"rdma-bench")
    cache.store(keys, np.zeros((blocks, 4096), np.uint8))
    t = time.perf_counter()
    for _ in range(n):
        with cache.lookup(keys) as hit:
            assert len(hit) == blocks
    us = (time.perf_counter() - t) / n * 1e6
    cache.close()
    return us


def _handoff_child(spec: str, node: int, n: int, barrier, q) -> None:
    import cxlrt
    from cxlrt import microbench as mb
    with cxlrt.open(spec, node=node) as r:
        lock = r.lock("rdma-handoff")
        barrier.wait()
        t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
        mb.lock_bench(lock, n)
        q.put((t0, time.monotonic()))


def cxlrt_handoff(spec: str, n: int = 40) -> float:
    """Microseconds per lock handoff: two processes (nodes 1 and 2, each its own
    attachment) run n acquire+release pairs each on one lock, started together; the
    time from the first start to the last finish over 2n acquisitions. The bakery
    serves tickets in order, so under contention each acquisition follows the
    other node's release."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")  # no attachment of ours in the children
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_handoff_child, args=(spec, node, n, barrier, q))
             for node in (1, 2)]
    for p in procs:
        p.start()
    spans = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a handoff process exited with {p.exitcode}")
    return (max(e for _, e in spans) - min(s for s, _ in spans)) / (2 * n) * 1e6


def in_guest(args) -> dict:
    py = sys.executable
    spec = subprocess.run(["sh", os.path.join(ROOT, "emulation/lab/rdma-serve.sh"), py,
                           "file:/tmp/rdma-perf", "perf", "7490", "128M"],
                          capture_output=True, text=True, check=True).stdout.strip()
    res: dict = {"spec": spec, "bw": [], "lat": {}}
    port = 18600
    for size in SIZES:
        for write in (False, True):
            ours, theirs = [], []
            for _ in range(args.rounds):
                port += 1
                theirs.append(perftest_bw(write, size, port))
                ours.append(cxlrt_bw(spec, write, size))
            res["bw"].append({"op": "write" if write else "read", "size": size,
                              "cxlrt_MBps": statistics.median(ours),
                              "perftest_MBps": statistics.median(theirs),
                              "cxlrt_runs": ours, "perftest_runs": theirs})
    lats, small = [], []
    for _ in range(args.rounds):
        port += 1
        lats.append(perftest_lat(port))
        small.append(cxlrt_small(spec))
        small[-1]["lock handoff, 2 nodes contending"] = cxlrt_handoff(spec)
    res["lat"]["ib_read_lat 8 B (us)"] = statistics.median(lats)
    for k in small[0]:
        res["lat"][f"cxlrt {k} (us)"] = statistics.median(s[k] for s in small)
    return res


def table(res: dict) -> str:
    rows = ["| op | request | cxlrt MB/s | perftest MB/s | ratio |",
            "| --- | --- | --- | --- | --- |"]
    for b in res["bw"]:
        rows.append(f"| {b['op']} | {b['size'] >> 10} KiB | {b['cxlrt_MBps']:.0f} | "
                    f"{b['perftest_MBps']:.0f} | {b['cxlrt_MBps'] / b['perftest_MBps']:.2f}x |")
    rows += ["", "| small operation | µs |", "| --- | --- |"]
    rows += [f"| {k} | {v:.1f} |" for k, v in res["lat"].items()]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs per figure (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_guest:
        print("RESULT " + json.dumps(in_guest(args)), flush=True)
        return 0
    mounts = []
    for d in {ROOT, sys.base_prefix, sys.prefix}:
        mounts += ["--mount", f"{d}:{d}"]
    cmd = (f"cd {ROOT} && PYTHONDONTWRITEBYTECODE=1 {sys.executable} perf/rdma_lab.py "
           f"--in-guest --rounds {args.rounds}")
    env = dict(os.environ, LAB_SMP=os.environ.get("LAB_SMP", "2"),
               LAB_TIMEOUT=os.environ.get("LAB_TIMEOUT", "1500"))
    print("booting a lab guest (SoftRoCE on lo); a few minutes under TCG ...", file=sys.stderr)
    p = subprocess.run(["bash", os.path.join(ROOT, "emulation/lab/run.sh"), "--cxl", "none",
                        *mounts, "--", cmd], capture_output=True, text=True, env=env)
    m = re.search(r"^RESULT (.*)$", p.stdout, re.M)
    if p.returncode != 0 or not m:
        print(p.stdout[-4000:] + p.stderr[-2000:], file=sys.stderr)
        return 1
    res = json.loads(m.group(1))
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
