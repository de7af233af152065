"""Regression tests from review: crashes, hangs and races that must stay fixed."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import pytest

import cxlrt
from cxlrt import superblock as sb
from tests.nodes import _CTX


def _hammer(spec, node):
    r = cxlrt.open(spec, node=node)
    off = r.heap[0]
    i = 0
    while True:  # killed from outside, most likely inside an emulated access
        r.store64(off + (i % 64) * 64, i)
        r.flush(off + (i % 64) * 64, 8)
        i += 1


@pytest.mark.crash
def test_process_killed_mid_access_does_not_wedge_its_node(region_dir):
    spec = f"emu:{region_dir}/r?cache=4K&ways=1"  # few sets: the child is always in one
    r = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    off = r.heap[0]
    for i in range(64):  # the parent uses the node before forking (inherited state)
        r.store64(off + i * 64, 1)
    for _ in range(3):
        p = _CTX.Process(target=_hammer, args=(spec, 0))
        p.start()
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        for i in range(64):  # same node, same sets: must not hang
            r.store64(off + i * 64, i)
            r.persist(off + i * 64, 8)
    assert [r.load64(off + i * 64) for i in range(64)] == list(range(64))
    r.close()


@pytest.mark.parametrize("field,value", [("sets", 0), ("sets", 3), ("ways", 0), ("ways", 999)])
def test_corrupt_sidecar_geometry_is_replaced_not_trusted(region_dir, field, value):
    spec = f"emu:{region_dir}/r"
    cxlrt.open(spec, node=0, create=True, size="1M", nodes=2).close()
    with open(f"{region_dir}/r.emu", "r+b") as f:
        f.seek({"ways": 16, "sets": 24}[field])
        f.write(struct.pack("<I" if field == "ways" else "<Q", value))
    r = cxlrt.open(spec, node=1)  # rebuilt from scratch instead of crashing
    r.store64(r.heap[0], 5)
    r.persist(r.heap[0], 8)
    assert r.dma_read(r.heap[0], 8) == (5).to_bytes(8, "little")
    r.close()


@pytest.mark.parametrize("scheme", ["file", "emu"])
def test_close_while_another_thread_copies_does_not_crash(region_dir, scheme):
    r = cxlrt.open(f"{scheme}:{region_dir}/r", node=0, create=True, size="8M", nodes=1)
    off, n = r.heap[0], 4 << 20
    errors = []

    def reader():
        try:
            for _ in range(200):
                r.dma_read(off, n)
        except cxlrt.RegionError as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.01)
    r.backend.close()  # bypasses Region's guard on purpose
    t.join()
    assert errors and isinstance(errors[0], cxlrt.RegionClosedError)


def _patch_section(path, index, d_off, d_len):
    """Move/resize one section-table entry and re-seal the checksum (a subtle forgery)."""
    with open(path, "r+b") as f:
        raw = bytearray(f.read(sb.SB_BYTES))
        at = 48 + 16 * index
        off, n = struct.unpack_from("<QQ", raw, at)
        struct.pack_into("<QQ", raw, at, off + d_off, n + d_len)
        struct.pack_into("<Q", raw, sb.SB_BYTES - 8, sb.checksum(bytes(raw)))
        f.seek(0)
        f.write(raw)


@pytest.mark.parametrize("index,d_off,d_len,msg", [
    (0, 40, 0, "nodes does not start on a 4096-byte boundary"),  # node areas sharing lines
    (4, -4096, 4096, "heap are not where"),                      # heap over the allocator
    (0, 0, -512, "nodes are not where"),                         # node section too short
    (1, 4096, 0, "locks are not where"),                         # locks over the directory
])
def test_checksummed_but_inconsistent_sections_are_rejected(region_dir, index, d_off, d_len,
                                                            msg):
    p = f"{region_dir}/s"
    cxlrt.format(f"file:{p}", size="1M", nodes=4)
    _patch_section(p, index, d_off, d_len)
    with pytest.raises(cxlrt.RegionError, match=msg):
        cxlrt.open(f"file:{p}", node=0)


def test_saturated_node_counters_do_not_lock_a_node_out(region_dir):
    """Attach count and incarnation wrap (the incarnation skips 0, which means none)."""
    spec = f"file:{region_dir}/h"
    r = cxlrt.open(spec, node=0, create=True, size="1M", nodes=2)
    r.store64(r.node_area(1) + 48, 2**64 - 1)  # attaches
    r.store64(r.node_area(1) + 16, 2**64 - 1)  # incarnation
    r.persist(r.node_area(1), 64)
    r.close()
    with cxlrt.open(spec, node=1) as r1:
        r1.flush(r1.node_area(1), 64)
        assert r1.load64(r1.node_area(1) + 48) == 0
        assert r1.load64(r1.node_area(1) + 16) == 1 == r1.liveness.incarnation


def test_concurrent_emu_attach_shares_one_sidecar(region_dir):
    from tests.nodes import raise_failures, run_procs
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="1M", nodes=8)
    res = raise_failures(run_procs(_sidecar_inode, [(f"emu:{region_dir}/r", n) for n in range(8)]))
    assert len(set(res)) == 1


def _sidecar_inode(spec, node):
    with cxlrt.open(spec, node=node) as r:
        st = os.stat(r.backend.sidecar_path)
        return st.st_ino
