"""The LMCache L2 adapter over a cxlrt KV cache, on every backend.

LMCache's own contract suite runs over this adapter in `.ci/lmcache-tests`; these
are the properties only cxlrt has: nodes sharing blocks, pins that hold against
deletion until unlock, keys that isolate tenants, and damaged or mis-sized blocks
that fail a load instead of returning wrong bytes.
"""

from __future__ import annotations

import argparse
import json
import select
import warnings

import pytest

from tests.engines import require  # noqa: E402

require("lmcache", "the LMCache L2 adapter needs `pip install --no-deps lmcache==0.5.6 && "
        "pip install cxlrt[lmcache]` (.ci/lmcache-tests does both)")
torch = pytest.importorskip("torch")

# LMCache's logger warns at import when opentelemetry-sdk is installed (vLLM brings it).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
    from lmcache.v1.memory_management import (  # noqa: E402
        MemoryFormat,
        MemoryObjMetadata,
        TensorMemoryObj,
    )
    from lmcache.v1.platform import consume_fd  # noqa: E402

    from cxlrt.integrations.lmcache import HEADER, CxlrtL2Adapter, object_key  # noqa: E402
from cxlrt.heapscan import footprint  # noqa: E402
from tests.nodes import raise_failures, run_procs  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*LoggingHandler.*:DeprecationWarning")

LAYOUT = {0: MemoryLayoutDesc(shapes=[], dtypes=[])}
MAX_OBJECT = 8192


def okey(i: int, model: str = "m", rank: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name=model, kv_rank=rank,
                     cache_salt=salt)


def mobj(floats: int, fill: float) -> TensorMemoryObj:
    data = torch.arange(floats, dtype=torch.float32) + fill
    meta = MemoryObjMetadata(shape=torch.Size([floats]), dtype=torch.float32, address=0,
                             phy_size=floats * 4, fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(data, meta, parent_allocator=None)


def wait(fd: int) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(10_000), "event fd not signalled within 10 s"
    consume_fd(fd)


def store(a: CxlrtL2Adapter, keys, objs):
    tid = a.submit_store_task(keys, objs)
    wait(a.get_store_event_fd())
    return a.pop_completed_store_tasks()[tid]


def lookup(a: CxlrtL2Adapter, keys) -> list[bool]:
    tid = a.submit_lookup_and_lock_task(keys, LAYOUT)
    wait(a.get_lookup_and_lock_event_fd())
    bm = a.query_lookup_and_lock_result(tid)
    return [bm.test(i) for i in range(len(keys))]


def load(a: CxlrtL2Adapter, keys, objs) -> list[bool]:
    tid = a.submit_load_task(keys, objs)
    wait(a.get_load_event_fd())
    bm = a.query_load_result(tid)
    return [bm.test(i) for i in range(len(keys))]


def unlock(a: CxlrtL2Adapter, keys) -> None:
    a.submit_unlock(keys)
    # Tasks run in order on one worker: when a lookup queued behind the unlock is
    # done, so is the unlock.
    assert lookup(a, [okey(10**9)]) == [False]


@pytest.fixture
def region(backend):
    r = backend.create(nodes=2, size="16M")
    yield backend
    r.close()


@pytest.fixture
def a(region):
    """An adapter on node 0 of the region."""
    adp = adapter(region, 0)
    yield adp
    adp.close()


def adapter(backend, node: int = 0, **kw) -> CxlrtL2Adapter:
    params = {"spec": backend.spec(), "node": node, "create": False,
              "max_object_bytes": MAX_OBJECT, "capacity_blocks": 32, **kw}
    return CxlrtL2Adapter(params)


def test_store_lookup_load_round_trip_on_another_node(region):
    a, b = adapter(region, 0), adapter(region, 1)
    try:
        keys = [okey(i) for i in range(4)]
        objs = [mobj(n, float(i)) for i, n in enumerate((1, 100, 1024, MAX_OBJECT // 4))]
        res = store(a, keys, objs)
        assert res.is_successful()
        assert res.bytes_transferred() == sum(o.get_size() for o in objs)
        assert lookup(b, keys + [okey(99)]) == [True] * 4 + [False]
        outs = [mobj(o.get_size() // 4, -1.0) for o in objs]
        assert load(b, keys, outs) == [True] * 4
        for o, got in zip(objs, outs, strict=True):
            assert torch.equal(o.tensor, got.tensor)
        unlock(b, keys)
    finally:
        b.close()
        a.close()


def _store_as(backend, node: int, n: int) -> bool:
    a = adapter(backend, node)
    try:
        return store(a, [okey(i) for i in range(n)], [mobj(300, float(i)) for i in range(n)]
                     ).is_successful()
    finally:
        a.close()


def test_blocks_another_process_stored_load_here(region, a):
    assert raise_failures(run_procs(_store_as, [(region, 1, 3)])) == [True]
    keys = [okey(i) for i in range(3)]
    assert lookup(a, keys) == [True] * 3
    outs = [mobj(300, -1.0) for _ in keys]
    assert load(a, keys, outs) == [True] * 3
    for i, out in enumerate(outs):
        assert torch.equal(out.tensor, mobj(300, float(i)).tensor)
    unlock(a, keys)


def test_a_locked_block_survives_delete_until_unlocked(region):
    a, b = adapter(region, 0), adapter(region, 1)
    try:
        k = okey(1)
        assert store(a, [k], [mobj(256, 3.0)]).is_successful()
        assert lookup(b, [k]) == [True]  # node 1 pins it
        a.delete([k])                     # node 0's delete must not free a pinned block
        assert lookup(a, [k]) == [True]
        unlock(a, [k])
        unlock(b, [k])                    # no pin is left anywhere
        a.delete([k])
        assert lookup(a, [k]) == [False]
        assert a.get_usage().total_bytes_used == 0
    finally:
        b.close()
        a.close()


def test_close_gives_back_the_pins_it_holds(region):
    a = adapter(region, 0)
    k = okey(1)
    assert store(a, [k], [mobj(64, 1.0)]).is_successful()
    assert lookup(a, [k]) == [True]
    a.close()  # locked, never unlocked
    c = adapter(region, 0)
    try:
        c.delete([k])
        assert lookup(c, [k]) == [False]
    finally:
        c.close()


@pytest.mark.parametrize("other", [okey(1, model="m2"), okey(1, rank=1), okey(1, salt="bob")],
                         ids=["model", "kv_rank", "cache_salt"])
def test_every_key_field_isolates(a, other):
    assert store(a, [okey(1)], [mobj(64, 1.0)]).is_successful()
    assert lookup(a, [okey(1), other]) == [True, False]
    unlock(a, [okey(1)])


def test_the_salt_keys_the_scheme():
    k = okey(1)
    assert object_key(k, b"a" * 32) != object_key(k, b"b" * 32)
    assert len(object_key(k, b"a" * 32)) == 16


def test_an_oversized_object_fails_its_store_task_and_the_rest_is_stored(a):
    big, small = okey(1), okey(2)
    res = store(a, [big, small], [mobj(MAX_OBJECT // 4 + 1, 0.0), mobj(8, 0.0)])
    assert not res.is_successful()
    assert lookup(a, [big, small]) == [False, True]
    unlock(a, [small])


def test_storing_a_present_key_again_succeeds_without_a_copy(a):
    k = okey(1)
    assert store(a, [k], [mobj(64, 1.0)]).bytes_transferred() == 256
    res = store(a, [k], [mobj(64, 9.0)])
    assert res.is_successful() and res.bytes_transferred() == 0
    out = mobj(64, 0.0)
    assert load(a, [k], [out]) == [True]
    assert torch.equal(out.tensor, mobj(64, 1.0).tensor)  # the first copy won


def test_a_buffer_of_another_size_is_a_failed_load(a):
    k = okey(1)
    assert store(a, [k], [mobj(64, 1.0)]).is_successful()
    short, long_ = mobj(63, -5.0), mobj(65, -5.0)
    assert load(a, [k, k], [short, long_]) == [False, False]
    assert torch.equal(short.tensor, mobj(63, -5.0).tensor)  # untouched
    assert torch.equal(long_.tensor, mobj(65, -5.0).tensor)


def test_a_damaged_block_is_a_failed_load_never_wrong_bytes(a):
    k = okey(1)
    assert store(a, [k], [mobj(64, 1.0)]).is_successful()
    cache = a.cache
    ck = object_key(k, cache.salt_digest)
    [entry] = [e for e in cache.entries() if e["key"] == ck]
    # The object's first bytes, after cxlrt's payload header and ours.
    at = entry["offset"] + 64 + HEADER.size
    cache.region.dma_write(at, b"\xff\xff\xff\xff")
    out = mobj(64, -5.0)
    assert load(a, [k], [out]) == [False]
    assert torch.equal(out.tensor, mobj(64, -5.0).tensor)  # untouched


def test_each_kind_of_task_signals_its_own_event_fd(a):
    fds = (a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd())
    assert len(set(fds)) == 3
    store(a, [okey(1)], [mobj(4, 0.0)])
    lookup(a, [okey(1)])
    load(a, [okey(1)], [mobj(4, 0.0)])
    p = select.poll()
    for fd in fds:
        p.register(fd, select.POLLIN)
    assert p.poll(0) == []  # each signal was for its own fd, and consumed


def test_lmcache_loads_it_as_a_plugin(region):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )
    spec = {"type": "plugin", "module_path": "cxlrt.integrations.lmcache",
            "class_name": "CxlrtL2Adapter",
            "adapter_params": {"spec": region.spec(), "node": 1, "create": False,
                               "max_object_bytes": 4096, "capacity_blocks": 8}}
    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
        ["--l2-adapter", json.dumps(spec)])
    [cfg] = parse_args_to_l2_adapters_config(args).adapters
    a = create_l2_adapter(cfg)
    try:
        assert isinstance(a, CxlrtL2Adapter)
        assert a.cache.block_bytes == 4096 + HEADER.size and a.cache.capacity == 8
        assert a.supports_global_eviction
    finally:
        a.close()


def test_bad_adapter_params_are_a_clear_error(region):
    with pytest.raises(ValueError, match="unknown cxlrt adapter fields"):
        CxlrtL2Adapter({"spec": region.spec(), "nodez": 2})
    with pytest.raises(ValueError, match="max_object_bytes must be int"):
        CxlrtL2Adapter({"spec": region.spec(), "max_object_bytes": "4k"})


@pytest.mark.parametrize("declared, capacity, global_eviction", [
    (None, 32 * MAX_OBJECT, True),  # the cache's capacity, in object bytes
    (0, 0, False),                  # none: cxlrt's own LRU is the only evictor
    (2000, 2000, True),
])
def test_the_capacity_declared_to_lmcache(region, declared, capacity, global_eviction):
    a = adapter(region, 0, max_capacity_bytes=declared)
    try:
        assert a.get_usage().total_capacity_bytes == capacity
        assert a.supports_global_eviction is global_eviction
        assert store(a, [okey(1)], [mobj(100, 0.0)]).is_successful()
        assert a.get_usage().total_bytes_used == 400
    finally:
        a.close()


def test_the_default_capacity_is_what_the_heap_holds(region):
    a = adapter(region, 0, capacity_blocks=None)
    try:
        c = a.cache
        most = c.region.heap[1] // footprint(64 + c.block_bytes)  # payloads alone
        assert 0.8 * most < c.capacity < most
        keys = [okey(i) for i in range(c.capacity)]
        assert store(a, keys, [mobj(MAX_OBJECT // 4, float(i)) for i in range(c.capacity)]
                     ).is_successful()  # all of them fit, no eviction needed
        assert c.stats()["evictions"] == 0
    finally:
        a.close()
