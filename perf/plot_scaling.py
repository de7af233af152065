#!/usr/bin/env python3
"""Draw the scaling benchmarks (perf/test_scaling.py, issue 12) from a pytest-benchmark JSON.

    python -m pytest perf/test_scaling.py --benchmark-only --benchmark-json=/tmp/scaling.json
    python perf/plot_scaling.py /tmp/scaling.json            # writes perf/scaling_*.png

Writes three PNGs, each with the measured figures on the left and the ratio to the
baseline measured in the same run on the right:

``scaling_lookup.png``
    KV lookups/s against chain length (``file:``, ``emu:``, Python dict).
``scaling_handoffs.png``
    lock handoffs/s against process count (bakery, manager, pthread mutex).
``scaling_bandwidth.png``
    store and load GB/s against block size (``file:``, ``emu:``, numpy copy).

Absolute figures are each row's median round (the fastest round of a contended lock
row is often one where the processes happened to run one after another). Ratios are
the rows' headline ``ratio``: the median over rounds of the row against the baseline
run just before it (perf/conftest.py). A figure whose benchmarks are not in the JSON
is skipped with a note; a JSON with none of them, or one that cannot be read, exits
with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

FIGURES = {  # file stem -> the curves (extra_info["scaling"]) it draws
    "scaling_lookup": ("lookup",),
    "scaling_handoffs": ("handoffs",),
    "scaling_bandwidth": ("store", "load"),
}
FAMILIES = {  # curve -> (x label, y label, x formatter, is a throughput in bytes)
    "lookup": ("chain length (blocks)", "lookups/s", str, False),
    "handoffs": ("processes", "handoffs/s", str, False),
    "store": ("block size", "store GB/s", None, True),
    "load": ("block size", "load GB/s", None, True),
}
STYLE = {  # row label -> (colour, marker, line style): the same in every picture
    "file": ("#1f77b4", "D", "-"),
    "emu": ("#ff7f0e", "s", "-"),
    "bakery": ("#1f77b4", "D", "-"),
    "manager": ("#2ca02c", "^", "-"),
}
BASELINE_STYLE = ("#555555", "o", "--")


class BadInput(Exception):
    """The JSON cannot be read or holds no scaling benchmarks (exit status 2)."""


def _size(n: float) -> str:
    """64 KiB, 2 MiB, 32 MiB."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n:g} B"


def load_rows(path: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Read a pytest-benchmark JSON; returns {curve: {label: row}} for the scaling rows.

    Each row is ``{"baseline": bool, "x": [...], "value": [...], "ratio": [...]}``,
    sorted by x; ``value`` is per second (lookups, handoffs) or GB/s (store, load),
    from the median round; ``ratio`` is None on baseline rows.

    Raises
    ------
    BadInput
        The file is missing, not JSON, not a pytest-benchmark report, or has no
        scaling benchmarks in it.
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path} is not JSON: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise BadInput(f"{path} is not a pytest-benchmark JSON (no 'benchmarks' list)")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for b in doc["benchmarks"]:
        info = b.get("extra_info") if isinstance(b, dict) else None
        if not isinstance(info, dict) or info.get("scaling") not in FAMILIES:
            continue
        name = b.get("fullname") or b.get("name") or "?"
        try:
            family, x = info["scaling"], float(info["scaling_x"])
            median = float(b["stats"]["median"])
            if FAMILIES[family][3]:
                value = info.get("gb_per_s_median", info["bytes"] / median / 1e9)
            else:
                value = info.get("per_s_median", info["ops"] / median)
            baseline = bool(info.get("baseline"))
            ratio = None if baseline else float(info["ratio"])
            label = str(info.get("label", b.get("name")))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise BadInput(f"{path}: benchmark {name} lacks what a scaling row needs "
                           f"({type(e).__name__}: {e}); was it run with perf/conftest.py?"
                           ) from e
        row = out.setdefault(family, {}).setdefault(
            label, {"baseline": baseline, "x": [], "value": [], "ratio": []})
        row["x"].append(x)
        row["value"].append(float(value))
        row["ratio"].append(ratio)
    if not out:
        raise BadInput(f"{path} has no scaling benchmarks (extra_info 'scaling'): run "
                       "python -m pytest perf/test_scaling.py --benchmark-only "
                       "--benchmark-json=FILE")
    for rows in out.values():
        for row in rows.values():
            order = sorted(range(len(row["x"])), key=row["x"].__getitem__)
            for k in ("x", "value", "ratio"):
                row[k] = [row[k][i] for i in order]
    return out


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)  # files only: no display needed, none touched
    import matplotlib.pyplot as plt
    return plt


def _draw(ax_value, ax_ratio, family: str, rows: dict[str, dict[str, Any]]) -> None:
    """One curve: measured figures on `ax_value`, ratios to the baseline on `ax_ratio`."""
    xlabel, ylabel, fmt, in_bytes = FAMILIES[family]
    base = next((label for label, r in rows.items() if r["baseline"]), None)
    xs = sorted({x for r in rows.values() for x in r["x"]})
    for label, r in sorted(rows.items(), key=lambda kv: not kv[1]["baseline"]):
        colour, marker, ls = BASELINE_STYLE if r["baseline"] else STYLE.get(
            label, (None, "o", "-"))
        shown = f"{label} (baseline)" if r["baseline"] else label
        ax_value.plot(r["x"], r["value"], marker=marker, ls=ls, color=colour, label=shown)
        if not r["baseline"]:
            pts = [(x, q) for x, q in zip(r["x"], r["ratio"], strict=True) if q]
            ax_ratio.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ls=ls,
                          color=colour, label=label)
            for x, q in pts:
                text = f"{q:.2f}x" if q >= 0.1 else f"{q:.2g}x"
                ax_ratio.annotate(text, (x, q), textcoords="offset points", xytext=(4, 4),
                                  fontsize=7, color=colour)
    ticks = [fmt(int(x)) if fmt else _size(x) for x in xs]
    for ax in (ax_value, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, ticks)
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    if in_bytes:
        ax_value.set_ylim(bottom=0)  # a few GB/s: linear reads better
    else:
        ax_value.set_yscale("log")  # rates span decades
    ax_value.set_ylabel(ylabel + " (median round)")
    ratios = [q for r in rows.values() for q in r["ratio"] if q]
    if ratios and max(ratios) / min(ratios) > 20:
        ax_ratio.set_yscale("log")
    else:  # from 0: a 10 % wobble should look like one
        ax_ratio.set_ylim(0, max([1.0, *ratios]) * 1.15)
    ax_ratio.margins(x=0.08)  # room for the labels of the last point
    ax_ratio.axhline(1.0, color=BASELINE_STYLE[0], ls="--", lw=1)
    ax_ratio.set_ylabel(f"ratio to {base or 'baseline'} (higher is better, paired rounds)")


def plot(rows: dict[str, dict[str, dict[str, Any]]], out_dir: str, dpi: int
         ) -> tuple[list[str], list[str]]:
    """Write each figure whose curves are in `rows`; returns (paths written, stems skipped)."""
    plt = _pyplot()
    written, skipped = [], []
    titles = {"lookup": "KV lookup rate against chain length",
              "handoffs": "Lock handoffs/s against process count (2 cores)",
              "store": "KV store bandwidth against block size",
              "load": "KV load bandwidth against block size"}
    for stem, families in FIGURES.items():
        present = [f for f in families if f in rows]
        if not present:
            skipped.append(stem)
            continue
        fig, axes = plt.subplots(len(present), 2, figsize=(12, 4.6 * len(present)),
                                 squeeze=False)
        for (ax_value, ax_ratio), family in zip(axes, present, strict=True):
            _draw(ax_value, ax_ratio, family, rows[family])
            ax_value.set_title(titles[family], fontsize=10)
            ax_ratio.set_title(titles[family].split(" against")[0] + ": ratio to baseline",
                               fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, stem + ".png")
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)
    return written, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plot_scaling.py",
        description="Draw perf/test_scaling.py's benchmarks (issue 12) from a "
                    "pytest-benchmark JSON into scaling_lookup.png, scaling_handoffs.png "
                    "and scaling_bandwidth.png: measured figures (median round) on the "
                    "left, ratios to the baseline of the same run on the right.",
        epilog="Make the JSON with: python -m pytest perf/test_scaling.py --benchmark-only "
               "--benchmark-json=FILE. Exit status 2: the JSON is missing, unreadable, "
               "or has no scaling benchmarks.")
    parser.add_argument("json", metavar="FILE.json",
                        help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)),
                        help="folder for the PNGs (default: perf/, next to this script)")
    parser.add_argument("--dpi", type=int, default=120,
                        help="resolution of the PNGs (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.dpi <= 0:
        parser.error(f"--dpi must be positive, got {args.dpi}")
    if not os.path.isdir(args.out_dir):
        parser.error(f"--out-dir {args.out_dir!r} is not a folder")
    try:
        rows = load_rows(args.json)
    except BadInput as e:
        parser.error(str(e))  # exits with status 2
    try:
        written, skipped = plot(rows, args.out_dir, args.dpi)
    except ImportError as e:
        print(f"plot_scaling.py: needs matplotlib ({e}): pip install -e '.[plot]'",
              file=sys.stderr)
        return 1
    for stem in skipped:
        print(f"plot_scaling.py: no {'/'.join(FIGURES[stem])} benchmarks in {args.json}: "
              f"{stem}.png not written", file=sys.stderr)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
