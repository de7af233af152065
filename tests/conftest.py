"""Shared fixtures: one `backend` fixture parametrised over every available backend.

Every algorithm test takes `backend` and runs unchanged on each of:
  file          the coherent shared file mapping
  numa          the same, bound to a NUMA node of this host (node 0 here; placement verified)
  dax-file      the dax: backend on a plain file: direct access with real clflush flushes
  devdax        the dax: backend on $CXLRT_TEST_DAX (a real /dev/daxX.Y, e.g. in the QEMU lab)
  rdma          a region `cxlrt serve` serves at $CXLRT_TEST_RDMA (rdma:HOST:PORT/NAME, e.g.
                over SoftRoCE in the QEMU lab: emulation/lab/rdma-serve.sh)
  emu           the non-coherent emulation, faults off
  emu-faulty    the emulation with seeded evictions, delayed flushes and the checker
  chm-lru       the CXL hybrid-memory device model, DRAM as a transparent page cache
  chm-staging   the same device under HyMCache's policy (DMA bypasses DRAM)
The emulations never skip; the device models run with a DRAM of 64 pages, so
fills, dirty write-backs and direct SSD requests happen throughout.
`--backend NAME` narrows the set; `--cxl-seed N` replays a faulty run (the seed is
in the test id and in every failure report).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass

import pytest

import cxlrt
from cxlrt import registry
from cxlrt.backend import DEBUG
from cxlrt.errors import DebugBuildRequired

DEFAULT_SEED = 1
NUMA_NODE = int(os.environ.get("CXLRT_TEST_NUMA_NODE", "0"))
DAX_DEVICE = os.environ.get("CXLRT_TEST_DAX", "")  # e.g. /dev/dax0.0 in the QEMU CXL lab
RDMA_REGION = os.environ.get("CXLRT_TEST_RDMA", "")  # e.g. rdma:127.0.0.1:7470/r0 in the lab
FAULTY = "evict=0.05&delay=1&check=1"
CHM_SMALL = "dram=256K&page=4K"


def pytest_addoption(parser):
    parser.addoption("--backend", action="append", default=[],
                     help="run only these backend variants (file, emu, emu-faulty, chm-lru, ...); "
                          "repeatable")
    parser.addoption("--no-backend", action="append", default=[],
                     help="leave these backend variants out (after --backend); repeatable")
    parser.addoption("--cxl-seed", type=int, default=None,
                     help=f"fault-injection seed for emu-faulty (default {DEFAULT_SEED})")


@dataclass
class BackendCase:
    """A backend variant under test: how to build a spec for a fresh region."""

    name: str
    scheme: str
    params: str
    seed: int | None
    root: str = ""

    @property
    def faulty(self) -> bool:
        return "evict" in self.params

    @property
    def coherent(self) -> bool:
        return self.scheme in ("file", "numa", "chm", "rdma")

    def spec(self, extra: str = "") -> str:
        q = "&".join(p for p in (self.params, extra) if p)
        where = f"{NUMA_NODE}/{self.path}" if self.scheme == "numa" else self.path
        if self.name == "devdax":
            where = DAX_DEVICE
        if self.name == "rdma":
            return RDMA_REGION + (f"?{q}" if q else "")
        return f"{self.scheme}:{where}" + (f"?{q}" if q else "")

    @property
    def path(self) -> str:
        return os.path.join(self.root, "region")

    def create(self, *, size="4M", nodes=4, node=0, lease=None, **kw) -> cxlrt.Region:
        if self.name in ("devdax", "rdma"):  # a device region: the whole device, afresh
            from cxlrt import registry
            size = registry.hook(self.scheme, "medium_size")(self.spec().partition(":")[2])
            cxlrt.format(self.spec(), size=size, nodes=nodes, force=True, lease=lease)
            return cxlrt.open(self.spec(), node=node, **kw)
        return cxlrt.open(self.spec(), node=node, create=True, size=size, nodes=nodes,
                          lease=lease, **kw)

    def open(self, node: int) -> cxlrt.Region:
        return cxlrt.open(self.spec(), node=node)

    def medium_word(self, off: int) -> int:
        """The 8-byte word at `off` as the medium holds it, read without a node's cache.

        For the emulation that is the file under it (its checker would rightly flag
        a DMA read of a line some node still holds dirty); elsewhere a DMA read.
        """
        spec = f"file:{self.path}" if self.scheme == "emu" else self.spec()
        with cxlrt.open(spec, node=0, observer=True) as r:
            return int.from_bytes(r.dma_read(off, 8), "little")


def _variants(config) -> list[tuple[str, str, str, int | None]]:
    seed = config.getoption("--cxl-seed")
    seed = DEFAULT_SEED if seed is None else seed
    out = []
    avail = registry.available()
    if "file" in avail:
        out.append(("file", "file", "", None))
    if "numa" in avail:
        from cxlrt.backends.numa import nodes
        if NUMA_NODE in nodes():
            out.append(("numa", "numa", "", None))
    if "dax" in avail:
        out.append(("dax-file", "dax", "", None))
        if DAX_DEVICE:
            out.append(("devdax", "dax", "", None))
    if RDMA_REGION and "rdma" in avail:
        out.append(("rdma", "rdma", "", None))
    out.append(("emu", "emu", "", None))
    out.append((f"emu-faulty-seed{seed}", "emu", f"seed={seed}&{FAULTY}", seed))
    out.append(("chm-lru", "chm", f"policy=lru&{CHM_SMALL}", None))
    # staging with a write buffer of a quarter of its DRAM (flushing when reads idle)
    out.append(("chm-staging", "chm", f"policy=staging&{CHM_SMALL}&wbuf=64K", None))
    wanted = config.getoption("--backend")
    if wanted:
        out = [v for v in out if any(v[0] == w or v[0].startswith(w + "-seed") for w in wanted)]
    unwanted = config.getoption("--no-backend")
    if unwanted:
        out = [v for v in out if not any(v[0] == w or v[0].startswith(w + "-seed")
                                         for w in unwanted)]
    return out


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        vs = _variants(metafunc.config)
        if "emu_only" in metafunc.fixturenames:
            vs = [v for v in vs if v[1] == "emu"]
        if "chm_only" in metafunc.fixturenames:
            vs = [v for v in vs if v[1] == "chm"]
        metafunc.parametrize("backend", vs, ids=[v[0] for v in vs], indirect=True)


@pytest.fixture
def chm_only():
    """Marks a test whose subject is the CXL-HM device model (its variants only)."""


@pytest.fixture
def emu_only():
    """Marks a test whose subject is the emulation itself (skips `file`)."""


@pytest.fixture
def backend(request, monkeypatch):
    name, scheme, params, seed = request.param
    root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                        f"cxlrt-test-{uuid.uuid4().hex[:12]}")
    os.makedirs(root, mode=0o700)
    # Node-local lock files go with the test's folder, not into /dev/shm for good.
    monkeypatch.setenv("CXLRT_LOCAL_DIR", root)
    request.node.cxl_seed = seed
    request.node.cxl_backend = name
    try:
        yield BackendCase(name, scheme, params, seed, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def keep():
    """keep(region) -> region, closed at teardown even when the test fails (a region
    left to the garbage collector with its heartbeat thread running can crash the
    interpreter)."""
    opened = []

    def _keep(r):
        opened.append(r)
        return r

    yield _keep
    for r in reversed(opened):
        try:
            r.close()
        except Exception:  # noqa: BLE001  (teardown: the test already reported)
            pass


@pytest.fixture
def region_dir(monkeypatch):
    """A private tmpfs folder for tests that build their own specs."""
    root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                        f"cxlrt-test-{uuid.uuid4().hex[:12]}")
    os.makedirs(root, mode=0o700)
    monkeypatch.setenv("CXLRT_LOCAL_DIR", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


# A LeaseLost that the runtime blames on the OS alone (Liveness.host_stalled: the heartbeat
# thread was ready but not run for longer than the lease, on a shared machine) says
# nothing of the code under test: such a failure is run once more (pytest-rerunfailures,
# the `test` extra), and a second one fails. The exception must be that LeaseLost, or
# carry it as its cause (a child's, re-raised by tests/nodes.raise_failures): anything
# else in the chain (an assert, another child's error) fails at once.
HOST_STALL = r"^LeaseLost: .*; a host stall: the OS did not run this process"
NOT_HOST_STALL = r"^(?!LeaseLost: |AssertionError: process \d+ failed:)"


def pytest_configure(config):
    if config.pluginmanager.hasplugin("rerunfailures") and not config.option.usepdb:
        config.option.rerun_show_tracebacks = True  # the first try's failure is shown too
        if config.option.reruns is None and not config.getini("reruns"):
            config.option.reruns = 1
        if config.option.only_rerun is None and config.option.rerun_except is None:
            config.option.only_rerun = [HOST_STALL]
            config.option.rerun_except = [NOT_HOST_STALL]
    # The session's node-local files go to a folder of its own (its subprocesses
    # inherit it): no other cxlrt process of the host is blamed by the guard below, and
    # the folder goes at the end. A folder the user chose is kept.
    if not os.environ.get("CXLRT_LOCAL_DIR"):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        config.cxlrt_local_dir = tempfile.mkdtemp(prefix="cxlrt-test-local-", dir=base)
        os.environ["CXLRT_LOCAL_DIR"] = config.cxlrt_local_dir


def pytest_unconfigure(config):
    d = getattr(config, "cxlrt_local_dir", None)
    if d:
        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop("CXLRT_LOCAL_DIR", None)


def _is_lab(item):
    return item.get_closest_marker("lab") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # The lab's guests run in the background while the rest of the suite runs
    # (tests/labqueue.py), so their tests, which wait for them, go last.
    lab = [i for i in items if _is_lab(i)]
    if lab and len(lab) < len(items):
        items[:] = [i for i in items if not _is_lab(i)] + lab


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    jobs = [i.module.JOBS[i.name] for i in session.items
            if _is_lab(i) and getattr(i.module, "READY", False) and i.name in i.module.JOBS]
    if jobs:
        from . import labqueue
        labqueue.start(jobs)
        session.config.add_cleanup(labqueue.stop)


@pytest.fixture(scope="module", autouse=True)
def _no_node_files_left_behind():
    """A module's regions go with their node-local files (`cxlrt delete`, or a test's own
    folder): code that leaves them behind fills a user's /dev/shm over the days. Those
    that no live process uses fail the module, and are removed."""
    from cxlrt import cleanup, nodelocal
    d = nodelocal.local_dir()  # the session's (tests that move it restore it)
    before = set(cleanup.survey(d))
    yield
    new = sorted(set(cleanup.survey(d)) - before)
    left = [x for x in (cleanup.remove_node(u, n, d, dry_run=True) for u, n in new)
            if not x.users]
    for x in left:
        cleanup.remove_node(int(x.uuid, 16), x.node, d)
    if left:
        pytest.fail(f"this module left node-local files in {d} that no live process uses: "
                    + "; ".join(f"node {x.node} of {x.uuid} ({len(x.paths)} files)" for x in left)
                    + ". Delete its regions with cxlrt.cleanup.delete (or open them under "
                    "the region_dir fixture).", pytrace=False)


def pytest_runtest_setup(item):
    # Negative controls switch a protocol off through test hooks, which exist only in
    # debug builds (CXLRT_DEBUG >= 1); .ci/run runs tests/algorithms on one as well.
    if item.get_closest_marker("debug_build") and not DEBUG:
        pytest.skip(DebugBuildRequired.HINT)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "cxl_seed", None)
    if report.failed and seed is not None:
        report.sections.append(
            ("cxlrt fault seed",
             f"backend {item.cxl_backend} ran with seed {seed}; replay with "
             f"--cxl-seed={seed} --backend=emu-faulty"))
    return report
