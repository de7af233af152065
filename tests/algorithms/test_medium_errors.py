"""A medium that fails one access: every step of a protocol, in turn.

A real medium returns errors: an RDMA completion error, a poisoned line, a device
that stops answering for a moment. `emu:` can fail one chosen access of the calling
thread (`EmuBackend.fail_access`), either before it takes effect or after (a write
that landed but whose answer was lost). Each test runs an operation once per access
it makes, failing that one, and after each checks what must always hold: the caller
got a clear error or a result, and nothing is lost or given out twice.
"""

from __future__ import annotations

from functools import partial

import pytest

import cxlrt
from cxlrt import check as cxcheck
from tests.algorithms.test_alloc import _assert_disjoint, _assert_tags, _tag_all
from tests.algorithms.test_kvcache import filled
from tests.algorithms.test_kvcache_failures import _delete_from, _lock_slots, _spawn

SEED = 11
MOST = 2000  # accesses of one operation: far more than any makes


def _fail_one_access(r, k, effect, act, kinds=("store", "flush", "fence"), times=1):
    """Run act() with the k-th access of `kinds` by this thread failing (k from 0), and the
    times - 1 after it. Returns (whether the first failure fired, the MediumError act
    raised or None)."""
    injected = r.backend.stats()["injected_failures"]
    r.backend.fail_access(after=k, kinds=kinds, effect=effect, times=times)
    err = None
    try:
        act()
    except cxlrt.MediumError as e:
        err = e
    finally:
        fired = r.backend.stats()["injected_failures"] > injected
        r.backend.fail_access(kinds=())
    return fired, err


def _medium_pins(r):
    r.flush(0, r.size)  # a word left in our node's view would reach the medium later
    (kv,) = cxlrt.inspect(r.spec)["kv_caches"]  # the medium, by DMA
    return kv["pins"]


# --- KV cache: pins ----------------------------------------------------------------------

@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_failed_access_anywhere_in_a_lookup_leaves_exact_pins(backend, emu_only, effect, keep):
    """The medium fails one store, flush or fence of a lookup and its release, each in
    turn. The caller gets a MediumError. A failure inside the pin mutex leaves the
    region's pin words and this process's record of them out of step, so it must mark
    the mutex; the next lookup rebuilds the words from the record. After every case
    the medium counts no pin, and at the end the other node deletes every block.
    Before, a failed fence after the pin pass, and any failed release, left their
    pins in the record for as long as the cache stayed open."""
    r, c, keys = filled(backend, nodes=2, capacity=64, blocks=8)
    keep(r)
    keys = [*keys, keys[1]]  # a block pinned twice by one lookup

    def lookup():
        with c.lookup(keys) as hit:
            assert len(hit) == len(keys)

    errors = marked = 0
    for k in range(MOST):
        fired, err = _fail_one_access(r, k, effect, lookup)
        if not fired:
            break  # the lookup made fewer than k + 1 such accesses: every one was failed
        errors += err is not None
        marked += any(s["repair"] for s in _lock_slots(r))
        lookup()  # rebuilds first if the mutex is marked
        assert not any(s["repair"] for s in _lock_slots(r)), f"access {k}: still marked"
        assert _medium_pins(r) == 0, f"access {k} failed: a pin stayed in the region"
    else:
        pytest.fail("a lookup that never runs out of accesses")
    assert k >= 20 and errors == k and marked >= 1, (k, errors, marked)
    p, q = _spawn(_delete_from, backend.spec(), 1, sorted(set(keys)))
    got = q.get(timeout=60)
    p.join(60)
    assert sorted(got) == sorted(set(keys)), "the other node could not delete a block"


def test_pins_a_failed_release_could_not_give_back_go_with_the_next_call(backend, emu_only, keep):
    """A release whose pin mutex cannot be taken (it is marked, and the rebuild's first
    read fails) gives nothing back and says so; the cache keeps those pins and gives
    them back on its next call, once the medium answers. Before, the hit counted as
    released and its pins held their blocks until the cache closed."""
    r, c, keys = filled(backend, nodes=2, capacity=64, blocks=8)
    keep(r)
    held = c.lookup(keys[:4])
    assert len(held) == 4
    for k in range(MOST):  # a failed write inside the mutex marks it
        fired, _ = _fail_one_access(r, k, False, lambda: c.lookup(keys).release())
        assert fired, "no access of a lookup marked the pin mutex"
        if any(s["repair"] for s in _lock_slots(r)):
            break
    r.backend.fail_access(after=0, kinds=("load",))  # the rebuild's first read
    with pytest.raises(cxlrt.MediumError, match="release"):
        held.release()
    assert not r.backend.fail_pending()
    assert _medium_pins(r) == 4, "the failed release gave pins back"
    with c.lookup(keys[:1]) as hit:  # rebuilds, then gives the four back first
        assert len(hit) == 1
    assert _medium_pins(r) == 0, "the next call kept them"
    p, q = _spawn(_delete_from, backend.spec(), 1, sorted(keys))
    got = q.get(timeout=60)
    p.join(60)
    assert sorted(got) == sorted(keys), "the other node could not delete a block"


# --- allocator ---------------------------------------------------------------------------

def _probe(r, live, k, what):
    """Nothing live was overwritten, and fresh objects of every kind land clear of
    what is live (an object handed out twice shows here)."""
    _assert_tags(r, live, SEED, f"{what}, access {k} failed")
    fresh = [(r.alloc(n), n) for n in (64, 64, 4096, 200_000)]
    _assert_disjoint(live + fresh)
    _tag_all(r, fresh, SEED)
    _assert_tags(r, live, SEED, f"{what}, access {k} failed, then fresh objects")
    for off, _ in fresh:
        r.free(off)


def _alloc_into(r, size, got):
    got.append((r.alloc(size), size))


def _free_once(r, off):
    """A free whose answer was lost may have happened: once more, and a double free is
    what it must say if it did."""
    try:
        r.free(off)
    except cxlrt.InvalidFreeError:
        pass


OPS = {"alloc-64": 64, "alloc-4KiB": 4096, "alloc-large": 200_000, "free-64": 64,
       "free-large": 200_000, "free-remote": 64, "drain": 64}
RETRIED = {"alloc-large": 4, "free-large": 4 + 8, "free-remote": 4, "drain": 4, "free-64": 3}


@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
@pytest.mark.parametrize("op", list(OPS))
def test_a_failed_access_anywhere_in_an_allocator_step_never_allocates_twice(
        backend, emu_only, op, effect, keep):
    """alloc, free (ours, a large run, another node's through its queue) and the
    owner's drain of that queue, each with one access failed in turn. Every call
    either works or raises MediumError; a free that raised is repeated (it may have
    happened: then it must say double free). Nothing live is ever overwritten or
    handed out again, and at the end `cxlrt check` finds nothing worse than a leak
    (the slot a failed step may strand, as a crash there does)."""
    r = keep(backend.create(nodes=2, size="32M"))
    other = keep(backend.open(1))
    size = OPS[op]
    live = [(r.alloc(n), n) for n in (64, 64, 128, 4096, 200_000)]
    _tag_all(r, live, SEED)
    errors = 0
    for k in range(MOST):
        victims = []
        if op.startswith("free") or op == "drain":
            victims = [(r.alloc(size), size) for _ in range(3 if op == "drain" else 1)]
        if op == "drain":
            for off, _ in victims:
                other.free(off)  # queued for node 0, which drains below
        who = other if op == "free-remote" else r
        got = []
        if op.startswith("alloc"):
            act = partial(_alloc_into, r, size, got)
        elif op == "drain":
            act = r._allocator.drain
        else:
            act = partial(who.free, victims[0][0])
        fired, err = _fail_one_access(who, k, effect, act, ("load", "store", "flush", "fence"))
        errors += err is not None
        if err is not None and op.startswith("free"):
            _free_once(who, victims[0][0])
        if err is not None and op == "drain":
            r._allocator.drain()  # the journal finishes what the failed drain began
        _tag_all(r, got, SEED)
        _probe(r, live + got, k, op)
        for off, _ in got:  # the heap as it was: the next round makes the same accesses
            r.free(off)
        if not fired:
            break
    else:
        pytest.fail(f"{op} never ran out of accesses")
    # Every failure made the call fail, but those that a step makes again because its
    # stores are idempotent, after which the call goes through: the allocator lock's
    # release, four accesses (two stores to our own line, a flush, a fence;
    # cxl_lock_release), and the free of a large run, eight more (_clear_run: the head's
    # store and publish, three tails, the persist). A 64 B free goes into the thread's
    # magazine: once its tag store was tried the object is cached, so the free has
    # happened whatever the tag's store, flush and fence answered (_mag_push).
    assert k >= 2 and k - errors == RETRIED.get(op, 0), (k, errors)
    for off, _ in live:
        r.free(off)
    r._allocator.drain()
    problems = cxcheck.check(backend.spec())["problems"]
    assert all(p.startswith("leak") for p in problems), problems


@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
@pytest.mark.parametrize("op", ["alloc-large", "free-large"])
def test_a_large_step_whose_medium_outlasts_its_retries_loses_no_chunk_for_good(
        backend, emu_only, op, effect, keep):
    """As above, with four accesses in a row failed: more than a large alloc's give-back
    or a large free's rewrite tries. The step may leave tail words whose head is gone.
    `cxlrt check` must call them a leak, not corruption. A failed alloc owes its run
    until it is given back, a free gives back the tails it left, and what the medium
    still kept back, reclaim (--repair) frees: once everything is freed, the whole heap
    is one free run again. Before, check failed on the tails, nothing reclaimed them,
    and a failed alloc whose give-back failed too stranded its run, so repeated
    failures ran the heap out of room."""
    r = keep(backend.create(nodes=2, size="32M"))
    empty = r.usage()["free_bytes"]
    size = OPS[op]
    live = [(r.alloc(n), n) for n in (64, 4096, 200_000)]
    _tag_all(r, live, SEED)
    for k in range(MOST):
        victims = [(r.alloc(size), size)] if op == "free-large" else []
        got = []
        act = partial(_alloc_into, r, size, got) if victims == [] else \
            partial(r.free, victims[0][0])
        fired, err = _fail_one_access(r, k, effect, act, ("load", "store", "flush", "fence"),
                                      times=4)
        if err is not None and victims:
            _free_once(r, victims[0][0])
        _tag_all(r, got, SEED)
        _probe(r, live + got, k, f"{op} 4x")
        for off, _ in got:
            r.free(off)
        if not fired:
            break
    else:
        pytest.fail(f"{op} never ran out of accesses")
    for off, _ in live:
        r.free(off)
    r.trim()
    problems = cxcheck.check(backend.spec())["problems"]
    assert all(p.startswith("leak") for p in problems), problems
    r._allocator.reclaim()  # what `cxlrt check --repair` does for the tails it names
    whole = r.alloc(empty)  # one run of every chunk: nothing stays stranded
    r.free(whole)
    assert cxcheck.check(backend.spec())["problems"] == []
