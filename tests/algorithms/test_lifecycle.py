"""Lifecycles (STYLE rule 7): a region closes its dependents first, every close() is
idempotent, and what was opened on a closed region says so when used."""

from __future__ import annotations

import pytest

import cxlrt
from cxlrt.channel import Channel

BB = 4096


def _everything(r):
    """One of each object that lives on a region, in use."""
    kv = cxlrt.KVCache(r, "kv", block_bytes=BB, capacity_blocks=8)
    kv.store([b"k" * 16], [bytes([7]) * BB])
    hit = kv.lookup([b"k" * 16])
    assert len(hit) == 1
    ch = Channel(r, "ch", slots=4, msg_bytes=64)
    ch.send(b"hello")
    lock = r.lock("lk")
    lock.acquire()
    lock.release()
    return kv, hit, ch, lock


def test_region_close_closes_its_dependents_first(backend):
    r = backend.create(nodes=2)
    kv, hit, ch, lock = _everything(r)
    r.close()
    assert kv.closed and ch.closed
    hit.release()  # only forgets: the cache gave its pins back
    # The pin is given back at the region's close, not left to this (live) process's
    # record: another node can evict the block, and the channel's roles are free.
    other = backend.open(1)
    kv2 = cxlrt.KVCache(other, "kv", create=False)
    for i in range(32):
        kv2.store([i.to_bytes(16, "little")], [bytes(BB)])
    with kv2.lookup([b"k" * 16]) as h:
        assert len(h) == 0
    assert Channel(other, "ch", slots=None, msg_bytes=None).try_recv() == b"hello"
    other.close()


def test_close_is_idempotent_in_any_order(backend):
    r = backend.create()
    kv, hit, ch, lock = _everything(r)
    for close in (hit.release, kv.close, ch.close, r.close) * 2:
        close()


@pytest.mark.parametrize("use", ["kv.lookup", "kv.store", "kv.load", "ch.send", "ch.recv",
                                 "lock.acquire", "region.load64", "region.lock"])
def test_objects_of_a_closed_region_say_so(backend, use):
    r = backend.create()
    kv, hit, ch, lock = _everything(r)
    r.close()
    calls = {
        "kv.lookup": lambda: kv.lookup([b"k" * 16]),
        "kv.store": lambda: kv.store([b"j" * 16], [bytes(BB)]),
        "kv.load": lambda: kv.load(hit),
        "ch.send": lambda: ch.send(b"x"),
        "ch.recv": lambda: ch.try_recv(),
        "lock.acquire": lambda: lock.acquire(timeout=1),
        "region.load64": lambda: r.load64(0),
        "region.lock": lambda: r.lock("other"),
    }
    with pytest.raises((cxlrt.RegionClosedError, ValueError), match="closed"):
        calls[use]()
