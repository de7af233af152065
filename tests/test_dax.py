"""The dax: backend: devdax where a device exists, fsdax files everywhere."""

from __future__ import annotations

import glob

import pytest

import cxlrt

dax = pytest.importorskip("cxlrt.backends.dax")  # Linux-only module; always built here

DEVICES = sorted(glob.glob("/dev/dax*"))


def test_file_without_map_sync_is_direct_and_non_coherent(region_dir):
    r = cxlrt.open(f"dax:{region_dir}/r", node=0, create=True, size="1M", nodes=1)
    assert r.stats() == {"mode": "fsdax", "map_sync": False}  # tmpfs has no MAP_SYNC
    assert not r.coherent
    assert cxlrt.Caps.PERSISTENT not in r.caps and cxlrt.Caps.MAPPABLE in r.caps
    r.close()


def test_map_sync_required_on_a_non_dax_filesystem(region_dir):
    cxlrt.format(f"file:{region_dir}/r", size="1M", nodes=1)
    with pytest.raises(cxlrt.RegionError, match="MAP_SYNC refused"):
        cxlrt.open(f"dax:{region_dir}/r?sync=require", node=0)


@pytest.mark.parametrize("path,msg", [("/dev/null", "not a devdax device"),
                                      ("/dev/shm", "neither a devdax")])
def test_non_dax_media_are_refused(path, msg):
    with pytest.raises(cxlrt.RegionError, match=msg):
        dax.describe(path)


@pytest.mark.hardware
@pytest.mark.skipif(not DEVICES, reason="no /dev/dax* on this host; the QEMU CXL lab "
                                        "(issue 5) provides one")
def test_devdax_device_round_trip(region_dir):  # region_dir: its node-local files go there
    path = DEVICES[0]
    mode, size, align = dax.describe(path)
    assert mode == "devdax" and size % align == 0
    r = cxlrt.open(f"dax:{path}", node=0, create=True, size=size, nodes=2)
    off = r.alloc(64)
    r.store64(off, 7)
    r.persist(off, 8)
    r.flush(off, 8)
    assert r.load64(off) == 7
    r.free(off)
    r.close()
