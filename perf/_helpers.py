"""Helpers shared by perf/ benchmarks: key chains, the baselines they are compared
with, and a group of forked processes that run one loop per round (test_kvcache,
test_lock and test_scaling).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np

import cxlrt
from cxlrt import microbench
from cxlrt.mapping import Mapping

BARRIER_TIMEOUT_S = 120.0  # a wedged child fails the benchmark instead of hanging it

# fork: the children inherit the mutex mapping and attach to the region themselves
_MP = multiprocessing.get_context("fork")


# --- KV lookups -------------------------------------------------------------------


def chains(n: int, length: int, salt: bytes) -> list[list[bytes]]:
    """`n` distinct chains of `length` chained 16-token block keys each."""
    span = length * 16
    return [cxlrt.block_hashes(range(i * span, (i + 1) * span), 16, salt=salt)
            for i in range(n)]


def dict_lookups(d: dict, chains: list[list[bytes]]) -> int:
    """Walk each chain through a dict, stopping at the first miss; returns keys found."""
    total = 0
    for keys in chains:
        for k in keys:
            if k not in d:
                break
            total += 1
    return total


def cache_lookups(cache: cxlrt.KVCache, chains: list[list[bytes]]) -> int:
    """One ``with cache.lookup(keys)`` per chain (pin, re-read, unpin); returns keys hit."""
    total = 0
    for keys in chains:
        with cache.lookup(keys) as hit:
            total += len(hit)
    return total


# --- bulk copies ------------------------------------------------------------------


def random_blocks(n: int, block_bytes: int, seed: int = 4) -> list[np.ndarray]:
    """`n` uint8 arrays of `block_bytes` random bytes (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]


def numpy_copy(src: list[np.ndarray], dst: np.ndarray) -> None:
    """Copy each block of `src` into its row of the preallocated `dst`."""
    for i, b in enumerate(src):
        np.copyto(dst[i], b)


# --- lock handoffs ----------------------------------------------------------------


def mutex_worker(mapping: Mapping, n: int, node: int):
    """A process's loop on the pthread mutex at offset 0 of `mapping` (`make` of Group)."""
    return partial(microbench.mutex_bench, mapping, 0, n), lambda: None


def lock_worker(spec: str, name: str, n: int, node: int):
    """A process's loop on lock `name` of the region `spec`, attached as `node`."""
    region = cxlrt.open(spec, node=node)
    lk = region.lock(name)
    return partial(microbench.lock_bench, lk, n), region.close


def _child(make: Callable, node: int, ready, go, done, stop, counts, span) -> None:
    """One process of a Group: per round, wait for `go`, run the loop, meet at `done`."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:  # spread over the cores, as hosts would be
            os.sched_setaffinity(0, {cpus[node % len(cpus)]})
        fn, close = make(node)
        try:
            ready.wait(BARRIER_TIMEOUT_S)
            while True:
                go.wait(BARRIER_TIMEOUT_S)
                if stop.value:
                    return
                span[2 * node] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for all
                counts[node] += fn()
                span[2 * node + 1] = time.perf_counter()
                done.wait(BARRIER_TIMEOUT_S)
        finally:
            close()
    except BaseException:
        for b in (ready, go, done):
            b.abort()  # the parent fails at its next wait instead of hanging
        raise


class Group:
    """`procs` forked processes, nodes 0..procs-1, that run their loop once per round.

    ``make(node)`` runs in each child and returns ``(loop, close)``. Calling the
    Group is one round as the parent sees it: release every child at once, wait
    until all are done. The children outlive the rounds, so no round pays for
    forking or attaching. Child ``i`` is pinned to CPU ``i mod ncpu`` (when there
    are two or more), so the processes spread over the cores. ``overlaps``
    records, per round, the fraction of the round during which every loop was
    running (0 when one finished before another started).
    """

    def __init__(self, make: Callable[[int], tuple[Callable[[], int], Callable[[], None]]],
                 procs: int):
        self.procs_n = procs
        self.rounds = 0
        self.ready = _MP.Barrier(procs + 1)
        self.go = _MP.Barrier(procs + 1)
        self.done = _MP.Barrier(procs + 1)
        self.stop = _MP.Value("b", 0, lock=False)
        self.counts = _MP.Array("Q", procs, lock=False)
        self.span = _MP.Array("d", 2 * procs, lock=False)  # (start, end) of each loop
        self.overlaps: list[float] = []
        self.procs = [_MP.Process(target=_child, daemon=True,
                                  args=(make, node, self.ready, self.go, self.done, self.stop,
                                        self.counts, self.span))
                      for node in range(procs)]

    def __enter__(self) -> Group:
        for p in self.procs:
            p.start()
        try:
            self.ready.wait(BARRIER_TIMEOUT_S)  # all attached: no round pays for it
        except threading.BrokenBarrierError:
            self.__exit__()
            raise
        return self

    def __call__(self) -> None:
        self.go.wait(BARRIER_TIMEOUT_S)
        self.done.wait(BARRIER_TIMEOUT_S)
        self.rounds += 1
        starts, ends = self.span[0::2], self.span[1::2]
        whole = max(ends) - min(starts)
        self.overlaps.append(max(0.0, min(ends) - max(starts)) / whole if whole > 0 else 0.0)

    def overlap(self, rounds: int) -> float:
        """Median overlap over the last `rounds` rounds (the timed ones)."""
        return statistics.median(self.overlaps[-rounds:])

    def __exit__(self, *exc) -> None:
        self.stop.value = 1
        try:
            if not self.go.broken:
                self.go.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass
        for p in self.procs:
            p.join(BARRIER_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()

    def check(self, n: int) -> None:
        """Every child exited cleanly after one full loop of `n` per round."""
        assert [p.exitcode for p in self.procs] == [0] * self.procs_n
        assert list(self.counts) == [self.rounds * n] * self.procs_n
