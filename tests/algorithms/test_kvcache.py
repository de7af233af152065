"""The prefix KV cache, written once, on every backend, across processes and nodes."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

import cxlrt
import cxlrt.crash
from cxlrt.kvcache import _break_pin_protocol
from tests.kvforge import forge_entry
from tests.nodes import _CTX, raise_failures, run_procs

BB = 4096  # block bytes in most tests


def block_for(key: bytes, bb: int = BB) -> bytes:
    """The bytes every test stores under `key`, so any node can verify a load."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    return (seed * (bb // 32 + 1))[:bb]


def chain(conv: int, nblocks: int, shared: int = 0) -> list[int]:
    """Tokens of a prompt: `shared` blocks common to all, then per-conversation blocks."""
    toks = list(range(16 * shared))
    toks += [100_000 + conv * 10_000 + i for i in range(16 * (nblocks - shared))]
    return toks


def open_cache(r, **kw):
    kw.setdefault("block_bytes", BB)
    kw.setdefault("capacity_blocks", 64)
    return cxlrt.KVCache(r, "kv", **kw)


def filled(backend, *, nodes=1, capacity=8, blocks=8):
    """A fresh region and cache holding one conversation's `blocks` blocks."""
    r = backend.create(nodes=nodes)
    c = open_cache(r, capacity_blocks=capacity)
    keys = c.block_hashes(chain(0, blocks))
    assert c.store(keys, [block_for(k) for k in keys]) == keys
    return r, c, keys


def store_new(c, conv, n=2):
    """Store `n` blocks of another conversation; returns (their keys, the keys stored)."""
    more = c.block_hashes(chain(conv, n))
    return more, c.store(more, [block_for(k) for k in more])


def test_store_lookup_load_round_trip_across_nodes(backend):
    a = backend.create(nodes=2)
    b = backend.open(1)
    ca, cb = open_cache(a), open_cache(b)
    keys = ca.block_hashes(chain(0, 6))
    stored = ca.store(keys, [block_for(k) for k in keys])
    assert stored == keys
    with cb.lookup(keys) as hit:
        assert len(hit) == 6 and list(hit.keys) == keys and hit.nbytes == 6 * BB
        out = cb.load(hit)
        assert out.shape == (6, BB)
        assert [out[i].tobytes() for i in range(6)] == [block_for(k) for k in keys]
    st = cb.stats()
    assert st["hits"] == 6 and st["stores"] == 6 and st["occupancy"] == 6
    assert st["bytes_stored"] == 6 * BB and st["bytes_loaded"] == 6 * BB
    a.close()
    b.close()


def test_lookup_returns_the_leading_run_only(backend):
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 5))
    c.store(keys[:2] + keys[3:], [block_for(k) for k in keys[:2] + keys[3:]])
    with c.lookup(keys) as hit:
        assert len(hit) == 2  # block 2 is missing: later blocks cannot be used
    other = c.block_hashes(chain(1, 5))
    with c.lookup(other) as hit:
        assert len(hit) == 0
    st = c.stats()
    assert (st["hits"], st["misses"], st["lookups"]) == (2, 3 + 5, 2)
    r.close()



def test_counters_reach_the_region_at_release_and_stats(backend):
    """Lookups count in process memory and reach the region with the next pass of
    the pin mutex: another node sees a hit's counts once it is released, a miss's
    once this process asks for stats; a forked child never publishes its parent's."""
    a = backend.create(nodes=2)
    b = backend.open(1)
    ca, cb = open_cache(a), open_cache(b)
    keys = ca.block_hashes(chain(0, 3))
    ca.store(keys, [block_for(k) for k in keys])
    with ca.lookup(keys) as hit:
        assert len(hit) == 3
    st = cb.stats()
    assert (st["lookups"], st["hits"], st["misses"]) == (1, 3, 0)
    ca.lookup(ca.block_hashes(chain(1, 2))).release()  # a miss: no pin pass at all
    assert cb.stats()["lookups"] == 1
    pid = os.fork()
    if pid == 0:  # the child publishes its own lookups only
        try:
            if backend.scheme == "rdma":
                # An RDMA attachment is its process's: the child is told so, the parent's
                # attachment is untouched (checked below).
                try:
                    ca.lookup(keys[:1]).release()
                except OSError:
                    os._exit(0 if "forked child" in (a.backend.failure() or "") else 3)
                os._exit(4)
            ca.lookup(keys[:1]).release()
            os._exit(0 if ca.stats()["lookups"] == 2 else 1)
        finally:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0
    st = ca.stats()
    child = 0 if backend.scheme == "rdma" else 1
    assert (st["lookups"], st["hits"], st["misses"]) == (2 + child, 3 + child, 2)
    assert st["bytes_loaded"] == 0
    a.close()
    b.close()

def test_load_targets(backend):
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 3))
    want = [block_for(k) for k in keys]
    c.store(keys, b"".join(want))  # one contiguous source buffer
    with c.lookup(keys) as hit:
        parts = [bytearray(BB) for _ in range(3)]  # one buffer per block
        c.load(hit, parts)
        assert [bytes(p) for p in parts] == want
        tail = np.zeros((2, BB), np.uint8)
        c.load(hit, tail, start=1)
        assert tail.tobytes() == b"".join(want[1:])
        if r.caps & cxlrt.Caps.MAPPABLE:
            views = c.views(hit)
            assert [bytes(v) for v in views] == want and views[0].readonly
            del views  # a live view keeps the region from closing
        else:
            with pytest.raises(cxlrt.UnsupportedError):
                c.views(hit)
        assert c.load(hit, start=3).shape == (0, BB)  # nothing left to load
        assert c.load(hit, start=1, stop=2).tobytes() == want[1]  # one block of the middle
        assert c.load(hit, start=2, stop=2).shape == (0, BB)
        for bad in ({"stop": 4}, {"start": 2, "stop": 1}, {"stop": True}, {"stop": 1.0}):
            with pytest.raises(ValueError, match="stop must be"):
                c.load(hit, **bad)
    with c.lookup(c.block_hashes(chain(1, 3))) as miss:  # a miss loads as empty too
        assert len(miss) == 0 and c.load(miss).shape == (0, BB)
        assert c.load(miss, bytearray(0)) == bytearray(0)
    r.close()


# torch is imported inside the two tensor tests only: the lab's guests run this module
# over 9p under TCG, where importing torch costs minutes, and leave these two out.
def test_load_into_torch_tensor(backend):
    torch = pytest.importorskip("torch")
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 3))
    want = [block_for(k) for k in keys]
    c.store(keys, want)
    with c.lookup(keys) as hit:
        t = torch.empty(3 * BB // 4, dtype=torch.float32)  # a torch tensor, any dtype
        c.load(hit, t)
        assert t.view(torch.uint8).numpy().tobytes() == b"".join(want)
        half = torch.zeros(BB, dtype=torch.float16)  # two blocks from the second on
        c.load(hit, half, start=1)
        assert half.view(torch.uint8).numpy().tobytes() == b"".join(want[1:])
    r.close()


def test_load_into_cuda_tensor(backend):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the CUDA load path (host-registered region, "
                    "async copies) runs where a GPU is present")
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 4))
    c.store(keys, [block_for(k) for k in keys])
    with c.lookup(keys) as hit:
        dst = torch.empty(4 * BB, dtype=torch.uint8, device="cuda")
        c.load(hit, dst)
        assert dst.cpu().numpy().tobytes() == b"".join(block_for(k) for k in keys)
    r.close()


def test_duplicate_store_is_skipped(backend):
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 4))
    assert c.store(keys[:2], [block_for(k) for k in keys[:2]]) == keys[:2]
    assert c.store(keys, [block_for(k) for k in keys]) == keys[2:]
    assert c.stats()["skipped"] == 2
    assert sorted(e["key"] for e in c.entries()) == sorted(keys)
    r.close()


def _store_same(spec, node, keys, rounds):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r)
    won = 0
    for _ in range(rounds):
        won += len(c.store(keys, [block_for(k) for k in keys]))
    deadline = time.monotonic() + 60
    while True:  # a key skipped here may still be being written by its winner
        hit = c.lookup(keys)
        if len(hit) == len(keys) or time.monotonic() > deadline:
            break
        hit.release()
        time.sleep(0.01)
    with hit:
        assert len(hit) == len(keys), f"node {node}: {len(hit)} of {len(keys)} became ready"
        out = c.load(hit)
        for i, k in enumerate(keys):
            assert out[i].tobytes() == block_for(k), f"node {node}: block {i} differs"
    r.close()
    return won


def test_concurrent_stores_of_the_same_keys_leave_one_entry_each(backend):
    r = backend.create(nodes=4)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 24))
    won = raise_failures(run_procs(_store_same, [(backend.spec(), n, keys, 3)
                                                 for n in range(4)]))
    assert sum(won) == len(keys)  # exactly one store won each key
    entries = c.entries()
    assert sorted(e["key"] for e in entries) == sorted(keys)
    assert all(e["state"] == "ready" for e in entries)
    assert c.stats()["occupancy"] == len(keys)
    r.close()


def _serve(spec, node, conv_ids, rounds, seed):
    """Look up a prompt, load and verify what hit, store the rest: a prefill worker."""
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=48)
    rnd = np.random.default_rng(seed * 31 + node)
    hits = loaded = 0
    for _ in range(rounds):
        conv = int(rnd.choice(conv_ids))
        keys = c.block_hashes(chain(conv, int(rnd.integers(4, 12)), shared=3))
        with c.lookup(keys) as hit:
            n = len(hit)
            if n:
                out = c.load(hit)
                for i in range(n):
                    assert out[i].tobytes() == block_for(keys[i]), \
                        f"node {node}: loaded block {i} is not what was stored"
                loaded += n
            hits += n
        c.store(keys[n:], [block_for(k) for k in keys[n:]])
    r.close()
    return hits, loaded


def test_overlapping_prefixes_from_several_processes(backend):
    """4 nodes x 2 processes share a system prompt; eviction runs (48 blocks for ~100)."""
    r = backend.create(nodes=4, size="8M")
    c = open_cache(r, capacity_blocks=48)
    seed = backend.seed or 0
    args = [(backend.spec(), n % 4, [n % 5, (n + 1) % 5, 7], 40, seed) for n in range(8)]
    res = raise_failures(run_procs(_serve, args, timeout=240))
    st = c.stats()
    assert sum(h for h, _ in res) == st["hits"] > 0
    assert st["evictions"] > 0, st
    assert st["occupancy"] <= 48
    assert all(e["state"] == "ready" for e in c.entries())
    assert len(c.entries()) == st["occupancy"]
    r.close()


def _verify_pinned(spec, node, keys, q_ready, q_stop):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=16)
    hit = c.lookup(keys)
    assert len(hit) == len(keys), "the pinned blocks were not all present"
    q_ready.put(1)
    checks = 0
    while q_stop.empty() or checks < 3:
        out = c.load(hit)
        for i, k in enumerate(keys):
            assert out[i].tobytes() == block_for(k), f"pinned block {i} changed under a pin"
        if r.caps & cxlrt.Caps.MAPPABLE:
            assert bytes(c.views(hit)[0]) == block_for(keys[0])
        checks += 1
        time.sleep(0.002)
    hit.release()
    r.close()
    return checks


def _fill(spec, node, conv, n, broken=False):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=16)
    if broken:
        _break_pin_protocol(c)
    stored = 0
    for i in range(n):
        keys = c.block_hashes(chain(conv * 1000 + i, 4))
        stored += len(c.store(keys, [block_for(k) for k in keys]))
    r.close()
    return stored


@contextmanager
def pinned_reader(backend, keys):
    """A process on node 1 that pins `keys` and verifies them until the block ends.

    Yields the process; its exit code is 0 only if every check passed.
    """
    q_ready, q_stop = _CTX.Queue(), _CTX.Queue()
    reader = _CTX.Process(target=_verify_pinned, args=(backend.spec(), 1, keys, q_ready, q_stop))
    reader.start()
    try:
        q_ready.get(timeout=60)
        yield reader
    finally:
        q_stop.put(1)
        reader.join(60)


def test_eviction_never_frees_a_pinned_block(backend):
    r, c, keys = filled(backend, nodes=3, capacity=16, blocks=4)
    with pinned_reader(backend, keys) as reader:
        stored = raise_failures(run_procs(_fill, [(backend.spec(), 2, 1, 30),
                                                  (backend.spec(), 0, 2, 30)]))
        assert sum(stored) > 16  # the cache turned over several times around the pins
        assert c.stats()["evictions"] >= sum(stored) - 12
        with c.lookup(keys) as hit:
            assert len(hit) == 4  # still there: pinned all along
    assert reader.exitcode == 0, "the reader saw a pinned block change (see its traceback)"
    with c.lookup(keys) as hit:
        assert len(hit) == 4
    r.close()


@pytest.mark.debug_build
def test_an_evictor_that_ignores_pins_is_caught(backend):
    """The broken protocol: evict without reading pins. The pinned reader must notice."""
    r, c, keys = filled(backend, nodes=3, capacity=16, blocks=4)
    with pinned_reader(backend, keys) as reader:
        # node 0 allocated the pinned payloads, so its frees make them reusable at once
        raise_failures(run_procs(_fill, [(backend.spec(), 0, 1, 30, True)]))
        time.sleep(0.05)  # the reader polls every 2 ms
    assert reader.exitcode != 0, "a pinned block was evicted and reused, and no reader noticed"
    r.close()


@pytest.mark.parametrize("broken", [
    pytest.param(False, id="pins-read"),
    pytest.param(True, id="pins-ignored", marks=pytest.mark.debug_build)])
def test_delete_drops_unpinned_blocks_and_keeps_pinned_ones(backend, broken):
    r, c, keys = filled(backend, nodes=2, capacity=16, blocks=4)
    peer = backend.open(1)
    cp = open_cache(peer, capacity_blocks=16)
    if broken:  # negative control: a deleter that does not read pins frees a held block
        _break_pin_protocol(c)
    with cp.lookup(keys[:1]):  # node 1 pins block 0
        absent = c.block_hashes(chain(9, 1))
        dropped = c.delete(keys[:3] + absent)
        assert dropped == (keys[:3] if broken else keys[1:3])
        assert c.stats()["occupancy"] == 4 - len(dropped)
        with c.lookup(keys) as hit:
            assert len(hit) == (0 if broken else 1)
    assert c.delete(keys[:1]) == ([] if broken else keys[:1])
    assert c.delete([]) == []
    with cp.lookup(keys[3:]) as hit:  # the block nobody deleted is still whole
        assert bytes(cp.load(hit)[0]) == block_for(keys[3])
    assert c.store(keys[:3], [block_for(k) for k in keys[:3]]) == keys[:3]  # room again
    cp.close()
    peer.close()
    r.close()


def test_lru_evicts_the_least_recently_used_unpinned_block(backend):
    r = backend.create(nodes=1)
    c = open_cache(r, capacity_blocks=16)
    a, b, d = (c.block_hashes(chain(i, 1)) for i in range(3))
    fill = [c.block_hashes(chain(10 + i, 1))[0] for i in range(13)]
    c.store(a, [block_for(a[0])])
    time.sleep(0.003)
    c.store(b, [block_for(b[0])])
    time.sleep(0.003)
    c.store(fill, [block_for(k) for k in fill])
    time.sleep(0.003)
    with c.lookup(a):  # a becomes the most recently used
        pass
    time.sleep(0.003)
    c.store(d, [block_for(d[0])])     # 16 of 16: the next store must evict
    assert c.stats()["occupancy"] == 16
    new = c.block_hashes(chain(99, 1))
    assert c.store(new, [block_for(new[0])]) == new
    with c.lookup(b) as hit:
        assert len(hit) == 0        # b was least recently used
    with c.lookup(a) as hit:
        assert len(hit) == 1
    assert c.stats()["evictions"] >= 1
    r.close()


def test_a_blocks_recency_is_its_latest_lookup_not_its_release(backend):
    """An unpin keeps its block's recency: a hit held across later lookups of other
    blocks does not make its block look newer than them when it is released."""
    r = backend.create(nodes=1)
    c = open_cache(r, capacity_blocks=16)
    a, b = (c.block_hashes(chain(i, 1)) for i in range(2))
    fill = [c.block_hashes(chain(10 + i, 1))[0] for i in range(14)]
    c.store(a, [block_for(a[0])])
    c.store(b, [block_for(b[0])])
    c.store(fill, [block_for(k) for k in fill])  # 16 of 16: the next store must evict
    time.sleep(0.003)
    held = c.lookup(a)
    assert len(held) == 1
    time.sleep(0.003)
    with c.lookup(b) as hit:  # looked up after a
        assert len(hit) == 1
    time.sleep(0.003)
    for k in fill:
        with c.lookup([k]) as hit:  # the newest of all
            assert len(hit) == 1
    time.sleep(0.003)
    held.release()  # a's release is the latest event, but not a use
    new = c.block_hashes(chain(99, 1))
    assert c.store(new, [block_for(new[0])]) == new
    with c.lookup(a) as hit:
        assert len(hit) == 0  # a: looked up least recently
    with c.lookup(b) as hit:
        assert len(hit) == 1
    r.close()


def _table(r, c):
    """(state, home slot) of every slot, read from the medium."""
    out = []
    for s in range(c.slots):
        raw = r.dma_read(c.slot_offset(s), 24)
        out.append((raw[16], int.from_bytes(raw[:8], "little") & (c.slots - 1)))
    return out


def test_steady_eviction_keeps_probe_walks_short(backend):
    """A tombstone stays only while a present key's walk (home slot to entry) passes it;
    every other one is emptied, so misses stop early instead of walking the table.
    Before: only a tombstone with an empty slot above it was emptied, and under steady
    eviction misses walked most of the table (30 us each at 2048 slots)."""
    r = backend.create()
    c = open_cache(r, block_bytes=64, capacity_blocks=32)  # 64 slots
    for conv in range(80):  # 16 new blocks a call into a full cache: 16 evictions each
        keys = c.block_hashes(chain(conv, 16))
        assert c.store(keys, [bytes(64)] * 16) == keys
    assert c.stats()["evictions"] >= 1000
    table = _table(r, c)
    live = {s for s, (st, _) in enumerate(table) if st in (1, 2, 4)}
    walks = set()
    for s in live:
        home = table[s][1]
        walk = [(home + i) % c.slots for i in range((s - home) % c.slots + 1)]
        assert all(table[w][0] != 0 for w in walk), "an empty slot inside a present key's walk"
        walks.update(walk)
    stale = [s for s, (st, _) in enumerate(table) if st == 3 and s not in walks]
    assert stale == [], f"tombstones no walk needs: {stale}"
    # And every present key is still found, the last store's whole chain among them.
    ready = [e["key"] for e in c.entries() if e["state"] == "ready"]
    assert len(ready) == 32
    for k in ready:
        with c.lookup([k]) as hit:
            assert len(hit) == 1
    keys = c.block_hashes(chain(79, 16))
    with c.lookup(keys) as hit:
        assert len(hit) == 16


def _homed(home: int, tag: int) -> bytes:
    """A 16-byte key whose home slot is `home` (its first 8 bytes, masked)."""
    return home.to_bytes(8, "little") + b"homed" + tag.to_bytes(3, "little")


def test_keys_crowded_onto_one_home_slot_are_found_past_one_another(backend):
    """A lookup reads its keys' home lines a batch at a time and walks on only for a
    key found elsewhere: past another key, past a tombstone, and around the table's
    end. In chains longer than one batch every key is found, and a hit ends exactly at
    the first key that is absent or deleted."""
    r = backend.create(nodes=1)
    c = open_cache(r, block_bytes=64, capacity_blocks=32)  # 64 slots
    last = c.slots - 1
    crowd = [_homed(last, i) for i in range(6)]  # one home: the walk wraps to 0..4
    spread = [_homed(5 * i % c.slots, 100 + i) for i in range(1, 15)]  # 65: slot 1
    keys = [k for pair in zip(spread, crowd + [None] * 8, strict=True) for k in pair if k]
    assert len(keys) == 20
    assert c.store(keys, [block_for(k, 64) for k in keys]) == keys
    table = _table(r, c)
    away = [(s - home) % c.slots for s, (st, home) in enumerate(table)
            if st == 2 and home != s]
    assert len(away) >= 5 and 1 in away, f"too few keys away from home: {away}"
    with c.lookup(keys) as hit:
        assert len(hit) == 20
        assert list(hit.keys) == keys
    assert c.delete([crowd[0]]) == [crowd[0]]
    assert _table(r, c)[last][0] == 3, "the deleted key's home slot should hold a tombstone"
    with c.lookup(keys) as hit:
        assert len(hit) == keys.index(crowd[0])
    rest = [k for k in keys if k != crowd[0]]
    with c.lookup(rest) as hit:
        assert len(hit) == 19
    absent = rest[:11] + [_homed(last, 999)] + rest[11:]
    with c.lookup(absent) as hit:
        assert len(hit) == 11
    with c.lookup([_homed(0, 998)] + rest) as hit:  # a miss at a home that others crowd
        assert len(hit) == 0
    r.close()


def test_a_store_evicts_only_for_the_keys_it_lacks(backend):
    """A full cache evicts once for the whole store, sized by the keys still absent:
    keys already present are skipped, and no other block is evicted for them."""
    r = backend.create()
    c = open_cache(r, block_bytes=64, capacity_blocks=32)
    old = c.block_hashes(chain(1, 8))
    recent = c.block_hashes(chain(0, 24))
    assert c.store(old, [bytes(64)] * 8) == old
    time.sleep(0.005)  # LRU stamps are milliseconds: `recent` is newer, whatever the slot
    assert c.store(recent, [bytes(64)] * 24) == recent
    before = c.stats()["evictions"]
    new = c.block_hashes(chain(2, 1))
    assert c.store(new + recent[:23], [bytes(64)] * 24) == new
    evicted = c.stats()["evictions"] - before
    assert 1 <= evicted <= 32 // 16, f"{evicted} evictions to store one new block"
    assert c.stats()["occupancy"] == 32 - evicted + 1
    with c.lookup(recent) as hit:  # the present keys the store skipped all stay
        assert len(hit) == 24
    left = 0
    for k in old:  # the evicted ones came from the older tenant (in any order within it)
        with c.lookup([k]) as hit:
            left += len(hit)
    assert left == 8 - evicted


def test_out_of_memory_evicts_for_the_store_not_the_whole_cache(backend):
    """When the region's memory is another node's (its payload chunks), evicting only
    hands it back through that node's queue: the store gives up after evicting what it
    needed, and the cache is not emptied for memory this node cannot have yet."""
    a = backend.create(nodes=2)
    b = backend.open(1)
    ca = open_cache(a, block_bytes=4032, capacity_blocks=2000)  # small payloads
    cb = open_cache(b, block_bytes=4032, capacity_blocks=2000)
    for conv in range(400):  # node 0 fills the heap (4 MiB) with its own chunks
        keys = ca.block_hashes(chain(conv, 4))
        ca.store(keys, [bytes(4032)] * 4)
    full = ca.stats()["occupancy"]
    assert full < 2000  # the region ran out, not the cache
    before = cb.stats()["evictions"]
    cb.store(cb.block_hashes(chain(10_000, 1)), [bytes(4032)])
    assert cb.stats()["evictions"] - before <= 1
    assert cb.stats()["occupancy"] >= full - 1
    keys = cb.block_hashes(chain(10_001, 300))  # more than the cache's own room
    cb.store(keys, [bytes(4032)] * 300)
    assert cb.stats()["evictions"] - before <= 1 + 300  # was: every block (726 of 726)
    assert cb.stats()["occupancy"] >= full - 301


def test_a_full_cache_of_pinned_blocks_stores_nothing_and_says_so(backend):
    r, c, keys = filled(backend, nodes=1)
    more = c.block_hashes(chain(1, 4))
    with c.lookup(keys) as hit:
        assert len(hit) == 8
        assert c.store(more, [block_for(k) for k in more]) == []  # no room: not an error
    assert c.store(more, [block_for(k) for k in more]) == more  # unpinned now: evicts
    r.close()


def _pins(r):
    """Pins the region holds, summed over nodes and blocks (read by DMA)."""
    (kv,) = cxlrt.inspect(r.spec)["kv_caches"]
    return kv["pins"]


def test_a_block_named_twice_in_one_lookup_holds_two_pins(backend):
    """A lookup pins once per key it names, so naming a block twice pins it twice.
    Off a direct mapping a lookup's pin words are read in one gather and written in
    one scatter: there, two counts of one word in a batch would each build on the
    same old value and one would be lost."""
    r, c, keys = filled(backend, nodes=1)
    with c.lookup([keys[0]]) as held:
        assert _pins(r) == 1
        with c.lookup([keys[0], keys[1], keys[0]]) as twice:
            assert len(twice) == 3
            assert _pins(r) == 4
        assert _pins(r) == 1
        more = c.block_hashes(chain(1, 8))
        stored = c.store(more, [block_for(k) for k in more])
        assert len(stored) == 7  # every block but the one still held was evicted
        with c.lookup([keys[0]]) as again:
            assert len(again) == 1
            assert c.load(again)[0].tobytes() == block_for(keys[0])
        assert len(held) == 1
    assert _pins(r) == 0
    r.close()


def _lookups_while_locked(spec, node, keys, n):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r)
    for _ in range(n):
        with c.lookup(keys) as hit:
            assert len(hit) == len(keys)
            out = c.load(hit)
            assert out[-1].tobytes() == block_for(keys[-1])
    r.close()
    return n


def test_lookups_complete_while_another_node_holds_the_cache_lock(backend):
    r = backend.create(nodes=2)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 8))
    c.store(keys, [block_for(k) for k in keys])
    lock = r.lock("kv:kv")  # the cache's global lock
    with lock:
        done = raise_failures(run_procs(_lookups_while_locked,
                                        [(backend.spec(), 1, keys, 50)], timeout=60))
    assert done == [50]
    r.close()


def _store_and_die(spec, node, keys):
    r = cxlrt.open(spec, node=node)
    c = cxlrt.KVCache(r, "kv", block_bytes=BB, capacity_blocks=4)
    cxlrt.crash.arm("kv.store.copy", "kill")  # SIGKILL mid-copy: no cleanup runs
    c.store(keys, [block_for(k) for k in keys])


def _die_storing(backend, keys):
    p = _CTX.Process(target=_store_and_die, args=(backend.spec(), 0, keys))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL


def test_entries_of_a_writer_that_died_are_reclaimed(backend):
    r = backend.create(nodes=1)
    c = open_cache(r, capacity_blocks=4)
    keys = c.block_hashes(chain(0, 4))
    _die_storing(backend, keys)
    assert [e["state"] for e in c.entries()] == ["writing"] * 4
    with c.lookup(keys) as hit:
        assert len(hit) == 0  # never published: never served
    # Storing the same keys reclaims them on the spot: a dead writer hides no prefix.
    assert c.store(keys, [block_for(k) for k in keys]) == keys
    with c.lookup(keys) as hit:
        assert [bytes(b) for b in c.load(hit)] == [block_for(k) for k in keys]
    # Other keys: eviction takes the dead writer's entries before any ready block.
    time.sleep(0.003)
    with c.lookup(keys[:2]):  # the most recently used: eviction must leave them
        pass
    half = c.block_hashes(chain(1, 2))
    _die_storing(backend, half)
    assert sorted(e["state"] for e in c.entries()) == ["ready"] * 2 + ["writing"] * 2
    more = c.block_hashes(chain(2, 2))
    assert c.store(more, [block_for(k) for k in more]) == more
    assert sorted(e["state"] for e in c.entries()) == ["ready"] * 4
    with c.lookup(keys[:2]) as hit:
        assert len(hit) == 2  # the two ready blocks survived
    assert c.stats()["occupancy"] == 4
    r.close()


def _corrupt(r, c, key, *, off=None, length=None, raw=None):
    e = next(e for e in c.entries() if e["key"] == key)
    at = c.slot_offset(e["slot"])
    if raw is None:
        raw = forge_entry(key, 2, e["generation"], e["offset"] if off is None else off,
                          e["length"] if length is None else length)
    r.store(at, raw)
    r.persist(at, 64)


@pytest.mark.parametrize("how", ["offset-outside", "offset-misaligned", "length", "torn-line"])
def test_a_corrupted_entry_raises_never_crashes(backend, how):
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 3))
    c.store(keys, [block_for(k) for k in keys])
    if how == "offset-outside":
        _corrupt(r, c, keys[1], off=r.size - 64)
    elif how == "offset-misaligned":
        _corrupt(r, c, keys[1], off=c.entries()[0]["offset"] + 8)
    elif how == "length":
        _corrupt(r, c, keys[1], length=1 << 40)
    else:
        _corrupt(r, c, keys[1], raw=bytes(range(64)))  # the check word cannot match
    with pytest.raises(cxlrt.RegionError, match="corrupt"):
        c.lookup(keys)
    r.close()


def test_a_corrupt_line_inside_a_walk_raises_for_every_key_that_walks_past_it(backend):
    """Keys A, C, B share one home slot; C's line (A's next) loses a bit of its key, so
    its check word no longer matches. A lookup of C or B walks past that line and must
    say the region is corrupt, not miss (a review found a lookup that checked only the
    line it stopped at: B was then a silent miss). A, at home, is still found."""
    r = backend.create(nodes=1)
    c = open_cache(r, block_bytes=64, capacity_blocks=32)
    a, mid, b = (_homed(7, t) for t in (1, 2, 3))
    assert c.store([a, mid, b], [block_for(k, 64) for k in (a, mid, b)]) == [a, mid, b]
    e = next(e for e in c.entries() if e["key"] == mid)
    assert e["slot"] == 8
    raw = bytearray(forge_entry(mid, 2, e["generation"], e["offset"], e["length"]))
    raw[15] ^= 0x40
    _corrupt(r, c, mid, raw=bytes(raw))
    for keys in ([b], [mid], [a, mid, b]):
        with pytest.raises(cxlrt.RegionError, match="corrupt"):
            c.lookup(keys)
    with c.lookup([a]) as hit:
        assert len(hit) == 1
    r.close()


def test_a_payload_header_that_does_not_match_raises(backend):
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 2))
    c.store(keys, [block_for(k) for k in keys])
    e = next(e for e in c.entries() if e["key"] == keys[1])
    with c.lookup(keys) as hit:
        r.dma_write(e["offset"] + 8, bytes(16))  # another key in the header: a reused payload
        with pytest.raises(cxlrt.RegionError, match="corrupt"):
            c.load(hit)
    r.close()


def test_attach_with_another_scheme_says_what_differs(backend):
    r = backend.create(nodes=2)
    open_cache(r, salt=b"llama-3-8b/bf16")
    b = backend.open(1)
    with pytest.raises(cxlrt.SchemeMismatchError, match="salt") as ei:
        open_cache(b, salt=b"llama-3-8b/fp8")
    assert "block_tokens" not in str(ei.value)
    with pytest.raises(cxlrt.SchemeMismatchError, match=r"block_tokens 16 \(you asked for 32\)"):
        open_cache(b, salt=b"llama-3-8b/bf16", block_tokens=32)
    with pytest.raises(cxlrt.SchemeMismatchError, match="algorithm 'blake2b'"):
        open_cache(b, salt=b"llama-3-8b/bf16", algorithm="sha256")
    with pytest.raises(cxlrt.SchemeMismatchError, match="block_bytes"):
        open_cache(b, salt=b"llama-3-8b/bf16", block_bytes=8192)
    same = open_cache(b, salt=b"llama-3-8b/bf16")
    assert same.offset == r.get("kv/kv")
    with pytest.raises(KeyError, match="no KV cache"):
        cxlrt.KVCache(b, "missing", block_bytes=BB, capacity_blocks=4, create=False)
    r.close()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [2**62 + 1, 2**63, 2**64 - 1])
def test_a_capacity_no_heap_could_hold_is_refused_at_once(backend, capacity):
    """Sizing the table for 2**62 blocks or more used to double its slot count past
    2**64 to 0 and loop for ever."""
    r = backend.create(nodes=1)
    with pytest.raises(ValueError, match="capacity_blocks"):
        open_cache(r, capacity_blocks=capacity)
    with pytest.raises(KeyError):
        r.get("kv/kv")  # nothing was created
    r.close()


def test_bad_input(backend):
    r = backend.create(nodes=1)
    for kw in ({"block_bytes": 0}, {"capacity_blocks": -1}, {"block_tokens": 1.5},
               {"algorithm": "crc32"}):
        with pytest.raises(ValueError):
            open_cache(r, **kw)
    with pytest.raises(ValueError, match="1..48 bytes"):
        cxlrt.KVCache(r, "x" * 49, block_bytes=BB, capacity_blocks=4)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 2))
    with pytest.raises(TypeError):
        c.lookup(keys[0])
    with pytest.raises(ValueError, match="16-byte"):
        c.lookup([b"short"])
    with pytest.raises(ValueError, match="expected 2 buffers"):
        c.store(keys, [block_for(keys[0])])
    with pytest.raises(ValueError, match="a block is"):
        c.store(keys, [b"x", b"y"])
    with pytest.raises(ValueError, match="need"):
        c.store(keys, bytes(BB))
    with pytest.raises(TypeError, match="buffer"):
        c.store(keys, 17)
    assert c.stats()["occupancy"] == 0  # nothing half-stored
    c.store(keys, [block_for(k) for k in keys])
    hit = c.lookup(keys)
    with pytest.raises(TypeError, match="read-only"):
        c.load(hit, bytes(2 * BB))
    with pytest.raises(ValueError, match="need"):
        c.load(hit, np.zeros(BB, np.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        c.load(hit, np.zeros((2, 2 * BB), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="start"):
        c.load(hit, start=3)
    hit.release()
    hit.release()  # idempotent
    with pytest.raises(ValueError, match="released"):
        c.load(hit)
    r.close()


def _pin_and_die(spec, node, keys):
    r = cxlrt.open(spec, node=node)
    c = open_cache(r, capacity_blocks=8)
    hit = c.lookup(keys)
    assert len(hit) == len(keys)
    os._exit(0)  # dies holding the pins: no release, no __dealloc__


def test_pins_of_a_dead_process_are_given_back_by_its_node(backend):
    r, c, keys = filled(backend, nodes=2)
    p = _CTX.Process(target=_pin_and_die, args=(backend.spec(), 1, keys))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    more, stored = store_new(c, 1)
    assert stored == []  # node 1's pins hold them all
    b = backend.open(1)
    cb = open_cache(b, capacity_blocks=8)  # node 1 attaches again: it heals its own pins
    assert cb.recover() == 0  # ... already done when it attached
    assert c.store(more, [block_for(k) for k in more]) == more
    b.close()
    r.close()


def test_eviction_recovers_pins_of_its_own_nodes_dead_process(backend):
    r, c, keys = filled(backend, nodes=1)
    p = _CTX.Process(target=_pin_and_die, args=(backend.spec(), 0, keys))
    p.start()
    p.join(60)
    more, stored = store_new(c, 1)
    assert stored == more  # found nothing, healed, evicted
    r.close()


def _drop_hit_under_a_held_pin_mutex(spec):
    """Exit 0 when dropping an unreleased hit did not wait for the pin mutex (held
    by another thread of this process) and the next call gave its pins back."""
    r = cxlrt.open(spec, node=0)
    c = open_cache(r, capacity_blocks=8)
    keys = c.block_hashes(chain(0, 8))
    hit = c.lookup(keys)
    assert len(hit) == 8
    held, go = threading.Event(), threading.Event()

    def hold():
        with r.lock("kvp:kv"):  # the cache's pin mutex (node-local tier)
            held.set()
            go.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    t0 = time.monotonic()
    del hit  # the last reference: Hit.__dealloc__ runs here, with the GIL held
    took = time.monotonic() - t0
    go.set()
    t.join()
    if took > 1.0:
        os._exit(3)
    more, stored = store_new(c, 1)
    os._exit(0 if stored == more else 4)  # 4: the dropped hit's pins were kept


def test_a_dropped_hit_takes_no_lock_and_its_pins_go_back_at_the_next_call(backend):
    """STYLE rule 7: __dealloc__ never takes a lock. A hit dropped while another
    thread holds the pin mutex used to wait for it with the GIL held, and that
    thread needs the GIL to let go: a deadlock. Now the pins wait for the cache's
    next call."""
    _in_a_child(backend, _drop_hit_under_a_held_pin_mutex, "dropping a hit",
                {3: "dropping a hit waited for the pin mutex",
                 4: "a dropped hit's pins were not given back"})


def _in_a_child(backend, target, what, codes):
    """Run target(spec) in a child process over a filled cache; fail with codes[exit
    code] unless it exits 0, or as a deadlock of `what` if it runs 30 s."""
    r, c, keys = filled(backend, nodes=1)
    r.close()
    p = _CTX.Process(target=target, args=(backend.spec(),))
    p.start()
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail(f"{what} deadlocked on the pin mutex")
    assert p.exitcode == 0, codes.get(p.exitcode, p.exitcode)


def _lookup_and_release_under_a_held_pin_mutex(spec):
    """Exit 0 when a lookup and a release, each made while another thread of this
    process holds the pin mutex and needs the GIL to let go of it, waited for it and
    did their work."""
    r = cxlrt.open(spec, node=0)
    c = open_cache(r, capacity_blocks=8)
    keys = c.block_hashes(chain(0, 8))
    c.lookup(keys).release()  # this process's pin record claimed (that waits without the GIL)
    held = threading.Event()

    def hold():
        with r.lock("kvp:kv"):  # the cache's pin mutex (node-local tier)
            held.set()
            time.sleep(0.3)  # then the GIL, to leave the with block

    for step in ("lookup", "release"):
        hit = c.lookup(keys) if step == "release" else None
        held.clear()
        t = threading.Thread(target=hold)
        t.start()
        assert held.wait(10)
        t0 = time.monotonic()
        if step == "lookup":
            hit = c.lookup(keys)
            if len(hit) != 8:
                os._exit(5)
            hit.release()
        else:
            hit.release()
        took = time.monotonic() - t0
        t.join()
        if took < 0.1:
            os._exit(6)  # it did not wait: it gave up, or nothing held the mutex
    more, stored = store_new(c, 1)
    os._exit(0 if stored == more else 4)  # 4: a pin was kept


def test_a_lookup_and_a_release_wait_for_a_held_pin_mutex_without_the_gil(backend):
    """A short lookup or release runs with the GIL held and only tries the pin mutex;
    busy, it starts again without the GIL. Waiting with the GIL held would deadlock
    with a holder that needs the GIL to let go; giving up would lose the hit."""
    _in_a_child(backend, _lookup_and_release_under_a_held_pin_mutex, "a lookup or a release",
                {4: "a pin was kept", 5: "the lookup lost its hit",
                 6: "a call did not wait for the held pin mutex"})


def test_a_hit_dropped_with_its_cache_gives_its_pins_back(backend):
    """The hit is the last reference to its cache object: both go at once, and the
    pins must not go with the cache's list of dropped hits (they would stay in this
    process's pin record, and every other node would count them)."""
    r, c, keys = filled(backend, nodes=2)

    def look_and_drop():
        other = open_cache(r, capacity_blocks=8)  # a second attach of the same cache
        hit = other.lookup(keys)
        assert len(hit) == len(keys)
        del other  # the hit holds the cache now; returning drops both

    look_and_drop()
    gc.collect()
    b = backend.open(1)
    cb = open_cache(b, capacity_blocks=8)
    more, stored = store_new(cb, 1)
    assert stored == more  # node 1 could evict: node 0 holds no pin any more
    b.close()
    r.close()


def test_a_forked_child_cannot_release_its_parents_pins(backend):
    r, c, keys = filled(backend, nodes=1)
    hit = c.lookup(keys)
    p = _CTX.Process(target=hit.release)  # the child's release only forgets the pins
    p.start()
    p.join(60)
    assert p.exitcode == 0
    more, stored = store_new(c, 1)
    assert stored == []  # still pinned by us
    hit.release()
    assert c.store(more, [block_for(k) for k in more]) == more
    r.close()


def _pin_table(node):
    from cxlrt.nodelocal import local_dir
    tables = [f for f in os.listdir(local_dir()) if f.endswith(".pins") and f"-node{node}-" in f]
    assert len(tables) == 1
    return os.path.join(local_dir(), tables[0])


def _rewrite(path, at, data):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


@pytest.mark.parametrize("how", ["lost", "earlier-boot"])
def test_a_node_whose_pin_table_is_gone_starts_with_no_pins(backend, how):
    """A host that lost /dev/shm, or rebooted, must not leave its old pins in the region."""
    r, c, keys = filled(backend, nodes=2)
    p = _CTX.Process(target=_pin_and_die, args=(backend.spec(), 1, keys))
    p.start()
    p.join(60)
    if how == "lost":
        os.unlink(_pin_table(1))
    else:
        _rewrite(_pin_table(1), 24, os.urandom(16))  # the boot id recorded in its header
    more, stored = store_new(c, 1)
    assert stored == []  # node 1's old pins
    b = backend.open(1)
    open_cache(b, capacity_blocks=8)  # a new table: node 1 clears its pins in the region
    assert c.store(more, [block_for(k) for k in more]) == more
    b.close()
    r.close()


def test_processes_of_one_node_in_two_pid_namespaces_are_refused(backend):
    r, c, keys = filled(backend, nodes=1)
    _rewrite(_pin_table(0), 40, (12345).to_bytes(8, "little"))  # another container made it
    b = backend.open(0)
    with pytest.raises(cxlrt.RegionError, match="pid namespace"):
        open_cache(b, capacity_blocks=8)
    b.close()
    r.close()


def test_a_block_pinned_65535_times_ends_the_hit_there(backend):
    r, c, keys = filled(backend, blocks=2)
    held = [c.lookup(keys[:1]) for _ in range(0xffff)]  # this node's pin count saturates
    assert all(len(h) == 1 for h in held)
    with c.lookup(keys) as hit:
        assert len(hit) == 0  # the first key cannot take one more pin: a miss, not an error
    with c.lookup([keys[1], keys[0]]) as hit:
        assert len(hit) == 1 and list(hit.keys) == [keys[1]]
    held.pop().release()
    with c.lookup(keys) as hit:
        assert len(hit) == 2
    for h in held:
        h.release()
    r.close()
