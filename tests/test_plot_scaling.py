"""perf/plot_scaling.py: PNGs from a pytest-benchmark JSON, and exit status 2 on bad input."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "plot_scaling.py"
PNGS = ["scaling_lookup.png", "scaling_handoffs.png", "scaling_bandwidth.png"]

# curve -> (group prefix, x values, baseline label, row labels, throughput in bytes)
CURVES = {
    "lookup": ("scaling_lookup", [8, 32, 128, 512], "python dict", ["file", "emu"], False),
    "handoffs": ("scaling_handoffs", [2, 4, 8, 16], "pthread mutex", ["bakery", "manager"],
                 False),
    "store": ("scaling_store", [64 << 10, 2 << 20, 32 << 20], "numpy copy", ["file", "emu"],
              True),
    "load": ("scaling_load", [64 << 10, 2 << 20, 32 << 20], "numpy copy", ["file", "emu"],
             True),
}


def _row(curve: str, x: int, label: str, baseline: bool, k: int) -> dict:
    """One benchmark as pytest-benchmark writes it, with perf/conftest.py's extra_info."""
    group, _, _, _, in_bytes = CURVES[curve]
    median = 1e-3 * (k + 1) * x ** 0.5
    info: dict = {"label": label, "scaling": curve, "scaling_x": x}
    if in_bytes:
        info.update(bytes=32 << 20, gb_per_s_median=(32 << 20) / median / 1e9)
    else:
        info.update(ops=1000, rate=curve, per_s_median=1000 / median)
    if baseline:
        info["baseline"] = True
    else:
        info["ratio"] = 1.0 / (k + 1)
    return {"group": f"{group}_{x}", "name": f"test_{curve}[{x}-{label}]",
            "fullname": f"perf/test_scaling.py::test_{curve}[{x}-{label}]",
            "stats": {"min": median * 0.9, "median": median, "max": median * 1.2, "rounds": 5},
            "extra_info": info}


def _report(curves=tuple(CURVES), extra=()) -> dict:
    rows = list(extra)
    for curve in curves:
        _, xs, base, labels, _ = CURVES[curve]
        for x in xs:
            rows.append(_row(curve, x, base, True, 0))
            rows.extend(_row(curve, x, label, False, k + 1) for k, label in enumerate(labels))
    return {"machine_info": {}, "commit_info": {}, "benchmarks": rows, "version": "5.1.0"}


def _write(path: Path, doc) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and header chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG: {head[:8]!r}"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_three_pngs_from_a_report(tmp_path):
    pytest.importorskip("matplotlib", reason="plot_scaling.py needs matplotlib (`plot` extra)")
    src = _write(tmp_path / "scaling.json", _report())
    out = tmp_path / "out"
    out.mkdir()
    p = run(src, "--out-dir", out, "--dpi", 50)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(out / name) for name in PNGS]
    for name in PNGS:
        w, h = png_size(out / name)
        assert w == 12 * 50  # 12-inch wide figures at --dpi 50
        assert h >= 200
    # --dpi scales the picture
    p = run(src, "--out-dir", out, "--dpi", 100)
    assert p.returncode == 0, p.stderr
    assert png_size(out / PNGS[0])[0] == 12 * 100


def test_partial_report_writes_what_it_has(tmp_path):
    pytest.importorskip("matplotlib", reason="plot_scaling.py needs matplotlib (`plot` extra)")
    src = _write(tmp_path / "lookup.json", _report(curves=["lookup", "load"]))
    p = run(src, "--out-dir", tmp_path)
    assert p.returncode == 0, p.stderr
    png_size(tmp_path / "scaling_lookup.png")
    png_size(tmp_path / "scaling_bandwidth.png")  # load alone still makes the picture
    assert not (tmp_path / "scaling_handoffs.png").exists()
    assert "no handoffs benchmarks" in p.stderr


_OTHER = {"group": "kv_lookup_32", "name": "test_lookup", "stats": {"median": 1e-3},
          "extra_info": {"label": "file", "ops": 200, "ratio": 0.4}}
_BROKEN = _row("lookup", 8, "file", False, 1)
del _BROKEN["extra_info"]["ratio"]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "is not a pytest-benchmark JSON"),
    ({"benchmarks": "nope"}, "is not a pytest-benchmark JSON"),
    ({"benchmarks": []}, "has no scaling benchmarks"),
    ({"benchmarks": [_OTHER]}, "has no scaling benchmarks"),
    (_report(extra=[_BROKEN]), "lacks what a scaling row needs"),
], ids=["missing", "not-json", "not-a-report", "bad-list", "empty", "other-benchmarks",
        "row-without-ratio"])
def test_bad_input_exits_2(tmp_path, content, message):
    src = tmp_path / "in.json"
    if content is not None:
        _write(src, content)
    p = run(src, "--out-dir", tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "plot_scaling.py: error:" in p.stderr and message in p.stderr, p.stderr
    assert str(src) in p.stderr  # says which file
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("args, message", [
    (["--dpi", "0"], "--dpi must be positive"),
    (["--out-dir", "/nonexistent/folder"], "is not a folder"),
], ids=["dpi", "out-dir"])
def test_bad_options_exit_2(tmp_path, args, message):
    src = _write(tmp_path / "scaling.json", _report())
    p = run(src, *args)
    assert p.returncode == 2
    assert message in p.stderr


def test_help():
    p = run("--help")
    assert p.returncode == 0
    for word in ("--out-dir", "--dpi", "FILE.json", "--benchmark-json", "Exit status 2"):
        assert word in p.stdout
