"""What the chm: observation scripts (chm_turns.py, chm_random.py) share: the device
model's parameters on the command line, and the spec they make."""

from __future__ import annotations

import argparse


def add_device_args(ap: argparse.ArgumentParser) -> None:
    """--block, --dram, --page, --lat, --bw and --wbw, with this machine's defaults."""
    ap.add_argument("--block", type=int, default=1, help="KV block MiB (1)")
    ap.add_argument("--dram", type=int, default=16, help="device DRAM MiB (16)")
    ap.add_argument("--page", type=int, default=64, help="device page KiB (64)")
    ap.add_argument("--lat", type=int, default=20000, help="SSD latency per request, ns (20000)")
    ap.add_argument("--bw", type=float, default=4.0, help="SSD read GB/s (4)")
    ap.add_argument("--wbw", type=float, default=2.0, help="SSD write GB/s (2)")


def device_spec(path: str, policy: str, a: argparse.Namespace) -> str:
    return (f"chm:{path}?policy={policy}&dram={a.dram}M&page={a.page}K&lat={a.lat}"
            f"&bw={a.bw}&wbw={a.wbw}")


def save(result: dict, a: argparse.Namespace, plot) -> None:
    """--json and --png, once the run is done."""
    import json
    import sys
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.png:
        plot(result, a.png)
        print(f"wrote {a.png}", file=sys.stderr)
