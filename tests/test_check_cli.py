"""`cxlrt check` and `cxlrt lockmgr` from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import cxlrt


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "cxlrt", *args], capture_output=True, text=True,
                       timeout=120)
    if check and p.returncode not in (0, 1):
        raise AssertionError(f"cxlrt {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


def test_check_clean_region_exits_0(region_dir):
    spec = f"emu:{region_dir}/r"
    run("format", spec, "--size", "8M", "--nodes", "3")
    with cxlrt.open(spec, node=1) as r:
        r.put("root", r.alloc(1000))
    p = run("check", spec)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "clean" in p.stdout and "1000" not in p.stderr
    report = json.loads(run("check", spec, "--json").stdout)
    assert report["problems"] == [] and report["directory"].keys() == {"root"}
    assert report["usage"]["small_objects"] == 1


def _hold_and_die(spec):
    r = cxlrt.open(spec, node=1)
    r.lock("job").acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_check_reports_dead_holder_and_repair_fixes_it(region_dir):
    import multiprocessing as mp
    spec = f"file:{region_dir}/r"
    run("format", spec, "--size", "8M", "--nodes", "2", "--lease", "0.3")
    p = mp.get_context("fork").Process(target=_hold_and_die, args=(spec,))
    p.start()
    p.join()
    time.sleep(0.8)
    bad = run("check", spec)
    assert bad.returncode == 1
    assert "dead node 1 still holds" in bad.stdout and "node 1 is dead" in bad.stdout
    fixed = run("check", spec, "--repair", "--node", "1")
    assert "released node 1's hold/request on lock 'job'" in fixed.stdout
    time.sleep(0.8)
    assert run("check", spec).returncode == 0


def test_repair_needs_a_node(region_dir):
    spec = f"file:{region_dir}/r"
    run("format", spec, "--size", "8M", "--nodes", "2")
    p = run("check", spec, "--repair", check=False)
    assert p.returncode == 2 and "--node" in p.stderr


def test_lockmgr_serves_manager_locks(region_dir):
    spec = f"file:{region_dir}/r"
    run("format", spec, "--size", "8M", "--nodes", "2")
    for value in ("-1", "inf", "nan", "soon"):
        bad = run("lockmgr", spec, "--spin", value, check=False)
        assert bad.returncode == 2 and "expected seconds" in bad.stderr, (value, bad.stderr)
    mgr = subprocess.Popen([sys.executable, "-m", "cxlrt", "lockmgr", spec, "--node", "0",
                            "--spin", "0.001"], stderr=subprocess.PIPE, text=True)
    try:
        with cxlrt.open(spec, node=1) as r:
            lock = r.lock("m", mode="manager")
            assert lock.acquire(timeout=20)
            lock.release()
            assert r.locks.manager_info()["node"] == 0
    finally:
        mgr.send_signal(signal.SIGINT)
        _, err = mgr.communicate(timeout=20)
    assert mgr.returncode == 0, err
    assert "granting manager-mode locks" in err
