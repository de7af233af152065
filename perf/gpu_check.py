#!/usr/bin/env python3
"""CUDA host registration, proven: one script for a GPU machine (well under 5 minutes).

    python perf/gpu_check.py                       # checks, then the bandwidth table
    python perf/gpu_check.py --size 2G --json gpu.json

Checks (each prints PASS or FAIL; the exit status is 1 if any failed):
  * KV blocks stored from the CPU load into CUDA tensors byte for byte, and blocks
    stored from CUDA tensors read back on the CPU, over ``file:`` (the region
    registered in place), ``emu:`` (non-coherent, registered, flushed first) and
    ``chm:`` (not mappable: the pinned bounce buffer);
  * a payload reused before the copy, and one reused while the device reads it
    (after the copies were enqueued), both raise instead of returning bytes;
  * a registered region's tensor is pinned memory to torch, and close() unregisters
    it (the same memory registers again after a reopen).
Bandwidth: host-to-device and device-to-host copies of ``--size`` bytes from a
registered region, from torch pinned memory and from pageable memory (the same
region unregistered, and a torch CPU tensor), each the best of ``--reps`` timed with
CUDA events; then KV stores of 2 MiB blocks from host memory and from CUDA, and a
KV load of them into one CUDA tensor (registered), each the best of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import cxlrt
from cxlrt import _cuda
from cxlrt.errors import CxlrtError
from cxlrt.spec import parse_size

MIB = 1 << 20
RESULTS: dict = {"checks": {}, "bandwidth": {}}


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS["checks"][name] = bool(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)


def raises(fn) -> str:
    try:
        fn()
    except CxlrtError as e:
        return type(e).__name__ + ": " + str(e).split("\n")[0][:90]
    return ""


def round_trip(torch, root: str, scheme: str, params: str) -> None:
    bb, n = 256 * 1024, 24
    spec = f"{scheme}:{os.path.join(root, scheme)}" + (f"?{params}" if params else "")
    r = cxlrt.open(spec, node=0, create=True, size="64M", nodes=1)
    c = cxlrt.KVCache(r, "gpu", block_bytes=bb, capacity_blocks=64)
    keys = c.block_hashes(range(n * 16))
    data = torch.randint(0, 256, (n * bb,), dtype=torch.uint8)
    stored = c.store(keys[:n // 2], data[:n // 2 * bb].numpy())
    gpu = data.cuda()
    stored += c.store(keys[n // 2:], gpu[n // 2 * bb:])  # from the device
    with c.lookup(keys) as hit:
        dst = torch.empty(n * bb, dtype=torch.uint8, device="cuda")
        c.load(hit, dst)
        ok_gpu = bool(torch.equal(dst, gpu))
        ok_cpu = c.load(hit).tobytes() == data.numpy().tobytes()
    check(f"{scheme}: {n} blocks CPU->region->GPU and GPU->region->CPU", stored == keys
          and ok_gpu and ok_cpu, f"registered={r.cuda_registered}")
    with c.lookup(keys[:4]) as hit:  # reused before the copy
        e = next(e for e in c.entries() if e["key"] == keys[2])
        r.dma_write(e["offset"], bytes(32))
        err = raises(lambda: c.load(hit, torch.empty(4 * bb, dtype=torch.uint8, device="cuda")))
        check(f"{scheme}: a payload reused before the copy raises", bool(err), err)
    if r.cuda_registered:  # reused while the device reads: the post-copy check
        e = next(e for e in c.entries() if e["key"] == keys[6])
        _cuda._after_enqueue = lambda cache, hit: r.dma_write(e["offset"], bytes(32))
        try:
            with c.lookup(keys[4:8]) as hit:
                err = raises(lambda: c.load(hit, torch.empty(4 * bb, dtype=torch.uint8,
                                                             device="cuda")))
        finally:
            _cuda._after_enqueue = None
        check(f"{scheme}: a payload reused while the device reads raises", bool(err), err)
        t = r.tensor(0, (4096,), torch.uint8)
        check(f"{scheme}: a registered region's tensor is pinned to torch", t.is_pinned())
        del t
    c.close()
    was = r.cuda_registered
    r.close()
    if was:
        r2 = cxlrt.open(spec, node=0)
        r2.register_cuda()
        check(f"{scheme}: close() unregistered (reopened, registered again)",
              not r.cuda_registered and r2.cuda_registered)
        r2.close()


def timed(torch, dst, src, reps: int) -> float:
    """Best GB/s of `reps` copies of src into dst (CUDA events around each)."""
    best = 0.0
    for i in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        if i:  # the first is a warm-up
            best = max(best, src.numel() * src.element_size() / (a.elapsed_time(b) * 1e6))
    return best


def bandwidth(torch, root: str, size: int, reps: int) -> None:
    r = cxlrt.open(f"file:{os.path.join(root, 'bw')}", node=0, create=True,
                   size=size + 64 * MIB, nodes=1)
    off = r.alloc(size, align=4096)
    region = r.tensor(off, (size,), torch.uint8)
    region.fill_(1)  # fault every page in before timing
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(size, dtype=torch.uint8)
    bw = RESULTS["bandwidth"]
    bw["region, not registered (pageable)"] = (timed(torch, gpu, region, reps),
                                               timed(torch, region, gpu, reps))
    t0 = time.perf_counter()
    r.register_cuda()
    reg_s = time.perf_counter() - t0
    bw["region, registered (cxlrt)"] = (timed(torch, gpu, region, reps),
                                        timed(torch, region, gpu, reps))
    bw["torch pinned"] = (timed(torch, gpu, pinned, reps), timed(torch, pinned, gpu, reps))
    bw["torch pageable"] = (timed(torch, gpu, pageable, reps), timed(torch, pageable, gpu, reps))
    pattern = (torch.arange(MIB, device="cuda") % 251).to(torch.uint8)
    region[:MIB].copy_(pattern, non_blocking=True)  # into registered memory, asynchronously
    torch.cuda.synchronize()
    check("registered region: a device-to-host copy lands in the medium",
          r.dma_read(off, MIB) == pattern.cpu().numpy().tobytes())
    del region, pinned, pageable
    r.close()
    bb = 2 * MIB
    n = min(256, size // bb // 2)
    r = cxlrt.open(f"file:{os.path.join(root, 'kv')}", node=0, create=True,
                   size=2 * n * bb + 64 * MIB, nodes=1)
    c = cxlrt.KVCache(r, "bw", block_bytes=bb, capacity_blocks=n)
    host = np.ones(n * bb, dtype=np.uint8)
    dst = torch.ones(n * bb, dtype=torch.uint8, device="cuda")
    for name, src in (("from host memory (numpy)", host), ("from CUDA (bounce buffer)", dst)):
        best = 0.0
        for i in range(reps + 1):  # each rep stores fresh keys into an emptied cache
            keys = c.block_hashes(range(i * n * 16, (i + 1) * n * 16))
            t0 = time.perf_counter()
            assert len(c.store(keys, src)) == n
            dt = time.perf_counter() - t0
            c.delete(keys)
            if i:
                best = max(best, n * bb / dt / 1e9)
        bw[f"KV store, {n} x 2 MiB blocks {name}"] = (None, best)
    keys = c.block_hashes(range(n * 16))
    c.store(keys, host)
    best = 0.0
    with c.lookup(keys) as hit:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            c.load(hit, dst)
            dt = time.perf_counter() - t0
            if i:
                best = max(best, n * bb / dt / 1e9)
    bw[f"KV load, {n} x 2 MiB blocks into CUDA (registered)"] = (best, None)
    c.close()
    r.close()
    RESULTS["register_s"] = reg_s
    print(f"\ncudaHostRegister of {size / MIB:.0f} MiB: {reg_s * 1e3:.1f} ms")
    print("\n| source / target | host to device GB/s | device to host GB/s |\n|---|---|---|")
    for name, (h2d, d2h) in bw.items():
        cells = ["" if v is None else f"{v:.1f}" for v in (h2d, d2h)]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--size", default="1G", help="bytes per bandwidth copy (default 1G)")
    ap.add_argument("--reps", type=int, default=5, help="timed copies per row (default 5)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                    help="where the regions' files go (default /dev/shm)")
    ap.add_argument("--json", default="", help="also write the results here")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch "
              f"{torch.__version__}); nothing to check", file=sys.stderr)
        return 2
    size = parse_size(a.size)
    root = tempfile.mkdtemp(prefix="cxlrt-gpu-", dir=a.dir)
    os.environ["CXLRT_LOCAL_DIR"] = root
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    print(f"{RESULTS['device']}, torch {torch.__version__}, regions in {a.dir}", flush=True)
    try:
        round_trip(torch, root, "file", "")
        round_trip(torch, root, "emu", "")
        round_trip(torch, root, "chm", "dram=4M&page=64K")
        bandwidth(torch, root, size, a.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    failed = [k for k, v in RESULTS["checks"].items() if not v]
    print(f"\n{len(RESULTS['checks']) - len(failed)} checks passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
