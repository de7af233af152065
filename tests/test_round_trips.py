"""perf/round_trips.py: the counts behind README's "No line cache, measured"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "round_trips.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=120)


def test_counts_back_the_readme(tmp_path):
    out = tmp_path / "rt.json"
    p = _run("--reps", "5", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["op"].split(" (")[0]: r for r in json.loads(out.read_text())["rows"]}
    # One READ to observe either way; a publish of a line not cached fills it first.
    assert (rows["observe"]["now"], rows["observe"]["cache"], rows["observe"]["nofill"]) \
        == (1, 1, 1)
    assert (rows["publish"]["now"], rows["publish"]["cache"], rows["publish"]["nofill"]) \
        == (1, 2, 1)
    # README's claim: a write-allocate cache never saves a round trip, and one that
    # never fills on a store would send at least 85 % of today's requests.
    for name, r in rows.items():
        assert r["now"] > 0, name
        assert r["cache"] >= r["now"] and r["nofill"] >= 0.85 * r["now"], (name, r)
    # README's figures for what batching did: a bakery cycle is 8 requests, and a
    # lookup's pins and second looks go as gathers and scatters (194 before, at 32).
    assert rows["bakery lock acquire + release"]["now"] == 8
    assert rows["KV lookup, 8-block chain"]["now"] == 15
    assert rows["KV lookup, 32-block chain"]["now"] == 39
    assert "| bakery lock acquire + release |" in p.stdout


def test_bad_arguments_are_refused():
    p = _run("--nodes", "1")
    assert p.returncode == 2 and "--nodes" in p.stderr
