"""The directory survives writers killed or stalled at each step (issue 9, scenario 1).

A writer on node 1 is SIGKILLed, or SIGSTOPped, at each named crash point of a
directory put (a new name, an overwrite) and delete. Afterwards, through the
public API only: every other name still reads back (nothing acknowledged is
lost), the interrupted change shows either its old or its new value, never a
torn one and never neither, `names()`, a new `put` and `cxlrt check` work, and
the next writer or `cxlrt check --repair` leaves the region clean.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import cxlrt
from cxlrt import check, crash
from tests.nodes import _CTX, raise_failures, run_procs

LEASE = 0.5  # seconds; a dead writer's hold on the meta lock is broken after it
STALL = 0.05  # seconds readers read while a live writer is stopped mid-update
STALL_LEASE = 10.0  # the stalled writer's lease: the whole stall (with process starts) fits

# (operation, crash point) pairs: every point each operation passes through.
STEPS = [
    ("new", "dir.put.name"), ("new", "dir.put.redo"), ("new", "dir.put.odd"),
    ("new", "dir.put.body"),
    ("overwrite", "dir.put.redo"), ("overwrite", "dir.put.odd"), ("overwrite", "dir.put.body"),
    ("delete", "dir.delete.redo"), ("delete", "dir.delete.odd"),
    ("delete", "dir.delete.body"),
]
# Points after which the entry is mid-change (generation odd) until someone finishes it.
TORN = {"dir.put.odd", "dir.put.body", "dir.delete.odd", "dir.delete.body"}
IDS = [f"{op}-{point.split('.', 1)[1]}" for op, point in STEPS]


def _populate(r, op):
    """Names around the victim entry, and the victim's (old, new) values (None = absent).

    "before" and "after" sit in the entries on either side of the victim's, so
    every scan of the directory passes over the entry the writer is changing.
    """
    offs = {k: r.alloc(64) for k in ("before", "victim", "after", "new", "later")}
    r.put("before", offs["before"])
    r.put("victim", offs["victim"])
    r.put("after", offs["after"])
    if op == "new":
        r.delete("victim")  # leaves a free entry between the two: the new name lands there
        return offs, None, offs["new"]
    if op == "overwrite":
        return offs, offs["victim"], offs["new"]
    return offs, offs["victim"], None


def _change(spec, node, op, new, point, mode):
    """In a child: arm `point`, then make the victim's change (dies or stops there)."""
    r = cxlrt.open(spec, node=node)
    crash.arm(point, mode)
    if op == "delete":
        r.delete("victim")
    else:
        r.put("victim", new)
    crash.disarm()
    r.close()


def _value(r, name):
    try:
        return r.get(name)
    except KeyError:
        return None


def _expect_others(r, offs, victim, extra=()):
    """Every name but the victim reads back; names() agrees with get()."""
    assert r.get("before") == offs["before"]
    assert r.get("after") == offs["after"]
    want = {"before", "after", *extra} | ({"victim"} if victim is not None else set())
    assert set(r.names()) == want


def _dir_problems(report):
    return [p for p in report["problems"] if "directory" in p]


def _wait_dead(spec, node, deadline_s=20.0):
    """Until `cxlrt check` judges `node` dead (its heartbeat past the lease)."""
    t_end = time.monotonic() + deadline_s
    while node not in check.check(spec)["dead_nodes"]:
        assert time.monotonic() < t_end, f"node {node} never judged dead"
        time.sleep(0.1)


def _wait_clean(spec, deadline_s=10.0):
    t_end = time.monotonic() + deadline_s
    while True:
        problems = check.check(spec)["problems"]
        if not problems:
            return
        assert time.monotonic() < t_end, problems
        time.sleep(0.1)


def _wait_stopped(pid, deadline_s=30.0):
    """Until process `pid` is stopped (state T); fails if it exits or never stops."""
    t_end = time.monotonic() + deadline_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("T", "t"):
            return
        assert state not in ("Z", "X", "gone"), "the writer finished without reaching its point"
        assert time.monotonic() < t_end, "the writer never reached its crash point"
        time.sleep(0.002)


def _kill_at(backend, op, point):
    """A region with a writer of node 1 killed at `point`; (r0, offs, old, new)."""
    r0 = backend.create(nodes=3, lease=LEASE)
    offs, old, new = _populate(r0, op)
    p = _CTX.Process(target=_change, args=(backend.spec(), 1, op, new, point, "kill"))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL, f"the writer exited {p.exitcode}, not at {point}"
    return r0, offs, old, new


def _after_the_kill(backend, r0, offs, old, new, point):
    """What must hold right after the kill, before anyone repairs anything."""
    spec = backend.spec()
    report = check.check(spec)  # reports, never raises
    torn = [p for p in _dir_problems(report) if "mid-change" in p]
    assert bool(torn) == (point in TORN), report["problems"]
    seen = _value(r0, "victim")
    assert seen in (old, new), (seen, old, new)
    _expect_others(r0, offs, seen)
    return seen


@pytest.mark.crash
@pytest.mark.parametrize("op,point", STEPS, ids=IDS)
def test_writer_killed_then_next_writer_repairs(backend, op, point):
    r0, offs, old, new = _kill_at(backend, op, point)
    seen = _after_the_kill(backend, r0, offs, old, new, point)
    r0.put("later", offs["later"])  # waits for the dead hold to be broken, then repairs
    assert _dir_problems(check.check(backend.spec())) == []
    assert _value(r0, "victim") == seen  # repairing changed nothing a reader had seen
    assert r0.get("later") == offs["later"]
    # The objects that name themselves in the directory can be created again.
    cxlrt.Channel(r0, "c", slots=2, msg_bytes=64).close()
    cxlrt.KVCache(r0, "kv", block_bytes=64, capacity_blocks=2).close()
    _expect_others(r0, offs, seen, ["later", "chan/c", "kv/kv"])
    b = backend.open(2)
    assert _value(b, "victim") == seen and b.get("later") == offs["later"]
    b.close()
    r0.close()


@pytest.mark.crash
@pytest.mark.parametrize("op,point", [s for s in STEPS if s[1] in TORN],
                         ids=[i for i, s in zip(IDS, STEPS, strict=True) if s[1] in TORN])
def test_writer_killed_then_check_repair_fixes_it(backend, op, point):
    r0, offs, old, new = _kill_at(backend, op, point)
    seen = _after_the_kill(backend, r0, offs, old, new, point)
    spec = backend.spec()
    _wait_dead(spec, 1)
    done = check.repair(spec, 1)
    assert any("directory" in a and "victim" in a for a in done["actions"]), done
    _wait_clean(spec)
    assert _value(r0, "victim") == seen
    _expect_others(r0, offs, seen)
    r0.put("later", offs["later"])
    assert r0.get("later") == offs["later"]
    r0.close()


def _repair_and_die(spec, node, off):
    """A next writer, killed while it finishes the dead writer's change."""
    r = cxlrt.open(spec, node=node)
    crash.arm("dir.repair.body", "kill")
    r.put("later", off)


@pytest.mark.crash
def test_repairer_killed_mid_repair(backend):
    """Repair is idempotent: a repairer killed halfway leaves the same work to the next."""
    r0, offs, old, new = _kill_at(backend, "overwrite", "dir.put.odd")
    p = _CTX.Process(target=_repair_and_die, args=(backend.spec(), 2, offs["later"]))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    assert r0.get("victim") == new  # the redo record made the overwrite whole
    assert _value(r0, "later") is None  # the repairer died before its own put
    r0.put("later", offs["later"])
    assert r0.get("victim") == new and r0.get("later") == offs["later"]
    _expect_others(r0, offs, new, ["later"])
    assert _dir_problems(check.check(backend.spec())) == []
    r0.close()


def _read_while_stalled(r, offs, old, new, seconds):
    """Reads every name over and over for `seconds`; the victim never goes back."""
    seen = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        v = _value(r, "victim")
        assert v in (old, new), (v, old, new)
        if seen and seen[-1] == new:
            assert v == new, "a reader saw the new value, then the old one again"
        seen.append(v)
        _expect_others(r, offs, v)
    return len(seen)


def _reader(spec, node, *args):
    with cxlrt.open(spec, node=node) as r:
        return _read_while_stalled(r, *args)


@pytest.mark.crash
@pytest.mark.parametrize("op,point", STEPS, ids=IDS)
def test_live_writer_stalled_mid_update_does_not_fail_readers(backend, op, point):
    r0 = backend.create(nodes=3, lease=STALL_LEASE)
    spec = backend.spec()
    offs, old, new = _populate(r0, op)
    p = _CTX.Process(target=_change, args=(spec, 1, op, new, point, "stop"))
    p.start()
    try:
        _wait_stopped(p.pid)
        # Another node reads for the length of the stall, and so do we.
        reads, = raise_failures(run_procs(_reader, [(spec, 2, offs, old, new, STALL)],
                                          timeout=60))
        assert reads > 0
        assert _read_while_stalled(r0, offs, old, new, STALL) > 0
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=30)
    assert p.exitcode == 0
    assert _value(r0, "victim") == new
    _expect_others(r0, offs, new)
    assert _dir_problems(check.check(spec)) == []
    r0.close()


def _change_then_report(spec, node, op, new, point, mode):
    """`_change`, exiting 3 if the writer is told it lost its lease (LeaseLost)."""
    from cxlrt.lock import LeaseLost
    try:
        _change(spec, node, op, new, point, mode)
    except LeaseLost:
        os._exit(3)


@pytest.mark.crash
def test_writer_stalled_past_its_lease_is_fenced(backend):
    """A writer stopped mid-overwrite past its lease: others finish its change and write
    on; when it resumes it stops with LeaseLost instead of writing over their work."""
    r0, spec = backend.create(nodes=3, lease=LEASE), backend.spec()
    offs, old, new = _populate(r0, "overwrite")
    p = _CTX.Process(target=_change_then_report,
                     args=(spec, 1, "overwrite", new, "dir.put.odd", "stop"))
    p.start()
    try:
        _wait_stopped(p.pid)
        r0.put("later", offs["later"])  # waits out the stalled writer's lease, settles
        assert r0.get("victim") == new
        r0.put("victim", offs["before"])  # acknowledged after the takeover
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=30)
    assert p.exitcode == 3, f"the resumed writer exited {p.exitcode}, not with LeaseLost"
    assert r0.get("victim") == offs["before"]
    _expect_others(r0, offs, offs["before"], ["later"])
    assert _dir_problems(check.check(spec)) == []
    r0.close()
