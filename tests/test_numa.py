"""The numa: backend on this host: binding, verified placement, clear errors."""

from __future__ import annotations

import pytest

import cxlrt
from tests.conftest import NUMA_NODE

numa = pytest.importorskip("cxlrt.backends.numa")  # Linux-only module; always built here


def test_pages_land_on_the_bound_node(region_dir):
    node = NUMA_NODE if NUMA_NODE in numa.nodes() else min(numa.nodes())
    r = cxlrt.open(f"numa:{node}/{region_dir}/r", node=0, create=True, size="4M", nodes=2)
    r.dma_write(r.heap[0], b"\x01" * (1 << 20))  # fault in 256 pages of heap
    where = r.backend.verify_placement()
    assert where.get(node, 0) >= 256 + 4
    assert r.stats()["pages_elsewhere"] == 0
    r.close()
    info = cxlrt.inspect(f"numa:{node}/{region_dir}/r")
    assert set(info["placement"]) == {str(node)}


@pytest.mark.parametrize("spec,err,msg", [
    ("numa:4095/x", cxlrt.RegionError, "does not exist"),
    ("numa:abc/x", ValueError, "not a number or 'auto'"),
    ("numa:0", ValueError, "must be NODE/NAME"),
    ("numa:0/", ValueError, "must be NODE/NAME"),
])
def test_bad_nodes(spec, err, msg):
    with pytest.raises(err, match=msg):
        cxlrt.open(spec, node=0, create=True, size="1M", nodes=1)


def test_auto_picks_a_cpu_less_node_or_says_there_is_none(region_dir):
    cpuless = [n for n, i in numa.nodes().items() if not i["cpus"] and i["mem_total"]]
    if cpuless:
        assert numa.pick_auto() in cpuless
    else:
        with pytest.raises(cxlrt.RegionError, match="no CPU-less NUMA node"):
            cxlrt.open(f"numa:auto/{region_dir}/r", node=0, create=True, size="1M", nodes=1)
