"""Bad and hostile input: every case is a clear exception, never a crash."""

from __future__ import annotations

import os
import stat
import struct

import pytest

import cxlrt
from cxlrt import superblock as sb


@pytest.fixture(params=["file", "emu"])
def scheme(request):
    return request.param


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def test_garbage_file_is_not_a_region(region_dir, scheme):
    p = f"{region_dir}/g"
    _write(p, os.urandom(1 << 20))
    with pytest.raises(cxlrt.NotARegionError, match="bad magic.*foreign or corrupt"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def test_half_formatted_region_never_looks_valid(region_dir, scheme):
    p = f"{region_dir}/h"
    body = sb.pack(1 << 20, 2, 123, with_magic=False)
    _write(p, body + bytes((1 << 20) - len(body)))
    with pytest.raises(cxlrt.NotARegionError, match="formatting never finished"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def test_truncated_file(region_dir, scheme):
    p = f"{region_dir}/t"
    cxlrt.format(f"{scheme}:{p}", size="1M", nodes=2)
    os.truncate(p, 512 * 1024)
    with pytest.raises(cxlrt.RegionSizeError, match="truncated"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def test_file_too_short_for_a_superblock(region_dir, scheme):
    p = f"{region_dir}/s"
    _write(p, b"CXL")
    with pytest.raises(cxlrt.RegionSizeError, match="too small to be a region"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def _patch(path, off, fmt, value, *, fix_checksum):
    with open(path, "r+b") as f:
        raw = bytearray(f.read(sb.SB_BYTES))
        struct.pack_into(fmt, raw, off, value)
        if fix_checksum:
            struct.pack_into("<Q", raw, sb.SB_BYTES - 8, sb.checksum(bytes(raw)))
        f.seek(0)
        f.write(raw)


def test_wrong_layout_version(region_dir, scheme):
    p = f"{region_dir}/v"
    cxlrt.format(f"{scheme}:{p}", size="1M", nodes=2)
    _patch(p, 8, "<I", 99, fix_checksum=True)
    with pytest.raises(cxlrt.LayoutVersionError, match="layout version 99"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def test_wrong_checksum(region_dir, scheme):
    p = f"{region_dir}/c"
    cxlrt.format(f"{scheme}:{p}", size="1M", nodes=2)
    _patch(p, 32, "<Q", 0x1234, fix_checksum=False)  # scribble on the uuid
    with pytest.raises(cxlrt.ChecksumError, match="checksum"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def test_section_outside_region_with_valid_checksum(region_dir, scheme):
    p = f"{region_dir}/o"
    cxlrt.format(f"{scheme}:{p}", size="1M", nodes=2)
    _patch(p, 48 + 16, "<Q", 1 << 40, fix_checksum=True)  # heap offset far away
    with pytest.raises(cxlrt.RegionError, match="outside the region"):
        cxlrt.open(f"{scheme}:{p}", node=0)


def test_node_out_of_range(region_dir, scheme):
    p = f"{region_dir}/n"
    cxlrt.format(f"{scheme}:{p}", size="1M", nodes=2)
    with pytest.raises(cxlrt.NodeRangeError, match="node 2 is out of range.*ids 0..1"):
        cxlrt.open(f"{scheme}:{p}", node=2)
    with pytest.raises(ValueError, match="node must be >= 0"):
        cxlrt.open(f"{scheme}:{p}", node=-1)
    with pytest.raises(TypeError, match="node must be an int"):
        cxlrt.open(f"{scheme}:{p}", node="0")


@pytest.mark.parametrize("size,nodes,err,msg", [
    ("16K", 2, cxlrt.RegionSizeError, "too small for 2 node"),
    ("1M", 0, ValueError, "nodes must be between 1 and 64"),
    ("1M", 65, ValueError, "nodes must be between 1 and 64"),
    ("1000000", 2, cxlrt.RegionSizeError, "not a multiple of 4096"),
    ("lots", 2, ValueError, "not a size"),
])
def test_bad_geometry_creates_nothing(region_dir, scheme, size, nodes, err, msg):
    p = f"{region_dir}/z"
    with pytest.raises(err, match=msg):
        cxlrt.open(f"{scheme}:{p}", node=0, create=True, size=size, nodes=nodes)
    assert not os.path.exists(p)


def test_node_beyond_new_region_removes_the_half_made_file(region_dir, scheme):
    p = f"{region_dir}/q"
    with pytest.raises(cxlrt.NodeRangeError):
        cxlrt.open(f"{scheme}:{p}", node=4, create=True, size="1M", nodes=4)
    assert not os.path.exists(p)


@pytest.mark.parametrize("spec,msg", [
    ("nvme:/dev/shm/x", "unknown region scheme 'nvme'"),
    ("no-colon-here", "expected SCHEME:PATH"),
    ("file:", "path after 'file:' is empty"),
    ("emu:/dev/shm/x?bogus=1", "unknown parameter.*bogus"),
    ("emu:/dev/shm/x?evict=2", "evict=.*expected 0.0 <= value <= 1.0"),
    ("emu:/dev/shm/x?seed=abc", "seed=.*expected an integer"),
    ("emu:/dev/shm/x?check=maybe", "check=.*expected 0 or 1"),
    ("emu:/dev/shm/x?seed=1&seed=2", "given twice"),
    ("file:/dev/shm/x?evict=0.1", "unknown parameter"),
])
def test_bad_spec(spec, msg):
    with pytest.raises(ValueError, match=msg):
        cxlrt.open(spec, node=0)


def test_missing_region_says_how_to_create_it(region_dir, scheme):
    with pytest.raises(FileNotFoundError, match="cxlrt format"):
        cxlrt.open(f"{scheme}:{region_dir}/missing", node=0)


def test_create_needs_size_and_nodes(region_dir, scheme):
    with pytest.raises(ValueError, match="needs both size= .* and nodes="):
        cxlrt.open(f"{scheme}:{region_dir}/x", node=0, create=True)


def test_attach_checks_expected_geometry(region_dir, scheme):
    spec = f"{scheme}:{region_dir}/g"
    cxlrt.format(spec, size="1M", nodes=2)
    with pytest.raises(cxlrt.RegionSizeError, match="asked for 2097152 bytes"):
        cxlrt.open(spec, node=0, size="2M")
    with pytest.raises(cxlrt.RegionError, match="formatted for 2"):
        cxlrt.open(spec, node=0, create=True, size="1M", nodes=3)


def test_new_region_file_is_private(region_dir, scheme):
    p = f"{region_dir}/m"
    cxlrt.format(f"{scheme}:{p}", size="1M", nodes=1)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_format_refuses_to_overwrite_without_force(region_dir, scheme):
    spec = f"{scheme}:{region_dir}/f"
    first = cxlrt.format(spec, size="1M", nodes=2)
    with pytest.raises(FileExistsError, match="--force"):
        cxlrt.format(spec, size="1M", nodes=2)
    second = cxlrt.format(spec, size="2M", nodes=3, force=True)
    assert (second["size"], second["nodes"]) == (2 << 20, 3)
    assert second["uuid"] != first["uuid"]


def test_not_a_regular_file(region_dir, scheme):
    with pytest.raises(cxlrt.RegionError, match="not a regular file"):
        cxlrt.open(f"{scheme}:{region_dir}", node=0)


def test_concurrent_creators_agree(region_dir, scheme):
    from tests.nodes import raise_failures, run_procs
    spec = f"{scheme}:{region_dir}/race"
    res = raise_failures(run_procs(_create_and_report, [(spec, n) for n in range(4)]))
    assert len(set(res)) == 1  # every process attached to the same format


def _create_and_report(spec, node):
    with cxlrt.open(spec, node=node, create=True, size="1M", nodes=4) as r:
        return r.uuid
