"""The backend contract, written once and run on every backend variant."""

from __future__ import annotations

import os
import platform
import re
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import cxlrt
from cxlrt.backend import copy_mode
from tests.nodes import _CTX, host_lock, raise_failures, run_procs


def test_publish_observe_between_two_nodes(backend):
    a = backend.create(nodes=2)
    b = backend.open(1)
    off = a.heap[0]
    a.store64(off, 0xDEADBEEF)
    a.persist(off, 8)
    b.flush(off, 8)  # observe: drop any copy, then load
    assert b.load64(off) == 0xDEADBEEF
    b.store64(off + 64, 7)
    b.persist(off + 64, 8)
    a.flush(off + 64, 8)
    assert a.load64(off + 64) == 7
    a.close()
    b.close()


def test_unaligned_bytes_across_lines(backend):
    r = backend.create()
    off = r.heap[0] + 61  # straddles three lines
    data = bytes(range(200))
    r.store(off, data)
    assert r.load(off, len(data)) == data  # the writer sees its own stores
    r.persist(off, len(data))
    assert r.dma_read(off, len(data)) == data
    r.close()


def test_dma_bypasses_views_and_is_visible_after_observe(backend):
    a = backend.create(nodes=2)
    b = backend.open(1)
    off = a.heap[0]
    payload = np.arange(4096, dtype=np.uint64).tobytes()
    b.flush(off, len(payload))
    a.dma_write(off, payload)
    b.flush(off, len(payload))
    assert b.load(off, len(payload)) == payload
    out = np.zeros(len(payload), dtype=np.uint8)
    b.dma_read_into(off, out)
    assert out.tobytes() == payload
    a.close()
    b.close()


def _dma_write_at_every_alignment(a, b, n: int) -> None:
    """dma_write n random bytes at ragged offsets over a guard pattern; node b must
    observe exactly them, and nothing beside them may move."""
    base, span = a.heap[0], n + 256
    model = bytearray(b"\xa5" * span)
    a.dma_write(base, bytes(model))
    rng = np.random.default_rng(n)
    for shift in (0, 1, 17, 63):
        b.flush(base, span)
        b.load(base, span)  # b now holds the old lines: they must go stale, not survive
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        a.dma_write(base + 64 + shift, data)
        model[64 + shift:64 + shift + n] = data
        b.flush(base, span)
        assert b.load(base, span) == model, f"n={n} shift={shift}"
        assert b.dma_read(base, span) == model, f"n={n} shift={shift}"


# Large dma_writes use non-temporal stores (cxl_copy.h, from CXL_NT_MIN = 16 KiB): the
# sizes straddle the switch, and every shift gives the copy a ragged head and tail.
@pytest.mark.parametrize("n", [4096, 16383, 16384, 16385, 65536 + 7, (1 << 20) + 33])
def test_large_dma_writes_land_whole_at_any_alignment(backend, n):
    a = backend.create(nodes=2)
    b = backend.open(1)
    _dma_write_at_every_alignment(a, b, n)
    a.close()
    b.close()


X86_64 = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.parametrize("mode, width", [("0", 0), ("sse2", 16), ("SSE2", 16)])
def test_dma_writes_in_every_copy_mode_land_the_same_bytes(backend, mode, width):
    """CXLRT_NT_STORES=0 (memcpy) and =sse2 (16-byte streams where the CPU has 32-byte
    ones), which perf/ uses to measure each way, copy the same bytes as the default."""
    backend.create(nodes=2).close()
    spec = backend.spec()
    width = width if X86_64 else 0  # elsewhere every copy is memcpy
    want = {"nt_stores": width > 0, "nt_min": 16384, "nt_width": width}
    code = ("import cxlrt\n"
            "from cxlrt.backend import copy_mode\n"
            "from tests.algorithms.test_region_ops import _dma_write_at_every_alignment\n"
            f"assert copy_mode() == {want!r}, copy_mode()\n"
            f"a, b = cxlrt.open({spec!r}, node=0), cxlrt.open({spec!r}, node=1)\n"
            "for n in (16384, 65543):\n"
            "    _dma_write_at_every_alignment(a, b, n)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, CXLRT_NT_STORES=mode))
    assert out.returncode == 0, out.stderr


def test_the_default_copy_mode_streams_as_wide_as_the_cpu_allows():
    """32-byte streams where the CPU has AVX (the fast path on this host), 16 on an
    x86-64 without it, memcpy elsewhere."""
    if os.environ.get("CXLRT_NT_STORES") not in (None, "1"):
        pytest.skip("CXLRT_NT_STORES chooses another mode for this run")
    with open("/proc/cpuinfo") as f:
        avx = re.search(r"^flags\s*:.*\bavx\b", f.read(), re.M) is not None
    width = (32 if avx else 16) if X86_64 else 0
    mode = copy_mode()
    assert mode == {"nt_stores": width > 0, "nt_min": 16384, "nt_width": width}, mode


def test_view_is_a_window_on_the_medium(backend):
    r = backend.create()
    off = r.heap[0]
    if not r.caps & cxlrt.Caps.MAPPABLE:  # a device model serves every byte itself
        with pytest.raises(cxlrt.UnsupportedError, match="not mappable"):
            r.view(off, 128)
        r.close()
        return
    v = r.view(off, 128)
    v[:5] = b"hello"
    assert r.dma_read(off, 5) == b"hello"
    with pytest.raises(cxlrt.RegionError, match=r"view\(s\) of the region are still alive"):
        r.close()
    del v
    r.close()
    r.close()  # idempotent
    assert r.closed


@pytest.mark.parametrize("op", ["load64", "store64", "load", "store", "flush", "dma_read",
                                "dma_write", "view"])
def test_out_of_range_raises(backend, op):
    r = backend.create()
    end = r.size
    calls = {
        "load64": lambda: r.load64(end - 4),
        "store64": lambda: r.store64(end, 1),
        "load": lambda: r.load(end - 10, 11),
        "store": lambda: r.store(end - 1, b"ab"),
        "flush": lambda: r.flush(end, 1),
        "dma_read": lambda: r.dma_read(2**63, 8),
        "dma_write": lambda: r.dma_write(end - 3, b"abcd"),
        "view": lambda: r.view(end - 8, 9),
    }
    with pytest.raises(cxlrt.OutOfRangeError, match="outside the region"):
        calls[op]()
    assert r.dma_read(end - 8, 8) == bytes(8)  # nothing was written
    r.close()


def test_misaligned_word_access_raises(backend):
    r = backend.create()
    with pytest.raises(cxlrt.OutOfRangeError, match="aligned"):
        r.store64(r.heap[0] + 4, 1)
    r.close()


def test_closed_region_raises(backend):
    r = backend.create()
    off = r.heap[0]
    r.close()
    with pytest.raises(cxlrt.RegionClosedError):
        r.load64(off)
    with pytest.raises(cxlrt.RegionClosedError):
        r.dma_write(off, b"x")


def test_attach_records_heartbeat(backend):
    backend.create(nodes=3).close()
    r = backend.open(2)
    info = cxlrt.inspect(backend.spec())
    assert info["nodes"] == 3
    a = info["node_areas"][2]
    assert a["attaches"] == 1 and a["state"] == "attached" and a["incarnation"] == 1
    assert a["heartbeat_age_s"] is not None
    assert info["node_areas"][1]["state"] == "never attached"
    assert info["node_areas"][0]["state"] == "detached"
    beat = a["beat"]
    time.sleep(3 * r.lease_ms / 8000)  # a few beat periods
    assert cxlrt.inspect(backend.spec())["node_areas"][2]["beat"] != beat  # it beats
    r.close()  # a clean detach of the node's last process: detached, never "dead"
    info = cxlrt.inspect(backend.spec())
    assert info["node_areas"][2]["state"] == "detached"
    assert info["node_areas"][2]["attaches"] == 1


# --- several processes ------------------------------------------------------------

def _slots_writer(spec, node, nodes, barrier, rounds):
    r = cxlrt.open(spec, node=node)
    base = r.heap[0]
    for k in range(rounds):
        # Each node owns one line per round (single-writer), publishes it, and
        # after the barrier observes every other node's line.
        mine = base + (k * nodes + node) * 64
        r.store(mine, struct.pack("<QQ", node, k) * 4)
        r.persist(mine, 64)
        barrier.wait()
        for other in range(nodes):
            off = base + (k * nodes + other) * 64
            r.flush(off, 64)
            got = r.load(off, 64)
            assert got == struct.pack("<QQ", other, k) * 4, (node, other, k, got)
    r.close()
    return node


def test_single_writer_lines_across_processes(backend):
    nodes, rounds = 3, 50
    backend.create(nodes=nodes).close()
    barrier = _CTX.Barrier(nodes)
    res = run_procs(_slots_writer, [(backend.spec(), n, nodes, barrier, rounds)
                                    for n in range(nodes)])
    assert raise_failures(res) == list(range(nodes))


def _locked_counter(spec, node, lockfile, iters):
    r = cxlrt.open(spec, node=node)
    off = r.heap[0]
    for _ in range(iters):
        with host_lock(lockfile):
            r.flush(off, 8)           # observe
            v = r.load64(off)
            r.store64(off, v + 1)
            r.persist(off, 8)         # publish before the lock is released
    stats = r.stats()
    r.close()
    return stats


@pytest.mark.parametrize("procs_per_node", [1, 2])
def test_correct_protocol_counts_exactly_across_processes(backend, procs_per_node):
    nodes, iters = 3, 400
    r0 = backend.create(nodes=nodes)
    r0.dma_write(r0.heap[0], bytes(64))  # a device keeps old heap bytes across formats
    lockfile = backend.path + ".lock"
    args = [(backend.spec(), n, lockfile, iters) for n in range(nodes)
            for _ in range(procs_per_node)]
    stats = raise_failures(run_procs(_locked_counter, args))
    r0.flush(r0.heap[0], 8)
    assert r0.load64(r0.heap[0]) == nodes * procs_per_node * iters
    if backend.faulty:
        # The faults were really injected: this passing means the protocol held.
        assert sum(s["evictions"] for s in stats) > 0
    r0.close()
