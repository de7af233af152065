"""Run LMCache's own L2 adapter test classes over cxlrt's adapter.

`.ci/lmcache-tests` copies this folder next to an unpacked LMCache sdist and
points $LMCACHE_SUITE_DIR at its tests/v1/distributed. test_contract.py imports
the test classes that take LMCache's adapter fixtures; the fixtures below replace
them (a fixture of the collecting module's conftest wins over one of the module a
class came from, which is not the collecting module). Each replacement is a cxlrt
adapter configured as the fixture it replaces configured theirs: the same declared
capacity, since the usage tests assert fractions of it. Tests that take none of
these fixtures test one of LMCache's own adapters (the mock's simulated bandwidth,
constructors of theirs): they are deselected, listed and counted.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # as LMCache's own conftest does

# (name, scheme, query): the coherent file mapping, and the non-coherent emulation
# with seeded faults and its coherence checker.
BACKENDS = [("file", "file", ""), ("emu-faulty", "emu", "?seed=1&evict=0.05&delay=1&check=1")]

# (suite, fixture) -> the capacity their fixture declares, bytes (0: none).
CAPACITY = {
    ("test_mock_l2_adapter", "adapter"): 1 << 20,                  # MockL2Adapter, 0.001 GB
    ("test_native_connector_l2_adapter", "adapter"): 0,            # no max_capacity_gb
    ("test_native_connector_l2_adapter", "adapter_with_capacity"): 2000,
}
FIXTURES = sorted({f for _, f in CAPACITY})
_counts: dict[str, int] = {}


def _cxlrt_adapter(request, monkeypatch, fixture: str):
    from cxlrt.integrations.lmcache import CxlrtL2Adapter

    _, scheme, query = request.param
    suite = request.cls.__module__.removeprefix("lmcache_suite_")
    root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp",
                        f"cxlrt-lmc-{uuid.uuid4().hex[:12]}")
    os.makedirs(root, mode=0o700)
    monkeypatch.setenv("CXLRT_LOCAL_DIR", root)
    # Objects in their tests are at most 4 KiB (the bandwidth test's 40 KB one is
    # deselected with it).
    adp = CxlrtL2Adapter({"spec": f"{scheme}:{root}/region{query}", "node": 0, "nodes": 2,
                          "size": "16M", "max_object_bytes": 64 << 10,
                          "capacity_blocks": 16,
                          "max_capacity_bytes": CAPACITY[(suite, fixture)]})
    try:
        yield adp
    finally:
        adp.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=BACKENDS, ids=[b[0] for b in BACKENDS])
def adapter(request, monkeypatch):
    yield from _cxlrt_adapter(request, monkeypatch, "adapter")


@pytest.fixture(params=BACKENDS, ids=[b[0] for b in BACKENDS])
def adapter_with_capacity(request, monkeypatch):
    yield from _cxlrt_adapter(request, monkeypatch, "adapter_with_capacity")


def pytest_collection_modifyitems(config, items):
    keep = [it for it in items if set(FIXTURES) & set(getattr(it, "fixturenames", ()))]
    gone = [it for it in items if it not in keep]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep
    _counts["deselected"] = len(gone)
    for it in gone:
        print(f"deselected (tests an LMCache adapter of theirs): {it.nodeid}")


def pytest_terminal_summary(terminalreporter):
    stats = terminalreporter.stats
    n = {k: len(stats.get(k, [])) for k in ("passed", "failed", "skipped", "error")}
    terminalreporter.write_line(
        f"LMCache L2 adapter contract over cxlrt: {n['passed']} passed, {n['failed']} failed, "
        f"{n['error']} errors, {n['skipped']} skipped, {_counts.get('deselected', 0)} deselected")
