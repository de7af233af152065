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


def _seconds(text: str) -> float:
    """argparse type: a duration in seconds, 0 to an hour (no inf, no nan)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= v <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in 0..3600, got {text!r}")
    return v


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
        if a["state"] != "attached":
            before = f" ({a['attaches']} attach(es) before)" if a["attaches"] else ""
            print(f"node {a['node']:<3} {a['state']}{before}")
        else:
            print(f"node {a['node']:<3} attached: pid {a['pid']}, host {a['host_id']}, "
                  f"life {a['incarnation']}, {a['attaches']} attach(es), beat {a['beat']} "
                  f"(last {a['heartbeat_age_s']} s ago by the host's clock)")
    for kv in info.get("kv_caches", []):
        if "error" in kv:
            print(f"kv cache {kv['name']!r}: unreadable ({kv['error']})")
            continue
        print(f"kv cache {kv['name']!r}: {kv['occupancy']}/{kv['capacity_blocks']} blocks of "
              f"{_human(kv['block_bytes'])} ({kv['block_tokens']} tokens, {kv['algorithm']}, "
              f"salt {kv['salt_digest'][:16]}); {kv['pinned_blocks']} pinned ({kv['pins']} pins); "
              f"{kv['hits']} hits, {kv['misses']} misses, {kv['stores']} stores, "
              f"{kv['evictions']} evictions")


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
    if args.plot:
        from cxlrt import plots
        plots.check(args.plot)  # a bad path or no matplotlib: an error before any work
    info = cxlrt.inspect(args.spec)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    if args.plot:
        print(f"plot     {plots.info_figure(info, args.plot)}", file=sys.stderr)
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


def _print_kept(kept: list[dict]) -> None:
    for x in kept:
        print(f"kept     node {x['node']} of {x['uuid']}: {'; '.join(x['users'])}")


def cmd_delete(args: argparse.Namespace) -> int:
    from cxlrt.cleanup import delete
    done = delete(args.spec, force=args.force, say=lambda m: print(m, file=sys.stderr))
    kept = [x for x in done["node_files"] if x["users"]]
    if args.json:
        print(json.dumps(done, indent=2))
        return 3 if kept else 0
    for p in done["medium"]:
        print(f"removed  {p}")
    if done["device"]:
        print(f"device   {done['spec']} is a device: left as it is (it still holds the region; "
              "`cxlrt format --force` reformats it)")
    n = sum(len(x["paths"]) for x in done["node_files"] if x["removed"])
    print(f"removed  {n} node-local file(s) of {done['uuid']}")
    _print_kept(kept)
    return 3 if kept else 0


def cmd_clean(args: argparse.Namespace) -> int:
    from cxlrt.cleanup import clean
    from cxlrt.nodelocal import local_dir
    done = clean(args.dir, dry_run=args.dry_run)
    kept = [x.as_dict() for x in done if x.users]
    if args.json:
        print(json.dumps([x.as_dict() for x in done], indent=2))
        return 0
    gone = [x for x in done if not x.users]
    verb = "would remove" if args.dry_run else "removed"
    for x in gone:
        print(f"{verb:<8} node {x.node} of {x.uuid}: {len(x.paths)} file(s)")
    _print_kept(kept)
    print(f"{args.dir or local_dir()}: {verb} the files of {len(gone)} node(s); "
          f"{len(kept)} in use")
    return 0


def cmd_lockmgr(args: argparse.Namespace) -> int:
    import signal
    import threading

    import cxlrt
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with cxlrt.open(args.spec, node=args.node) as region:
        region.start_lock_manager(spin=args.spin)
        print(f"cxlrt lockmgr: granting manager-mode locks of {args.spec} as node "
              f"{args.node}; Ctrl-C to stop", file=sys.stderr)
        while not stop.wait(0.5):
            pass
    return 0


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from cxlrt import registry
    registry.get("rdma")  # ImportError with what to install, where it is not built
    parse, make = registry.hook("rdma", "parse_region_arg"), registry.hook("rdma", "server")
    pairs = [parse(r) for r in args.regions]
    regions = dict(pairs)
    if len(regions) != len(pairs):
        raise ValueError("two regions have one name: name them NAME=SPEC")
    server = make(regions, args.listen, dev=args.dev, ib_port=args.ib_port, gid=args.gid)
    stopped = threading.Event()

    def stop(*_):
        stopped.set()
        server.stopping.set()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host = args.listen[0]
    for name, s in server.regions.items():
        print(f"cxlrt serve: rdma:{'[' + host + ']' if ':' in host else host}:{server.port}/"
              f"{name} -> {s.spec} ({s.size} bytes, device GID {server.device.gid})",
              file=sys.stderr, flush=True)
    print(f"cxlrt serve: listening on {host}:{server.port}; Ctrl-C to stop", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.stop("the server was stopped" if stopped.is_set() else "the server failed")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from cxlrt.serving import vllm_demo
        return vllm_demo.main(args)
    from cxlrt import demo
    given = {k: v for k, v in vars(args).items() if k in DEMO_OPTIONS and v is not None}
    cfg = demo.DemoConfig.quick(**given) if args.quick else demo.DemoConfig(**given)
    if args.plot:
        from cxlrt import plots
        plots.check(args.plot)  # a bad path or no matplotlib: an error before the demo runs
    try:
        report = demo.run(cfg, show=not args.json,
                          out=(lambda *a: None) if args.json else print)
    except KeyboardInterrupt:
        print("\ncxlrt demo: interrupted; workers stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ConnectionError) as e:  # a worker failed or stalled
        print(f"cxlrt demo: failed: {e}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(report, indent=2))
    if args.plot:
        print(f"cxlrt demo: plot written to {plots.demo_figure(report, args.plot)}",
              file=sys.stderr)
    return 0 if report["ok"] else 1


DEMO_OPTIONS = ("prefill", "decode", "conversations", "turns", "system_tokens", "user_tokens",
                "new_tokens", "block_tokens", "cache_blocks", "seed", "spec", "modes")


def _modes(text: str) -> tuple[str, ...]:
    """`--modes`: a comma list of demo modes, each named once."""
    from cxlrt.serving.config import MODES
    names = tuple(m.strip() for m in text.split(","))
    bad = [m for m in names if m not in MODES]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{'unknown mode ' + repr(bad[0]) if bad else 'a mode named twice'} in {text!r}; "
            f"give a comma list of {', '.join(MODES)}")
    return tuple(m for m in MODES if m in names)

DEMO_HELP = """\
Serves a multi-turn chat workload (C conversations x T turns, all sharing one
system prompt; each turn's prompt holds the whole conversation so far) through
a tiny transformer with fixed random weights, with P prefill and D decode worker
processes, four ways in one run (--modes picks some):
  (a) no cache  P+D colocated workers recompute every prompt; no KV transfer
  (b) TCP       prefill computes the whole prompt's KV and sends it to decode
                over a loopback TCP socket, as a NIC-based transfer does
  (b') TCP+cache as (b), but each prefill worker keeps an LRU prefix cache of
                the KV it computed in its own memory (LMCache-local style) and
                computes only what it misses; still sends the whole prompt's KV
  (c) cxlrt     prefill looks the prompt's blocks up in a KV cache in the
                shared region, computes and stores only the missing blocks, and
                tells decode over a cxlrt channel which keys are ready; decode
                loads every block through cxlrt
Each worker is a separate process attached as its own node of an emulated rack
(emu: on /dev/shm, removed afterwards) unless --spec names another region.

Reports per turn and overall, per mode: prefix hit rate, KV bytes moved, time to
first token (issue -> first token at decode; mean and p99), the TTFT ratios of
(c) to (a), (b) and (b'), the mean TTFT split into queueing, KV load, compute
and hand-off, and whether every generated token equals a monolithic run
of the same model (whole prompt in one prefill, then greedy decode), with each
first token's logits within 1e-3 of it (the same KV, not just the same argmax).
Exit status 0 when all modes match it, 1 when one does not, 2 on bad input, 3
when a worker fails or stalls, 130 when interrupted.
"""


def _at_least_1(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


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
    i.add_argument("--plot", metavar="FILE.png",
                   help="also draw each KV cache's occupancy, pinned blocks and hit rate "
                        "to this PNG (needs matplotlib)")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("check", help="verify a region's invariants; repair a dead node",
                       description="Check the chunk table, small-chunk bitmaps, remote-free "
                                   "queues, locks, directory and node heartbeats. Exit code 0 "
                                   "when clean, 1 when problems are found. With --repair "
                                   "--node N, release a dead node's lock holds and reclaim its "
                                   "empty or leaked chunks, and tail chunks whose large "
                                   "run lost its head, first.",
                       epilog=SPEC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("spec", help="region spec")
    c.add_argument("--repair", action="store_true", help="repair the dead node given by --node")
    c.add_argument("--node", type=int, help="the node to repair")
    c.add_argument("--force", action="store_true",
                   help="repair even if the node's heartbeat is fresh (dangerous)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=cmd_check)

    x = sub.add_parser("delete", help="delete a region and this host's node-local files",
                       description="Remove a region's file (and the emulation's sidecar) and "
                                   "this host's node-local files of every node. Refuses while a "
                                   "node's heartbeat moves (it watches for up to a lease). "
                                   "Node-local files a live process uses are kept even with "
                                   "--force, and named. A device region is left as it is. Exit "
                                   "code 0 when all is gone; 1 when refused (nothing deleted) "
                                   "or not a region; 2 on bad input; 3 when the region was "
                                   "deleted but some node-local files were kept.",
                       epilog=SPEC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("spec", help="region spec, e.g. file:/dev/shm/rack0")
    x.add_argument("--force", action="store_true",
                   help="delete even while nodes are alive (their processes lose the region)")
    x.add_argument("--json", action="store_true", help="print what was removed as JSON")
    x.set_defaults(func=cmd_delete)

    k = sub.add_parser("clean", help="remove node-local files no live process uses",
                       description="Each node of a region keeps small files in $CXLRT_LOCAL_DIR "
                                   "(default /dev/shm): its robust mutexes, KV pin tables and "
                                   "channel roles. They outlive the region's file when it is "
                                   "removed by hand. Remove every node's files that no live "
                                   "process uses (attached, in any pid namespace, or still "
                                   "mapping them); what a host reboot would lose, and nothing "
                                   "the region cannot rebuild. Another user's files, and a "
                                   "node whose flock stays held, are named and passed over.")
    k.add_argument("--dir", help="the folder to clean (default: $CXLRT_LOCAL_DIR, else /dev/shm)")
    k.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    k.add_argument("--json", action="store_true", help="print every node's files as JSON")
    k.set_defaults(func=cmd_clean)

    m = sub.add_parser("lockmgr", help="run the lock manager for manager-mode locks",
                       description="Attach as a node and grant manager-mode locks round-robin "
                                   "until stopped (SIGINT/SIGTERM). One manager per region.")
    m.add_argument("spec", help="region spec")
    m.add_argument("--node", type=int, default=0, help="node id to attach as (default 0)")
    m.add_argument("--spin", type=_seconds, default=None, metavar="SECONDS",
                   help="keep spinning this long after a grant changed hands before "
                        "sleeping between passes (default 0.002; 0 never spins: a shared "
                        "core)")
    m.set_defaults(func=cmd_lockmgr)

    v = sub.add_parser(
        "serve", help="serve regions to other hosts over RDMA (clients open rdma:HOST:PORT/NAME)",
        description="Register each region's memory for one-sided RDMA READ and WRITE and "
                    "serve it until stopped (SIGINT/SIGTERM). Clients open "
                    "rdma:HOST:PORT/NAME with the usual Region API; this process never "
                    "copies their data. Format the regions first (`cxlrt format`), or let a "
                    "client create them.")
    v.add_argument("regions", nargs="+", metavar="[NAME=]SPEC",
                   help="a mappable local region (file:, numa:, dax:); NAME defaults to the "
                        "medium's file name")
    v.add_argument("--listen", type=_listen, required=True, metavar="HOST:PORT",
                   help="the control socket (port 0 picks a free one, printed at start)")
    v.add_argument("--dev", default="", help="RDMA device (default: the first one)")
    v.add_argument("--ib-port", type=int, default=1, help="RDMA port number (default 1)")
    v.add_argument("--gid", type=int, default=-1,
                   help="GID index (default: the first IPv4-mapped GID, else the first set)")
    v.set_defaults(func=cmd_serve)

    from cxlrt.demo import DemoConfig
    dflt, quick = DemoConfig(), DemoConfig.quick()
    d = sub.add_parser("demo", help="serve LLM requests four ways on an emulated CXL rack "
                                    "(the main job)",
                       description=DEMO_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)

    def opt(name: str, what: str, short: str | None = None) -> None:
        key = name.replace("-", "_")
        a, b = getattr(dflt, key), getattr(quick, key)
        names = [f"--{name}"] + ([short] if short else [])
        d.add_argument(*names, type=_at_least_1, metavar="N",
                       help=f"{what} (default {a}" + (f"; --quick: {b})" if a != b else ")"))

    opt("prefill", "prefill worker processes, P", "-P")
    opt("decode", "decode worker processes, D", "-D")
    opt("conversations", "conversations served at once, C", "-C")
    opt("turns", "turns per conversation, T", "-T")
    opt("system-tokens", "tokens of the shared system prompt")
    opt("user-tokens", "new user tokens per turn")
    opt("new-tokens", "tokens generated per turn")
    opt("block-tokens", "tokens per KV block (one cache key)")
    d.add_argument("--cache-blocks", type=_at_least_1, metavar="N",
                   help="cache capacity in blocks (default: room for the whole workload); "
                        "smaller makes it evict, and decode recomputes what it misses")
    d.add_argument("--modes", type=_modes, metavar="M,M",
                   help="which modes to run, a comma list of nocache (a), tcp (b), tcp_cache "
                        "(b': TCP from a per-worker prefix cache) and cxlrt (c) (default all)")
    d.add_argument("--seed", type=int, metavar="N",
                   help=f"seed of the weights, the tokens and the emulation (default {dflt.seed})")
    d.add_argument("--spec", metavar="SPEC",
                   help="run cxlrt mode on this region instead of a fresh emu: file in /dev/shm, "
                        "e.g. file:/dev/shm/rack0, numa:auto/rack0, dax:/dev/dax0.0; it is "
                        "formatted (its contents are lost)")
    d.add_argument("--engine", choices=("toy", "vllm"), default="toy",
                   help="toy: the demo's own tiny transformer (default); vllm: real vLLM engines, "
                        "no connector vs vLLM's ExampleConnector vs cxlrt (needs the vllm extra; "
                        "takes -C, -T, --system-tokens, --user-tokens, --new-tokens, --seed, "
                        "--quick, --json)")
    d.add_argument("--quick", action="store_true",
                   help="a small workload that runs in seconds (for tests and a first look)")
    d.add_argument("--json", action="store_true",
                   help="print a machine-readable report instead of the table")
    d.add_argument("--plot", metavar="FILE.png",
                   help="also draw TTFT per turn for each mode, with the prefix hit rate on "
                        "a second axis, to this PNG (needs matplotlib)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # ImportError: an extra is missing
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
