"""Clocks of different hosts disagree: liveness must not depend on them (issue 9).

A holder runs with its wall clock (CLOCK_REALTIME) set back by many leases, as a
host whose NTP failed would be. Nothing may judge it dead for that: another node
must not get the lock it holds. The skew comes from a tiny LD_PRELOAD shim built
here, so the holder is a fresh interpreter (not a fork).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.nodes import raise_failures, run_procs

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
typedef int (*cg_fn)(clockid_t, struct timespec *);
int clock_gettime(clockid_t id, struct timespec *ts)
{
    static cg_fn real;
    if (!real)
        real = (cg_fn)dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    const char *s = getenv("SKEW_S");
    if (rc == 0 && id == CLOCK_REALTIME && s)
        ts->tv_sec += atol(s);
    return rc;
}
"""

HOLDER = textwrap.dedent("""
    import sys, time, cxlrt
    from cxlrt.lock import LeaseLost
    r = cxlrt.open(sys.argv[1], node=1)
    lock = r.lock("skew")
    lock.acquire()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    try:
        lock.release()
        print("released", flush=True)
    except LeaseLost:
        print("LeaseLost", flush=True)
    r.close()
""")


@pytest.fixture(scope="module")
def skew_shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the clock shim")
    d = tmp_path_factory.mktemp("shim")
    (d / "skew.c").write_text(SHIM)
    so = d / "libskew.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(d / "skew.c"), "-ldl"],
                   check=True)
    return str(so)


def _try_acquire(spec, node, timeout):
    import cxlrt
    r = cxlrt.open(spec, node=node)
    ok = r.lock("skew").acquire(timeout=timeout)
    r.close()
    return ok


@pytest.mark.crash
@pytest.mark.parametrize("skew_s", [-30, 30])
def test_a_holder_whose_clock_is_off_by_many_leases_keeps_its_lock(backend, skew_shim, skew_s):
    lease = 0.5
    r0 = backend.create(nodes=3, lease=lease)
    r0.lock("skew")
    env = dict(os.environ, LD_PRELOAD=skew_shim, SKEW_S=str(skew_s))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, backend.spec(), str(6 * lease)],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (ok,) = raise_failures(run_procs(_try_acquire, [(backend.spec(), 2, 4 * lease)]))
        assert not ok, f"a clock {skew_s:+d} s off made a live holder look dead"
        assert holder.stdout.readline().strip() == "released"
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    r0.close()
