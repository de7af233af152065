"""The two-tier lock, written once, on every backend, in both global modes."""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import threading
import time

import pytest

import cxlrt
from tests.nodes import _CTX, raise_failures, run_procs

MODES = ["bakery", "manager"]


def _counter_worker(spec, node, mode, iters, use_lock, barrier):
    r = cxlrt.open(spec, node=node)
    lock = r.lock("counter", mode=mode)
    off = r.heap[0]
    barrier.wait()  # everyone contends from the first increment
    try:
        for _ in range(iters):
            if use_lock:
                lock.acquire()
            try:
                r.flush(off, 8)              # observe
                v = r.load64(off)
                os.sched_yield()             # invite a competitor into the window
                r.store64(off, v + 1)
                r.persist(off, 8)            # publish before release
            finally:
                if use_lock:
                    lock.release()
    except cxlrt.CoherenceError as e:
        return e
    finally:
        stats = r.stats()
        r.close()
    return stats


def _setup(backend, mode, nodes=4):
    r0 = backend.create(nodes=nodes, lock_manager=(mode == "manager"))
    r0.dma_write(r0.heap[0], bytes(64))  # a device keeps old heap bytes across formats
    r0.lock("counter", mode=mode)
    return r0


@pytest.mark.parametrize("mode", MODES)
def test_mutual_exclusion_4_nodes_2_procs_each(backend, mode):
    nodes, per_node, iters = 4, 2, 1000
    r0 = _setup(backend, mode, nodes)
    barrier = _CTX.Barrier(nodes * per_node)
    args = [(backend.spec(), n, mode, iters, True, barrier) for n in range(nodes)
            for _ in range(per_node)]
    res = raise_failures(run_procs(_counter_worker, args, timeout=240))
    assert not [e for e in res if isinstance(e, cxlrt.CoherenceError)], res
    assert backend.medium_word(r0.heap[0]) == nodes * per_node * iters
    acq = r0.lock("counter").acquisitions()
    assert acq == [per_node * iters] * nodes, acq  # every node got every turn it asked for
    if backend.faulty:
        assert sum(s["evictions"] for s in res) > 0
    r0.close()


@pytest.mark.parametrize("spin", [0.0, 0.05])
def test_manager_grants_whether_it_spins_or_sleeps(backend, spin):
    """spin 0: a ~20 us sleep between passes; 0.05: passes back to back while busy."""
    nodes, iters = 3, 300
    r0 = backend.create(nodes=nodes)
    r0.dma_write(r0.heap[0], bytes(64))
    r0.lock("counter", mode="manager")
    r0.start_lock_manager(spin=spin)
    assert r0.locks.manager_spin == spin
    barrier = _CTX.Barrier(nodes)
    args = [(backend.spec(), n, "manager", iters, True, barrier) for n in range(nodes)]
    res = raise_failures(run_procs(_counter_worker, args, timeout=240))
    assert not [e for e in res if isinstance(e, cxlrt.CoherenceError)], res
    assert backend.medium_word(r0.heap[0]) == nodes * iters
    assert r0.lock("counter").acquisitions() == [iters] * nodes
    pace = r0.locks.manager_info()
    assert pace["spin"] == spin and pace["sleeps"] > 0  # idle before and after the run
    if spin:
        assert pace["yields"] > 0, pace  # grants changing hands kept it spinning
    else:
        assert pace["yields"] == 0, pace
    for bad in (-1, float("inf"), float("nan"), 1e12):
        with pytest.raises(ValueError, match="manager_spin must be 0..3600"):
            r0.locks.manager_spin = bad
    r0.close()


@pytest.mark.parametrize("mode", MODES)
def test_skipping_the_lock_loses_updates(backend, mode, emu_only):
    """Negative control: the same workload without the lock must fail."""
    nodes, per_node, iters = 4, 2, 3000
    r0 = _setup(backend, mode, nodes)
    barrier = _CTX.Barrier(nodes * per_node)
    args = [(backend.spec(), n, mode, iters, False, barrier) for n in range(nodes)
            for _ in range(per_node)]
    res = run_procs(_counter_worker, args, timeout=240)
    caught = [e for e in res if isinstance(e, cxlrt.CoherenceError)]
    final = backend.medium_word(r0.heap[0])
    assert caught or final < nodes * per_node * iters, (final, backend.seed)
    r0.close()


class _PassOverLock:
    """The negative control: a lock that serves node 3 only once the other nodes have
    stopped contending, as a lock that always prefers them would. Judged by the same
    measure, on a loaded machine too (an flock that merely backs node 3 off was not:
    under load its spinners lose their cores and node 3 gets its share)."""

    def __init__(self, path, node):
        self.path, self.node = path, node
        self.fd = os.open(path, os.O_RDWR)

    def __enter__(self):
        while self.node == 3 and not all(os.path.exists(f"{self.path}.done{n}") for n in range(3)):
            time.sleep(0.001)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def done(self):
        open(f"{self.path}.done{self.node}", "w").close()


def _timed_worker(spec, node, mode, seconds, barrier, seq):
    """Acquire and release for `seconds`; (node, acquisitions, median and max bypass).

    A bypass is how many acquisitions of other nodes came between our call to
    acquire and our entry: `seq` counts every entry, under the lock.
    """
    if mode == "pass-over":
        r, lock = None, _PassOverLock(spec, node)
    else:
        r = cxlrt.open(spec, node=node)
        lock = r.lock("fair", mode=mode)
    barrier.wait()
    end = time.monotonic() + seconds
    bypasses = []
    while time.monotonic() < end:
        before = seq.value
        with lock:
            got = seq.value
            seq.value = got + 1
        bypasses.append(got - before)
    if r is not None:
        r.close()
    else:
        lock.done()
    bypasses.sort()
    return node, len(bypasses), bypasses[len(bypasses) // 2], bypasses[-1]


NODES = 4


@pytest.mark.parametrize("mode", MODES)
def test_no_node_starves_under_contention(backend, mode):
    """Four nodes take the lock in a loop for 1.5 s; none may get under a fifth of the
    mean share. A machine with two cores and other work beside the suite can leave one
    process without a core for most of a run (CI saw {0: 5213, 1: 354, 2: 5214, 3: 5213},
    where the median bypass tells whether its waits were passed over), so a lock fails
    only when a node starves in each of three runs: an unfair protocol starves it every
    time."""
    r0 = backend.create(nodes=NODES, lock_manager=(mode == "manager"))
    r0.lock("fair", mode=mode)
    runs = []
    for _ in range(3):
        got = _bypasses(backend.spec(), mode)
        print(f"(acquisitions, median bypass, worst bypass) per node ({mode}, "
              f"{backend.name}): {got}")
        runs.append(got)
        if not _starved(got):
            break
    else:
        pytest.fail(f"a node starved in each of three runs: {runs}")
    r0.close()


def _bypasses(spec, mode):
    barrier = _CTX.Barrier(NODES)
    seq = _CTX.RawValue("q", 0)
    res = raise_failures(run_procs(_timed_worker, [(spec, n, mode, 1.5, barrier, seq)
                                                   for n in range(NODES)]))
    got = {node: (n, median, worst) for node, n, median, worst in res}
    assert sum(n for n, _, _ in got.values()) == seq.value  # every entry counted once
    return got


def _starved(got):
    """The nodes that took under a fifth of the mean share of entries."""
    mean = sum(n for n, _, _ in got.values()) / len(got)
    return [node for node, (n, _, _) in got.items() if n < 0.2 * mean]


def test_the_starvation_measure_catches_a_lock_that_passes_a_node_over(tmp_path):
    path = tmp_path / "flock"
    path.touch()
    got = _bypasses(str(path), "pass-over")
    assert _starved(got) == [3], got


def _hold_and_die(spec, node, mode):
    r = cxlrt.open(spec, node=node)
    lock = r.lock("crash", mode=mode)
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _acquire_after(spec, node, mode, timeout):
    r = cxlrt.open(spec, node=node)
    lock = r.lock("crash", mode=mode)
    t0 = time.monotonic()
    ok = lock.acquire(timeout=timeout)
    waited = time.monotonic() - t0
    # Taken over either by our acquire itself or by our heartbeat's first sweep.
    recovered = lock.recovered or r.locks.local.lock_slot(lock.index)["recovered"] > 0
    if ok:
        lock.release()
    r.close()
    return ok, waited, recovered


@pytest.mark.crash
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["node-alone", "sibling-beats", "sibling-waits"])
def test_holder_killed_is_recovered_within_the_bound(backend, mode, case):
    """node-alone: the dead process was its node's only one, so the lease expires;
    sibling-beats: another process of its node is attached, and its heartbeat thread
    clears the hold; sibling-waits: a new process of its node is the one waiting, and
    takes the dead holder's robust mutex over itself."""
    lease = 0.5
    r0 = backend.create(nodes=3, lease=lease, lock_manager=(mode == "manager"))
    r0.lock("crash", mode=mode)
    sibling = None
    if case == "sibling-beats":
        sibling = cxlrt.open(backend.spec(), node=1)  # a live process of the dead one's node
        sibling.locks  # noqa: B018  (starts its heartbeat thread)
    p = _CTX.Process(target=_hold_and_die, args=(backend.spec(), 1, mode))
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    waiter = 1 if case == "sibling-waits" else 2
    (ok, waited, recovered), = raise_failures(
        run_procs(_acquire_after, [(backend.spec(), waiter, mode, 10 * lease + 5)]))
    assert ok, f"lock not recovered after a holder died ({mode}, {case})"
    bound = lease + 1.5  # lease + heartbeat period + observation slack on a loaded 2-core box
    assert waited < bound, f"recovery took {waited:.2f}s (bound {bound}s)"
    if case == "sibling-waits":
        assert recovered  # the waiter's process took over the dead holder's mutex
    if case == "sibling-beats":
        index = sibling.lock("crash").index
        assert sibling.locks.local.lock_slot(index)["recovered"] >= 1
    if sibling is not None:
        sibling.close()
    r0.close()


@pytest.mark.crash
@pytest.mark.parametrize("mode", MODES)
def test_node_restarted_elsewhere_withdraws_its_old_ticket(backend, mode):
    """The holder's host is gone (node-local file lost) and a new process takes the node
    id on another host. It cannot know the old host is gone before the old life has
    been silent for a lease, so it watches for that long (an open that may not wait so
    long is refused, saying how), then clears the old hold at once: waiters do not
    wait for the lease a second time."""
    from cxlrt.nodelocal import local_path
    lease = 3.5  # longer than an open watches by default (3 s)
    r0 = backend.create(nodes=3, lease=lease, lock_manager=(mode == "manager"))
    r0.lock("crash", mode=mode)
    p = _CTX.Process(target=_hold_and_die, args=(backend.spec(), 1, mode))
    p.start()
    p.join()
    os.unlink(local_path(r0.uuid, 1))  # "another host": no node-local state survives
    with pytest.raises(cxlrt.RegionError, match="wait="):
        cxlrt.open(backend.spec(), node=1)
    t0 = time.monotonic()
    reborn = cxlrt.open(backend.spec(), node=1, wait=lease + 2)
    assert lease * 0.9 < time.monotonic() - t0 < lease + 2
    assert reborn.liveness.incarnation == 2
    (ok, waited, _), = raise_failures(
        run_procs(_acquire_after, [(backend.spec(), 2, mode, 10.0)]))
    assert ok and waited < 2.0, waited  # cleared by the new life, not expired again
    reborn.close()
    r0.close()


@pytest.mark.parametrize("mode", MODES)
def test_timeout_withdraws_cleanly(backend, mode):
    a = backend.create(nodes=3, lock_manager=(mode == "manager"))
    b = backend.open(1)
    c = backend.open(2)
    la, lb, lc = a.lock("t", mode=mode), b.lock("t"), c.lock("t")
    assert la.acquire()
    t0 = time.monotonic()
    assert lb.acquire(timeout=0.2) is False
    assert 0.15 < time.monotonic() - t0 < 5
    la.release()
    assert lc.acquire(timeout=5)  # b's withdrawn ticket/request does not block c
    assert la.locked() and lc.held_by_me() and not lb.held_by_me()
    lc.release()
    assert not la.locked()
    for r in (a, b, c):
        r.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_waiter_whose_region_closes_gives_up_with_a_clear_error(backend, mode):
    """Close() while another thread of the process waits for a lock: the waiter must
    not go on to "acquire" through a closed region (on a direct mapping its words no
    longer check anything: the mapping is retired, and reads as zeros)."""
    a = backend.create(nodes=2, lock_manager=(mode == "manager"))
    b = backend.open(1)
    la, lb = a.lock("w", mode=mode), b.lock("w")
    assert la.acquire()
    out = []

    def wait():
        try:
            out.append(lb.acquire(timeout=20))
        except Exception as e:  # what the waiter saw is the result
            out.append(e)

    t = threading.Thread(target=wait)
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive() and not out  # it waits on a's hold
        b.close()
        t.join(10)
        assert not t.is_alive(), "the waiter did not notice its region close"
        assert len(out) == 1 and isinstance(out[0], cxlrt.RegionClosedError), out
    finally:
        la.release()
        t.join(30)
        b.close()
        a.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_region_closed_under_its_waiters_leaves_the_lock_usable(backend, mode):
    """Two waiters of node 1 in one process, one in the global tier (it holds the
    node-local mutex) and one on that mutex, each round, three rounds: close() must let
    both leave through the live mapping. A waiter that let go of the mutex through a
    retired mapping left the real one owned, and the next life of node 1 in this
    process waited on it until its timeout."""
    a = backend.create(nodes=2, lock_manager=(mode == "manager"))
    la = a.lock("w", mode=mode)
    assert la.acquire()
    try:
        for rnd in range(3):
            b = backend.open(1)
            lb = b.lock("w")
            out = []

            def wait(lb=lb, out=out):
                try:
                    out.append(lb.acquire(timeout=20))
                except Exception as e:  # what the waiter saw is the result
                    out.append(e)

            ts = [threading.Thread(target=wait) for _ in range(2)]
            for t in ts:
                t.start()
            time.sleep(0.2)
            assert not out, (rnd, out)
            t0 = time.monotonic()
            b.close()
            assert time.monotonic() - t0 < 5, "close() waited out a waiter's timeout"
            for t in ts:
                t.join(5)
            assert not any(t.is_alive() for t in ts), f"round {rnd}: a waiter is still waiting"
            assert len(out) == 2 and all(isinstance(x, cxlrt.RegionClosedError) for x in out), \
                (rnd, out)
    finally:
        la.release()
    b = backend.open(1)
    lb = b.lock("w")
    t0 = time.monotonic()
    assert lb.acquire(timeout=5), "node 1's lock was left held by a closed life"
    assert time.monotonic() - t0 < 2
    lb.release()
    b.close()
    assert la.acquire(timeout=5)
    la.release()
    a.close()


def test_close_while_this_thread_holds_a_lock_is_refused(backend):
    """Nothing else could give the hold back: pthread mutexes are released by their
    owner only, so a closed life would leave the lock held by a thread that never
    returns to it."""
    r = backend.create(nodes=2)
    lock = r.lock("h")
    lock.acquire()
    with pytest.raises(cxlrt.RegionError, match="'h' is held by this thread"):
        r.close()
    assert not r.closed and lock.held_by_me()
    lock.release()
    r.close()
    r2 = backend.open(0)
    l2 = r2.lock("h")
    assert l2.acquire(timeout=2)  # free, not "already held by this thread"
    l2.release()
    r2.close()


def test_close_waits_for_another_threads_hold(backend):
    r = backend.create(nodes=2)
    lock = r.lock("h")
    held, done = threading.Event(), []

    def hold():
        with lock:
            held.set()
            time.sleep(0.5)
        done.append(time.monotonic())

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    r.close()  # returns once the holder has released
    closed_at = time.monotonic()
    t.join(5)
    assert done and done[0] <= closed_at
    r2 = backend.open(0)
    l2 = r2.lock("h")
    assert l2.acquire(timeout=2)
    l2.release()
    r2.close()


def test_lock_misuse_is_a_clear_error(backend):
    r = backend.create(nodes=2)
    lock = r.lock("x")
    with lock:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            lock.acquire()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()
    with pytest.raises(ValueError, match="fixed when it is created"):
        r.lock("x", mode="manager")
    with pytest.raises(ValueError, match="bakery' or 'manager"):
        r.lock("y", mode="spin")
    for bad in ("", "n" * 41):
        with pytest.raises(ValueError, match="1..40 bytes"):
            r.lock(bad)
    r.close()


# --- a manager-mode lock with no manager ------------------------------------------------

def test_manager_lock_with_no_manager_raises_instead_of_waiting_for_ever(backend):
    r = backend.create(nodes=2, lease=0.1)
    lock = r.lock("m", mode="manager")
    r.locks.manager_wait = 0.3
    t0 = time.monotonic()
    with pytest.raises(cxlrt.NoLockManager, match="no manager was ever started"):
        lock.acquire()
    assert 0.3 <= time.monotonic() - t0 < 10
    assert lock.acquire(timeout=0.05) is False  # a shorter timeout still just times out
    r.start_lock_manager()
    assert lock.acquire(timeout=5)
    lock.release()
    r.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _manager_then_wait(spec, ready, go):
    for attempt in range(3):
        try:
            r = cxlrt.open(spec, node=1, lock_manager=True)
            break
        except cxlrt.LeaseLost as e:
            # This process stalled past the 0.5 s lease while it claimed the manager
            # role (CI saw "no beat published for 1.547 s" beside the lab's guests): a
            # loaded host, not what this test is about. open() closed the region.
            print(f"manager start {attempt + 1} of 3: {e}", file=sys.stderr)
            if attempt == 2:
                raise
    ready.set()
    go.wait(60)
    r.close()


def test_a_waiter_gives_up_on_a_stopped_manager_but_not_on_a_running_one(backend):
    """A running manager's passes keep a long wait going; once its process is stopped
    (and nobody takes over), the waiter raises after manager_wait. The lease is long
    enough for the live holder's beats: at 0.1 s a heartbeat 100 ms late on a busy
    2-vCPU host made the manager revoke its grant, and the waiter got the lock."""
    r = backend.create(nodes=3, lease=0.5)
    lock = r.lock("m", mode="manager")
    ready, go = _CTX.Event(), _CTX.Event()
    mgr = _CTX.Process(target=_manager_then_wait, args=(backend.spec(), ready, go))
    mgr.start()
    try:
        assert ready.wait(30)
        holder = cxlrt.open(backend.spec(), node=2)
        held = holder.lock("m")
        assert held.acquire(timeout=10)
        r.locks.manager_wait = 0.5
        assert lock.acquire(timeout=1.5) is False  # 3 x manager_wait behind a live holder
        held.release()
        assert lock.acquire(timeout=10)
        assert held.acquire(timeout=0.05) is False
        os.kill(mgr.pid, signal.SIGSTOP)
        while _state(mgr.pid) != "T":  # stopped for real, not just signalled
            time.sleep(0.005)
        lock.release()
        with pytest.raises(cxlrt.NoLockManager, match="node 1"):
            held.acquire(timeout=30)  # holder's region kept the default wait: 3 s
        holder.close()
    finally:
        os.kill(mgr.pid, signal.SIGCONT)
        go.set()
        mgr.join(30)
    r.close()


def test_a_close_during_a_heap_section_leaves_the_heap_usable(backend):
    """The allocator's node-local heap mutex is in the same file as the lock slots. A
    close() during a long trim() (remote frees applied under that mutex) must not
    retire the mapping under it: the trim let go of the mutex through the retired
    copy, the real one stayed owned by its exited thread, and node 0's allocator hung
    in every process. Now the trim finishes, or stops with a clear error, and the next
    life allocates at once; the region checks clean."""
    from cxlrt.check import check
    r0 = backend.create(nodes=2, size="64M")
    r1 = backend.open(1)
    n, overlapped = 20000, False
    while not overlapped and n <= 320000:
        offs = [r0.alloc(64) for _ in range(n)]
        for o in offs:
            r1.free(o)  # queued for node 0, applied by its trim() under the heap mutex
        span = {}

        def trim(span=span, r0=r0):
            span["t0"] = time.monotonic()
            try:
                span["rc"] = r0.trim()
            except Exception as e:  # what the trim saw is the result
                span["rc"] = e
            span["t1"] = time.monotonic()

        t = threading.Thread(target=trim)
        t.start()
        while "t0" not in span:
            time.sleep(0.0005)
        time.sleep(0.002)
        if "t1" not in span:  # the trim is running: close under it
            r0.close()
            overlapped = True
        t.join(30)
        assert not t.is_alive(), "the trim hung"
        assert span["rc"] is None or isinstance(span["rc"], cxlrt.CxlrtError), span["rc"]
        if overlapped:
            r0 = backend.open(0)
        n *= 2
    assert overlapped, "no trim long enough to overlap a close (machine too fast?)"
    got = []
    a = threading.Thread(target=lambda: got.append(r0.alloc(64)), daemon=True)
    a.start()
    a.join(5)
    assert got, "node 0's heap mutex is still owned by the exited trim thread"
    r0.trim()
    r0.close()
    r1.close()
    assert check(backend.spec())["problems"] == []


_LEAK = """
import sys, cxlrt
if sys.argv[2] == "raise":
    with cxlrt.open(sys.argv[1], node=0) as r:
        r.lock("y").acquire()
        raise ValueError("user bug between acquire and release")
r = cxlrt.open(sys.argv[1], node=0)
r.lock("y").acquire()  # and the interpreter exits holding it, the region never closed
"""


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_hold_a_process_leaves_behind_is_recovered(backend, how):
    """An exception between acquire and release inside `with cxlrt.open(...)`, or an
    exit while holding: the user's exception comes out (not a refusal of close), and
    the next process of the node gets the lock. The node-local file must stay mapped
    until the process exits, so the kernel marks the mutex owner-dead; unmapped at
    close or at exit, it stayed owned by the dead thread for good."""
    import subprocess
    import sys
    r = backend.create(nodes=2)
    r.lock("y")
    p = subprocess.run([sys.executable, "-c", _LEAK, backend.spec(), how], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ))
    if how == "raise":
        assert p.returncode == 1 and "ValueError: user bug" in p.stderr, p.stderr[-800:]
        assert "RegionError" not in p.stderr, p.stderr[-800:]
    else:
        assert p.returncode == 0, p.stderr[-800:]
    lk = r.lock("y")
    t0 = time.monotonic()
    assert lk.acquire(timeout=5), "the hold of a dead process was never recovered"
    assert time.monotonic() - t0 < 3
    lk.release()
    r.close()
