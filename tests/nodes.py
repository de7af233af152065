"""Run test bodies as separate processes, one or more per node."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import traceback
from contextlib import contextmanager

_CTX = mp.get_context("fork")


def _child(q, i, fn, args):
    try:
        q.put((i, "ok", fn(*args), None))
    except BaseException as e:  # report everything, KeyboardInterrupt included
        try:
            q.put((i, "err", e, traceback.format_exc()))
        except Exception:
            q.put((i, "err", RuntimeError(repr(e)), traceback.format_exc()))


def run_procs(fn, arglists, *, timeout: float = 120.0) -> list:
    """Run ``fn(*args)`` in one process per entry of `arglists`; return results in order.

    Returns a list whose items are the return values, or the exception a child
    raised (the caller decides whether that is a failure). A child that dies
    without reporting, or outlives `timeout`, fails the test.
    """
    q = _CTX.Queue()
    ps = [_CTX.Process(target=_child, args=(q, i, fn, a), daemon=True)
          for i, a in enumerate(arglists)]
    for p in ps:
        p.start()
    out: list = [None] * len(ps)
    got = 0
    tbs = {}
    try:
        while got < len(ps):
            i, status, value, tb = q.get(timeout=timeout)
            out[i] = value
            if tb:
                tbs[i] = tb
            got += 1
    finally:
        for p in ps:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for i, p in enumerate(ps):
        if p.exitcode not in (0, None) and out[i] is None:
            raise AssertionError(f"process {i} died with exit code {p.exitcode}")
    for i, v in enumerate(out):
        if isinstance(v, BaseException):
            v.__cxl_traceback__ = tbs.get(i, "")
    return out


def raise_failures(results) -> list:
    """Re-raise the first exception a child reported; else return the results. A child's
    host stall (a LeaseLost the OS caused, which the suite reruns) comes last, so that
    it never stands in for another child's failure."""
    from cxlrt.errors import LeaseLost
    order = sorted(range(len(results)),
                   key=lambda i: isinstance(results[i], LeaseLost) and results[i].host_stall)
    for i in order:
        v = results[i]
        if isinstance(v, BaseException):
            tb = getattr(v, "__cxl_traceback__", "")
            raise AssertionError(f"process {i} failed:\n{tb}") from v
    return results


@contextmanager
def host_lock(path: str):
    """An external lock (flock on one host) for protocols tested before cxlrt has its own."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
