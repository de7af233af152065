"""A medium that fails one access of a KV store, eviction, delete or load, each in turn.

The pin protocol's sweep is in test_medium_errors.py; this file sweeps the paths that
write entries and payloads. What must hold after every case is what a serving engine
relies on: the call raised MediumError or did its work; every key that any node finds
loads the bytes stored under it and no others; no pin is left on the medium; the
cache is not wedged (the same store again puts every key in, another node deletes
every block); and `cxlrt check` finds nothing worse than a leak.
"""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import pytest

import cxlrt
from cxlrt import check as cxcheck
from cxlrt import crash
from tests.algorithms.test_directory_crash import _wait_stopped
from tests.algorithms.test_kvcache import BB, _corrupt, block_for, chain, filled, open_cache
from tests.algorithms.test_kvcache_failures import _spawn
from tests.algorithms.test_medium_errors import MOST, _fail_one_access, _medium_pins

KINDS = ("load", "store", "flush", "fence", "dma")
CAP = 8


def _verify(c, keys, what):
    """Every key the cache finds loads its own bytes; returns how many it found."""
    try:
        with c.lookup(keys) as hit:  # a chain: stops at the first miss
            found = list(hit.keys)
            out = c.load(hit) if len(hit) else []
    except cxlrt.MediumError:
        raise  # the failure injected into this very call
    except cxlrt.RegionError as e:  # "corrupt region" and the like: say which case
        raise AssertionError(f"{what}: {e}") from e
    for j, key in enumerate(found):
        assert bytes(out[j]) == block_for(key), f"{what}: block {j} loads another's bytes"
    return len(found)


def _present(c, keys):
    """Which of `keys` the cache holds (each looked up alone: chains stop at a miss)."""
    got = []
    for key in keys:
        with c.lookup([key]) as hit:
            if len(hit):
                got.append(key)
    return got


def _store(c, keys):
    c.store(keys, [block_for(k) for k in keys])


def _check_clean(spec):
    problems = cxcheck.check(spec)["problems"]
    assert all(p.startswith("leak") for p in problems), problems


OPS = ("store", "store-evict", "delete", "load")


@pytest.mark.parametrize("times", [1, 4], ids=["once", "4x"])
@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
@pytest.mark.parametrize("op", OPS)
def test_a_failed_access_anywhere_in_a_kv_step_never_serves_wrong_bytes(
        backend, emu_only, op, effect, times, keep):
    """Node 0 stores (into room, or into a full cache, which evicts), deletes or loads,
    with one of its accesses failed, each in turn. Node 1, in the same process, then
    finds every key it can and loads it: it must get the bytes stored under that key.
    The same store again must then hold every key (a failed store may not leave a key
    stuck as being written), and no pin may stay on the medium."""
    r = keep(backend.create(nodes=2, size="32M"))
    other = keep(backend.open(1))
    c = open_cache(r, capacity_blocks=CAP)
    co = open_cache(other, capacity_blocks=CAP)
    base = c.block_hashes(chain(0, 4))
    errors = 0
    for k in range(MOST):
        conv = 1 + k  # fresh keys every round: no round reuses a half-written entry
        new = c.block_hashes(chain(conv, 4 if op == "store-evict" else 2))
        if op == "store-evict":
            _store(c, base + c.block_hashes(chain(10_000 + k, 4)))  # full: the store evicts
        else:
            _store(c, base)
            _store(c, new)
        assert _medium_pins(r) == 0
        if op.startswith("store"):
            act = partial(_store, c, new)
        elif op == "delete":
            act = partial(c.delete, new[:1] + base[2:])
        else:
            act = partial(_verify, c, base + new, "the failing load itself")
        fired, err = _fail_one_access(r, k, effect, act, KINDS, times)
        errors += err is not None
        what = f"{op}, access {k} failed ({'done' if effect else 'undone'}, {times}x)"
        _verify(co, base, what)
        _verify(co, new, what)
        _verify(c, base + new, what)
        assert _medium_pins(r) == 0, f"{what}: a pin stayed on the medium"
        if op.startswith("store"):
            _store(c, new)  # again: nothing may be stuck half-written
            assert _present(co, new) == new, f"{what}: the store again left keys out"
            _verify(co, new, what + ", then stored again")
        elif op == "delete":
            c.delete(new[:1] + base[2:])  # again: it goes through
            assert not _present(co, new[:1] + base[2:]), f"{what}: the delete again kept keys"
        if not fired:
            break
    else:
        pytest.fail(f"{op} never ran out of accesses")
    assert k >= 3 and errors >= 1, (k, errors)
    assert co.delete(_present(co, co.block_hashes(chain(0, 4)))) is not None
    c.close()
    co.close()
    _check_clean(backend.spec())


def test_check_names_a_payload_that_two_entries_hold(backend, keep):
    """The safety net under these sweeps: `cxlrt check` reads every entry, claim line
    and record of each cache, and a payload named twice (what the defects above made:
    two ready blocks on one payload, each loading the other's bytes once both are
    written) is a problem; so is a torn entry. Before, check looked at no KV cache."""
    r = keep(backend.create(nodes=1))
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 3))
    _store(c, keys)
    _check_clean(backend.spec())
    ents = {e["key"]: e for e in c.entries()}
    _corrupt(r, c, keys[1], off=ents[keys[0]]["offset"])
    problems = cxcheck.check(backend.spec())["problems"]
    first, second = sorted((ents[keys[0]]["slot"], ents[keys[1]]["slot"]))
    assert any(f"entry {first} (ready) and entry {second} (ready) (given out twice)" in p
               for p in problems), problems
    _corrupt(r, c, keys[2], raw=bytes(63) + b"\x01")
    problems = cxcheck.check(backend.spec())["problems"]
    assert any(f"entry {ents[keys[2]]['slot']} is torn or corrupt" in p for p in problems), problems


def _store_stalled_in_its_burial(spec, lease, out):
    """In a child: a store whose copy fails (its first DMA) buries its claim, and stops
    between the burial's record and its tombstone for longer than the lease; resumed,
    its publish is refused (fenced) and done again. Reports what is left."""
    r = cxlrt.open(spec, node=0)
    c = open_cache(r, capacity_blocks=CAP)
    keys = c.block_hashes(chain(1, 1))
    r.backend.fail_access(after=0, kinds=("dma",))
    crash.arm("kv.evict.intent", "stop")
    try:
        _store(c, keys)
        err = None
    except cxlrt.RegionError as e:
        err = type(e).__name__
    crash.disarm()
    r.backend.fail_access(kinds=())
    out.put((err, c.records(), [e["slot"] for e in c.entries()]))
    c.close()
    r.close()


@pytest.mark.crash
def test_a_burial_said_again_after_a_stall_leaves_no_second_record(backend, emu_only, keep):
    """A burial whose record landed but whose tombstone did not (the writer stalled past
    the lease in between, so the write was fenced) is done again by the publish's retry.
    The first record must go first: before, it stayed, and the next store's settle
    freed the payload a second time, by then another object's (found by review)."""
    lease = 0.5
    r = keep(backend.create(nodes=2, size="32M", lease=lease))
    c = open_cache(r, capacity_blocks=CAP)
    p, q = _spawn(_store_stalled_in_its_burial, backend.spec(), lease)
    try:
        _wait_stopped(p.pid)
        time.sleep(4 * lease)
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.join(timeout=60)
    err, records, slots = q.get(timeout=5)
    assert err is not None and slots == [], (err, slots)
    assert records == [], f"a record of the first burial stayed: {records}"
    objs = [r.alloc(64 + BB) for _ in range(4)]  # the heap's next payload-sized objects
    c.recover()  # settles records: none may free anything now
    again = [r.alloc(64 + BB) for _ in range(4)]
    assert not set(objs) & set(again), "a payload was freed twice and handed out again"
    _check_clean(backend.spec())


@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_failed_access_in_a_lookup_counts_each_lookup_at_most_once(backend, emu_only,
                                                                     effect, keep):
    """Lookups count into process-local counters that the next pass of the pin mutex
    publishes. With any one access of a lookup and its release failing (its effect
    lost or kept), each lookup is counted once: a pass whose counters were published
    before the failure used to add them back (counted twice), and a release whose
    mutex was taken dropped them (lost). "Once" holds where the failing access is not
    a store: a failed store of the counters' own line may or may not have landed, and
    they are not said again (at most once)."""
    r, c, keys = filled(backend, nodes=1, capacity=64, blocks=4)
    keep(r)
    miss = c.block_hashes(chain(77, 2))
    wrong = []
    for kind in ("load", "store", "flush", "fence"):
        for k in range(MOST):
            before = c.stats()["lookups"]
            c.lookup(miss).release()
            c.lookup(miss).release()  # two pending lookups: no pin pass yet
            injected = r.backend.stats()["injected_failures"]
            r.backend.fail_access(after=k, kinds=(kind,), effect=effect)
            try:
                with c.lookup(keys):
                    pass
            except cxlrt.MediumError:
                pass
            finally:
                fired = r.backend.stats()["injected_failures"] > injected
                r.backend.fail_access(kinds=())
            if not fired:
                break
            with c.lookup(keys):  # repairs a marked mutex
                pass
            counted = c.stats()["lookups"] - before
            if counted > 4 or (counted < 4 and kind != "store"):
                wrong.append((kind, k, counted))
    assert not wrong, f"(failing access, its number, lookups counted of 4): {wrong}"
