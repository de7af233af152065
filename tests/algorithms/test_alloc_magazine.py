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


def test_a_thread_that_exits_leaves_its_magazine_to_the_next_sweep(backend):
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
    assert r0.usage()["small_objects"] == 5  # a gone thread's cache is not free to anyone
    assert r0._allocator.sweep() == 1
    assert r0.usage()["small_objects"] == 0 and r0.usage()["cached_objects"] == 0


def test_close_gives_back_what_every_thread_cached(backend):
    r0 = backend.create(size="8M", nodes=2)
    spec = backend.spec()
    threads = [threading.Thread(target=lambda: [r0.free(r0.alloc(64)) for _ in range(3)])
               for _ in range(4)]
    for off in [r0.alloc(1024) for _ in range(7)]:
        r0.free(off)
    assert r0.usage()["cached_objects"] == 7
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r0.close()
    with cxlrt.open(spec, node=1) as r1:
        use = r1.usage()
        # The exited threads' records are swept by close only if they are this
        # Allocator's: all of them are.
        assert use["small_objects"] == 0 and use["cached_objects"] == 0, use


def test_a_forked_child_never_pops_its_parents_magazine(backend):
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
