"""The directory of named root objects, on every backend."""

from __future__ import annotations

import pytest

import cxlrt
from tests.nodes import raise_failures, run_procs


def test_put_get_delete_across_nodes(backend):
    a = backend.create(nodes=2)
    b = backend.open(1)
    off = a.alloc(256)
    a.put("kv/root", off)
    assert b.get("kv/root") == off
    assert b.names() == ["kv/root"]
    b.put("kv/root", off + 64)  # rebinding a name
    assert a.get("kv/root") == off + 64
    a.delete("kv/root")
    with pytest.raises(KeyError):
        b.get("kv/root")
    with pytest.raises(KeyError):
        b.delete("kv/root")
    assert a.names() == []
    a.close()
    b.close()


@pytest.mark.parametrize("name,err", [
    ("", ValueError), ("x" * 65, ValueError), ("é" * 33, ValueError),
    ("bad\udcff", ValueError), (b"bytes", TypeError), (None, TypeError),
])
def test_bad_names(backend, name, err):
    r = backend.create(nodes=1)
    with pytest.raises(err):
        r.put(name, r.heap[0])
    assert r.names() == []
    r.close()


@pytest.mark.parametrize("off", [0, -1, 1 << 40, "12"])
def test_bad_offsets(backend, off):
    r = backend.create(nodes=1)
    with pytest.raises(ValueError, match="inside the region"):
        r.put("x", off)
    r.close()


def test_full_directory(backend):
    r = backend.create(nodes=1)
    for i in range(128):
        r.put(f"n{i}", r.heap[0] + i)
    with pytest.raises(cxlrt.RegionError, match="full"):
        r.put("one-more", r.heap[0])
    r.delete("n5")
    r.put("one-more", r.heap[0])
    assert len(r.names()) == 128
    r.close()


def _putter(spec, node, count):
    with cxlrt.open(spec, node=node) as r:
        for i in range(count):
            r.put(f"node{node}-{i}", r.heap[0] + node * 1000 + i)
        return sorted(r.names())


def test_concurrent_puts_from_several_nodes(backend):
    nodes, count = 3, 20
    r0 = backend.create(nodes=nodes)
    raise_failures(run_procs(_putter, [(backend.spec(), n, count) for n in range(nodes)]))
    names = r0.names()
    assert len(names) == nodes * count
    for n in range(nodes):
        for i in range(count):
            assert r0.get(f"node{n}-{i}") == r0.heap[0] + n * 1000 + i
    r0.close()


def test_corrupt_offset_in_directory_is_an_error(backend):
    r = backend.create(nodes=1)
    r.put("x", r.heap[0])
    base = r.sections["directory"][0]
    r.dma_write(base + 8, (1 << 50).to_bytes(8, "little"))  # scribble the entry's offset
    r.flush(base, 128)
    with pytest.raises(cxlrt.RegionError, match="outside the region"):
        r.get("x")
    r.close()
