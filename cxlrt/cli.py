"""The `cxlrt` command: format, inspect and demonstrate shared CXL regions."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

SPEC_HELP = """\
Region specs are SCHEME:PATH[?key=value&...]:
  file:/dev/shm/rack0                      coherent shared file (one host)
  emu:/dev/shm/rack0?seed=7&evict=0.01&check=1
                                           non-coherent emulation of a CXL device
emu: parameters: seed (fault seed), evict (probability of a spontaneous write-back
per access), delay=1 (flushes complete only at the next fence), check=1 (raise
CoherenceError on protocol violations), lat (ns per line), bw (GB/s), cache
(bytes per node, e.g. 1M), ways.
"""


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_info(info: dict[str, Any]) -> None:
    print(f"region   {info['spec']}")
    print(f"size     {info['size']} bytes ({_human(info['size'])})")
    print(f"nodes    {info['nodes']}")
    print(f"layout   version {info['version']}, format id {info['uuid']}")
    for name, (off, n) in info["sections"].items():
        print(f"section  {name:<9} offset {off:#x}, {n} bytes ({_human(n)})")
    if "placement" in info:
        where = ", ".join(f"node {k}: {v} pages" for k, v in sorted(info["placement"].items()))
        print(f"placement metadata pages by NUMA node: {where}")
    for a in info["node_areas"]:
        if a["heartbeat_age_s"] is None:
            before = f" ({a['attaches']} attach(es) before)" if a["attaches"] else ""
            print(f"node {a['node']:<3} not attached{before}")
        else:
            print(f"node {a['node']:<3} pid {a['pid']}, host {a['host_id']}, "
                  f"{a['attaches']} attach(es), heartbeat {a['heartbeat_age_s']} s ago")


def cmd_format(args: argparse.Namespace) -> int:
    import cxlrt
    info = cxlrt.format(args.spec, size=args.size, nodes=args.nodes, force=args.force,
                        lease=args.lease)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"formatted {info['spec']}: {_human(info['size'])}, {info['nodes']} nodes, "
              f"heap {_human(info['sections']['heap'][1])}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import cxlrt
    info = cxlrt.inspect(args.spec)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from cxlrt import check
    if args.repair:
        if args.node is None:
            print("cxlrt check: error: --repair needs --node N (the dead node to repair)",
                  file=sys.stderr)
            return 2
        done = check.repair(args.spec, args.node, force=args.force)
        if not args.json:
            for a in done["actions"] or ["nothing to repair"]:
                print(f"repair: {a}")
    report = check.check(args.spec)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        u = report["usage"]
        print(f"region   {report['spec']}")
        for n in report["nodes"]:
            state = ("dead" if n["dead"] else "alive") if n["attached"] else "not attached"
            print(f"node {n['node']:<3} {state}")
        print(f"locks    {len(report['locks'])} ({', '.join(x['name'] for x in report['locks'])})")
        print(f"heap     {u['chunks']} chunks: {u['free_chunks']} free, {u['small_chunks']} small "
              f"({u['small_objects']} objects), {u['large_chunks']} in {u['large_objects']} "
              f"large objects; {u['live_bytes']} live bytes")
        print(f"names    {len(report['directory'])}")
        for p in report["problems"]:
            print(f"PROBLEM  {p}")
        print("clean" if not report["problems"] else f"{len(report['problems'])} problem(s)")
    return 0 if not report["problems"] else 1


def cmd_lockmgr(args: argparse.Namespace) -> int:
    import signal
    import threading

    import cxlrt
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with cxlrt.open(args.spec, node=args.node, lock_manager=True):
        print(f"cxlrt lockmgr: granting manager-mode locks of {args.spec} as node "
              f"{args.node}; Ctrl-C to stop", file=sys.stderr)
        while not stop.wait(0.5):
            pass
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cxlrt import demo
    quiet = args.json
    report = demo.run(nodes=args.nodes, iters=args.iters, seed=args.seed, evict=args.evict,
                      path=args.path, keep=args.keep, show=not quiet,
                      out=(lambda *a: None) if quiet else print)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cxlrt",
        description="cxlrt: shared memory for rack-scale LLM KV caches on CXL. "
                    "Format a region, inspect it, or run the demo on an emulated rack.",
        epilog=SPEC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    from cxlrt import __version__
    p.add_argument("--version", action="version", version=f"cxlrt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    f = sub.add_parser("format", help="create and format a region",
                       description="Create a region file and write its superblock. "
                                   "Refuses to overwrite an existing file without --force.",
                       epilog=SPEC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    f.add_argument("spec", help="region spec, e.g. emu:/dev/shm/rack0")
    f.add_argument("--size", required=True, help="region size: bytes or 64M, 1G, ...")
    f.add_argument("--nodes", type=int, required=True, help="how many nodes may attach (1-64)")
    f.add_argument("--force", action="store_true", help="reformat an existing region (destroys it)")
    f.add_argument("--lease", type=float, default=None,
                   help="seconds of silence after which a node is presumed dead and its lock "
                        "holds are broken (default 2)")
    f.add_argument("--json", action="store_true", help="print the result as JSON")
    f.set_defaults(func=cmd_format)

    i = sub.add_parser("info", help="show a region's superblock and nodes",
                       description="Read a region's superblock and node areas without "
                                   "attaching as a node.",
                       epilog=SPEC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("spec", help="region spec, e.g. file:/dev/shm/rack0")
    i.add_argument("--json", action="store_true", help="print machine-readable JSON")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("check", help="verify a region's invariants; repair a dead node",
                       description="Check the chunk table, small-chunk bitmaps, remote-free "
                                   "queues, locks, directory and node heartbeats. Exit code 0 "
                                   "when clean, 1 when problems are found. With --repair "
                                   "--node N, release a dead node's lock holds and reclaim its "
                                   "empty or leaked chunks first.",
                       epilog=SPEC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("spec", help="region spec")
    c.add_argument("--repair", action="store_true", help="repair the dead node given by --node")
    c.add_argument("--node", type=int, help="the node to repair")
    c.add_argument("--force", action="store_true",
                   help="repair even if the node's heartbeat is fresh (dangerous)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=cmd_check)

    m = sub.add_parser("lockmgr", help="run the lock manager for manager-mode locks",
                       description="Attach as a node and grant manager-mode locks round-robin "
                                   "until stopped (SIGINT/SIGTERM). One manager per region.")
    m.add_argument("spec", help="region spec")
    m.add_argument("--node", type=int, default=0, help="node id to attach as (default 0)")
    m.set_defaults(func=cmd_lockmgr)

    d = sub.add_parser("demo", help="run the emulated-rack demo (the main job)",
                       description="Format an emulated rack, run nodes as separate processes "
                                   "incrementing a shared counter with and without flushes, "
                                   "and show the checker catching the broken protocol.")
    d.add_argument("--nodes", type=int, default=4, help="nodes (processes), default 4")
    d.add_argument("--iters", type=int, default=20000, help="increments per node, default 20000")
    d.add_argument("--seed", type=int, default=7, help="fault-injection seed, default 7")
    d.add_argument("--evict", type=float, default=0.02,
                   help="spontaneous write-back probability per access, default 0.02")
    d.add_argument("--path", help="region file (default: a fresh folder in /dev/shm)")
    d.add_argument("--keep", action="store_true", help="keep the region file afterwards")
    d.add_argument("--json", action="store_true", help="print the report as JSON only")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command == "demo" and (args.nodes < 1 or args.iters < 1):
        parser.error("--nodes and --iters must be at least 1")
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"cxlrt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a cxlrt error is the user's answer, not a crash
        from cxlrt.errors import CxlrtError
        if isinstance(e, CxlrtError):
            print(f"cxlrt {args.command}: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
