"""perf/ harness: scratch regions, and every benchmark's ratio to its group's baseline.

Machines are noisy, so no benchmark asserts a time. Each group holds one
baseline row measured in the same run, and every other row is reported relative
to it. Rows go through :class:`Bench` (fixture ``bench``), which fills
``benchmark.extra_info``:

``label``
    what the row is, as printed (``"file"``, ``"numpy copy"``).
``baseline``
    True on the one row of the group the others are divided by.
``bytes``
    bytes moved per call (throughput groups): ratio = baseline time / time, so
    0.97x means 97 % of the baseline's throughput.
``ops``
    operations per call (cost groups): ratio = time / baseline time, so 4x means
    four times the baseline's cost; ns/op is reported too. Rows of one group may
    do different numbers of ops per call (a slow row loops fewer times): every
    ratio compares time per op.
``op``
    optional name of one op in the summary (``"pair"`` prints ns/pair).
``rate``
    with ``ops``: the ops are counted as a rate (``"handoffs"``), so the group is
    a throughput group (ratio = baseline time per op / time per op) and the row
    reports ops per second.
``note``
    optional text appended to the row's summary line.
``target``
    optional ``{"min_ratio": x}``, ``{"max_ratio": x}`` or ``{"max_ns_per_op": y}``;
    reported, never asserted.
``paired_label``, ``paired_baseline_s``, ``paired_ops``
    the baseline re-run just before each timed round, and its ops per call when
    they differ from the row's (see :meth:`Bench.run`).

Before pytest-benchmark writes ``--benchmark-json`` this file adds to each row:

``ratio``
    the headline: for paired rows the median over rounds of the per-round ratio;
    otherwise ``ratio_row``.
``ratio_row``, ``ratio_row_median``
    min/min and median/median against the group's baseline row, which ran
    seconds earlier or later; on a shared machine they drift by +-15 %.
``ratio_paired_min``
    min over rounds of the paired baseline against the row's min.
``gb_per_s``, ``ns_per_op``, ``per_s`` (and ``_median``)
    from the row's min (median) round.
``target_met``
    the target verdict.

The terminal summary prints one line per row.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

import cxlrt
from cxlrt import nodelocal, shm
from cxlrt.mapping import Mapping

REGION_SIZE = "256M"
SMALL_REGION_SIZE = "64M"  # lock and allocator benchmarks (small_regions)
NODES = 4

SPECS = {
    "file": "file:{path}",
    # The emulation with every fault off: no evictions, no delayed flushes, no
    # modelled latency. `emu-check` adds the checker, for information only.
    "emu": "emu:{path}?seed=1&evict=0&delay=0&lat=0&check=0",
    "emu-check": "emu:{path}?seed=1&evict=0&delay=0&lat=0&check=1",
    # A capacity tier slower than memory: DMA at a modelled 2 or 8 GB/s (test_staging.py).
    "emu-2GBps": "emu:{path}?seed=1&evict=0&delay=0&lat=0&check=0&bw=2",
    "emu-8GBps": "emu:{path}?seed=1&evict=0&delay=0&lat=0&check=0&bw=8",
    # The CXL-HM device model (test_chm.py, chm_turns.py's defaults): 16 MiB of device
    # DRAM in 64 KiB pages over an SSD of 20 us a request, 4 GB/s read, 2 GB/s write.
    "chm-lru": "chm:{path}?policy=lru&dram=16M&page=64K&lat=20000&bw=4&wbw=2",
    "chm-staging": "chm:{path}?policy=staging&dram=16M&page=64K&lat=20000&bw=4&wbw=2",
}
LABELS = {"file": "file", "emu": "emu", "emu-check": "emu check=1"}  # others: the case as is

_ROWS = pytest.StashKey[list]()


# --- regions ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def perf_dir() -> Iterator[str]:
    """The session's private directory under /dev/shm, removed at the end."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="cxlrt-perf-", dir=shm)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _discard(region: cxlrt.Region, path: str) -> None:
    """Close a region and delete every file it left: the region, the `.emu`
    sidecar, and the node-local files of its lock service (all nodes, since
    forked benchmark processes attach as other nodes)."""
    uuid, nodes = region.uuid, region.nodes
    try:
        region.close()
    finally:
        for p in (path, path + ".emu"):
            if os.path.exists(p):
                os.unlink(p)
        nodelocal.remove_files(uuid, nodes)


@pytest.fixture(scope="session")
def regions(perf_dir: str) -> Iterator[Callable[[str], cxlrt.Region]]:
    """``regions(kind)``: node 0 of a fresh region of that kind (see SPECS), opened once.

    The regions live in a private directory under /dev/shm; the region files, the
    emulation's ``.emu`` sidecars and any node-local lock files are removed at
    the end of the session.
    """
    opened: dict[str, cxlrt.Region] = {}

    def get(kind: str) -> cxlrt.Region:
        if kind not in opened:
            spec = SPECS[kind].format(path=os.path.join(perf_dir, kind))
            opened[kind] = cxlrt.open(spec, node=0, create=True, size=REGION_SIZE, nodes=NODES)
        return opened[kind]

    try:
        yield get
    finally:
        for kind, region in opened.items():
            _discard(region, os.path.join(perf_dir, kind))


@pytest.fixture(scope="session")
def small_regions(perf_dir: str) -> Iterator[Callable[..., cxlrt.Region]]:
    """``small_regions(kind, lock_manager=False)``: node 0 of a fresh 64 MiB region.

    For the lock and allocator benchmarks. They get regions of their own because
    test_dma.py copies raw bytes over the start of the ``regions`` heap, where the
    allocator would put its chunks. ``lock_manager=True`` opens a separate region
    whose lock manager runs in a thread of this process. Everything is removed at
    the end of the session, node-local files included.
    """
    with _region_cache(perf_dir) as open_once:
        def get(kind: str, *, lock_manager: bool = False) -> cxlrt.Region:
            name = f"small-{kind}" + ("-mgr" if lock_manager else "")
            return open_once(name, kind, size=SMALL_REGION_SIZE, nodes=NODES,
                             lock_manager=lock_manager)
        yield get


@pytest.fixture(scope="module")
def mutex(perf_dir: str, request) -> Iterator[Mapping]:
    """The baseline of the lock benchmarks: a robust process-shared pthread mutex at
    offset 0 of a 4 KiB zero file (one per module)."""
    path = os.path.join(perf_dir, f"mutex-{request.module.__name__}")
    with open(path, "wb") as f:
        f.write(bytes(4096))
    m = Mapping(path, 4096)
    shm.init_robust_mutexes(m, 0, 1, 64)
    yield m
    m.close()
    os.unlink(path)


@pytest.fixture(scope="session")
def sized_regions(perf_dir: str) -> Iterator[Callable[..., cxlrt.Region]]:
    """``sized_regions(name, kind, size=, nodes=, lease=None, lock_manager=False)``:
    node 0 of a fresh region of that kind, size and node count, opened once per name.

    For benchmarks that need more room or more nodes than ``regions`` and
    ``small_regions`` give (perf/test_scaling.py: 32 MiB blocks, 16 processes).
    ``lease`` (seconds) is passed to :func:`cxlrt.open` when creating. Everything
    is removed at the end of the session, node-local files included.
    """
    with _region_cache(perf_dir) as open_once:
        yield lambda name, kind, **kw: open_once(f"sized-{name}", kind, **kw)


@contextlib.contextmanager
def _region_cache(perf_dir: str) -> Iterator[Callable[..., cxlrt.Region]]:
    """``open_once(name, kind, size=, nodes=, lease=None, lock_manager=False)``: node 0
    of a fresh region in perf_dir/name, opened once per name; all discarded at the end."""
    opened: dict[str, tuple[cxlrt.Region, str]] = {}

    def open_once(name: str, kind: str, *, size: str, nodes: int, lease: float | None = None,
                  lock_manager: bool = False) -> cxlrt.Region:
        if name not in opened:
            path = os.path.join(perf_dir, name)
            region = cxlrt.open(SPECS[kind].format(path=path), node=0, create=True, size=size,
                                nodes=nodes, lease=lease, lock_manager=lock_manager)
            opened[name] = (region, path)
        return opened[name][0]

    try:
        yield open_once
    finally:
        for region, path in opened.values():
            _discard(region, path)


class Bench:
    """The one harness every benchmark goes through: name the row, then time it.

    ``describe(group, case, baseline=None, **info)`` names the row: ``case`` is
    a region kind (labelled from LABELS); the group's baseline row passes
    ``baseline="its label"`` instead. ``info`` goes into extra_info (``bytes``,
    ``ops``, ``target``).

    ``run(fn, rounds=, warmup=, paired=None)`` times ``fn`` with
    ``benchmark.pedantic`` and returns its last result, for the caller to check.
    With ``paired=(label, baseline_fn)`` the baseline is also run, and timed
    here, just before every round: each round then has a partner measured a few
    milliseconds apart, and the ratio is taken per round, which cancels the
    slow drift of a shared machine that separate baseline rows cannot. When the
    baseline does a different number of ops per call than the row, pass
    ``paired=(label, baseline_fn, baseline_ops)``: ratios then compare time per op.
    """

    def __init__(self, benchmark):
        self.benchmark = benchmark
        self.extra_info = benchmark.extra_info

    def describe(self, group: str, case: str, baseline: str | None = None, **info) -> None:
        self.benchmark.group = group
        self.extra_info["label"] = baseline or LABELS.get(case, case)
        if baseline:
            self.extra_info["baseline"] = True
        self.extra_info.update({k: v for k, v in info.items() if v is not None})

    def run(self, fn: Callable[[], object], *, rounds: int, warmup: int,
            paired: tuple | None = None) -> object:
        if paired is None:
            return self.benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup)
        label, baseline_fn, *ops = paired
        times: list[float] = []

        def setup() -> None:  # untimed by pytest-benchmark: we time it
            t0 = time.perf_counter()
            baseline_fn()
            times.append(time.perf_counter() - t0)

        result = self.benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=warmup)
        self.extra_info["paired_label"] = label
        self.extra_info["paired_baseline_s"] = times[warmup:]  # one per timed round
        if ops:
            self.extra_info["paired_ops"] = ops[0]
        return result


@pytest.fixture
def bench(benchmark) -> Bench:
    """The harness around pytest-benchmark's ``benchmark`` (see :class:`Bench`)."""
    return Bench(benchmark)


# --- ratios -----------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_ROWS] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # raises when the test failed: a failed check records nothing
    fixture = getattr(item, "funcargs", {}).get("benchmark")
    if fixture is not None and fixture.stats is not None:  # None with --benchmark-disable
        item.config.stash[_ROWS].append(fixture.stats)
    return result


def _groups(rows: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for row in rows:
        out.setdefault(row.group or "", []).append(row)
    for members in out.values():
        members.sort(key=lambda r: not r.extra_info.get("baseline"))  # baseline first
    return dict(sorted(out.items()))


def _throughput(info: dict) -> bool:
    return "bytes" in info or "rate" in info


def _ratio(info: dict, base_s: float, row_s: float) -> float:
    """Throughput rows: base/row (higher is better). Cost rows: row/base (lower is better)."""
    return base_s / row_s if _throughput(info) else row_s / base_s


def _per_row_ops(info: dict, base_ops) -> float:
    """Factor that scales a baseline time to the row's ops per call (1 if not given)."""
    return info["ops"] / base_ops if base_ops and "ops" in info else 1.0


def _annotate(rows: list) -> None:
    """Add ratios, rates and target verdicts to each row's extra_info."""
    for members in _groups(rows).values():
        base = next((r for r in members if r.extra_info.get("baseline")), None)
        for row in members:
            info, st = row.extra_info, row.stats
            if "bytes" in info:
                info["gb_per_s"] = info["bytes"] / st.min / 1e9
                info["gb_per_s_median"] = info["bytes"] / st.median / 1e9
            if "ops" in info:
                info["ns_per_op"] = st.min / info["ops"] * 1e9
                info["ns_per_op_median"] = st.median / info["ops"] * 1e9
                if "rate" in info:
                    info["per_s"] = info["ops"] / st.min
                    info["per_s_median"] = info["ops"] / st.median
            if base is not None and row is not base:
                k = _per_row_ops(info, base.extra_info.get("ops"))
                info["ratio_row"] = _ratio(info, base.stats.min * k, st.min)
                info["ratio_row_median"] = _ratio(info, base.stats.median * k, st.median)
                info["ratio"] = info["ratio_row"]
            paired = info.get("paired_baseline_s")
            if paired and len(paired) == len(st.data):
                k = _per_row_ops(info, info.get("paired_ops"))
                paired = [b * k for b in paired]
                per_round = [_ratio(info, b, t) for b, t in zip(paired, st.data, strict=True)]
                info["ratio"] = statistics.median(per_round)
                info["ratio_paired_min"] = _ratio(info, min(paired), st.min)
            target = info.get("target") or {}
            if "min_ratio" in target and "ratio" in info:
                info["target_met"] = info["ratio"] >= target["min_ratio"]
            if "max_ratio" in target and "ratio" in info:
                info["target_met"] = info["ratio"] <= target["max_ratio"]
            if "max_ns_per_op" in target and "ns_per_op" in info:
                info["target_met"] = info["ns_per_op"] < target["max_ns_per_op"]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session):
    # tryfirst: runs before pytest-benchmark's own wrapper saves --benchmark-json.
    _annotate(session.config.stash.get(_ROWS, []))
    return (yield)


def _x(ratio: float) -> str:
    """A ratio for the summary: two decimals, or two significant digits below 0.1."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _line(group: str, row, base) -> str:
    info = row.extra_info
    head = f"{group} {info.get('label', row.name)}: "
    kind = "throughput" if "bytes" in info else "rate" if "rate" in info else "time"
    if row is base:
        text = "baseline"
    elif "paired_label" in info and "ratio" in info:
        text = f"{_x(info['ratio'])} {info['paired_label']} {kind} (paired rounds"
        if "ratio_row" in info:
            text += f"; {_x(info['ratio_row'])} the baseline row"
        text += ")"
    elif "ratio" in info:
        text = (f"{_x(info['ratio'])} {base.extra_info.get('label', base.name)} {kind} "
                f"(median {_x(info['ratio_row_median'])})")
    else:
        text = "no baseline in this run"
    if "gb_per_s" in info:
        text += f", {info['gb_per_s']:.2f} GB/s (median {info['gb_per_s_median']:.2f})"
    if "per_s" in info:
        text += (f", {info['per_s']:,.0f} {info['rate']}/s "
                 f"(median {info['per_s_median']:,.0f})")
    elif "ns_per_op" in info:
        unit = f"ns/{info.get('op', 'op')}"
        text += f", {info['ns_per_op']:.1f} {unit} (median {info['ns_per_op_median']:.1f})"
    target = info.get("target") or {}
    if "target_met" in info:
        want = (f">= {target['min_ratio']:.2f}x" if "min_ratio" in target
                else f"<= {target['max_ratio']:.2f}x" if "max_ratio" in target
                else f"< {target['max_ns_per_op']} ns/op")
        text += f"  [target {want}: {'met' if info['target_met'] else 'MISSED'}]"
    if "note" in info:
        text += f"  ({info['note']})"
    return head + text


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    rows = config.stash.get(_ROWS, [])
    if not rows:
        return
    terminalreporter.section("cxlrt: ratios to each group's baseline")
    for group, members in _groups(rows).items():
        base = next((r for r in members if r.extra_info.get("baseline")), None)
        for row in members:
            terminalreporter.write_line(_line(group, row, base))
