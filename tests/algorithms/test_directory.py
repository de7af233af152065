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


def test_odd_generation_without_redo_is_an_error_and_repair_settles_it(backend):
    """A scribbled generation (odd, no redo record): a clear error, never a hang or a guess;
    `cxlrt check` reports it and `--repair` keeps the entry's still-valid body."""
    from cxlrt import check
    r = backend.create(nodes=2)
    off = r.alloc(64)
    r.put("x", off)
    base = r.sections["directory"][0]
    r.flush(base, 128)
    gen = int.from_bytes(r.dma_read(base + 24, 8), "little")
    r.dma_write(base + 24, (gen + 1).to_bytes(8, "little"))
    r.flush(base, 128)
    with pytest.raises(cxlrt.RegionError, match="without a valid redo record"):
        r.get("x")
    with pytest.raises(cxlrt.RegionError, match="without a valid redo record"):
        r.put("y", off)
    problems = check.check(backend.spec())["problems"]
    assert any("without a valid redo record" in p for p in problems), problems
    done = check.repair(backend.spec(), 1)  # node 1 never attached: nothing of it is live
    assert any("kept its old body" in a for a in done["actions"]), done
    assert check.check(backend.spec())["problems"] == []
    assert r.get("x") == off
    r.close()


def _churn_or_watch(spec, node, offs, stable, rounds, churn):
    """Churn: overwrite, delete and re-put one name, over and over. Watch: read meanwhile,
    never an error, never a value nobody wrote, never a lost name."""
    with cxlrt.open(spec, node=node) as r:
        for k in range(rounds):
            if churn:
                r.put("churn", offs[k % len(offs)])
                if k % 3 == 2:
                    r.delete("churn")
                continue
            try:
                assert r.get("churn") in offs
            except KeyError:
                pass
            assert r.get("stable") == stable
            assert set(r.names()) <= {"churn", "stable"}
    return rounds


def test_readers_during_live_updates_see_whole_values(backend):
    r0 = backend.create(nodes=3)
    offs = [r0.alloc(64) for _ in range(4)]
    stable = r0.alloc(64)
    r0.put("stable", stable)
    spec = backend.spec()
    raise_failures(run_procs(_churn_or_watch, [(spec, 1, offs, stable, 60, True),
                                               (spec, 2, offs, stable, 30, False)]))
    assert r0.get("stable") == stable
    r0.close()
