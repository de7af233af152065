#!/usr/bin/env python3
"""HyMCache observation 4 on the device model: the demo's multi-turn chat end to end,
with a prefix footprint several times a DRAM budget.

    python perf/chm_endtoend.py                # table on stdout, perf/chm_endtoend.png
    python perf/chm_endtoend.py --turns 6 --json out.json

The demo (``cxlrt demo --modes cxlrt``: prefill and decode worker processes, a KV
cache in one region, every generated token checked against a monolithic run) serves
the same workload three ways:

  dram      a DRAM-only cache of the budget: a ``file:`` region on tmpfs whose cache
            holds budget / block bytes blocks; it evicts, and what it misses is
            computed again
  staging   cxlrt over a CXL-HM device (``chm:``) with that budget as device DRAM and
            the SSD tier behind it, room for the whole footprint, HyMCache's policy
  lru       the same device run as a transparent DRAM cache

The budget is the workload's KV footprint (every distinct block it stores) divided by
``--ratio``. Per turn: the prefix hit rate and the mean TTFT. HyMCache's shape is the
target: the device keeps its hit rate in later turns where the DRAM-only cache loses
reuse, and staging serves those hits faster than lru.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _chm import add_device_args, add_output_args, device_spec, save, scratch, script_parser  # noqa: E402

BLOCK_BYTES = 131072  # the demo's toy model: 16 tokens x 4 layers x K,V x 256 x float32
WAYS = ("dram", "staging", "lru")


def footprint_blocks(a: argparse.Namespace) -> int:
    """Distinct KV blocks the workload stores: the shared system prompt once, then each
    conversation's own tokens up to its last turn's prompt."""
    bt = a.block_tokens
    own = a.turns * a.user_tokens + (a.turns - 1) * a.new_tokens
    return a.system_tokens // bt + a.conversations * -(-own // bt)


def demo(spec: str, a: argparse.Namespace, cache_blocks: int | None) -> dict:
    cmd = [sys.executable, "-m", "cxlrt", "demo", "--modes", "cxlrt", "--json",
           "--spec", spec, "--turns", str(a.turns), "--conversations", str(a.conversations),
           "--system-tokens", str(a.system_tokens), "--user-tokens", str(a.user_tokens),
           "--new-tokens", str(a.new_tokens), "--block-tokens", str(a.block_tokens),
           "--seed", str(a.seed)]
    if cache_blocks:
        cmd += ["--cache-blocks", str(cache_blocks)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"the demo failed on {spec} (exit {res.returncode}):\n{res.stderr}")
    return json.loads(res.stdout)


def run(a: argparse.Namespace, progress=None) -> dict:
    fp = footprint_blocks(a)
    # Whole device pages: the DRAM budget is what the device really has.
    budget = max(a.page << 10, fp * BLOCK_BYTES // a.ratio // (a.page << 10) * (a.page << 10))
    rows = []
    with scratch("chm-endtoend") as root:
        for way in WAYS:
            if way == "dram":
                out = demo(f"file:{os.path.join(root, 'dram')}", a, budget // BLOCK_BYTES)
            else:
                out = demo(device_spec(os.path.join(root, way), way, a, f"{budget >> 10}K"), a,
                           None)
            m = out["modes"]["cxlrt"]
            row = {"way": way, "tokens_equal": m["overall"]["tokens_equal"],
                   "hit_rate": [t["prefix_hit_rate"] for t in m["turns"]],
                   "ttft_ms": [t["ttft_mean_s"] * 1e3 for t in m["turns"]],
                   "overall_hit_rate": m["overall"]["prefix_hit_rate"],
                   "overall_ttft_ms": m["overall"]["ttft_mean_s"] * 1e3,
                   "evictions": out["cache"]["evictions"]}
            rows.append(row)
            if progress:
                progress(row)
    return {"params": vars(a), "footprint_mib": fp * BLOCK_BYTES / 2**20,
            "budget_mib": budget / 2**20, "rows": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, p = result["rows"], result["params"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        turns = range(1, len(r["hit_rate"]) + 1)
        ax.plot(turns, [h * 100 for h in r["hit_rate"]], "o-", label=r["way"])
        bx.plot(turns, r["ttft_ms"], "o-", label=r["way"])
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix hit rate, %")
    ax.legend(fontsize=8)
    bx.set_xlabel("turn")
    bx.set_ylabel("mean TTFT, ms")
    bx.legend(fontsize=8)
    fig.suptitle(f"demo, {p['conversations']} conversations x {p['turns']} turns: footprint "
                 f"{result['footprint_mib']:.0f} MiB, DRAM budget {result['budget_mib']:.1f} MiB "
                 f"(1/{p['ratio']}); SSD {p['lat'] / 1000:g} us + {p['bw']} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    ap = script_parser(__doc__)
    ap.add_argument("--ratio", type=int, default=8, help="footprint / DRAM budget (8)")
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation (8)")
    ap.add_argument("--conversations", type=int, default=4, help="conversations (4)")
    ap.add_argument("--system-tokens", type=int, default=1024, help="shared prompt tokens (1024)")
    ap.add_argument("--user-tokens", type=int, default=64, help="new user tokens a turn (64)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated a turn (32)")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (16)")
    ap.add_argument("--seed", type=int, default=0, help="the demo's seed (0)")
    add_device_args(ap, sized=False)
    add_output_args(ap, "chm_endtoend.png")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    for name in ("ratio", "turns", "conversations", "user_tokens", "new_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.block_tokens != 16:
        ap.error("--block-tokens: the demo's model keeps 16 tokens a block here")
    fp = footprint_blocks(a)
    print(f"footprint {fp} blocks ({fp * BLOCK_BYTES / 2**20:.0f} MiB), DRAM budget 1/{a.ratio}",
          file=sys.stderr)

    def show(r: dict) -> None:
        print(f"{r['way']:>8}  hit rate/turn " + " ".join(f"{h:.2f}" for h in r["hit_rate"])
              + "  TTFT ms/turn " + " ".join(f"{t:.0f}" for t in r["ttft_ms"])
              + f"  tokens equal: {r['tokens_equal']}", flush=True)

    result = run(a, show)
    print(f"DRAM budget {result['budget_mib']:.2f} MiB", file=sys.stderr)
    save(result, a, plot)
    return 0 if all(r["tokens_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
