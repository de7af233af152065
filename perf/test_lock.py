"""Cross-node locks against a process-shared pthread mutex.

Groups:

``lock_uncontended``
    One process, ``lock_bench(lock, N)``: N x (acquire, release) in one nogil
    loop, on node 0 of a 64 MiB region. Rows: ``file:`` bakery (the target),
    ``file:`` manager (the lock manager runs in a thread of this process) and
    ``emu:`` bakery (every fault and the checker off), each with its own N.
    Baseline: ``mutex_bench(mapping, 0, N)``, N x lock/unlock of a robust
    process-shared pthread mutex in a 4 KiB /dev/shm file. ns/pair is per
    acquire+release. Target: ``file:`` bakery at most 3x the mutex's time.
``lock_contended``
    Two forked processes, nodes 0 and 1 of the same ``file:`` region, each
    running the same loop on the same lock, released together by a barrier.
    The parent times each round on its wall clock, from releasing the barrier
    to both processes reporting back; handoffs/s = 2N / that time. Rows:
    bakery and manager (granted by this process's manager thread). Baseline:
    the same two processes on the shared pthread mutex. Ratio = the row's
    handoffs/s over the mutex's. For information, no target.

Every row's rounds are paired with a baseline run just before it (see
conftest.Bench.run); ratios compare time per op, so rows may use different N.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
from _helpers import Group, lock_worker, mutex_worker

from cxlrt import microbench
from cxlrt.mapping import Mapping

ROUNDS = 20
WARMUP = 2
TARGET = {"max_ratio": 3.0}
MUTEX_BASELINE = "pthread mutex"
LOCK = "bench"            # bakery lock in small_regions("file") and ("emu")
MGR_LOCK = "benchm"       # manager lock in small_regions("file", lock_manager=True)

# ops per call: chosen so a round takes about 3-25 ms on a 2-core machine (the manager
# rows assume it spins on a core of its own; sleeping between passes, a round of them
# takes about 0.2-0.4 s, slow but still measured)
UNCONTENDED_N = {"mutex": 100_000, "file bakery": 100_000, "file manager": 10_000,
                 "emu bakery": 10_000}
CONTENDED_N = {"mutex": 100_000, "file bakery": 20_000, "file manager": 4_000}
CONTENDED_ROUNDS = 10
CONTENDED_WARMUP = 1

# Python >= 3.12 warns when forking a process with threads (here: the regions'
# heartbeat and lock-manager threads); the children only attach and run nogil loops.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning")


# case -> (region kind, lock_manager, lock name, mode)
LOCKS = {"file bakery": ("file", False, LOCK, "bakery"),
         "emu bakery": ("emu", False, LOCK, "bakery"),
         "file manager": ("file", True, MGR_LOCK, "manager")}


def _lock_for(small_regions, case: str):
    """(region, lock) of a case: node 0 of its region, the lock created on first use."""
    kind, manager, name, mode = LOCKS[case]
    region = small_regions(kind, lock_manager=manager)
    return region, region.lock(name, mode=mode)


class _Counted:
    """Calls fn and adds its result (iterations done) to .total."""

    def __init__(self, fn: Callable[[], int]):
        self.fn, self.total = fn, 0

    def __call__(self) -> int:
        n = self.fn()
        self.total += n
        return n


# --- uncontended --------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mutex", "file bakery", "file manager", "emu bakery"])
def test_lock_uncontended(bench, small_regions, mutex, case):
    n = UNCONTENDED_N[case]
    bench.describe("lock_uncontended", case,
                   baseline=MUTEX_BASELINE if case == "mutex" else None, ops=n, op="pair",
                   target=TARGET if case == "file bakery" else None)
    baseline = partial(microbench.mutex_bench, mutex, 0, UNCONTENDED_N["mutex"])
    if case == "mutex":
        assert bench.run(baseline, rounds=ROUNDS, warmup=WARMUP) == n
        assert microbench.mutex_bench(mutex, 0, 1) == 1  # left unlocked
        return
    _, lk = _lock_for(small_regions, case)
    before = lk.acquisitions()[0]
    fn = _Counted(partial(microbench.lock_bench, lk, n))
    result = bench.run(fn, rounds=ROUNDS, warmup=WARMUP,
                       paired=(MUTEX_BASELINE, baseline, UNCONTENDED_N["mutex"]))
    assert result == n
    assert lk.acquisitions()[0] - before == fn.total  # every pair went through the global tier
    assert not lk.held_by_me()
    assert lk.acquire(timeout=5.0)  # free for the next taker
    lk.release()


# --- contended: two processes ------------------------------------------------------


def _pair(make: Callable[[int], tuple[Callable[[], int], Callable[[], None]]]) -> Group:
    """Two forked processes, nodes 0 and 1, each pinned to its own CPU (when there are
    two), so they contend instead of taking turns on one core."""
    return Group(make, 2)


def _mutex_pair(mapping: Mapping) -> Group:
    return _pair(partial(mutex_worker, mapping, CONTENDED_N["mutex"]))


def _describe_overlap(bench, pair: Group, rounds: int) -> None:
    """extra_info["overlap"]: median over the timed rounds (the last `rounds`)."""
    overlap = pair.overlap(rounds)
    bench.extra_info["overlap"] = overlap
    bench.extra_info["note"] = f"loops overlapped {overlap:.0%} of the round (median)"


@pytest.mark.parametrize("case", ["mutex", "file bakery", "file manager"])
def test_lock_contended(bench, small_regions, mutex, case):
    n = CONTENDED_N[case]
    bench.describe("lock_contended", case, baseline=MUTEX_BASELINE if case == "mutex" else None,
                   ops=2 * n, rate="handoffs")
    if case == "mutex":
        with _mutex_pair(mutex) as pair:
            bench.run(pair, rounds=CONTENDED_ROUNDS, warmup=CONTENDED_WARMUP)
        pair.check(n)
        _describe_overlap(bench, pair, CONTENDED_ROUNDS)
        return
    region, lk = _lock_for(small_regions, case)
    before = lk.acquisitions()
    with (_mutex_pair(mutex) as base,
          _pair(partial(lock_worker, region.spec, lk.name, n)) as pair):
        bench.run(pair, rounds=CONTENDED_ROUNDS, warmup=CONTENDED_WARMUP,
                  paired=(MUTEX_BASELINE, base, 2 * CONTENDED_N["mutex"]))
    pair.check(n)
    base.check(CONTENDED_N["mutex"])
    _describe_overlap(bench, pair, CONTENDED_ROUNDS)
    after = lk.acquisitions()
    # every acquisition went through the global tier, on the children's nodes only
    assert [after[j] - before[j] for j in range(len(after))] == [pair.rounds * n] * 2 + [0] * (
        len(after) - 2)
    assert lk.acquire(timeout=5.0)  # nobody left it held
    lk.release()
