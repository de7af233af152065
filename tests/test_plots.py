"""`cxlrt demo --plot` and `cxlrt info --plot`: a real PNG, drawn from the real report."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the `plot` extra)")


def cxlrt(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "cxlrt", *args], capture_output=True, text=True,
                       timeout=240)
    if check and p.returncode != 0:
        raise AssertionError(f"cxlrt {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


def png_size(path):
    """(width, height) of a PNG, after checking its signature and header chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG: {head[:8]!r}"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def ink(path):
    """How many distinct colours the picture holds: a blank canvas has one."""
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    return len({tuple(px) for px in img.reshape(-1, img.shape[-1])[::7].tolist()})


def test_demo_plot_is_a_png_of_every_mode(tmp_path):
    out = tmp_path / "ttft.png"
    p = cxlrt("demo", "--quick", "--plot", str(out))
    assert f"plot written to {out}" in p.stderr
    w, h = png_size(out)
    assert w >= 600 and h >= 300
    assert ink(out) > 20  # lines, bars, text: not an empty figure


def test_demo_plot_draws_what_the_report_says(tmp_path):
    # The figure's data are the report's: one line per mode, one bar per turn.
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from cxlrt import plots
    turns = [{"turn": t, "ttft_mean_s": 0.1 * t, "prefix_hit_rate": 0.25 * t}
             for t in (1, 2, 3)]
    report = {"ok": True, "config": {"conversations": 2, "turns": 3, "prefill": 1, "decode": 1},
              "modes": {k: {"label": k, "turns": turns} for k in ("nocache", "tcp", "cxlrt")}}
    drawn = {}
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        ax = fig.axes[0]
        drawn["lines"] = [list(line.get_ydata()) for line in ax.get_lines()]
        drawn["bars"] = [b.get_height() for b in fig.axes[1].patches]
        return real(fig, *a, **kw)

    plt.Figure.savefig = spy
    try:
        plots.demo_figure(report, tmp_path / "x.png")
    finally:
        plt.Figure.savefig = real
    assert drawn["lines"] == [pytest.approx([100.0, 200.0, 300.0])] * 3
    assert drawn["bars"] == pytest.approx([25.0, 50.0, 75.0])


def test_info_plot_shows_occupancy_pins_and_hits(region_dir, tmp_path):
    import cxlrt as rt
    spec = f"file:{region_dir}/rack"
    out = tmp_path / "info.png"
    with rt.open(spec, node=0, create=True, size="8M", nodes=2) as r:
        c = rt.KVCache(r, "llama", block_bytes=4096, capacity_blocks=16, salt=b"m")
        keys = c.block_hashes(range(64))
        c.store(keys, [bytes(4096)] * 4)
        hit = c.lookup(keys[:3])  # three blocks pinned while info reads the region
        human = cxlrt("info", spec, "--plot", str(out))
        hit.release()
    assert "4/16 blocks" in human.stdout and "3 pinned (3 pins)" in human.stdout
    png_size(out)
    assert ink(out) > 10


@pytest.mark.parametrize("path,msg", [("x.jpg", "ending in .png"),
                                      ("/nonexistent/dir/x.png", "does not exist")])
def test_a_bad_plot_path_fails_before_any_work(path, msg):
    p = cxlrt("demo", "--quick", "--plot", path, check=False)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
    assert "tokens equal" not in p.stdout  # refused before the demo ran
