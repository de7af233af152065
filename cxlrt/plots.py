"""Pictures of what `cxlrt demo` and `cxlrt info` report (``--plot FILE.png``).

matplotlib is optional (the ``plot`` extra): the functions here import it only
when called, with the Agg backend, so they work on a machine with no display and
cost nothing to a run that draws no picture.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

MODE_STYLE = {  # mode key -> (colour, marker): the same in every picture
    "nocache": ("#888888", "o"),
    "tcp": ("#d62728", "s"),
    "tcp_cache": ("#ff7f0e", "^"),
    "cxlrt": ("#1f77b4", "D"),
}


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install matplotlib "
                          "(or the `plot` extra: pip install -e '.[plot]')") from e
    matplotlib.use("Agg", force=True)  # files only: no display needed, none touched
    import matplotlib.pyplot as plt
    return plt


def check(path: str | os.PathLike[str]) -> str:
    """Refuse, before any work is done, a path that cannot take a PNG or a machine
    without matplotlib; returns the path."""
    path = _target(path)
    _pyplot()
    return path


def _target(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not path.lower().endswith(".png"):
        raise ValueError(f"--plot writes a PNG: give a path ending in .png, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot: folder {folder!r} does not exist")
    return path


_PNG_DOC = """
    path : str or path-like
        The PNG to write; its folder must exist.

    Returns
    -------
    str
        The path written.
    """


def _png(draw: Callable[[dict[str, Any], Any], Any]
         ) -> Callable[[dict[str, Any], str | os.PathLike[str]], str]:
    """A figure function ``f(data, path) -> path`` from ``draw(data, pyplot) -> figure``:
    the path check, the file and closing the figure are the same for every picture.
    ``draw``'s docstring ends in its data parameter; the path and return are added."""
    def figure(data: dict[str, Any], path: str | os.PathLike[str]) -> str:
        path = _target(path)
        plt = _pyplot()
        fig = draw(data, plt)
        fig.tight_layout()
        fig.savefig(path, format="png")
        plt.close(fig)
        return path
    # Not functools.wraps: its __wrapped__ would show draw's (data, pyplot) signature.
    figure.__name__, figure.__qualname__ = draw.__name__, draw.__qualname__
    figure.__doc__ = (draw.__doc__ or "").rstrip() + _PNG_DOC
    return figure


@_png
def demo_figure(report: dict[str, Any], plt: Any) -> Any:
    """Draw TTFT per turn for each mode of a demo report, with cxlrt's prefix hit
    rate on a second axis, to ``path`` (a .png).

    Parameters
    ----------
    report : dict
        What :func:`cxlrt.demo.run` returns (``cxlrt demo --json``).
    """
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    turns_seen = 0
    for key, mode in report["modes"].items():
        turns = mode["turns"]
        x = [t["turn"] for t in turns]
        y = [t["ttft_mean_s"] * 1e3 for t in turns]
        colour, marker = MODE_STYLE.get(key, ("black", "x"))
        ax.plot(x, y, marker=marker, color=colour, label=f"{mode['label']} TTFT")
        turns_seen = max(turns_seen, len(x))
    ax.set_xlabel("turn")
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_xticks(range(1, turns_seen + 1))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    cx = report["modes"].get("cxlrt")
    if cx is not None:
        hit = ax.twinx()
        rates = [100 * (t["prefix_hit_rate"] or 0.0) for t in cx["turns"]]
        hit.bar([t["turn"] for t in cx["turns"]], rates, width=0.35, alpha=0.18,
                color=MODE_STYLE["cxlrt"][0], label="cxlrt prefix hit rate")
        hit.set_ylabel("prefix hit rate (%)")
        hit.set_ylim(0, 105)
        h2, l2 = hit.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
        ax.set_zorder(hit.get_zorder() + 1)  # lines over the bars
        ax.patch.set_visible(False)
    cfg = report["config"]
    ax.set_title(f"cxlrt demo: {cfg['conversations']} conversations x {cfg['turns']} turns, "
                 f"P={cfg['prefill']} D={cfg['decode']}"
                 + ("" if report["ok"] else "  (TOKENS DIFFER)"), fontsize=10)
    ax.legend(handles, labels, fontsize=8, loc="upper left")
    return fig


@_png
def info_figure(info: dict[str, Any], plt: Any) -> Any:
    """Draw each KV cache of a region (``cxlrt info``): occupancy and pinned blocks
    against capacity, and the hit rate of its lookups, to ``path`` (a .png).

    Parameters
    ----------
    info : dict
        What :func:`cxlrt.inspect` returns (``cxlrt info --json``).
    """
    caches = [kv for kv in info.get("kv_caches", []) if "error" not in kv]
    fig, (occ, hits) = plt.subplots(1, 2, figsize=(9, 0.6 * max(len(caches), 1) + 2.4),
                                    dpi=110)
    names = [kv["name"] for kv in caches]
    y = list(range(len(caches)))
    if caches:
        cap = [kv["capacity_blocks"] for kv in caches]
        occ.barh(y, [100.0] * len(y), color="#eeeeee", label="capacity")
        occ.barh(y, [100 * kv["occupancy"] / c for kv, c in zip(caches, cap, strict=True)],
                 color="#1f77b4", label="occupied")
        occ.barh(y, [100 * kv.get("pinned_blocks", 0) / c
                     for kv, c in zip(caches, cap, strict=True)],
                 color="#ff7f0e", height=0.4, label="pinned")
        for i, (kv, c) in enumerate(zip(caches, cap, strict=True)):
            occ.text(101, i, f"{kv['occupancy']}/{c} blocks, {kv.get('pins', 0)} pins",
                     va="center", fontsize=8)
        looked = [kv["hits"] + kv["misses"] for kv in caches]
        hits.barh(y, [100 * kv["hits"] / n if n else 0 for kv, n in
                      zip(caches, looked, strict=True)], color="#2ca02c")
        for i, (kv, n) in enumerate(zip(caches, looked, strict=True)):
            hits.text(1, i, f"{kv['hits']} of {n} blocks looked up", va="center", fontsize=8)
    else:
        occ.text(0.5, 0.5, "no KV cache in this region", ha="center", va="center",
                 transform=occ.transAxes)
    for ax, what in ((occ, "share of capacity (%)"), (hits, "lookup hit rate (%)")):
        ax.set_yticks(y, names if ax is occ else [""] * len(y))
        ax.set_xlim(0, 140 if ax is occ else 100)
        ax.set_xlabel(what)
        ax.invert_yaxis()
    if caches:
        occ.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{info['spec']}: {len(caches)} KV cache(s)", fontsize=10)
    return fig
