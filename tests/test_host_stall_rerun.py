"""A failure the runtime blames on the host is run once more; every other failure fails.

tests/conftest.py sets this up (pytest-rerunfailures): a LeaseLost whose message says the
heartbeat thread was not run (liveness.pyx's _HOST_STALL) is the machine's doing. A
heartbeat blocked in its beat, or any other failure, is the code's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import os
import pytest
from cxlrt.errors import LeaseLost
from cxlrt.liveness import _HOST_STALL

STALL = "lock 'x': silent (the heartbeat thread has not run for 1.2 s; " + _HOST_STALL + ")"
BLOCKED = "lock 'x': silent (the heartbeat has been inside one beat for 1.1 s: the medium"

def _first(name):
    p = os.path.join(os.path.dirname(__file__), name + ".seen")
    first = not os.path.exists(p)
    open(p, "a").close()
    return first

def test_stalled_by_the_host_once():
    if _first("stalled"):
        raise LeaseLost(STALL)

def test_stalled_by_the_host_twice():
    raise LeaseLost(STALL)

def test_a_childs_stall_once():  # as tests/nodes.raise_failures re-raises it
    if _first("child"):
        raise AssertionError("process 1 failed:\\ntraceback") from LeaseLost(STALL)

def test_blocked_heartbeat_once():
    if _first("blocked"):
        raise LeaseLost(BLOCKED)

def test_an_assert_while_handling_a_stall_once():
    if _first("handling"):
        try:
            raise LeaseLost(STALL)
        except LeaseLost:
            assert 1 == 2

def test_wrong_value_once():
    if _first("wrong"):
        assert 1 == 2
'''


def test_only_a_silence_the_host_made_is_run_again(tmp_path, pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("rerunfailures"), \
        "pytest-rerunfailures is missing: pip install -e '.[test]'"
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure  # noqa: F401\n")
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(CASES))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options are not the inner one's
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rA", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    for passed in ("test_stalled_by_the_host_once", "test_a_childs_stall_once"):
        assert f"PASSED test_cases.py::{passed}" in text, text
    for failed in ("test_stalled_by_the_host_twice", "test_blocked_heartbeat_once",
                   "test_an_assert_while_handling_a_stall_once", "test_wrong_value_once"):
        assert f"FAILED test_cases.py::{failed}" in text, text
    assert "2 passed" in text and "4 failed" in text and "3 rerun" in text, text
