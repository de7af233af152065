"""Recovery that never lies (issue 9): each test is one way the earlier design broke
mutual exclusion or wedged a lock, replayed through the public API on every backend.

A "two holders" detector: inside the critical section a process writes its own tag
to a shared word, yields, and reads the word back; anyone else's tag there means
two processes held the lock at once.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

import cxlrt
import cxlrt.check
from cxlrt.lock import LeaseLost
from tests.conftest import HOST_STALL
from tests.nodes import _CTX, raise_failures, run_procs

MODES = ["bakery", "manager"]
LEASE = 0.5


@pytest.fixture
def reaper():
    """Children a test starts; whatever the outcome, none is left stopped or running."""
    procs = []
    yield procs.append
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(5)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _stop_for(pid: int, seconds: float) -> None:
    """SIGSTOP a process (waiting until it is really stopped), then resume it."""
    os.kill(pid, signal.SIGSTOP)
    while not _stopped(pid):
        time.sleep(0.005)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


def _overlap_worker(spec, node, name, tag, seconds, barrier):
    """Take the lock repeatedly for `seconds`; count sections that saw another tag."""
    r = cxlrt.open(spec, node=node)
    lock = r.lock(name)
    off = r.heap[0]
    if barrier is not None:
        barrier.wait()
    end = time.monotonic() + seconds
    n = overlaps = lost = 0
    while time.monotonic() < end:
        if not lock.acquire(timeout=5 * LEASE + 5):
            continue
        try:
            r.flush(off, 8)  # observe before we write: the last writer was another node
            r.store64(off, tag)
            r.persist(off, 8)
            os.sched_yield()
            time.sleep(0.0005)
            r.flush(off, 8)
            overlaps += r.load64(off) != tag
            n += 1
        finally:
            try:
                lock.release()
            except LeaseLost:
                lost += 1  # reported, as it must be: not an overlap we missed
    r.close()
    return n, overlaps, lost


# --- 3. a stalled holder is told, every time ----------------------------------------------

def _release_and_close(r, lock):
    """'released', or 'LeaseLost' when the release reported a silence past the lease."""
    try:
        lock.release()
        out = "released"
    except LeaseLost:
        out = "LeaseLost"
    r.close()
    return out


def _report(q, fn, *args):
    q.put(fn(*args))


def _hold_then_release(spec, node, mode, ready, go, when):
    r = cxlrt.open(spec, node=node)
    lock = r.lock("stall", mode=mode)
    if when == "waiting":
        ready.set()  # the parent holds the lock: we queue behind it
        lock.acquire()
    else:
        lock.acquire()
        ready.set()
    go.wait()
    return _release_and_close(r, lock)


@pytest.mark.crash
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("when", ["holding", "waiting"])
def test_a_holder_stalled_past_its_lease_is_told_every_time(backend, reaper, mode, when):
    """Scenario 3: LeaseLost from release() in 5 of 5 runs, whether the process was
    stopped while holding or while it waited in the queue."""
    r0 = backend.create(nodes=3, lease=LEASE, lock_manager=(mode == "manager"))
    lock0 = r0.lock("stall", mode=mode)
    for _ in range(5):
        ready, go = _CTX.Event(), _CTX.Event()
        if when == "waiting":
            lock0.acquire()
        q = _CTX.Queue()
        p = _CTX.Process(target=_report, args=(q, _hold_then_release, backend.spec(), 1, mode,
                                               ready, go, when))
        p.start()
        reaper(p)
        assert ready.wait(30)
        time.sleep(0.1)
        _stop_for(p.pid, 3 * LEASE)
        if when == "waiting":
            lock0.release()
        go.set()
        assert q.get(timeout=30) == "LeaseLost", f"{mode}/{when}: a stall went unreported"
        p.join(10)
    r0.close()


def _tell(lock, r):
    """What release() said: (LeaseLost's text with our liveness figures, its host_stall)."""
    try:
        lock.release()
        return "released", None
    except LeaseLost as e:
        return f"{e} {r.liveness.stats()}", e.host_stall


def _held_while_stopped(q, spec, node, ready, go, cmds):
    """Hold a lock until `go`, then report _tell; again while `cmds` says "again"."""
    r = cxlrt.open(spec, node=node)
    lock = r.lock("stall")
    while True:
        lock.acquire()
        ready.set()
        go.wait()
        go.clear()
        q.put(_tell(lock, r))
        if cmds.get(timeout=30) != "again":
            break
    r.close()


def _blocked_after_a_stop(q, spec, node, stopped, go, stall_s):
    """Stopped once before the hold (a silence that does not count); then hold a lock
    while the beat is blocked for `stall_s` (a debug build's hook), and report _tell."""
    r = cxlrt.open(spec, node=node)
    lock = r.lock("stall")
    stopped.set()
    go.wait()
    lock.acquire()
    r.liveness._stall_heartbeat(stall_s)
    time.sleep(stall_s / 3)
    q.put(_tell(lock, r))
    r.close()


@pytest.mark.crash
def test_a_stopped_holders_lease_lost_blames_the_stop_not_the_heartbeat(backend, reaper):
    """A silence the OS made (SIGSTOP stands in for a host that did not run us) is named
    as such, so that it is told apart from a heartbeat that the medium blocked. A stop
    that lands inside one of its beats (microseconds in every 62 ms) looks like a beat
    that blocked, and is tried again."""
    r0 = backend.create(nodes=3, lease=LEASE)
    ready, go, q = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    cmds = _CTX.Queue()
    p = _CTX.Process(target=_held_while_stopped, args=(q, backend.spec(), 1, ready, go, cmds))
    p.start()
    reaper(p)
    for _ in range(3):
        assert ready.wait(30)
        ready.clear()
        _stop_for(p.pid, 3 * LEASE)
        go.set()
        text, host_stall = q.get(timeout=30)
        if host_stall or "inside one beat" not in text:
            break
        cmds.put("again")  # the stop landed inside a beat: once more
    cmds.put("done")
    assert re.search(HOST_STALL, f"LeaseLost: {text}"), text  # what the suite reruns
    assert host_stall is True, text
    p.join(10)
    r0.close()


def _body_fails_while_stopped(q, spec, node, ready, go):
    """A `with lock:` whose body raises after a stop: what __exit__'s LeaseLost said."""
    r = cxlrt.open(spec, node=node)
    try:
        with r.lock("stall"):
            ready.set()
            go.wait()
            raise ValueError("the section's own error")
    except LeaseLost as e:
        q.put((f"{e} {r.liveness.stats()}", e.host_stall, repr(e.__context__)))
    except ValueError:
        q.put(("no LeaseLost", None, None))
    r.close()


@pytest.mark.crash
def test_a_stall_is_not_blamed_over_an_error_of_the_section(backend, reaper):
    """A `with` body that raised is the code's error whether or not the host stalled: the
    LeaseLost raised over it does not blame the host, so the suite never reruns it."""
    r0 = backend.create(nodes=3, lease=LEASE)
    ready, go, q = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    p = _CTX.Process(target=_body_fails_while_stopped, args=(q, backend.spec(), 1, ready, go))
    p.start()
    reaper(p)
    assert ready.wait(30)
    _stop_for(p.pid, 3 * LEASE)
    go.set()
    text, host_stall, context = q.get(timeout=30)
    assert "ValueError" in context, (text, context)
    assert host_stall is False, text
    assert not re.search(HOST_STALL, f"LeaseLost: {text}"), text
    p.join(10)
    r0.close()


@pytest.mark.debug_build
def test_a_heartbeat_blocked_in_its_beat_is_not_called_a_host_stall(backend):
    """The negative control: the beat thread runs but its beat takes 3 s (as a blocked
    medium would make it): LeaseLost says so, and does not blame the host."""
    r = backend.create(nodes=3, lease=LEASE)
    lock = r.lock("blocked")
    lock.acquire()
    r.liveness._stall_heartbeat(3.0)
    time.sleep(1.0)
    with pytest.raises(LeaseLost, match="inside one beat") as e:
        lock.release()
    assert not re.search(HOST_STALL, f"LeaseLost: {e.value}")  # never rerun: ours to fix
    assert e.value.host_stall is False
    deadline = time.monotonic() + 10
    while "ended" not in r.liveness.silence():
        assert time.monotonic() < deadline, r.liveness.silence()
        time.sleep(0.05)
    assert "made by slow beats" in r.liveness.silence()
    assert r.liveness.host_stalled() is False
    r.close()


@pytest.mark.crash
@pytest.mark.debug_build
def test_an_earlier_stop_does_not_excuse_a_blocked_beat_in_the_hold(backend, reaper):
    """A process stopped once before it took the lock, whose beat then blocks while it
    holds it: the silence that counts is the blocked beat, not a host stall."""
    r0 = backend.create(nodes=3, lease=LEASE)
    stopped, go, q = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    p = _CTX.Process(target=_blocked_after_a_stop,
                     args=(q, backend.spec(), 1, stopped, go, 3.0))
    p.start()
    reaper(p)
    assert stopped.wait(30)
    _stop_for(p.pid, 3 * LEASE)
    time.sleep(0.3)  # its heartbeat beats again: that silence has ended
    go.set()
    text, host_stall = q.get(timeout=30)
    assert "inside one beat" in text, text
    assert "its heartbeat thread not run" not in text, text  # before the hold: not counted
    assert not re.search(HOST_STALL, f"LeaseLost: {text}"), text
    assert host_stall is False
    p.join(10)
    r0.close()


def test_check_reports_remaining_validity(backend):
    r = backend.create(nodes=2, lease=2.0)
    lock = r.lock("v")
    with lock:
        left = lock.check()
        assert 0.5 < left <= 2.0
    with pytest.raises(RuntimeError, match="not held"):
        lock.check()
    r.close()


# --- 4. a clean detach never hides a dead sibling's hold --------------------------------

def _hold_and_die(spec, node, mode):
    r = cxlrt.open(spec, node=node)
    r.lock("crash", mode=mode).acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _acquire_within(spec, node, name, timeout):
    r = cxlrt.open(spec, node=node)
    lock = r.lock(name)
    t0 = time.monotonic()
    ok = lock.acquire(timeout=timeout)
    waited = time.monotonic() - t0
    if ok:
        lock.release()
    r.close()
    return ok, waited


@pytest.mark.crash
@pytest.mark.parametrize("mode", MODES)
def test_a_clean_detach_gives_back_a_dead_siblings_hold(backend, reaper, mode):
    """Scenario 4: a holder is SIGKILLed, then a sibling process of its node that
    never used a lock detaches cleanly; the lock must not stay held for good."""
    r0 = backend.create(nodes=3, lease=LEASE, lock_manager=(mode == "manager"))
    r0.lock("crash", mode=mode)
    sibling = backend.open(1)
    p = _CTX.Process(target=_hold_and_die, args=(backend.spec(), 1, mode))
    p.start()
    reaper(p)
    p.join()
    assert p.exitcode == -signal.SIGKILL
    sibling.close()
    (ok, waited), = raise_failures(run_procs(_acquire_within,
                                             [(backend.spec(), 2, "crash", 10.0)]))
    assert ok, "the dead sibling's hold outlived the clean detach"
    assert waited < LEASE + 1.5, waited
    assert cxlrt.inspect(backend.spec())["node_areas"][1]["state"] == "detached"
    report = cxlrt.check.check(backend.spec())
    assert not [p for p in report["problems"] if "lock" in p], report["problems"]
    r0.close()


# --- 5. two processes of one node starting together on a fresh host ---------------------

def _start_and_contend(spec, node, local_dir, tag, barrier):
    os.environ["CXLRT_LOCAL_DIR"] = local_dir
    barrier.wait()
    return _overlap_worker(spec, node, "fresh", tag, 0.15, None)


@pytest.mark.crash
@pytest.mark.slow
def test_two_processes_of_a_node_starting_together_on_a_fresh_host(backend):
    """Scenario 5: each round gives node 1 a new node-local folder (a fresh host) and
    starts two of its processes at the same instant while node 2 contends; the
    first one's cleanup of the node's earlier life must not undo the other's ticket."""
    r0 = backend.create(nodes=3, lease=LEASE)
    r0.lock("fresh")
    rounds = 30 if backend.faulty else 60
    overlaps = 0
    for k in range(rounds):
        local = os.path.join(backend.root, f"host{k}")
        os.makedirs(local)
        barrier = _CTX.Barrier(3)
        args = [(backend.spec(), 1, local, 11, barrier), (backend.spec(), 1, local, 12, barrier),
                (backend.spec(), 2, os.environ["CXLRT_LOCAL_DIR"], 20, barrier)]
        res = raise_failures(run_procs(_start_and_contend, args, timeout=60))
        overlaps += sum(o for _, o, _ in res)
    assert overlaps == 0, f"{overlaps} critical sections overlapped in {rounds} fresh starts"
    r0.close()


# --- 2. a healthy node is never judged dead ----------------------------------------------

def _owner_holds(spec, q, holding, done):
    """Node 0: owns a small object, then holds lock 'x' for a while."""
    r = cxlrt.open(spec, node=0)
    q.put(r.alloc(64))  # an allocator of ours exists, and another node will free into it
    lock = r.lock("x")
    lock.acquire()
    holding.set()
    done.wait()
    return _release_and_close(r, lock)


@pytest.mark.crash
def test_a_slow_peer_cannot_make_a_healthy_node_look_dead(backend, reaper):
    """Scenario 2: node 3 holds the allocator lock for many leases while a free is
    queued for node 0, which holds lock 'x'. Node 0 is healthy: node 2 must not get
    'x' (earlier, node 0's heartbeat waited on the allocator lock and stopped)."""
    r = backend.create(nodes=4, node=1, lease=LEASE)  # node 0 is the child alone
    r.lock("x")
    q, holding, done = _CTX.Queue(), _CTX.Event(), _CTX.Event()
    out = _CTX.Queue()
    p = _CTX.Process(target=_report, args=(out, _owner_holds, backend.spec(), q, holding, done))
    p.start()
    reaper(p)
    obj = q.get(timeout=30)
    d = backend.open(3)
    d.free(obj)  # a remote free: queued for node 0
    alloc_lock = d.locks.builtin(1)
    assert holding.wait(30)
    with alloc_lock:
        (ok, _), = raise_failures(run_procs(_acquire_within,
                                            [(backend.spec(), 2, "x", 6 * LEASE)]))
    done.set()
    assert not ok, "node 2 took lock 'x' from healthy node 0"
    assert out.get(timeout=30) == "released"  # and node 0 was never silent
    p.join(10)
    d.close()
    r.close()


# --- a superseded lock manager never writes again ----------------------------------------

def _run_manager(spec, ready, go, out):
    r = cxlrt.open(spec, node=0, lock_manager=True)
    ready.set()
    go.wait()
    time.sleep(4 * LEASE)  # resumed: time to do damage, if it still granted
    out.put(r.locks.mgr_exit)
    r.close()


@pytest.mark.crash
def test_a_superseded_manager_resumes_and_stays_out(backend, reaper):
    """A manager stalled past the lease is replaced; when it resumes it must stop
    for good, and the locks it used to grant keep one holder at a time."""
    r1 = backend.create(nodes=4, node=1, lease=LEASE)
    r1.lock("m", mode="manager")
    ready, go, out = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    old = _CTX.Process(target=_run_manager, args=(backend.spec(), ready, go, out))
    old.start()
    reaper(old)
    assert ready.wait(30)
    os.kill(old.pid, signal.SIGSTOP)
    time.sleep(3 * LEASE)
    r1.start_lock_manager()  # takes over: node 0 is silent past its lease
    assert r1.locks.manager_info()["node"] == 1
    os.kill(old.pid, signal.SIGCONT)
    go.set()
    barrier = _CTX.Barrier(2)
    res = raise_failures(run_procs(_overlap_worker, [
        (backend.spec(), 2, "m", 2, 1.5, barrier), (backend.spec(), 3, "m", 3, 1.5, barrier)]))
    assert sum(o for _, o, _ in res) == 0, f"two holders of a manager lock: {res}"
    assert all(n > 0 for n, _, _ in res), res
    assert "superseded" in (out.get(timeout=30) or ""), "the old manager kept running"
    assert r1.locks.manager_info()["node"] == 1
    old.join(10)
    r1.close()


def _manager_stopping_at_grant(spec, ready, out):
    from cxlrt import crash
    crash.arm("lock.mgr.grant", "stop", 1)  # stops itself before its first grant store
    r = cxlrt.open(spec, node=0, lock_manager=True)
    ready.set()
    while crash.hits() < 1:
        time.sleep(0.01)
    time.sleep(4 * LEASE)  # resumed: its stale grant store has happened by now
    out.put(r.locks.mgr_exit)
    r.close()


def _tagged_hold(spec, node, tag, hold, asking, held, out):
    """Take lock "m" once, stamp our tag, hold; report whether the tag survived."""
    r = cxlrt.open(spec, node=node)
    r.locks.manager_wait = 60  # no manager passes while the test stalls the first one
    lock = r.lock("m")
    off = r.heap[0]
    asking.set()
    assert lock.acquire(timeout=60)
    r.flush(off, 8)
    r.store64(off, tag)
    r.persist(off, 8)
    held.set()
    end = time.monotonic() + hold
    seen = tag
    while time.monotonic() < end and seen == tag:
        time.sleep(0.005)
        r.flush(off, 8)
        seen = r.load64(off)
    lock.release()
    out.put((tag, seen))
    r.close()


@pytest.mark.crash
def test_a_manager_stopped_before_its_grant_store_never_grants_a_second_holder(backend, reaper):
    """Manager M1 decides to grant node 3 and stops just before the store. M2 takes
    over and grants node 2, which holds. M1 resumes and its one store lands (coherent
    memory) or is refused (the emulation): node 3 must not hold while node 2 does,
    and M1 must find itself superseded. The first design re-issued that stale word."""
    r1 = backend.create(nodes=4, node=1, lease=LEASE)
    r1.lock("m", mode="manager")
    ready, out = _CTX.Event(), _CTX.Queue()
    old = _CTX.Process(target=_manager_stopping_at_grant, args=(backend.spec(), ready, out))
    old.start()
    reaper(old)
    assert ready.wait(30)
    ev = {k: _CTX.Event() for k in ("a_ask", "a_held", "b_ask", "b_held")}
    held = _CTX.Queue()
    b = _CTX.Process(target=_tagged_hold, args=(backend.spec(), 3, 3, 0.2, ev["b_ask"],
                                                ev["b_held"], held))
    b.start()
    reaper(b)
    deadline = time.monotonic() + 30
    while not _stopped(old.pid):  # M1 stopped itself about to grant node 3
        assert time.monotonic() < deadline, "the manager never reached its grant"
        time.sleep(0.01)
    a = _CTX.Process(target=_tagged_hold, args=(backend.spec(), 2, 2, 6 * LEASE, ev["a_ask"],
                                                ev["a_held"], held))
    a.start()
    reaper(a)
    assert ev["a_ask"].wait(30)
    time.sleep(3 * LEASE)  # node 2 is asking, and M1 silent past its lease
    r1.start_lock_manager()
    assert ev["a_held"].wait(30), "the new manager never granted node 2"
    assert not ev["b_held"].is_set()
    os.kill(old.pid, signal.SIGCONT)
    results = dict(held.get(timeout=60) for _ in range(2))
    assert results[2] == 2, f"node 3 held the lock while node 2 did ({results})"
    assert "superseded" in (out.get(timeout=30) or ""), "the old manager did not stop"
    for p in (a, b, old):
        p.join(10)
    r1.close()


# --- two hosts attaching as one node -----------------------------------------------------

def _attach_elsewhere(spec, node, local_dir):
    os.environ["CXLRT_LOCAL_DIR"] = local_dir  # another host: its own node-local state
    t0 = time.monotonic()
    try:
        r = cxlrt.open(spec, node=node)
    except cxlrt.RegionError as e:
        return "refused", str(e), time.monotonic() - t0
    inc = r.liveness.incarnation
    r.close()
    return "attached", inc, time.monotonic() - t0


def _live_node(spec, node, ready, go, out):
    r = cxlrt.open(spec, node=node)
    lock = r.lock("n")
    ready.set()
    go.wait()
    try:
        lock.acquire(timeout=5)
        lock.release()
        out.put("acquired")
    except LeaseLost as e:
        out.put(f"LeaseLost: {e}")
    r.close()


@pytest.mark.crash
def test_a_second_host_attaching_as_a_live_node_is_refused(backend, reaper):
    r0 = backend.create(nodes=3, lease=LEASE)
    r0.lock("n")
    ready, go, out = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    p = _CTX.Process(target=_live_node, args=(backend.spec(), 1, ready, go, out))
    p.start()
    reaper(p)
    assert ready.wait(30)
    other = os.path.join(backend.root, "other-host")
    os.makedirs(other)
    (what, msg, _), = raise_failures(run_procs(_attach_elsewhere, [(backend.spec(), 1, other)]))
    assert what == "refused" and "alive" in msg and "node id" in msg, (what, msg)
    # Stalled past the lease, the node is taken over by the other host; when the
    # stalled process resumes it is fenced: it takes no lock as node 1 any more.
    os.kill(p.pid, signal.SIGSTOP)
    (what, inc, took), = raise_failures(run_procs(_attach_elsewhere, [(backend.spec(), 1, other)]))
    assert what == "attached" and inc == 2, (what, inc)
    assert took < LEASE + 2.0, took
    os.kill(p.pid, signal.SIGCONT)
    go.set()
    assert out.get(timeout=30).startswith("LeaseLost")
    p.join(10)
    r0.close()


# --- many nodes ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mutual_exclusion_16_nodes(backend, mode):
    nodes = 16
    r0 = backend.create(nodes=nodes, size="8M", lease=2.0, lock_manager=(mode == "manager"))
    r0.lock("m16", mode=mode)
    barrier = _CTX.Barrier(nodes - 1)
    res = raise_failures(run_procs(
        _overlap_worker, [(backend.spec(), n, "m16", 100 + n, 1.0, barrier)
                          for n in range(1, nodes)], timeout=240))
    assert sum(o for _, o, _ in res) == 0, res
    assert sum(lost for _, _, lost in res) == 0, res
    assert all(n > 0 for n, _, _ in res), res  # nobody starved
    r0.close()
