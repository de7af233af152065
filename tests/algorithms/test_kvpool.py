"""KVPool: KV caches on several devices as one, each chain whole on one device, on every
backend, across processes and nodes."""

from __future__ import annotations

import dataclasses
import os

import pytest

import cxlrt
from tests.algorithms.test_kvcache import BB, block_for, chain
from tests.nodes import raise_failures, run_procs

DEVICES = 3
_opened: list = []


@pytest.fixture(autouse=True)
def _close_devices(backend):  # torn down before `backend` removes their folder
    yield
    while _opened:
        _opened.pop().close()


def devices(backend, n=DEVICES, *, nodes=2):
    """n fresh regions of the backend variant under test: n devices of one kind (closed
    after the test)."""
    if backend.name in ("devdax", "rdma"):
        pytest.skip(f"{backend.name}: the lab gives one device of this kind")
    cases = []
    for i in range(n):
        root = os.path.join(backend.root, f"dev{i}")
        os.makedirs(root, exist_ok=True)
        cases.append(dataclasses.replace(backend, root=root))
    regions = [c.create(nodes=nodes, size="4M") for c in cases]
    _opened.extend(regions)
    return cases, regions


def caches(regions, capacity=64, **kw):
    return [cxlrt.KVCache(r, "kv", block_bytes=BB, capacity_blocks=capacity, **kw)
            for r in regions]


def stored_on(pool, keys):
    """The devices that hold any of `keys`."""
    on = set()
    for i, c in enumerate(pool.caches):
        for k in keys:
            with c.lookup([k]) as hit:
                if len(hit):
                    on.add(i)
    return on


def test_chains_stay_whole_on_one_device_and_new_ones_go_round(backend):
    cases, regions = devices(backend)
    pool = cxlrt.KVPool(caches(regions), placement="round_robin")
    chains = [pool.block_hashes(chain(conv, 4)) for conv in range(6)]
    for keys in chains:
        assert pool.store(keys[:2], [block_for(k) for k in keys[:2]]) == keys[:2]
    for keys in chains:  # the next turn: the continuation goes to the chain's home
        assert pool.store(keys, [block_for(k) for k in keys]) == keys[2:]
    homes = [pool.home(keys) for keys in chains]
    assert homes == [0, 1, 2, 0, 1, 2]
    assert pool.placed == [2, 2, 2]
    st = pool.stats()
    assert [d["placed"] for d in st["devices"]] == [2, 2, 2]
    assert [d["occupancy"] for d in st["devices"]] == [8, 8, 8]
    for keys, home in zip(chains, homes, strict=True):
        assert stored_on(pool, keys) == {home}
    # Another node, with its own pool over the same devices, finds each chain at home.
    others = [c.open(1) for c in cases]
    _opened.extend(others)
    pool1 = cxlrt.KVPool(caches(others))
    for keys, home in zip(chains, homes, strict=True):
        with pool1.lookup(keys) as hit:
            assert len(hit) == 4 and pool1.device_of(hit) == home
            out = hit.cache.load(hit)
            assert [out[i].tobytes() for i in range(4)] == [block_for(k) for k in keys]
    with pool1.lookup(pool.block_hashes(chain(99, 2))) as hit:
        assert len(hit) == 0


def test_load_placement_fills_the_emptier_device(backend):
    _, regions = devices(backend, 2)
    cs = caches(regions)
    pre = cs[0].block_hashes(chain(50, 6))
    assert cs[0].store(pre, [block_for(k) for k in pre]) == pre  # device 0 starts fuller
    pool = cxlrt.KVPool(cs, placement="load")
    homes = []
    for conv in range(6):
        keys = pool.block_hashes(chain(conv, 2))
        pool.store(keys, [block_for(k) for k in keys])
        homes.append(pool.home(keys))
    # Device 1 takes chains until it is as full as device 0; then they alternate, a tie
    # going to the device placed on longest ago.
    assert homes == [1, 1, 1, 0, 1, 0]
    assert (cs[0].occupancy, cs[1].occupancy) == (10, 8)


def test_a_chain_whose_first_block_went_finds_a_new_home(backend):
    _, regions = devices(backend, 2)
    pool = cxlrt.KVPool(caches(regions), placement="round_robin")
    keys = pool.block_hashes(chain(0, 3))
    pool.store(keys, [block_for(k) for k in keys])
    assert pool.home(keys) == 0
    assert pool.caches[0].delete(keys[:1]) == keys[:1]
    assert pool.home(keys) is None
    with pool.lookup(keys) as hit:
        assert len(hit) == 0  # the chain is read from its first block on: a miss
    assert pool.store(keys, [block_for(k) for k in keys]) == keys
    assert pool.home(keys) == 1
    with pool.lookup(keys) as hit:
        out = hit.cache.load(hit)
        assert [out[i].tobytes() for i in range(3)] == [block_for(k) for k in keys]


def _place_chains(specs, node, convs):
    regions = [cxlrt.open(s, node=node) for s in specs]
    pool = cxlrt.KVPool(caches(regions, create=False), placement="round_robin")
    for conv in convs:
        keys = pool.block_hashes(chain(conv, 3))
        pool.store(keys, [block_for(k) for k in keys])
    got = {}
    for conv in convs:
        keys = pool.block_hashes(chain(conv, 3))
        with pool.lookup(keys) as hit:
            assert len(hit) == 3, (conv, len(hit))
            out = hit.cache.load(hit)
            assert [out[i].tobytes() for i in range(3)] == [block_for(k) for k in keys]
            got[conv] = pool.device_of(hit)
    return got


def test_processes_of_several_nodes_place_and_read_chains(backend):
    cases, regions = devices(backend, 2, nodes=4)
    cs = caches(regions)
    specs = [c.spec() for c in cases]
    # Four processes on four nodes; conversations 0-3 are stored by two processes at once.
    args = [(specs, n, [n, (n + 1) % 4, 10 + n]) for n in range(4)]
    res = raise_failures(run_procs(_place_chains, args, timeout=240))
    pool = cxlrt.KVPool(cs)
    for conv in list(range(4)) + [10, 11, 12, 13]:
        keys = pool.block_hashes(chain(conv, 3))
        home = pool.home(keys)
        assert home is not None
        with pool.caches[home].lookup(keys) as hit:
            assert len(hit) == 3  # whole on its home, whichever process placed it
    assert all(seen.values() for seen in res)


def test_admit_goes_to_the_chains_home(backend):
    _, regions = devices(backend, 2)
    pool = cxlrt.KVPool(caches(regions), placement="round_robin")
    keys = pool.block_hashes(chain(0, 2))
    admitted = pool.admit(keys, [block_for(k) for k in keys])
    if "wbuf" not in backend.params:
        assert admitted is True  # no write buffer: admit is store
    if admitted:
        assert stored_on(pool, keys) == {0}
        with pool.lookup(keys) as hit:
            assert len(hit) == 2
    else:  # a full buffer: nothing stored anywhere
        assert stored_on(pool, keys) == set()
    assert pool.admit([], []) is True


def test_bad_pools_are_clear_errors(backend):
    _, regions = devices(backend, 2)
    a, b = caches(regions)
    with pytest.raises(ValueError, match="at least one KVCache"):
        cxlrt.KVPool([])
    with pytest.raises(TypeError, match="must be KVCache objects"):
        cxlrt.KVPool([a, "b"])
    with pytest.raises(ValueError, match="placement must be one of round_robin, load"):
        cxlrt.KVPool([a, b], placement="random")
    with pytest.raises(ValueError, match="its own region"):
        cxlrt.KVPool([a, cxlrt.KVCache(regions[0], "kv2", block_bytes=BB, capacity_blocks=8)])
    twice = cxlrt.open(regions[0].spec, node=1)  # another Region object, the same region
    _opened.append(twice)
    with pytest.raises(ValueError, match="its own region"):
        cxlrt.KVPool([a, cxlrt.KVCache(twice, "kv", create=False)])
    with pytest.raises(ValueError, match="home_from must be an int >= 0"):
        cxlrt.KVPool([a, b], home_from=-1)
    # Blocks of 128 tokens: a probe of 64 tokens would hash to no key on either side.
    t1 = cxlrt.KVCache(regions[0], "t128", block_bytes=BB, capacity_blocks=8, block_tokens=128)
    t2 = cxlrt.KVCache(regions[1], "t128", block_bytes=BB, capacity_blocks=8, block_tokens=128,
                       salt=b"other")
    with pytest.raises(ValueError, match="hashes tokens differently"):
        cxlrt.KVPool([t1, t2])
    other = cxlrt.KVCache(regions[1], "big", block_bytes=2 * BB, capacity_blocks=8)
    with pytest.raises(ValueError, match="one pool holds one model's KV"):
        cxlrt.KVPool([a, other])
    salted = cxlrt.KVCache(regions[1], "salted", block_bytes=BB, capacity_blocks=8, salt=b"x")
    with pytest.raises(ValueError, match="hashes tokens differently"):
        cxlrt.KVPool([a, salted])
    pool = cxlrt.KVPool([a, b])
    with a.lookup(pool.block_hashes(chain(0, 1))) as hit:
        with pytest.raises(ValueError, match="not from one of the pool's caches"):
            cxlrt.KVPool([b]).device_of(hit)
    assert "2 devices" in repr(pool) and len(pool) == 2
    b.close()
    with pytest.raises(ValueError, match="device 1's cache 'kv' is closed"):
        pool.lookup(pool.block_hashes(chain(0, 1)))
    with pytest.raises(ValueError, match="device 1's cache 'kv' is closed"):
        cxlrt.KVPool([a, b])


def test_objects_of_different_sizes_share_the_devices(backend):
    # Two models' KV (blocks of 4 KiB and 12 KiB) over the same two devices.
    _, regions = devices(backend, 2)
    small = cxlrt.KVPool(caches(regions), placement="round_robin")
    big = cxlrt.KVPool([cxlrt.KVCache(r, "big", block_bytes=3 * BB, capacity_blocks=16)
                        for r in regions], placement="round_robin")
    for conv in range(4):
        ks = small.block_hashes(chain(conv, 2))
        kb = big.block_hashes(chain(conv, 2))
        small.store(ks, [block_for(k) for k in ks])
        big.store(kb, [block_for(k, 3 * BB) for k in kb])
    for conv in range(4):
        for pool, bb in ((small, BB), (big, 3 * BB)):
            keys = pool.block_hashes(chain(conv, 2))
            with pool.lookup(keys) as hit:
                assert len(hit) == 2
                out = hit.cache.load(hit)
                assert [out[i].tobytes() for i in range(2)] == [block_for(k, bb) for k in keys]
    assert small.placed == big.placed == [2, 2]


def test_home_from_spreads_chains_that_share_a_system_prompt(backend):
    _, regions = devices(backend)
    system = 2  # blocks every conversation starts with

    def conv_keys(pool, conv, n=4):
        return pool.block_hashes(chain(conv, n, shared=system))

    # Without home_from, the shared first block decides: every chain lands on one device.
    lumped = cxlrt.KVPool(caches(regions), placement="round_robin")
    for conv in range(3):
        keys = conv_keys(lumped, conv)
        lumped.store(keys, [block_for(k) for k in keys])
    assert [lumped.home(conv_keys(lumped, c)) for c in range(3)] == [0, 0, 0]
    # With it, each conversation's own blocks decide, and each home has the prompt.
    cs = [cxlrt.KVCache(r, "spread", block_bytes=BB, capacity_blocks=64) for r in regions]
    pool = cxlrt.KVPool(cs, placement="round_robin", home_from=system)
    for conv in range(6):
        keys = conv_keys(pool, conv)
        pool.store(keys[:3], [block_for(k) for k in keys[:3]])
        pool.store(keys, [block_for(k) for k in keys])  # the next turn goes home
    assert [pool.home(conv_keys(pool, c)) for c in range(6)] == [0, 1, 2, 0, 1, 2]
    for conv in range(6):
        keys = conv_keys(pool, conv)
        assert stored_on(pool, keys[system:]) == {conv % 3}
        with pool.lookup(keys) as hit:
            assert len(hit) == 4 and pool.device_of(hit) == conv % 3
    assert [c.occupancy for c in cs] == [system + 2 * 2] * 3  # the prompt once per device
    assert pool.home(conv_keys(pool, 0)[:system]) == 0  # the prompt alone: the first holder


def test_the_longest_copy_is_read_and_extended(backend):
    # Two processes placing one new chain at once can leave copies of different
    # lengths on two devices: lookups read the longer, stores extend it.
    _, regions = devices(backend, 2)
    cs = caches(regions)
    pool = cxlrt.KVPool(cs)
    keys = pool.block_hashes(chain(0, 6))
    cs[0].store(keys[:1], [block_for(keys[0])])
    cs[1].store(keys[:4], [block_for(k) for k in keys[:4]])
    with pool.lookup(keys) as hit:
        assert len(hit) == 4 and pool.device_of(hit) == 1
    assert pool.store(keys, [block_for(k) for k in keys]) == keys[4:]
    assert stored_on(pool, keys[1:]) == {1}
    assert pool.placed == [0, 0]  # it had a home: nothing was placed
