"""What the chm: observation scripts (chm_turns.py, chm_random.py) share: the device
model's parameters on the command line, and the spec they make."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from contextlib import contextmanager


def add_device_args(ap: argparse.ArgumentParser, *, sized: bool = True) -> None:
    """--block and --dram (unless the script sizes them), --page, --lat, --bw and --wbw,
    with this machine's defaults."""
    if sized:
        ap.add_argument("--block", type=int, default=1, help="KV block MiB (1)")
        ap.add_argument("--dram", type=int, default=16, help="device DRAM MiB (16)")
    ap.add_argument("--page", type=int, default=64, help="device page KiB (64)")
    ap.add_argument("--lat", type=int, default=20000, help="SSD latency per request, ns (20000)")
    ap.add_argument("--bw", type=float, default=4.0, help="SSD read GB/s (4)")
    ap.add_argument("--wbw", type=float, default=2.0, help="SSD write GB/s (2)")


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help is the script's docstring: first line, then the rest."""
    return argparse.ArgumentParser(description=doc.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=doc.split("\n\n", 1)[1])


def add_output_args(ap: argparse.ArgumentParser, png: str) -> None:
    """--json, and --png defaulting to perf/<png>."""
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), png),
                    help=f"plot path (default perf/{png}; '' for none)")


def request_parser(doc: str, *, requests: int, seed: int, png: str):
    """(parser, tail) for a random-requests script: the parser has its --help from `doc`,
    --pool, --per and --requests; tail() adds the shared rest (the device, --window,
    --seed, --json and --png) after the script's own, and returns the parser."""
    ap = script_parser(doc)
    ap.add_argument("--pool", type=int, default=64, help="KV blocks stored (64: 4x DRAM)")
    ap.add_argument("--per", type=int, default=8, help="blocks read per request (8)")
    ap.add_argument("--requests", type=int, default=requests,
                    help=f"requests per mode ({requests})")

    def tail() -> argparse.ArgumentParser:
        add_device_args(ap)
        ap.add_argument("--window", type=int, default=4, help="staging window, blocks (4)")
        ap.add_argument("--seed", type=int, default=seed,
                        help=f"seed of the bytes and picks ({seed})")
        add_output_args(ap, png)
        return ap

    return ap, tail


def check_request_args(ap: argparse.ArgumentParser, a: argparse.Namespace, *more: str) -> None:
    """Counts at least 1, and --per within --pool."""
    for name in ("pool", "per", "requests", "block", "dram", "page", "window", *more):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if a.per > a.pool:
        ap.error("--per cannot exceed --pool")


def random_lists(a: argparse.Namespace) -> list:
    """2 x --requests lists of --per distinct blocks of --pool, from --seed."""
    import numpy as np
    rng = np.random.default_rng(a.seed + 1)
    return [rng.choice(a.pool, a.per, replace=False) for _ in range(2 * a.requests)]


@contextmanager
def scratch(name: str):
    """A directory in /dev/shm for the devices and, with them, the node-local files (so
    they do not go into /dev/shm itself); removed after."""
    root = tempfile.mkdtemp(prefix=f"cxlrt-{name}-", dir="/dev/shm")
    os.environ["CXLRT_LOCAL_DIR"] = root
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def device_spec(path: str, policy: str, a: argparse.Namespace, dram: str = "") -> str:
    return (f"chm:{path}?policy={policy}&dram={dram or f'{a.dram}M'}&page={a.page}K&lat={a.lat}"
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
