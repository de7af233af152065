"""The crash/stall harness (issue 9): stop or kill a process at every named crash point,
let the others carry on, then check what must hold.

    python -m cxlrt.harness                                   # every point x kill, stop
    python -m cxlrt.harness --points 'lock.*' --backends emu-faulty --nodes 16
    python -m cxlrt.harness --rounds 3 --json matrix.json     # the soak

For every selected point x mode x backend (and variant, where a family has several)
the driver runs one *case*:

1. a fresh region in a private tmpfs folder (node-local files in a folder of their
   own), ``--nodes`` nodes, a short lease;
2. a workload of one process per node, written by the point's *family*, in which
   the *victim* (node 1) arms the point. ``kill``: it SIGKILLs itself there.
   ``stop``: it SIGSTOPs itself there; the driver waits until /proc says it is
   stopped, keeps it stopped for ``--stop-leases`` leases while the others carry
   on, then SIGCONTs it and lets it finish;
3. afterwards: every survivor finished cleanly; no survivor waited longer than
   lease + 1.5 s for a resource after the victim died or stopped, and each got it
   while the victim was still stopped (or within that bound of its death); a
   resumed victim completed or was told (LeaseLost, RegionError); the family's
   invariants hold (no two holders, no acknowledged operation lost or altered, no
   object allocated twice); ``cxlrt.check.check()`` is clean, after at most one
   ``cxlrt.check.repair()`` of the dead node;
4. a victim that never reached its point fails the case: a point armed and never
   reached proves nothing.

Every process keeps a *ledger* (JSON lines appended to a file in the case folder,
written before and after each operation), so what a killed process acknowledged
survives it. A family is one function, registered with :func:`family`, that returns
a :class:`Workload` (its processes, a setup, a verify). Locks, the allocator and the
directory are here; the KV cache (``kv.*``, cxlrt.harness_kv) and the channel
(``chan.*``, cxlrt.harness_chan) live in modules of their own, imported at the end
of this one, and register the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import cxlrt
from cxlrt import crash, layoutinfo
from cxlrt.errors import RegionError
from cxlrt.lock import LeaseLost

_LINE = layoutinfo.CONSTANTS["CXL_LINE_SIZE"]  # a lock case's tag and counter: a line each

_CTX = mp.get_context("fork")

LEASE = 0.5           # s: the regions' lease
SLACK = 1.5           # s: recovery bound = lease + SLACK after the victim died or stopped
STOP_LEASES = 3.0     # leases a stopped victim stays stopped
REACH_S = 10.0        # s: a victim that has not reached its point by then never will
JOIN_S = 30.0         # s: a process told to finish that is still running by then hangs
ACQUIRE_S = 10.0      # s: a survivor that waits this long for a lock reports it
MASK64 = (1 << 64) - 1

BACKENDS = {
    "file": "file:{path}",
    "emu": "emu:{path}?seed={seed}",
    "emu-faulty": "emu:{path}?seed={seed}&evict=0.05&delay=1&check=1",
}

# Cases that fail because of a bug in the code under test, not in the harness:
# (point, mode, backend pattern) -> what goes wrong. They stay in the matrix and
# show as "known" (or "xpass" when they pass) without failing the run.
KNOWN: dict[tuple[str, str, str], str] = {
}


class HarnessError(Exception):
    """A workload could not do what the case needs (not an invariant violation)."""


# --- cases and results -------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One run: a point, how the victim is interrupted there, on which backend."""

    point: str
    mode: str                 # "kill" | "stop"
    backend: str              # a key of BACKENDS
    variant: str = ""         # a family's sub-case (e.g. the lock mode), "" for none
    nodes: int = 4
    seed: int = 1
    nth: int = 1              # the victim stops/dies the nth time it reaches the point
    lease: float = LEASE
    stop_leases: float = STOP_LEASES

    @property
    def label(self) -> str:
        return self.point + (f"[{self.variant}]" if self.variant else "")

    @property
    def bound(self) -> float:
        return self.lease + SLACK

    def replay(self) -> str:
        """The command that runs this case again."""
        return (f"python -m cxlrt.harness --points {self.point} --modes {self.mode} "
                f"--backends {self.backend} --nodes {self.nodes} --seed {self.seed} "
                f"--nth {self.nth}" + (f" --variants {self.variant}" if self.variant else "")
                + (f" --lease {self.lease:g}" if self.lease != LEASE else "")
                + (f" --stop-leases {self.stop_leases:g}" if self.stop_leases != STOP_LEASES
                   else ""))


@dataclass
class Result:
    case: Case
    status: str               # "pass" | "fail" | "known" | "xpass"
    seconds: float
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.case), "label": self.case.label, "status": self.status,
                "seconds": round(self.seconds, 2), "problems": self.problems,
                "details": self.details, "replay": self.case.replay()}


# --- workloads ---------------------------------------------------------------------------

@dataclass
class Proc:
    """One process of a workload: `fn(ctx, *args)` runs in a forked child as `node`."""

    role: str                 # "victim" (exactly one) or anything else (a survivor)
    node: int
    fn: Callable[..., None]
    args: tuple = ()
    wave: int = 0             # told to finish after every process of a lower wave exited


@dataclass
class Workload:
    """What a family runs for one case."""

    procs: list[Proc]
    # verify(data) -> problems, run by the driver once every process is gone and
    # `cxlrt check` (with its one repair) is done; it reads the region as an observer.
    verify: Callable[[CaseData], list[str]]
    resources: tuple[str, ...]     # what survivors wait for (ctx.op's `res`)
    # setup(region, case) -> dict, run once as node 0 of the new region; the dict is
    # ctx.shared in every process.
    setup: Callable[[cxlrt.Region, Case], dict] | None = None
    size: str = "8M"
    go_at_event: bool = False      # survivors start only once the victim is at its point
    # The victim holds a lock at its point: stopped past its lease, it must not resume
    # as if nothing happened (LeaseLost, RegionError).
    told_after_stop: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    prefixes: tuple[str, ...]
    build: Callable[[Case], Workload]
    variants: Callable[[str], list[str]]
    max_nth: Callable[[str], int]


FAMILIES: dict[str, Family] = {}


def family(name: str, *prefixes: str, variants: Callable[[str], list[str]] | None = None,
           max_nth: Callable[[str], int] | None = None):
    """Register `build(case) -> Workload` for the points that start with `prefixes`."""
    def deco(build: Callable[[Case], Workload]) -> Callable[[Case], Workload]:
        FAMILIES[name] = Family(name, prefixes, build, variants or (lambda p: [""]),
                                max_nth or (lambda p: 4))
        return build
    return deco


def family_of(point: str) -> Family | None:
    for fam in FAMILIES.values():
        if point.startswith(fam.prefixes):
            return fam
    return None


# --- the child side ----------------------------------------------------------------------

class Ctx:
    """What a workload process gets: the case, its place in it, its ledger, the signals."""

    def __init__(self, case: Case, spec: str, index: int, proc: Proc, shared: dict,
                 ledger: str, ready: Any, go: Any, stop: Any, progress: Any,
                 resources: tuple[str, ...], go_at_event: bool) -> None:
        self.case, self.spec, self.index, self.shared = case, spec, index, shared
        self.role, self.node = proc.role, proc.node
        self.victim = proc.role == "victim"
        self.seed = case.seed
        self._ledger, self._fd = ledger, -1
        self._ready, self.go, self.stop = ready, go, stop
        self._progress, self._res = progress, {r: i for i, r in enumerate(resources)}
        self._go_at_event = go_at_event
        self._deadline = 0.0

    # signals
    def start(self) -> None:
        """Say we are ready, then wait for the driver's go (a go-at-event victim does not)."""
        self._ready.set()
        if not (self.victim and self._go_at_event):
            self.go.wait()
        self._deadline = time.monotonic() + REACH_S

    def arm(self) -> None:
        """Arm the case's point in this process (the victim only)."""
        if not self.victim:
            raise HarnessError("only the victim arms the point")
        crash.arm(self.case.point, self.case.mode, self.case.nth)

    def reached(self) -> bool:
        """The victim was at its point (it resumed from the stop there)."""
        return crash.hits() >= self.case.nth

    def running(self) -> bool:
        """Go on with the loop: survivors until told to stop, the victim until it was at
        its point (or gave up: the driver reports a point never reached)."""
        if self.victim:
            return not self.reached() and time.monotonic() < self._deadline
        return not self.stop.is_set()

    # ledger
    def record(self, k: str, **kw: Any) -> None:
        """Append one record (a line of JSON) to our ledger; it survives a SIGKILL."""
        if self._fd < 0:
            self._fd = os.open(self._ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        kw["k"] = k
        kw["t"] = time.monotonic()
        os.write(self._fd, (json.dumps(kw, separators=(",", ":")) + "\n").encode())

    def op(self, res: str, t0: float, t1: float, **kw: Any) -> None:
        """A survivor got `res` at t1 after asking at t0 (monotonic, the host's clock)."""
        self.record("op", res=res, t0=t0, t1=t1, **kw)
        i = self.index * len(self._res) + self._res[res]
        self._progress[i] = max(self._progress[i], t1)


def _child_main(ctx: Ctx, fn: Callable[..., None], args: tuple) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the driver's handler (main())
    try:
        fn(ctx, *args)
    except BaseException as e:  # report everything: the driver judges it
        ctx.record("exit", ok=False, error=type(e).__name__, message=str(e)[:800],
                   clear=isinstance(e, (LeaseLost, RegionError)),
                   tb=traceback.format_exc()[-3000:])
        sys.exit(3)
    ctx.record("exit", ok=True)


def _in_child(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """fn(*args) in a forked child (the driver never attaches as a node itself)."""
    recv, send = _CTX.Pipe(duplex=False)

    def body() -> None:
        try:
            send.send(("ok", fn(*args)))
        except BaseException:
            send.send(("err", traceback.format_exc()))

    p = _CTX.Process(target=body, daemon=True)
    p.start()
    try:
        if not recv.poll(timeout):
            raise HarnessError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout} s")
        status, value = recv.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
        recv.close()
        send.close()
    if status != "ok":
        raise HarnessError(f"{getattr(fn, '__name__', fn)} failed:\n{value}")
    return value


# --- the driver ---------------------------------------------------------------------------

def backend_spec(backend: str, path: str, seed: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[backend].format(path=path, seed=seed)


def _tmpfs() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@contextlib.contextmanager
def _environ(**kw: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in kw}
    os.environ.update(kw)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ("T" = stopped), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"


def _setup_region(spec: str, case: Case, size: str,
                  setup: Callable[[cxlrt.Region, Case], dict] | None) -> dict:
    with cxlrt.open(spec, node=0, create=True, size=size, nodes=case.nodes,
                    lease=case.lease) as r:
        return setup(r, case) if setup is not None else {}


@dataclass
class CaseData:
    """What the driver hands a family's verify: the case, its ledgers, its timeline."""

    case: Case
    spec: str
    shared: dict
    procs: list[Proc]
    ledgers: list[list[dict]]
    t_event: float             # when the driver saw the victim dead or stopped
    t_cont: float | None       # when it resumed a stopped victim
    details: dict

    def records(self, k: str | None = None, *, victim: bool | None = None
                ) -> Iterator[tuple[Proc, dict]]:
        for p, recs in zip(self.procs, self.ledgers, strict=True):
            if victim is not None and (p.role == "victim") != victim:
                continue
            for rec in recs:
                if k is None or rec["k"] == k:
                    yield p, rec

    def observer(self) -> cxlrt.Region:
        return cxlrt.open(self.spec, node=0, observer=True)


def _read_ledger(path: str) -> list[dict]:
    out: list[dict] = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):  # a record cut by a kill mid-write is not one
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def run_case(case: Case, *, build: Callable[[Case], Workload] | None = None,
             keep: bool = False) -> Result:
    """Run one case; `build` overrides the point's family (negative controls use it)."""
    t0 = time.monotonic()
    problems: list[str] = []
    details: dict[str, Any] = {}
    if build is None:
        fam = family_of(case.point)
        if fam is None:
            raise ValueError(f"no workload for {case.point!r} yet")
        build = fam.build
    root = tempfile.mkdtemp(prefix="cxlrt-harness-", dir=_tmpfs())
    local = os.path.join(root, "local")
    os.makedirs(local)
    try:
        with _environ(CXLRT_LOCAL_DIR=local):
            _drive(case, build, root, problems, details)
    except HarnessError as e:
        problems.append(f"harness: {e}")
    finally:
        if keep and problems:
            details["folder"] = root
        else:
            shutil.rmtree(root, ignore_errors=True)
    known = next((why for (pt, mode, be), why in KNOWN.items()
                  if pt == case.point and mode == case.mode
                  and fnmatch.fnmatchcase(case.backend, be)), None)
    if known:
        details["known"] = known
        status = "known" if problems else "xpass"
    else:
        status = "fail" if problems else "pass"
    return Result(case, status, time.monotonic() - t0, problems, details)


def _drive(case: Case, build: Callable[[Case], Workload], root: str, problems: list[str],
           details: dict[str, Any]) -> None:
    spec = backend_spec(case.backend, os.path.join(root, "region"), case.seed)
    wl = build(case)
    victims = [i for i, p in enumerate(wl.procs) if p.role == "victim"]
    if len(victims) != 1:
        raise HarnessError(f"a workload has exactly one victim, not {len(victims)}")
    vi = victims[0]
    shared = _in_child(_setup_region, spec, case, wl.size, wl.setup)
    go = _CTX.Event()
    waves = sorted({p.wave for p in wl.procs})
    stops = {w: _CTX.Event() for w in waves}
    progress = _CTX.Array("d", len(wl.procs) * len(wl.resources), lock=False)
    readies = [_CTX.Event() for _ in wl.procs]
    paths = [os.path.join(root, f"ledger-{i}-{p.role}-node{p.node}.jsonl")
             for i, p in enumerate(wl.procs)]
    ctxs = [Ctx(case, spec, i, p, shared, paths[i], readies[i], go, stops[p.wave], progress,
                wl.resources, wl.go_at_event) for i, p in enumerate(wl.procs)]
    # Not daemonic: a workload process may start children of its own (a sibling).
    children = [_CTX.Process(target=_child_main, args=(ctxs[i], p.fn, p.args),
                             name=f"cxlrt-harness-{p.role}-{p.node}")
                for i, p in enumerate(wl.procs)]
    t_event: float | None = None
    t_cont: float | None = None
    try:
        for i, c in enumerate(children):  # in order: a process may need the ones before it
            c.start()
            if not _wait_ready(readies[i], c):
                raise HarnessError(f"{wl.procs[i].role} of node {wl.procs[i].node} never got "
                                   f"ready (exit code {c.exitcode}); "
                                   + _exit_note(_read_ledger(paths[i])))
        if not wl.go_at_event:
            go.set()
        t_go = time.monotonic()
        victim = children[vi]
        t_event, how = _await_point(victim, case.mode)
        details["reached"] = how
        if t_event is not None:
            details["reach_s"] = round(t_event - t_go, 3)
        if t_event is None:
            problems.append(f"the victim never reached {case.point}@{case.nth} ({how}): "
                            "a point nobody reaches proves nothing; "
                            + _exit_note(_read_ledger(paths[vi])))
            return
        go.set()
        if case.mode == "stop":
            time.sleep(max(0.0, t_event + case.stop_leases * case.lease - time.monotonic()))
            t_cont = time.monotonic()
            os.kill(victim.pid, signal.SIGCONT)
            victim.join(JOIN_S)
            if victim.exitcode is None:
                problems.append(f"the resumed victim did not finish within {JOIN_S} s")
        else:
            _await_progress(progress, len(wl.procs), len(wl.resources), vi, t_event,
                            t_event + case.bound)
        time.sleep(0.1)  # survivors go on a little after the victim is gone
        for w in waves:
            stops[w].set()
            for i, c in enumerate(children):
                if wl.procs[i].wave == w and i != vi:
                    c.join(JOIN_S)
                    if c.exitcode is None:
                        problems.append(f"{wl.procs[i].role} of node {wl.procs[i].node} did "
                                        f"not finish within {JOIN_S} s of being told to stop")
    finally:
        for c in children:
            if c.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGCONT)
                c.kill()
            c.join(10)
    ledgers = [_read_ledger(p) for p in paths]
    data = CaseData(case, spec, shared, wl.procs, ledgers, t_event, t_cont, details)
    problems += _check_processes(data, children, vi)
    if case.mode == "stop" and wl.told_after_stop and data.details.get("victim") == "completed":
        problems.append("the victim was stopped past its lease inside a locked section and "
                        "resumed without being told (no LeaseLost, no RegionError)")
    problems += _check_recovery(data, wl.resources, vi)
    problems += _check_region(data)
    try:
        problems += wl.verify(data)
    except Exception:  # noqa: BLE001 (a region the verify cannot read is a finding too)
        problems.append(f"verify failed:\n{traceback.format_exc()[-2000:]}")


def _wait_ready(ready: Any, child: Any, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready.wait(0.05):
            return True
        if child.exitcode is not None:
            return False
    return False


def _await_point(victim: Any, mode: str) -> tuple[float | None, str]:
    """(when, how): the victim died of SIGKILL, or stopped; (None, why) if it did not."""
    end = time.monotonic() + REACH_S + 10
    while time.monotonic() < end:
        if mode == "kill":
            victim.join(0.002)
            if victim.exitcode is not None:
                if victim.exitcode == -signal.SIGKILL:
                    return time.monotonic(), "killed there"
                return None, f"it exited with code {victim.exitcode}"
        else:
            state = _proc_state(victim.pid)
            if state in ("T", "t"):
                return time.monotonic(), "stopped there"
            if victim.exitcode is not None or state in ("Z", "X", "gone"):
                victim.join(5)
                return None, f"it exited with code {victim.exitcode}"
            time.sleep(0.002)
    return None, f"it was still running after {REACH_S + 10:.0f} s"


def _await_progress(progress: Any, nprocs: int, nres: int, vi: int, since: float,
                    until: float) -> None:
    """Until every resource was had by a survivor after `since`, or until `until`."""
    while time.monotonic() < until:
        if all(max((progress[i * nres + r] for i in range(nprocs) if i != vi), default=0.0)
               > since for r in range(nres)):
            return
        time.sleep(0.01)


def _exit_note(ledger: list[dict]) -> str:
    ends = [r for r in ledger if r["k"] == "exit"]
    if not ends:
        return "its ledger has no exit record"
    e = ends[-1]
    if e["ok"]:
        return "it finished its loop normally"
    return f"it raised {e['error']}: {e['message']}\n{e.get('tb', '')}"


def _check_processes(data: CaseData, children: list, vi: int) -> list[str]:
    """Every survivor finished cleanly; the victim died there, or resumed and finished
    or was told (LeaseLost, RegionError)."""
    out = []
    for i, (p, c) in enumerate(zip(data.procs, children, strict=True)):
        ends = [r for r in data.ledgers[i] if r["k"] == "exit"]
        if i == vi:
            if data.case.mode == "kill":
                continue
            if not ends:
                out.append(f"the resumed victim left no exit record (exit code {c.exitcode})")
                continue
            e = ends[-1]
            if e["ok"]:
                data.details["victim"] = "completed"
            elif e["clear"]:
                data.details["victim"] = f"{e['error']}: {e['message'][:200]}"
            else:
                out.append(f"the resumed victim failed with {e['error']} (neither completed "
                           f"nor told LeaseLost/RegionError): {e['message']}\n{e.get('tb', '')}")
            continue
        if not ends or not ends[-1]["ok"]:
            out.append(f"{p.role} of node {p.node} failed (exit code {c.exitcode}): "
                       + _exit_note(data.ledgers[i]))
    return out


def _check_recovery(data: CaseData, resources: tuple[str, ...], vi: int) -> list[str]:
    """No survivor waited longer than the bound after the event, and each resource was
    had again while the victim was stopped (or within the bound of its death)."""
    out = []
    case, t_event = data.case, data.t_event
    what = "stopped" if case.mode == "stop" else "died"
    window_end = data.t_cont if case.mode == "stop" and data.t_cont else t_event + case.bound
    worst = {}
    for res in resources:
        ops = [r for p, r in data.records("op", victim=False) if r["res"] == res
               and r["t1"] > t_event]
        if not ops:
            out.append(f"recovery: no survivor had {res!r} after the victim {what}")
            continue
        stuck = max(r["t1"] - max(r["t0"], t_event) for r in ops)
        worst[res] = round(stuck, 3)
        if stuck > case.bound:
            out.append(f"recovery: a survivor waited {stuck:.2f} s for {res!r} after the "
                       f"victim {what} (bound: lease + {SLACK} = {case.bound} s)")
        first = min(r["t1"] for r in ops)
        if first > window_end:
            where = ("while the victim was stopped" if case.mode == "stop"
                     else f"within {case.bound} s of its death")
            out.append(f"recovery: no survivor had {res!r} {where} (first after "
                       f"{first - t_event:.2f} s)")
    data.details["worst_wait_s"] = worst
    return out


def _check_region(data: CaseData) -> list[str]:
    """`cxlrt check` clean, after at most one `cxlrt check --repair` of a dead node."""
    from cxlrt import check
    spec = data.spec
    report = check.check(spec)
    if not report["problems"]:
        return []
    dead = report["dead_nodes"]
    if len(dead) != 1:
        return [f"check: {len(dead)} dead nodes {dead} (one repair allowed); problems: "
                + "; ".join(report["problems"])]
    try:
        done = check.repair(spec, dead[0])
    except Exception as e:  # noqa: BLE001 (any failure of repair is the finding)
        return [f"check: repair of node {dead[0]} failed: {type(e).__name__}: {e}"]
    data.details["repair"] = done["actions"]
    after = check.check(spec)
    if after["problems"]:
        return [f"check: still unclean after repairing node {dead[0]}: "
                + "; ".join(after["problems"])]
    return []


# --- lock family ---------------------------------------------------------------------------
#
# Locks "hb" (bakery) and "hm" (manager mode); a tag word and a counter word for each, on
# lines of their own. Inside every critical section a process checks its hold is still
# valid (Lock.check: the fencing a long section does), writes its tag, increments the
# counter, yields, and reads the tag back: another holder's tag there, in a section whose
# release raised no LeaseLost, is two holders at once. Node 0 runs the lock manager (or
# stands by to take over when the victim is the manager) and works as well; node 1 is
# the victim; the other nodes work.

LOCK_NAMES = {"bakery": "hb", "manager": "hm"}


def _lock_variants(point: str) -> list[str]:
    if point == "lock.acquire.ticket":
        return ["bakery"]
    if point.startswith("lock.mgr."):
        return ["manager"]
    return ["bakery", "manager"]


def _lock_setup(r: cxlrt.Region, case: Case) -> dict:
    r.lock("hb", mode="bakery")
    r.lock("hm", mode="manager")
    words = {}
    for name in LOCK_NAMES.values():
        off = r.alloc(2 * _LINE)  # tag word on one line, counter on the next
        r.store64(off, 0)
        r.store64(off + _LINE, 0)
        r.persist(off, 2 * _LINE)
        words[name] = off
    return {"words": words}


def _critical(ctx: Ctx, r: cxlrt.Region, lock: Any, tag: int) -> dict:
    """One critical section of `lock`; returns its op record's fields."""
    t0 = time.monotonic()
    if not lock.acquire(timeout=ACQUIRE_S):
        raise HarnessError(f"node {ctx.node} could not take {lock.name!r} in {ACQUIRE_S} s")
    t1 = time.monotonic()
    off = ctx.shared["words"][lock.name]
    rec = {"lock": lock.name, "overlap": False, "lost": False, "inc": False}
    try:
        lock.check()  # a hold that is already suspect writes nothing
        r.flush(off, 2 * _LINE)  # observe both lines before writing into them
        r.store64(off, tag)
        r.persist(off, 8)
        ctx.record("cs", lock=lock.name)  # the counter increment may follow
        r.store64(off + _LINE, r.load64(off + _LINE) + 1)
        r.persist(off + _LINE, 8)
        rec["inc"] = True
        os.sched_yield()
        time.sleep(0.0003)
        r.flush(off, 8)
        rec["overlap"] = r.load64(off) != tag
    except LeaseLost:
        rec["lost"] = True
    finally:
        try:
            lock.release()
        except LeaseLost:
            rec["lost"] = True
    rec.update(t0=t0, t1=t1)
    return rec


def _lock_tag(ctx: Ctx) -> int:
    return (ctx.node + 1) << 32 | (os.getpid() & 0xFFFFFFFF)


def _lock_loop(ctx: Ctx, r: cxlrt.Region, locks: list[Any]) -> None:
    tag = _lock_tag(ctx)
    i = 0
    while ctx.running():
        rec = _critical(ctx, r, locks[i % len(locks)], tag)
        ctx.op(rec["lock"], rec["t0"], rec["t1"], lock=rec["lock"], overlap=rec["overlap"],
               lost=rec["lost"], inc=rec["inc"])
        i += 1
        time.sleep(0.001)


def _standby(ctx: Ctx, r: cxlrt.Region, done: threading.Event) -> None:
    """Take the lock-manager role over when no manager runs (what an operator's
    supervisor does); records each takeover."""
    while not done.wait(0.02):
        try:
            if r.locks.mgr_epoch:
                if r.locks.mgr_exit is not None:
                    ctx.record("manager-exit", why=r.locks.mgr_exit)
                continue  # we are the manager
            info = r.locks.manager_info()
            if info is None or not info["running"]:
                r.start_lock_manager()
                ctx.record("takeover", epoch=r.locks.mgr_epoch)
        except RegionError:
            pass  # another manager runs, or started meanwhile


def _lock_keeper(ctx: Ctx, run_manager: bool, lock_of: Callable[[cxlrt.Region, str], Any]
                 ) -> None:
    with cxlrt.open(ctx.spec, node=ctx.node, lock_manager=run_manager) as r:
        locks = [lock_of(r, n) for n in ("hb", "hm")]
        done = threading.Event()
        t = threading.Thread(target=_standby, args=(ctx, r, done), daemon=True)
        t.start()
        ctx.start()
        try:
            _lock_loop(ctx, r, locks)
        finally:
            done.set()
            t.join()


def _lock_worker(ctx: Ctx, lock_of: Callable[[cxlrt.Region, str], Any]) -> None:
    with cxlrt.open(ctx.spec, node=ctx.node) as r:
        locks = [lock_of(r, n) for n in ("hb", "hm")]
        ctx.start()
        _lock_loop(ctx, r, locks)


def _lock_victim(ctx: Ctx) -> None:
    case = ctx.case
    with cxlrt.open(ctx.spec, node=ctx.node) as r:
        if case.point == "lock.mgr.grant":
            ctx.arm()
            r.start_lock_manager()  # we are the manager: our grant thread reaches the point
            ctx.start()
            while ctx.running():
                time.sleep(0.005)
            if not ctx.reached():
                return
            # Resumed: our manager's next pass must find itself superseded and stop.
            end = time.monotonic() + 10 * case.lease
            while r.locks.mgr_exit is None and time.monotonic() < end:
                time.sleep(0.01)
            ctx.record("outcome", manager=r.locks.mgr_exit or "still granting")
            return
        lock = r.lock(LOCK_NAMES[case.variant])
        ctx.start()
        ctx.arm()
        tag = _lock_tag(ctx)
        while ctx.running():
            rec = _critical(ctx, r, lock, tag)
            ctx.record("vop", **rec)
            if ctx.reached():
                ctx.record("outcome", lost=rec["lost"])
            time.sleep(0.001)


def _lock_verify(data: CaseData) -> list[str]:
    out = []
    case = data.case
    both: dict[tuple[int, str], int] = {}
    told: dict[tuple[int, str], int] = {}
    for p, rec in data.records():
        if rec["k"] not in ("op", "vop"):
            continue
        key = (p.node, rec["lock"])
        if rec["overlap"] and not rec["lost"]:
            both[key] = both.get(key, 0) + 1
        if rec["lost"] and p.role != "victim":
            told[key] = told.get(key, 0) + 1
    for (node, name), n in sorted(both.items()):
        out.append(f"two holders: {n} critical section(s) of node {node} on {name!r} read "
                   "another holder's tag, and their release reported no lost lease")
    for (node, name), n in sorted(told.items()):
        out.append(f"node {node} (never stopped) was told LeaseLost {n} time(s) on {name!r}: "
                   "a healthy node judged silent (or a starved host)")
    with data.observer() as r:
        for name, off in data.shared["words"].items():
            r.flush(off + _LINE, 8)
            count = r.load64(off + _LINE)
            done = sum(1 for _, x in data.records("op") if x["lock"] == name and x["inc"])
            done += sum(1 for _, x in data.records("vop") if x["lock"] == name and x["inc"])
            begun = sum(1 for _, x in data.records("cs") if x["lock"] == name)
            data.details[f"sections_{name}"] = done
            if not done <= count <= begun:
                out.append(f"lock {name!r}: counter {count}, but {done} increments completed "
                           f"and {begun} began: " + ("lost updates (two holders at once)"
                                                     if count < done else "corrupted"))
    outcome = [rec for _, rec in data.records("outcome", victim=True)]
    takeovers = [rec for _, rec in data.records("takeover", victim=False)]
    if case.point == "lock.mgr.grant":
        if not takeovers:
            out.append("no survivor took the lock-manager role over from the victim")
        if case.mode == "stop":
            what = outcome[-1]["manager"] if outcome else "no outcome recorded"
            if "superseded" not in what:
                out.append(f"the resumed manager was not fenced: {what}")
    elif case.mode == "stop" and not (outcome and outcome[-1]["lost"]) \
            and data.details.get("victim") == "completed":
        out.append("the victim was stopped past its lease holding or waiting for the lock, "
                   "and resumed without being told LeaseLost")
    return out


@family("lock", "lock.", variants=_lock_variants)
def lock_workload(case: Case, *, lock_of: Callable[[cxlrt.Region, str], Any] | None = None
                  ) -> Workload:
    """Lock points. `lock_of(region, name)` gives the survivors' locks (default
    region.lock: a negative control passes a broken one)."""
    if case.nodes < 3:
        raise HarnessError("the lock workload needs 3 nodes or more")
    lock_of = lock_of or (lambda r, name: r.lock(name))
    mgr_victim = case.point == "lock.mgr.grant"
    keeper = Proc("keeper", 0, _lock_keeper, (not mgr_victim, lock_of), wave=1)
    victim = Proc("victim", 1, _lock_victim)
    workers = [Proc("worker", n, _lock_worker, (lock_of,)) for n in range(2, case.nodes)]
    # A victim that runs the manager claims the role before the keeper stands by.
    procs = [victim, keeper] if mgr_victim else [keeper, victim]
    return Workload(procs + workers, verify=_lock_verify, resources=("hb", "hm"),
                    setup=_lock_setup, size="4M")


# --- allocator family ----------------------------------------------------------------------
#
# One process per node: each allocates objects of mixed sizes (small, up to the largest
# class, and chunk runs), writes a tag derived from the object's id over all of it, frees
# some itself, hands some to another node picked at random (which checks the tag and frees
# it remotely: every owner's remote-free queue has several freers; drains) and trims now
# and then. The ledger records each
# allocation once acknowledged and each free before and after. At the end every object
# the ledgers say is live must carry its tag, no two may overlap, and the heap must hold
# as many objects as the ledgers account for (none lost, none leaked by a lost free).

SMALL = (24, 64, 100, 256, 500, 1000, 2048, 4000)
MEDIUM = (5000, 9000, 16384)
LARGE = (20000, 70000, 140000)


def _pattern(uid: int, size: int) -> bytes:
    word = (((uid + 1) * 0x9E3779B97F4A7C15) & MASK64 | 1).to_bytes(8, "little")
    return (word * (size // 8 + 1))[:size]


def _alloc_size(rnd: random.Random) -> int:
    x = rnd.random()
    return rnd.choice(SMALL if x < 0.7 else MEDIUM if x < 0.9 else LARGE)


def _alloc_proc(ctx: Ctx, queues: list, after_alloc: Callable[..., None] | None) -> None:
    n = ctx.case.nodes
    inbox = queues[ctx.node]
    others = [k for k in range(n) if k != ctx.node]
    for q in queues:
        q.cancel_join_thread()  # a receiver that died leaves our items; never block on it
    rnd = random.Random(ctx.seed * 7919 + ctx.node)
    live: dict[int, tuple[int, int]] = {}  # uid -> (off, size)
    later: list[tuple[float, int, int, int]] = []  # received, to free at (due, uid, ...)
    count = 0

    def intact(r: cxlrt.Region, uid: int, off: int, size: int, why: str) -> None:
        if r.dma_read(off, size) != _pattern(uid, size):
            ctx.record("violation", what=f"object {uid:#x} at {off:#x} ({size} B) was "
                       f"altered ({why}): allocated twice, or freed behind its owner's back")

    def free(r: cxlrt.Region, uid: int, off: int) -> None:
        ctx.record("f?", uid=uid)
        t0 = time.monotonic()
        r.free(off)
        t1 = time.monotonic()
        ctx.record("f", uid=uid)
        if not ctx.victim:
            ctx.op("alloc", t0, t1, what="free")

    with cxlrt.open(ctx.spec, node=ctx.node) as r:
        ctx.start()
        if ctx.victim:
            ctx.arm()
        i = 0
        while ctx.running():
            i += 1
            x = rnd.random()
            if x < 0.45 or not live:
                size = _alloc_size(rnd)
                uid = (ctx.node << 40) | count
                count += 1
                ctx.record("a?", uid=uid, size=size)
                t0 = time.monotonic()
                off = r.alloc(size)
                t1 = time.monotonic()
                r.dma_write(off, _pattern(uid, size))
                ctx.record("a", uid=uid, off=off, size=size)
                if not ctx.victim:
                    ctx.op("alloc", t0, t1, what="alloc", size=size)
                    if after_alloc is not None and after_alloc(ctx, r, uid, off, size):
                        continue  # the hook took it: it stays live in the ledger, untouched
                live[uid] = (off, size)
            elif x < 0.65:
                uid = rnd.choice(list(live))
                off, size = live.pop(uid)
                intact(r, uid, off, size, "before its owner freed it")
                free(r, uid, off)
            elif x < 0.85:
                uid = rnd.choice(list(live))
                off, size = live.pop(uid)
                intact(r, uid, off, size, "before it was handed on")
                to = rnd.choice(others)  # several freers per owner's queue
                ctx.record("h", uid=uid, to=to)
                queues[to].put((uid, off, size))
            else:
                uid = rnd.choice(list(live))
                intact(r, uid, *live[uid], "while its owner held it")
            while len(live) > 12:
                uid = next(iter(live))
                off, size = live.pop(uid)
                free(r, uid, off)
            if i % 8 == 0:
                t0 = time.monotonic()
                r.trim()  # applies remote frees queued for us, gives back empty chunks
                if not ctx.victim:
                    ctx.op("alloc", t0, time.monotonic(), what="trim")
            while ctx.running():
                try:
                    uid, off, size = inbox.get_nowait()
                except queue.Empty:
                    break
                intact(r, uid, off, size, "when it was received")
                # Freed a while later: remote frees keep arriving while a victim stalls.
                later.append((time.monotonic() + rnd.uniform(0, 4 * ctx.case.lease),
                              uid, off, size))
            later.sort()
            while later and later[0][0] <= time.monotonic() and ctx.running():
                _, uid, off, size = later.pop(0)
                intact(r, uid, off, size, "before it was freed remotely")
                free(r, uid, off)
            time.sleep(0.001)
        if not ctx.victim:
            for _, uid, off, size in later:
                intact(r, uid, off, size, "before it was freed remotely")
                free(r, uid, off)
            r.trim()


def _allocated(r: cxlrt.Region) -> set[int]:
    """Offsets of every object the heap holds allocated: large-run heads and the set
    bits of small chunks' bitmaps (the layout heapscan walks), observed."""
    from cxlrt.alloc import class_geometry, table_word
    from cxlrt.heapscan import CHUNK, LARGE, SMALL, SMALL_MAGIC, _table, small_chunk
    _, heap_off, n, words = _table(r)
    geo = class_geometry()
    out = set()
    for k, w in enumerate(words):
        kind, _, low = table_word(w)
        base = heap_off + k * CHUNK
        if kind == LARGE:
            out.add(base)
        elif kind == SMALL and low < len(geo):
            size, nslots, start = geo[low]
            h, bitmap = small_chunk(r, base, nslots)
            if h.magic != SMALL_MAGIC:
                continue
            for i in range(nslots):
                if bitmap[i // 64] >> (i % 64) & 1:
                    out.add(base + start + i * size)
    return out


def _alloc_verify(data: CaseData) -> list[str]:
    out = []
    objs: dict[int, dict] = {}
    freeing, freed = set(), set()
    inflight = 0
    for i, recs in enumerate(data.ledgers):
        pending = False
        for rec in recs:
            k = rec["k"]
            if k == "a?":
                pending = True
            elif k == "a":
                pending = False
                objs[rec["uid"]] = {"off": rec["off"], "size": rec["size"], "t": rec["t"]}
            elif k == "f?":
                freeing.add(rec["uid"])
            elif k == "f":
                freed.add(rec["uid"])
            elif k == "violation":
                out.append(f"{data.procs[i].role} of node {data.procs[i].node}: {rec['what']}")
        inflight += pending
    for uid, o in objs.items():  # a uid is allocated once: the order of ledgers is moot
        o["state"] = "freed" if uid in freed else "freeing" if uid in freeing else "live"
    live = sorted((o["off"], o["size"], uid) for uid, o in objs.items() if o["state"] == "live")
    unsure = sum(1 for o in objs.values() if o["state"] == "freeing")
    from cxlrt import heapscan
    with data.observer() as r:
        damaged = [(off, size, uid) for off, size, uid in live
                   if r.dma_read(off, size) != _pattern(uid, size)]
        s = heapscan.scan(r)
        allocated = _allocated(r)
    overlaps = [(a, n, u, b, v) for (a, n, u), (b, _, v) in zip(live, live[1:], strict=False)
                if a + n > b]
    for a, n, u, b, v in overlaps[:5]:
        out.append(f"objects {u:#x} at {a:#x} (+{n}) and {v:#x} at {b:#x} are both live "
                   "and overlap: allocated twice")
    if len(overlaps) > 5:
        out.append(f"... and {len(overlaps) - 5} more overlapping pairs of live objects")
    for off, size, uid in damaged[:5]:
        out.append(f"object {uid:#x} at {off:#x} ({size} B), acknowledged and never freed, "
                   "does not carry its tag: allocated twice, or freed")
    if len(damaged) > 5:
        out.append(f"... and {len(damaged) - 5} more live objects without their tags")
    queued = sum(len(q) for q in s.queued.values())
    held = s.small_objects + s.large_objects - queued
    data.details["objects"] = {"live": len(live), "unsure": unsure, "inflight": inflight,
                               "heap": held, "queued": queued,
                               "acknowledged": len(objs)}
    if held < len(live):
        out.append(f"the heap holds {held} objects but {len(live)} acknowledged ones were "
                   "never freed: acknowledged allocations lost")
    elif held > len(live) + unsure + inflight:
        out.append(f"the heap holds {held} objects, the ledgers account for at most "
                   f"{len(live) + unsure + inflight}: acknowledged frees lost (a leak)")
        # Name the suspects: allocated, on no queue, and the last object the ledgers
        # saw there was freed (an unacknowledged allocation may sit there too).
        queued_offs = {x for q in s.queued.values() for x in q}
        last = {o["off"]: (uid, o) for uid, o in sorted(objs.items(), key=lambda x: x[1]["t"])}
        for off in sorted(allocated - {o for o, _, _ in live} - queued_offs):
            uid, o = last.get(off, (0, None))
            if o is not None and o["state"] == "freed":
                who = [data.procs[i].node for i, recs in enumerate(data.ledgers)
                       if any(x["k"] == "f" and x["uid"] == uid for x in recs)]
                out.append(f"suspect: object {uid:#x} at {off:#x} ({o['size']} B), freed by "
                           f"node {who[0] if who else '?'} (acknowledged), is still "
                           "allocated and on no remote-free queue")
    return out


@family("alloc", "alloc.", "free.")
def alloc_workload(case: Case, *, after_alloc: Callable[..., None] | None = None
                   ) -> Workload:
    """Allocator points. `after_alloc(ctx, region, uid, off, size)` runs in survivors
    after each acknowledged allocation; when it returns True the workload leaves that
    object alone from then on (a negative control misbehaves there)."""
    if case.nodes < 3:
        raise HarnessError("the allocator workload needs 3 nodes or more")
    queues = [_CTX.Queue() for _ in range(case.nodes)]
    procs = [Proc("victim" if k == 1 else "worker", k, _alloc_proc, (queues, after_alloc))
             for k in range(case.nodes)]
    # Room for what a stall holds hostage: objects handed to the stopped victim wait
    # in its inbox, and its own objects freed by others wait on its queue, until it
    # resumes. At 4 MiB a node, 3 and 5 of 40 runs of the 4-node alloc.drain stop
    # case ran out of memory (a worker's OutOfMemory, no protocol fault; the first
    # with the build before the lock's batching); at 12 MiB none of 120 did.
    return Workload(procs, verify=_alloc_verify, resources=("alloc",),
                    size=f"{max(48, 12 * case.nodes)}M")


# --- directory family ----------------------------------------------------------------------
#
# Every node puts, overwrites and deletes names of its own ("n<node>.<k>"), each value an
# offset inside a 64 KiB object of its own (so `cxlrt check` finds them in live chunks).
# The ledger records each change before and after; at the end every name must hold the
# value of its last acknowledged change, or, for a change never acknowledged (the victim's,
# or one a LeaseLost interrupted), the value before or after it. For dir.repair.body a
# sibling process of the victim's node is first killed mid-put (leaving its entry torn),
# and the victim's next write, which finishes that entry, is the one interrupted.

def _dir_names(case: Case, node: int) -> list[str]:
    k = max(2, min(4, 100 // case.nodes))
    return [f"n{node}.{j}" for j in range(k)]


def _dir_setup(r: cxlrt.Region, case: Case) -> dict:
    return {"base": {n: r.alloc(65536) for n in range(case.nodes)}}


def _tear(ctx: Ctx) -> None:
    """Child: a sibling of the victim's node, killed between the odd generation and the
    body of a put."""
    with cxlrt.open(ctx.spec, node=ctx.node) as r:
        crash.arm("dir.put.odd", "kill")
        value = ctx.shared["base"][ctx.node] + 8 * 8191
        ctx.record("d?", name="torn", value=value)
        r.put("torn", value)


def _dir_proc(ctx: Ctx) -> None:
    if ctx.victim and ctx.case.point == "dir.repair.body":
        p = _CTX.Process(target=_tear, args=(ctx,))
        p.start()
        p.join(60)
        if p.exitcode != -signal.SIGKILL:
            raise HarnessError(f"the sibling was not killed at dir.put.odd ({p.exitcode})")
    names = _dir_names(ctx.case, ctx.node)
    base = ctx.shared["base"][ctx.node]
    rnd = random.Random(ctx.seed * 104729 + ctx.node)
    now: dict[str, int | None] = dict.fromkeys(names)
    seq = 0
    with cxlrt.open(ctx.spec, node=ctx.node) as r:
        ctx.start()
        if ctx.victim:
            ctx.arm()
        while ctx.running():
            name = rnd.choice(names)
            x = rnd.random()
            if now[name] is not None and x >= 0.8:
                try:
                    got: int | None = r.directory.get(name)
                except KeyError:
                    got = None
                if got != now[name]:
                    ctx.record("violation", what=f"{name!r} reads {got}, its last "
                               f"acknowledged value is {now[name]}")
                continue
            if now[name] is None or x < 0.55:
                seq += 1
                value: int | None = base + 8 * (seq % 8192)
            else:
                value = None
            ctx.record("d?", name=name, value=value)
            t0 = time.monotonic()
            if value is None:
                r.delete(name)
            else:
                r.put(name, value)
            t1 = time.monotonic()
            ctx.record("d", name=name, value=value)
            if not ctx.victim:
                ctx.op("dir", t0, t1)
            now[name] = value
            if seq % 8 == 0:
                mine = {k: v for k, v in r.directory.items() if k in now}
                want = {k: v for k, v in now.items() if v is not None}
                if mine != want:
                    ctx.record("violation", what=f"node {ctx.node} reads its names as "
                               f"{mine}, its acknowledged ones are {want}")
            time.sleep(0.001)


def _dir_verify(data: CaseData) -> list[str]:
    out = []
    possible: dict[str, set] = {}
    for i, recs in enumerate(data.ledgers):
        for rec in recs:
            if rec["k"] == "d?":
                possible[rec["name"]] = possible.get(rec["name"], {None}) | {rec["value"]}
            elif rec["k"] == "d":
                possible[rec["name"]] = {rec["value"]}
            elif rec["k"] == "violation":
                out.append(f"{data.procs[i].role} of node {data.procs[i].node}: {rec['what']}")
    with data.observer() as r:
        items = r.directory.items()
    got = dict(items)
    if len(got) != len(items):
        out.append(f"the directory holds a name twice: {sorted(n for n, _ in items)}")
    for name, want in sorted(possible.items()):
        if got.get(name) not in want:
            seen = "absent" if name not in got else hex(got[name])
            out.append(f"{name!r} is {seen}, but its acknowledged value is "
                       + " or ".join("absent" if v is None else hex(v) for v in want))
    for name in sorted(set(got) - set(possible)):
        out.append(f"{name!r} is in the directory, but nobody put it")
    data.details["names"] = len(got)
    return out


@family("dir", "dir.", max_nth=lambda p: 1 if p == "dir.repair.body" else 4)
def dir_workload(case: Case) -> Workload:
    if case.nodes < 3:
        raise HarnessError("the directory workload needs 3 nodes or more")
    procs = [Proc("victim" if k == 1 else "worker", k, _dir_proc) for k in range(case.nodes)]
    return Workload(procs, verify=_dir_verify, resources=("dir",), setup=_dir_setup,
                    size=f"{max(8, case.nodes)}M", go_at_event=case.point == "dir.repair.body",
                    told_after_stop=True)  # every dir.* point is under the meta lock


# --- the matrix ----------------------------------------------------------------------------

def select(points: str = "*", modes: tuple[str, ...] = ("kill", "stop"),
           backends: tuple[str, ...] = ("file", "emu-faulty"), *, nodes: int = 4,
           seed: int = 1, rounds: int = 1, nth: int | None = None,
           variants: tuple[str, ...] | None = None, lease: float = LEASE,
           stop_leases: float = STOP_LEASES) -> tuple[list[Case], list[str]]:
    """The cases of a matrix, and the selected points that have no workload yet.

    `points` is one or more fnmatch patterns over crash.POINTS, comma-separated.
    Round 0 uses `seed` and nth 1; round k uses seed + k and an nth drawn from it.
    """
    pats = [p for p in points.split(",") if p]
    chosen = [p for p in crash.POINTS if any(fnmatch.fnmatchcase(p, x) for x in pats)]
    if not chosen:
        raise ValueError(f"no crash point matches {points!r}; see --list")
    cases, missing = [], []
    for point in chosen:
        fam = family_of(point)
        if fam is None:
            missing.append(point)
            continue
        for k in range(rounds):
            s = seed + k
            n = nth or (1 if k == 0 else
                        1 + random.Random(s * 31 + zlib.crc32(point.encode()))
                        .randrange(fam.max_nth(point)))
            for v in fam.variants(point):
                if variants and v not in variants:
                    continue
                for mode in modes:
                    for be in backends:
                        cases.append(Case(point, mode, be, v, nodes, s, n, lease, stop_leases))
    return cases, missing


def format_matrix(results: list[Result]) -> str:
    """Rows point[variant], columns mode/backend. A cell is "pass 2.1s" for one round, or
    "3/3 2.2s" (rounds that passed, mean time) for several, followed by FAIL, known
    (a listed bug showed) or xpass (a listed bug did not show) when any round was one."""
    cols: list[tuple[str, str]] = []
    rows: list[str] = []
    cells: dict[tuple[str, tuple[str, str]], list[Result]] = {}
    for res in results:
        c = (res.case.mode, res.case.backend)
        if c not in cols:
            cols.append(c)
        if res.case.label not in rows:
            rows.append(res.case.label)
        cells.setdefault((res.case.label, c), []).append(res)
    width = max([len(r) for r in rows] + [5]) + 2
    heads = [f"{m}/{b}" for m, b in cols]
    cw = max([len(h) for h in heads] + [20]) + 2
    lines = ["point".ljust(width) + "".join(h.ljust(cw) for h in heads).rstrip()]
    for row in rows:
        line = row.ljust(width)
        for c in cols:
            got = cells.get((row, c), [])
            if not got:
                line += "-".ljust(cw)
                continue
            t = sum(x.seconds for x in got) / len(got)
            marks = [m for m, st in (("FAIL", "fail"), ("known", "known"), ("xpass", "xpass"))
                     if any(x.status == st for x in got)]
            if len(got) == 1:
                text = f"{marks[0] if marks else 'pass'} {t:.1f}s"
            else:
                ok = sum(x.status in ("pass", "xpass") for x in got)
                text = " ".join([f"{ok}/{len(got)} {t:.1f}s", *marks])
            line += text.ljust(cw)
        lines.append(line.rstrip())
    return "\n".join(lines)


def report(results: list[Result]) -> str:
    """Failures in full (with their replay command); known bugs once each, with the
    cases where they showed."""
    out = []
    for res in results:
        if res.status == "fail":
            c = res.case
            out.append(f"\nFAIL {c.label} {c.mode} {c.backend} (seed {c.seed}, nth {c.nth}, "
                       f"{res.seconds:.1f} s)")
            out += ["  - " + p.replace("\n", "\n    ") for p in res.problems]
            out.append(f"  replay: {c.replay()}")
    known: dict[str, list[Result]] = {}
    for res in results:
        if res.status in ("known", "xpass"):
            known.setdefault(res.details["known"], []).append(res)
    for why, got in known.items():
        shown = [r for r in got if r.status == "known"]
        out.append(f"\nKNOWN BUG ({len(shown)} of {len(got)} cases showed it): {why}")
        for r in shown[:4]:
            c = r.case
            out.append(f"  - {c.label} {c.mode} {c.backend} seed {c.seed} nth {c.nth}: "
                       + r.problems[0].split("\n")[0][:300])
        if len(shown) > 4:
            out.append(f"  - ... and {len(shown) - 4} more")
    return "\n".join(out).strip("\n")


def summary(results: list[Result]) -> dict[str, int]:
    out = {"pass": 0, "fail": 0, "known": 0, "xpass": 0}
    for r in results:
        out[r.status] += 1
    return out


def _parse_list(text: str, allowed: tuple[str, ...] | dict, what: str) -> tuple[str, ...]:
    items = tuple(x for x in text.split(",") if x)
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"cxlrt.harness: unknown {what} {','.join(bad) or text!r}; "
                         f"choose from {', '.join(allowed)}")
    return items


def _list_points() -> str:
    lines = []
    for p, what in crash.POINTS.items():
        fam = family_of(p)
        v = fam.variants(p) if fam else []
        tag = (fam.name + (f" [{', '.join(v)}]" if v != [""] else "")) if fam else "no workload"
        lines.append(f"{p:22} {tag:26} {what}")
    return "\n".join(lines)


EPILOG = """\
backends:
  file        the coherent shared-file mapping
  emu         the non-coherent emulation, faults off (seed = the case's seed)
  emu-faulty  emu:PATH?seed=S&evict=0.05&delay=1&check=1 (seeded faults + checker)

A case: a fresh region in a private tmpfs folder, one process per node working on
the point's protocol; the victim (node 1) arms the point and dies there (kill) or
stops there and is resumed --stop-leases leases later (stop); then the checks (see
the module's docstring). A cell of the matrix is pass/FAIL and the case's time;
"known" is a bug listed in cxlrt.harness.KNOWN that showed, "xpass" one that did not
show this time; with --rounds, passed/total. Failures follow the matrix with what
went wrong and the command that replays them. Exit status 1 when any case failed
(known bugs excepted), else 0.

examples:
  python -m cxlrt.harness --list
  python -m cxlrt.harness --points 'dir.*' --modes stop --backends file
  python -m cxlrt.harness --points 'lock.*' --backends emu-faulty --nodes 16
  python -m cxlrt.harness --rounds 3 --json soak.json           # the soak
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cxlrt.harness",
        description="Crash/stall harness (issue 9): for each crash point x mode x backend, "
                    "kill or stop a process there while others work on, then check that "
                    "nothing acknowledged was lost, nothing was held or allocated twice, "
                    "survivors recovered within lease + 1.5 s, and `cxlrt check` is clean "
                    "after at most one repair.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="file,emu-faulty",
                    help="comma-separated: file, emu, emu-faulty (default: file,emu-faulty)")
    ap.add_argument("--nodes", type=int, default=4,
                    help="nodes in the rack, one process each, 3..16 (default 4)")
    ap.add_argument("--points", default="*",
                    help="fnmatch pattern(s) over the crash points, comma-separated "
                         "(default '*': every point that has a workload)")
    ap.add_argument("--modes", default="kill,stop", help="kill, stop or both (default both)")
    ap.add_argument("--variants", default="",
                    help="only these variants of a family (e.g. bakery,manager for locks)")
    ap.add_argument("--seed", type=int, default=1, help="seed of round 0 (default 1)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the matrix N times with seeds seed..seed+N-1 and nth values "
                         "drawn from them (round 0: nth 1); the soak (default 1)")
    ap.add_argument("--nth", type=int, default=None,
                    help="interrupt the victim the nth time it reaches its point (replay)")
    ap.add_argument("--lease", type=float, default=LEASE,
                    help=f"the regions' lease in seconds (default {LEASE})")
    ap.add_argument("--stop-leases", type=float, default=STOP_LEASES,
                    help=f"leases a stopped victim stays stopped (default {STOP_LEASES:g})")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    ap.add_argument("--keep", action="store_true",
                    help="keep the folders (region, ledgers) of failed cases")
    ap.add_argument("--list", action="store_true", help="list the crash points and exit")
    ap.add_argument("-q", "--quiet", action="store_true", help="no line per case")
    args = ap.parse_args(argv)
    if args.list:
        print(_list_points())
        return 0
    if not 3 <= args.nodes <= 16:
        ap.error("--nodes must be 3..16")
    if args.rounds < 1 or (args.nth is not None and args.nth < 1):
        ap.error("--rounds and --nth count from 1")
    backends = _parse_list(args.backends, BACKENDS, "backend")
    modes = _parse_list(args.modes, ("kill", "stop"), "mode")
    variants = tuple(x for x in args.variants.split(",") if x) or None
    try:
        cases, missing = select(args.points, modes, backends, nodes=args.nodes, seed=args.seed,
                                rounds=args.rounds, nth=args.nth, variants=variants,
                                lease=args.lease, stop_leases=args.stop_leases)
    except ValueError as e:
        ap.error(str(e))
    if missing:
        print(f"no workload yet for {len(missing)} point(s), not run: {', '.join(missing)}",
              file=sys.stderr)
    # SIGTERM unwinds like Ctrl-C: each case's cleanup kills its processes (resuming
    # a stopped one first) and removes its folder.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    results = []
    for i, case in enumerate(cases, 1):
        res = run_case(case, keep=args.keep)
        results.append(res)
        if not args.quiet:
            print(f"[{i}/{len(cases)}] {res.status:5} {res.seconds:5.1f}s  {case.label} "
                  f"{case.mode} {case.backend} seed={case.seed} nth={case.nth}"
                  + (f"  ({res.problems[0][:120]})" if res.problems else ""), flush=True)
    total = time.monotonic() - t0
    print()
    print(format_matrix(results))
    counts = summary(results)
    print(f"\n{len(results)} cases in {total:.0f} s: " +
          ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    text = report(results)
    if text:
        print("\n" + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv,
                       "nodes": args.nodes, "lease_s": args.lease,
                       "bound_s": args.lease + SLACK, "stop_leases": args.stop_leases,
                       "seconds": round(total, 1), "summary": counts,
                       "not_run": missing, "cases": [r.to_json() for r in results]},
                      f, indent=1)
    return 1 if counts["fail"] else 0


# The families that live in modules of their own register themselves on import.
from cxlrt import harness_chan, harness_kv  # noqa: E402,F401

if __name__ == "__main__":
    # Run through the imported module, whose FAMILIES the modules above filled.
    from cxlrt import harness as _harness
    sys.exit(_harness.main())
