"""Per-thread magazines of freed small objects (alloc.pyx): a second free of a cached
object is refused wherever it comes from, a cached object is never handed out twice,
and what a thread or process that is gone kept cached goes back to the heap."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import cxlrt
from cxlrt import check as cxcheck
from tests.nodes import _CTX


def _forks_with_its_region(backend):
    """These tests fork a process that goes on with its parent's Region, which only a
    mapping survives: an rdma: attachment is its own process's (a forked child must
    open its own), so there they cannot say anything about the magazines."""
    if backend.scheme == "rdma":
        pytest.skip("an rdma: attachment does not survive fork (the child opens its own)")


def _run_child(fn, *args):
    p = _CTX.Process(target=fn, args=args)
    p.start()
    p.join(120)
    return p.exitcode


def _until_gone(tid):
    """A joined Python thread's OS thread may take a moment more to leave the kernel."""
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _free_in_child(spec, node, off):
    with cxlrt.open(spec, node=node) as r:
        try:
            r.free(off)
        except cxlrt.InvalidFreeError:
            os._exit(3)
    os._exit(0)


def _cache_and_die(spec, node, n):
    r = cxlrt.open(spec, node=node)
    offs = [r.alloc(64) for _ in range(n)] + [r.alloc(256) for _ in range(n)]
    for off in offs:
        r.free(off)
    assert r.usage()["cached_objects"] == 2 * n
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_double_free_of_a_cached_object_is_refused_from_any_thread_or_process(backend):
    r0 = backend.create(size="8M", nodes=2)
    assert r0._allocator.magazines
    x = r0.alloc(64)
    r0.free(x)
    with pytest.raises(cxlrt.InvalidFreeError):
        r0.free(x)  # the same thread: its own magazine holds x
    y = r0.alloc(128)
    t = threading.Thread(target=r0.free, args=(y,))
    t.start()
    t.join()
    with pytest.raises(cxlrt.InvalidFreeError):
        r0.free(y)  # another thread's magazine holds y (the thread is gone, not yet swept)
    z = r0.alloc(512)
    r0.free(z)
    assert _run_child(_free_in_child, backend.spec(), 0, z) == 3, "another process freed z again"
    assert r0.usage()["small_objects"] == 0
    assert r0.alloc(64) == x  # what a thread freed last it gets back first


def test_a_remote_free_of_a_cached_object_never_hands_it_out_twice(backend):
    """Node 1 cannot see node 0's magazines. A second free of an object node 0 cached
    is refused by the tag the object carries; one queued before node 0's own free
    (node 0 cannot tell that it is queued) is left to the magazine by the drain.
    Without either, the object was handed out twice."""
    r0 = backend.create(size="8M", nodes=2)
    r1 = backend.open(1)
    x = r0.alloc(64)
    r0.free(x)  # cached by node 0
    with pytest.raises(cxlrt.InvalidFreeError):
        r1.free(x)
    y = r0.alloc(64)
    assert y == x
    r1.free(y)  # queued on node 0's remote-free queue, its bit still set
    r0.free(y)  # and freed by its owner too: cached
    assert r0._allocator.drain() == 0  # left to the magazine
    got = [r0.alloc(64) for _ in range(3000)]  # the magazine, then the bitmap
    assert len(set(got)) == len(got), f"{y:#x} handed out {got.count(y)} times"
    for off in got:
        r0.free(off)
    r1.close()


def test_a_killed_process_magazine_is_a_leak_check_names_until_the_node_attaches(backend):
    r1 = backend.create(size="8M", nodes=2, node=1, lease=0.5)
    spec = backend.spec()
    base = r1.usage()["small_objects"]
    assert _run_child(_cache_and_die, spec, 0, 10) == -signal.SIGKILL
    assert r1.usage()["small_objects"] == base + 20  # leaked: nobody will pop them
    report = cxcheck.check(spec)
    leaks = [p for p in report["problems"] if "in its magazine" in p]
    assert leaks and "left 20 freed object(s) of node 0" in leaks[0], report["problems"]
    with cxlrt.open(spec, node=0) as r0:
        assert r0._allocator.swept_at_attach == 1
        assert r0.usage()["small_objects"] == base
    assert not [p for p in cxcheck.check(spec)["problems"] if "magazine" in p]


def test_check_repair_gives_a_dead_nodes_magazine_back(backend):
    r1 = backend.create(size="8M", nodes=2, node=1, lease=0.5)
    spec = backend.spec()
    assert _run_child(_cache_and_die, spec, 0, 5) == -signal.SIGKILL
    assert any("magazine" in a for a in cxcheck.repair(spec, 0, force=True)["actions"])
    assert r1.usage()["small_objects"] == 0
    assert not [p for p in cxcheck.check(spec)["problems"] if "magazine" in p]


def test_a_thread_that_exits_leaves_its_magazine_to_the_next_thread_or_sweep(backend):
    r0 = backend.create(size="8M", nodes=2)

    tids = []

    def work():
        tids.append(threading.get_native_id())
        for off in [r0.alloc(64) for _ in range(5)]:
            r0.free(off)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    _until_gone(tids[0])
    use = r0.usage()
    assert use["small_objects"] == 0 and use["cached_objects"] == 5, use  # ours to give back
    assert not cxcheck.check(backend.spec())["problems"]  # no leak: this process runs on
    assert r0._allocator.sweep() == 1
    assert r0.usage()["small_objects"] == 0 and r0.usage()["cached_objects"] == 0
    t = threading.Thread(target=work)  # a new thread's claim sweeps too
    t.start()
    t.join()
    _until_gone(tids[1])
    t = threading.Thread(target=lambda: r0.free(r0.alloc(64)))
    t.start()
    t.join()
    assert r0.usage()["cached_objects"] == 1  # the second worker's five went back


def test_close_gives_back_what_every_thread_cached(backend):
    r0 = backend.create(size="8M", nodes=2)
    spec = backend.spec()
    tids = []

    def work():
        tids.append(threading.get_native_id())
        for _ in range(3):
            r0.free(r0.alloc(64))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for off in [r0.alloc(1024) for _ in range(7)]:
        r0.free(off)
    assert r0.usage()["cached_objects"] == 7
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tid in tids:
        _until_gone(tid)
    r0.close()
    with cxlrt.open(spec, node=1) as r1:
        use = r1.usage()  # ours and the exited threads' went back
        assert use["small_objects"] == 0 and use["cached_objects"] == 0, use


def test_close_leaves_a_running_threads_magazine_to_it_until_it_is_gone(backend):
    """A thread may be inside a push or a pop when another closes the region: a record
    given back under it could be claimed by another process and written by both (an
    object handed out twice). Close leaves it; it goes back once its thread is gone."""
    r0 = backend.create(size="8M", nodes=2)
    spec = backend.spec()
    cached, done, tids = threading.Event(), threading.Event(), []

    def work():
        tids.append(threading.get_native_id())
        for off in [r0.alloc(64) for _ in range(6)]:
            r0.free(off)
        cached.set()
        done.wait(30)

    t = threading.Thread(target=work)
    t.start()
    assert cached.wait(30)
    r0.close()
    with cxlrt.open(spec, node=1) as r1:
        assert r1.usage()["cached_objects"] == 6  # still the running thread's
    done.set()
    t.join()
    _until_gone(tids[0])
    with cxlrt.open(spec, node=0) as r0:  # attaching sweeps what gone threads kept
        assert r0._allocator.swept_at_attach == 1
        assert r0.usage()["small_objects"] == 0 and r0.usage()["cached_objects"] == 0


def test_a_forked_child_never_pops_its_parents_magazine(backend):
    _forks_with_its_region(backend)
    r0 = backend.create(size="8M", nodes=2)
    offs = [r0.alloc(64) for _ in range(8)]
    for off in offs:
        r0.free(off)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            got = [r0.alloc(64) for _ in range(8)]
            os.write(wr, b",".join(b"%d" % x for x in got))
        finally:
            os._exit(0)
    os.close(wr)
    with os.fdopen(rd, "rb") as f:
        theirs = {int(x) for x in f.read().split(b",") if x}
    os.waitpid(pid, 0)
    mine = {r0.alloc(64) for _ in range(8)}
    assert mine == set(offs), "the parent lost its cached objects"
    assert len(theirs) == 8 and not theirs & mine, "parent and child were given the same object"


def test_more_threads_than_records_still_never_share_an_object(backend):
    r0 = backend.create(size="8M", nodes=2)
    n, held, errors = 72, [], []
    barrier = threading.Barrier(n)

    def work():
        try:
            for off in [r0.alloc(64) for _ in range(3)]:
                r0.free(off)
            barrier.wait(30)  # every thread alive at once: 72 threads, 64 records
            held.append([r0.alloc(64) for _ in range(4)])
            barrier.wait(30)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    flat = [x for h in held for x in h]
    assert len(flat) == 4 * n and len(set(flat)) == len(flat), "an object was handed out twice"
    for off in flat:
        r0.free(off)
    r0._allocator.sweep()
    r0.trim()
    assert r0.usage()["small_objects"] == 0


def test_an_object_a_magazine_gave_back_can_be_freed_by_any_node(backend):
    """A give-back clears the tag before the bit: a tag left on an object handed out
    again from the bitmap would make another node refuse its free as a double one."""
    r0 = backend.create(size="8M", nodes=2)
    r1 = backend.open(1)
    offs = [r0.alloc(64) for _ in range(40)]
    for off in offs:
        r0.free(off)  # past 16 a free gives half the magazine back
    again = [r0.alloc(64) for _ in range(40)]
    assert set(again) == set(offs)
    for off in again:
        r1.free(off)  # remote: each is refused if it still carries a tag
    assert r0._allocator.drain() == 40
    assert r0.usage()["small_objects"] == 0
    r1.close()


def _churn(spec, node, stop):
    r = cxlrt.open(spec, node=node)
    while not stop.is_set():
        offs = [r.alloc(64) for _ in range(40)]
        for off in offs:
            r.free(off)  # past 16 a free gives half the magazine back
        r.trim()         # the rest goes back, and the emptied chunk
    r.close()


def test_check_of_a_node_that_allocates_and_trims_reports_nothing(backend):
    """check reads the table, the records and the bitmaps at different moments, while a
    give-back may clear a bit between them: it must not call that a cached free slot."""
    backend.create(size="8M", nodes=2, node=1).close()
    stop = _CTX.Event()
    p = _CTX.Process(target=_churn, args=(backend.spec(), 0, stop))
    p.start()
    try:
        time.sleep(0.5)
        for _ in range(6):
            problems = [x for x in cxcheck.check(backend.spec())["problems"] if "magazine" in x]
            assert not problems, problems
    finally:
        stop.set()
        p.join(60)
    assert p.exitcode == 0


def _namespaced(backend, fn):
    """Run fn(spec, out) in a child, which reports as JSON into the file `out` (no
    thread, so no multiprocessing queue, can start once a pid namespace is unshared);
    skip where this host refuses to unshare one."""
    import json
    _forks_with_its_region(backend)
    backend.create(size="8M", nodes=2, node=1)
    out = os.path.join(backend.root, fn.__name__ + ".json")
    assert _run_child(fn, backend.spec(), out) == 0
    with open(out) as f:
        got = json.load(f)
    if got[0] == "skip":
        pytest.skip(f"cannot unshare a pid namespace here: {got[1]}")
    return got


def _in_new_pid_namespace(spec, out):
    """Cache objects, move our children into a new pid namespace, fork one there that
    trims (a sweep): it must judge no record of ours, which it cannot see. Reports as
    JSON into the file `out` (no thread can start once the namespace is unshared, so
    no multiprocessing queue either)."""
    import ctypes
    import json
    r = cxlrt.open(spec, node=0)
    mine = [r.alloc(64) for _ in range(4)]
    for off in mine:
        r.free(off)
    if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:  # CLONE_NEWPID
        report = ["skip", os.strerror(ctypes.get_errno())]
    else:
        pid = os.fork()
        if pid == 0:  # pid 1 of the new namespace: the parent's pid names nobody here
            code = 0
            try:
                r.trim()
                r._allocator.sweep()
            except BaseException:  # noqa: BLE001 (reported by the exit code)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        cached = r.usage()["cached_objects"]
        again = [r.alloc(64) for _ in range(4)]
        report = ["done", os.waitstatus_to_exitcode(status), cached, sorted(mine),
                  sorted(again), r.usage()["small_objects"]]
    with open(out, "w") as f:
        json.dump(report, f)
    os._exit(0)  # no close: its threads' work cannot start threads in here


def test_a_process_in_another_pid_namespace_never_sweeps_a_live_magazine(backend):
    """A forked child in a new pid namespace asks kill() about pids that name nobody
    there: had it judged our record by them, it would give back objects we pop."""
    got = _namespaced(backend, _in_new_pid_namespace)
    _, code, cached, mine, again, live = got
    assert code == 0
    assert cached == 4, "the child gave back a live process's magazine"
    assert again == mine, "the parent's cached objects were taken from it"
    assert live == 4  # the four it holds, and nothing given back under it


def _pid1_forks_pid1(spec, out):
    """A namespace's pid 1 caches objects, then forks into a new namespace of its own: the
    child is pid 1 with tid 1 too, so a pid does not tell the two apart. Reports as
    JSON into the file `out`."""
    import ctypes
    import json
    libc = ctypes.CDLL(None, use_errno=True)
    r = cxlrt.open(spec, node=0)
    if libc.unshare(0x20000000) != 0:  # CLONE_NEWPID
        with open(out, "w") as f:
            json.dump(["skip", os.strerror(ctypes.get_errno())], f)
        os._exit(0)
    g = os.fork()
    if g == 0:  # pid 1
        code = 1
        try:
            cached = [r.alloc(64) for _ in range(6)]
            for off in cached:
                r.free(off)
            if libc.unshare(0x20000000) != 0:
                os._exit(3)
            rd, wr = os.pipe()
            h = os.fork()
            if h == 0:  # pid 1 again, in the next namespace
                got = [r.alloc(64) for _ in range(3)]
                os.write(wr, json.dumps([os.getpid(), got]).encode())
                os._exit(0)
            os.close(wr)
            hpid, theirs = json.loads(os.read(rd, 65536).decode())
            os.waitpid(h, 0)
            ours = [r.alloc(64) for _ in range(3)]
            with open(out, "w") as f:
                json.dump(["done", os.getpid(), hpid, cached, theirs, ours], f)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(g, 0)
    os._exit(os.waitstatus_to_exitcode(status))


def test_a_child_that_is_pid_1_like_its_parent_never_pops_its_parents_magazine(backend):
    """A container's init that sandboxes a child in a new pid namespace: both are pid 1,
    tid 1. The child's copy of its parent's record cache must not name the parent's
    record (a fork empties it), nor may the parent's process token be the child's."""
    got = _namespaced(backend, _pid1_forks_pid1)
    _, gpid, hpid, cached, theirs, ours = got
    assert gpid == hpid == 1
    assert not set(theirs) & set(ours), "parent and child were handed the same object"
    assert set(ours) <= set(cached) and not set(theirs) & set(cached), \
        "the child popped its parent's magazine"
