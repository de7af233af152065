"""Channel roles under failure (issue 9, scenario 8), on every backend.

A role (producer or consumer) is taken over only when its owner is certainly
gone; an owner that was taken over while stalled fails on its next publish
instead of writing; and nothing a send() acknowledged is lost or received
twice, across kills and stalls at every ``chan.*`` crash point.

Processes: the test process creates the region as the last node; the owner
under test runs in a forked child, alone on its node, so that stopping the
child also stops its node's heartbeat. Claimants in another pid namespace run
under ``unshare --pid --fork --mount-proc``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import cxlrt
import cxlrt.crash
from cxlrt.channel import Channel, ChannelBusyError
from cxlrt.liveness import pid_namespace
from tests.nodes import _CTX

LEASE = 0.5                     # seconds: the regions of these tests judge nodes fast
BOUND = 2 * LEASE + 2.0         # a takeover must succeed within this after the owner is gone
NAME = "roles"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.crash


def _msg(tag: str, i: int) -> bytes:
    return f"{tag}{i:06d}".encode()


def _setup(backend, nodes=4, slots=4):
    """Region of `nodes` nodes (this process is the last one) and the channel."""
    r = backend.create(nodes=nodes, node=nodes - 1, lease=LEASE)
    ch = Channel(r, NAME, slots=slots, msg_bytes=64)
    return r, ch


def _wait_state(pid: int, want: str, timeout: float = 20.0) -> None:
    """Wait until process `pid` is in /proc state `want` ('T' stopped, 'Z'/gone dead)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
            state = raw[raw.rindex(b")") + 2:].split()[0].decode()
        except OSError:
            state = "gone"
        if state == want or (want == "Z" and state == "gone"):
            return
        if state in ("Z", "gone"):
            break  # it ended without reaching the crash point
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {want!r} (crash point not hit?)")


def _take(ch, op, deadline):
    """Retry `op()` while the role is busy; (result, seconds it took)."""
    t0 = time.monotonic()
    while True:
        try:
            return op(), time.monotonic() - t0
        except ChannelBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


# --- children -------------------------------------------------------------------------------

def _owner(role, spec, node, count, done, arm, pause_at, ready, go, gap, conn):
    """As `role`, send P0, P1, ... (`gap` s apart) or receive, `count` times; a producer
    then sends one more (which raises once it was taken over). `done` counts the calls
    that returned. Reports (messages received, first error or None)."""
    out, err = [], None
    try:
        r = cxlrt.open(spec, node=node)
        ch = Channel(r, NAME, slots=None, msg_bytes=None, create=False)
        if arm:
            cxlrt.crash.arm(*arm)
        for i in range(count + (role == "producer")):
            if i == pause_at:
                ready.set()
                go.wait(60)
            if role == "producer":
                ch.send(_msg("P", i), timeout=30 if i < count else 5)
            else:
                out.append(ch.recv(timeout=30))
            done.value = i + 1
            if gap:
                time.sleep(gap)
    except Exception as e:
        err = _error(e)
    conn.send((out, err))
    conn.close()


def _drainer(spec, node, end, conn):
    """Consumer for producer tests: receive until message `end`, then drain briefly."""
    out, err = [], None
    try:
        r = cxlrt.open(spec, node=node)
        ch = Channel(r, NAME, slots=None, msg_bytes=None, create=False)
        while True:
            m = ch.recv(timeout=60)
            out.append(m)
            if m == end:
                break
        t = time.monotonic() + 0.3
        while time.monotonic() < t:
            m = ch.try_recv()
            if m is not None:
                out.append(m)
            else:
                time.sleep(0.01)
        ch.close()
        r.close()
    except Exception as e:
        err = _error(e)
    conn.send((out, err))
    conn.close()


def _start(fn, *args):
    parent, child = _CTX.Pipe(duplex=False)
    p = _CTX.Process(target=fn, args=(*args, child), daemon=True)
    p.start()
    child.close()
    return p, parent


def _result(p, conn, timeout=60):
    assert conn.poll(timeout), f"child {p.pid} did not report"
    out = conn.recv()
    p.join(10)
    return out


def _take_over_stalled(ch, prod, pconn, go, sends, cons, cconn, end):
    """`prod` is stopped: take its producer role with T0 .. T<sends-1>, resume it, let
    it finish, then send `end` to the drainer `cons`. (seconds from now to the
    takeover, producer's error, messages received, consumer's error)"""
    stopped_at = time.monotonic()
    try:
        _, took = _take(ch, lambda: ch.send(_msg("T", 0), timeout=10), stopped_at + BOUND)
        for j in range(1, sends):
            ch.send(_msg("T", j), timeout=10)
    except TimeoutError as e:
        raise AssertionError(f"{e}; drainer: {_result(cons, cconn, 5)}") from e
    finally:
        os.kill(prod.pid, signal.SIGCONT)
        go.set()
    _, perr = _result(prod, pconn)
    try:
        ch.send(end, timeout=10)
    except TimeoutError as e:  # the drainer stopped taking: say why
        raise AssertionError(f"{e}; drainer: {_result(cons, cconn, 5)}") from e
    got, cerr = _result(cons, cconn)
    return took, perr, got, cerr


# --- pid namespaces ---------------------------------------------------------------------------

_NS_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["CXLRT_TEST_ROOT"])
import cxlrt
from cxlrt.channel import Channel, ChannelBusyError
from cxlrt.liveness import pid_namespace
a = json.loads(sys.argv[1])
out = {"pid": os.getpid(), "pidns": pid_namespace(), "busy": 0, "error": None}
r = cxlrt.open(a["spec"], node=a["node"])
ch = Channel(r, a["name"], slots=None, msg_bytes=None, create=False)
t0 = time.monotonic()


def first(op):  # op() once the role can be taken: retried while busy, up to the bound
    while True:
        try:
            v = op()
            out["took"] = time.monotonic() - t0
            return v
        except ChannelBusyError:
            out["busy"] += 1
            if time.monotonic() - t0 > a["bound"]:
                raise
            time.sleep(0.02)


try:
    if a["mode"] == "claim":        # try to take the producer role for `for` seconds
        out["sent"] = False
        while time.monotonic() - t0 < a["for"]:
            try:
                ch.send(b"intruder", timeout=1)
                out["sent"] = True
                break
            except ChannelBusyError as e:
                out["busy"] += 1
                out["last"] = str(e)
                time.sleep(0.02)
    elif a["mode"] == "produce":    # take the producer role, then send `count` messages
        def msg(i):
            return ("%s%06d" % (a["tag"], i)).encode()
        out["acked"] = 0
        first(lambda: ch.send(msg(0), timeout=10))
        out["acked"] = 1
        for i in range(1, a["count"]):
            ch.send(msg(i), timeout=10)
            out["acked"] = i + 1
    elif a["mode"] == "die":        # take the producer role, send one message, then die
        ch.send(b"last", timeout=10)
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # no close: the role stays claimed by a process that is gone
    elif a["mode"] == "consume":    # take the consumer role, then receive `count` messages
        got = [first(lambda: ch.recv(timeout=10).decode())]
        while len(got) < a["count"]:
            got.append(ch.recv(timeout=10).decode())
        out["got"] = got
except Exception as e:
    out["error"] = [type(e).__name__, str(e)]
ch.close()
r.close()
print("RESULT " + json.dumps(out))
"""


def _unshare_ok() -> str | None:
    """None if this host lets us run a process in a new pid namespace, else why not."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                       capture_output=True, timeout=30)
    if p.returncode != 0:
        return f"unshare --pid refused here: {p.stderr.decode().strip()}"
    return None


_UNSHARE = []


def _in_new_pidns(**args) -> dict:
    """Run _NS_SCRIPT as a process of a new pid namespace on this host; its result."""
    if not _UNSHARE:
        _UNSHARE.append(_unshare_ok())
    if _UNSHARE[0]:
        pytest.skip(_UNSHARE[0])
    env = dict(os.environ, CXLRT_TEST_ROOT=ROOT)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                        _NS_SCRIPT, json.dumps(args)], capture_output=True, timeout=120,
                       env=env, cwd=ROOT)
    lines = [ln for ln in p.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    assert lines, f"pid-namespace claimant failed (rc {p.returncode}):\n{p.stderr.decode()}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("where", ["same-node", "other-node"])
def test_claimant_in_another_pid_namespace_never_takes_a_live_producer(backend, where):
    """hostNetwork pods: same host name, other pid namespace. The claimant must get
    ChannelBusyError for longer than a lease, the producer keeps sending, and the
    consumer receives every message in order."""
    n = 300
    r, ch = _setup(backend, slots=8)
    acked = _CTX.Value("q", 0, lock=False)
    ready, go = _CTX.Event(), _CTX.Event()
    cons, cconn = _start(_drainer, backend.spec(), 1, _msg("P", n - 1))
    # The producer streams for about 3 s, long enough to overlap the whole claimant.
    prod, pconn = _start(_owner, "producer", backend.spec(), 0, n, acked, None, -1, ready, go, 0.01)
    res = _in_new_pidns(spec=backend.spec(), node=0 if where == "same-node" else 2,
                        name=NAME, mode="claim", **{"for": 3 * LEASE})
    _, err = _result(prod, pconn)
    got, cerr = _result(cons, cconn)
    assert res["pidns"] != pid_namespace()
    assert not res.get("sent"), f"a claimant in another pid namespace took the role: {res}"
    assert res["busy"] > 0 and "alive" in res["last"], res
    assert cerr is None, cerr
    assert err is None and acked.value == n + 1, (err, acked.value)
    assert got[:n] == [_msg("P", i) for i in range(n)], "the consumer lost or reordered messages"
    ch.close()
    r.close()


def test_a_dead_owner_in_another_pid_namespace_of_a_live_node_gives_the_role_back(backend):
    """The producer runs in another pid namespace of our node and dies without close().
    The node beats on (this process is attached as it), so neither a pid nor the node's
    heartbeat can tell; the role must still be taken over within the bound."""
    r = backend.create(nodes=3, node=0, lease=LEASE)
    ch = Channel(r, NAME, slots=4, msg_bytes=64)
    res = _in_new_pidns(spec=backend.spec(), node=0, name=NAME, mode="die")
    assert res["pidns"] != pid_namespace() and res["error"] is None, res
    t0 = time.monotonic()
    while True:
        try:
            ch.send(b"ours", timeout=5)
            break
        except ChannelBusyError as e:
            assert time.monotonic() - t0 < BOUND, f"the dead owner's role never came back: {e}"
            time.sleep(0.02)
    cons = Channel(r, NAME, slots=None, msg_bytes=None, create=False)
    assert [cons.recv(timeout=5), cons.recv(timeout=5)] == [b"last", b"ours"]
    cons.close()
    ch.close()
    r.close()


# --- a producer stalled past the lease, then resumed --------------------------------------------

STALL_AT = ["between-sends", "chan.send", "chan.send.post", "chan.claim"]


@pytest.mark.parametrize("where", STALL_AT)
def test_stalled_producer_is_fenced_and_nothing_acknowledged_is_lost(backend, where):
    """Producer P (alone on node 0) is SIGSTOPped past the lease; T (node 3) takes the
    role over after the bound; P resumes: its next send raises. The consumer gets every
    message any send acknowledged, exactly once, in order per producer, nothing else."""
    k = 5  # P's messages before the stall
    r, ch = _setup(backend, slots=4)
    acked = _CTX.Value("q", 0, lock=False)
    ready, go = _CTX.Event(), _CTX.Event()
    if where == "between-sends":
        arm, pause = None, k
    else:
        arm, pause = (where, "stop", 1 if where == "chan.claim" else k + 1), -1
        go.set()
    end = _msg("T", 999999)
    cons, cconn = _start(_drainer, backend.spec(), 2, end)
    prod, pconn = _start(_owner, "producer", backend.spec(), 0, 50, acked, arm, pause, ready, go, 0)
    if where == "between-sends":
        assert ready.wait(30)
        os.kill(prod.pid, signal.SIGSTOP)
    _wait_state(prod.pid, "T")
    p_acked = acked.value
    # T's 7 messages wrap the 4-slot ring past the takeover's hole.
    took, perr, got, cerr = _take_over_stalled(ch, prod, pconn, go, 7, cons, cconn, end)
    assert 0.5 * LEASE <= took <= BOUND, (f"the role was taken {took:.2f} s after the stall "
                                         "(too early: its owner could not be judged dead yet)")
    assert cerr is None, cerr
    assert perr is not None and perr[0] == "ChannelRoleLostError", (
        f"the resumed producer was not stopped: {perr}, acked {acked.value}")
    assert "taken over" in perr[1]
    p_final = acked.value
    assert p_final in (p_acked, p_acked + 1)  # an in-flight send may finish as acknowledged
    want = [_msg("P", i) for i in range(p_final)] + [_msg("T", j) for j in range(7)] + [end]
    assert got == want, f"received {got}, expected {want}"
    ch.close()
    r.close()


STALL_RECV = ["between-recvs", "chan.recv", "chan.recv.post"]


@pytest.mark.parametrize("where", STALL_RECV)
def test_stalled_consumer_is_fenced_and_receives_nothing_twice(backend, where):
    """Consumer C (alone on node 0) stalls past the lease; C2 (node 3) takes over;
    C resumes: its next recv raises. C and C2 together receive every acknowledged
    message exactly once, in order."""
    n, k = 20, 4
    r, ch = _setup(backend, slots=4)
    sent = _CTX.Value("q", 0, lock=False)
    got = _CTX.Value("q", 0, lock=False)
    pready, pgo = _CTX.Event(), _CTX.Event()
    pgo.set()
    ready, go = _CTX.Event(), _CTX.Event()
    if where == "between-recvs":
        arm, pause = None, k
    else:
        arm, pause = (where, "stop", k + 1), -1
        go.set()
    prod, pconn = _start(_owner, "producer", backend.spec(), 1, n, sent, None, -1, pready, pgo, 0)
    cons, cconn = _start(_owner, "consumer", backend.spec(), 0, n, got, arm, pause, ready, go, 0)
    if where == "between-recvs":
        assert ready.wait(30)
        os.kill(cons.pid, signal.SIGSTOP)
    _wait_state(cons.pid, "T")
    stopped_at = time.monotonic()
    mine = []
    try:
        first, took = _take(ch, lambda: ch.recv(timeout=10), stopped_at + BOUND)
        assert took <= BOUND, f"takeover took {took:.2f} s"
        mine.append(first)
        while mine[-1] != _msg("P", n - 1):
            mine.append(ch.recv(timeout=10))
    finally:
        os.kill(cons.pid, signal.SIGCONT)
        go.set()
    theirs, err = _result(cons, cconn)
    _, perr = _result(prod, pconn)
    assert err is not None and err[0] == "ChannelRoleLostError", (theirs, err)
    assert perr is None or perr[0] == "TimeoutError", perr  # its extra send finds no consumer
    assert theirs + mine == [_msg("P", i) for i in range(n)], (theirs, mine)
    ch.close()
    r.close()


# --- SIGKILL at every crash point; a new owner takes over within the bound ----------------------

KILL_PROD = ["chan.claim", "chan.send", "chan.send.post"]
KILL_CONS = ["chan.claim", "chan.recv", "chan.recv.post"]
TAKERS = ["same-node", "other-node", "other-pidns"]


@pytest.mark.parametrize("taker", TAKERS)
@pytest.mark.parametrize("point", KILL_PROD)
def test_producer_killed_at_a_crash_point_is_replaced(backend, point, taker):
    k = 3
    r, ch = _setup(backend, slots=16)
    acked = _CTX.Value("q", 0, lock=False)
    ev = _CTX.Event()
    arm = (point, "kill", 1 if point == "chan.claim" else k + 1)
    prod, pconn = _start(_owner, "producer", backend.spec(), 0, 10, acked, arm, -1, ev, ev, 0)
    _wait_state(prod.pid, "Z")
    prod.join(10)
    assert prod.exitcode == -signal.SIGKILL, f"not killed at {point}: {prod.exitcode}"
    p_acked = acked.value
    deadline = time.monotonic() + BOUND
    m = 5
    if taker == "other-pidns":
        res = _in_new_pidns(spec=backend.spec(), node=1, name=NAME, mode="produce", tag="T",
                            count=m, bound=BOUND)
        assert res["error"] is None and res["acked"] == m, res
        assert res["took"] <= BOUND
    else:
        r2 = backend.open(0) if taker == "same-node" else r
        ch2 = Channel(r2, NAME, slots=None, msg_bytes=None) if taker == "same-node" else ch
        _take(ch2, lambda: ch2.send(_msg("T", 0), timeout=10), deadline)
        for j in range(1, m):
            ch2.send(_msg("T", j), timeout=10)
        if taker == "same-node":
            ch2.close()
            r2.close()
    got = []
    while (x := ch.try_recv()) is not None:
        got.append(x)
    head = [_msg("P", i) for i in range(p_acked)]
    inflight = [_msg("P", p_acked)] if point == "chan.send.post" else []
    assert got == head + inflight + [_msg("T", j) for j in range(m)], got
    ch.close()
    r.close()


@pytest.mark.parametrize("taker", TAKERS)
@pytest.mark.parametrize("point", KILL_CONS)
def test_consumer_killed_at_a_crash_point_is_replaced(backend, point, taker):
    n, k = 10, 3
    r, ch = _setup(backend, slots=16)
    for i in range(n):
        ch.send(_msg("P", i), timeout=10)
    got = _CTX.Value("q", 0, lock=False)
    ev = _CTX.Event()
    arm = (point, "kill", 1 if point == "chan.claim" else k + 1)
    cons, cconn = _start(_owner, "consumer", backend.spec(), 0, n, got, arm, -1, ev, ev, 0)
    _wait_state(cons.pid, "Z")
    cons.join(10)
    assert cons.exitcode == -signal.SIGKILL, f"not killed at {point}: {cons.exitcode}"
    c_got = got.value
    # recv.post: the dead consumer published head for a message it never returned:
    # that message was taken by it (at most once), the rest is for the new consumer.
    start = c_got + (1 if point == "chan.recv.post" else 0)
    rest = n - start
    deadline = time.monotonic() + BOUND
    if taker == "other-pidns":
        res = _in_new_pidns(spec=backend.spec(), node=1, name=NAME, mode="consume", count=rest,
                            bound=BOUND)
        assert res["error"] is None, res
        mine = [x.encode() for x in res["got"]]
    else:
        r2 = backend.open(0) if taker == "same-node" else r
        ch2 = Channel(r2, NAME, slots=None, msg_bytes=None) if taker == "same-node" else ch
        first, _ = _take(ch2, lambda: ch2.recv(timeout=10), deadline)
        mine = [first] + [ch2.recv(timeout=10) for _ in range(rest - 1)]
        assert ch2.try_recv() is None
        if taker == "same-node":
            ch2.close()
            r2.close()
    assert mine == [_msg("P", i) for i in range(start, n)], (c_got, mine)
    ch.close()
    r.close()


# --- the run chain: a consumer far behind many takeovers --------------------------------------

_KEEP = []  # a child's region and channel, alive until it exits (no close, no release)


def _send_one_and_vanish(spec, node, i):
    r = cxlrt.open(spec, node=node)
    ch = Channel(r, NAME, slots=None, msg_bytes=None, create=False)
    try:
        ch.send(_msg("P", i), timeout=5)
    except ChannelBusyError as e:
        return _error(e)
    _KEEP.append((r, ch))
    return None  # exits without close(): the claim stays, its process is gone


def test_a_consumer_behind_many_takeovers_keeps_every_message(backend):
    """Producers on alternating nodes each send one message and die: every takeover
    starts a new run. The consumer, which has received nothing, can still follow the
    chain; a takeover that would overwrite a run line it still needs is refused
    (ChannelBusyError) until it has caught up."""
    from tests.nodes import run_procs
    r, ch = _setup(backend, slots=16)
    runs = cxlrt.channel.RUNS
    for i in range(runs):
        (err,) = run_procs(_send_one_and_vanish, [(backend.spec(), i % 2, i)])
        assert err is None, (i, err)
    assert ch.owner("producer")["run"] == runs - 1
    (err,) = run_procs(_send_one_and_vanish, [(backend.spec(), runs % 2, runs)])
    assert err is not None and err[0] == "ChannelBusyError", err
    assert "consumer has not received past" in err[1]
    assert len(ch) == runs
    assert [ch.recv(timeout=5) for _ in range(runs)] == [_msg("P", i) for i in range(runs)]
    (err,) = run_procs(_send_one_and_vanish, [(backend.spec(), runs % 2, runs)])
    assert err is None, err  # caught up: the line may be reused
    assert ch.recv(timeout=5) == _msg("P", runs)
    assert ch.try_recv() is None
    assert ch.owner("producer")["run"] == runs
    ch.close()
    r.close()


# --- negative control: without the epoch checks the symptom comes back ------------------

@pytest.mark.debug_build
def test_without_epoch_checks_a_stalled_producer_loses_acknowledged_messages(backend):
    """The fencing is what saves the stalled producer's messages: turn the epoch checks
    off in the producer and its sends after the takeover are acknowledged but never
    received (or they overwrite the new producer's), and it is not told."""
    r, ch = _setup(backend, slots=4)
    acked = _CTX.Value("q", 0, lock=False)
    ready, go = _CTX.Event(), _CTX.Event()
    end = _msg("T", 999999)
    cons, cconn = _start(_drainer, backend.spec(), 2, end)
    cxlrt.channel._test_skip_fencing(True)  # inherited by the forked producer only
    try:
        prod, pconn = _start(_owner, "producer", backend.spec(), 0, 8, acked, None, 3, ready, go, 0)
    finally:
        cxlrt.channel._test_skip_fencing(False)
    assert ready.wait(30)
    os.kill(prod.pid, signal.SIGSTOP)
    _, perr, got, cerr = _take_over_stalled(ch, prod, pconn, go, 1, cons, cconn, end)
    assert perr is None or perr[0] != "ChannelRoleLostError", perr  # never told
    lost = [_msg("P", i) for i in range(acked.value) if _msg("P", i) not in got]
    assert lost or cerr is not None, "acknowledged messages all arrived without fencing"
    ch.close()
    r.close()


def test_an_observer_cannot_take_a_role(backend):
    r, ch = _setup(backend)
    obs = cxlrt.open(backend.spec(), node=0, observer=True)
    och = Channel(obs, NAME, slots=None, msg_bytes=None, create=False)
    with pytest.raises(cxlrt.RegionError, match="observer"):
        och.send(b"x")
    assert ch.owner("producer") is None
    och.close()
    obs.close()
    ch.close()
    r.close()
