"""README's two lead commands are exactly what CI runs (issue 15): a newcomer who pastes
them does what CI does, and a step CI needs cannot hide outside them."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def lead_commands() -> list[str]:
    """The first two fenced blocks of README.md, one command each."""
    blocks = re.findall(r"^```\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    cmds = [b.strip() for b in blocks[:2]]
    assert all("\n" not in c for c in cmds), f"a lead block holds more than one line: {cmds}"
    return cmds


def test_readme_leads_with_the_demo_then_the_tests():
    demo, tests = lead_commands()
    assert demo.endswith("cxlrt demo") and "pip install" in demo
    assert tests.endswith("python -m pytest") and '".[test]"' in tests
    for cmd in (demo, tests):  # fresh machine: they make their own venv
        assert cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && ")


def test_ci_runs_both_lead_commands_verbatim_in_order():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    demo, tests = lead_commands()
    assert demo in lines and tests in lines, "README's lead commands are not in .ci/run"
    assert lines.index(demo) < lines.index(tests)
    # Nothing before them installs what they need: before the test command only the
    # lab and the linters (ruff) are set up.
    before = lines[:lines.index(tests)]
    installs = [ln for ln in before if re.search(r"\bpip\b.*\binstall\b", ln) and ln != demo]
    assert all("ruff" in ln for ln in installs), f"CI-only installs before the tests: {installs}"
