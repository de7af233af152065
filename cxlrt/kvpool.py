"""KV caches on several devices used as one: HyMCache's unified address space with
request-level placement.

A chain lives whole on one device, its home, so a request's blocks come from one
device, in order, and its prefetch is one sequential stream there; requests spread
over the devices by the chains they read. The home of a chain is the device that
holds the longest run of it (ties to the lower index), found by looking the chain up
on every device: every process and node agrees on it with no shared directory, and
when two processes placed one new chain at once (each storing it whole on a
different device) lookups still read the longer copy.

Most requests share a system prompt. With ``home_from=k`` (the prompt's blocks) a
chain's own blocks decide its home: a device that holds no more than the first k
blocks of it is not its home, so new conversations are placed over the devices and
each home gets its own copy of the prompt when a chain is stored there. With the
default 0 every chain sharing a first block lands where that block is.

A chain that has no home yet is placed by `placement`: ``round_robin`` takes the
devices in turn, ``load`` the one whose cache is least full (occupancy over capacity;
ties to the device placed on longest ago).

Costs: each lookup and store looks the chain up on every device (one lookup each; the
longest hit is kept, the others released), so each device's lookup counters count the
pool's lookups, and a miss costs a lookup per device.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from cxlrt.kvcache import Hit, KVCache

PLACEMENTS = ("round_robin", "load")


class KVPool:
    """Several devices' KV caches with one chain-to-device placement.

    Parameters
    ----------
    caches : sequence of KVCache
        One per device (each over its own region). They must hash alike (block size,
        tokens per block, algorithm and salt), since a chain's keys name it on every
        device.
    placement : "round_robin" or "load"
        How a chain with no home yet picks one.
    home_from : int
        Leading blocks that many chains share (a system prompt): they do not make a
        device a chain's home, and are copied to each home (default 0).
    """

    def __init__(self, caches: Sequence[KVCache], *, placement: str = "load",
                 home_from: int = 0) -> None:
        caches = list(caches)
        if not caches:
            raise ValueError("a KVPool needs at least one KVCache")
        for i, c in enumerate(caches):
            if not isinstance(c, KVCache):
                raise TypeError(f"caches must be KVCache objects, not {type(c).__name__}")
            if c.closed:
                raise ValueError(f"device {i}'s cache {c.name!r} is closed")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, "
                             f"not {placement!r}")
        if isinstance(home_from, bool) or not isinstance(home_from, int) or home_from < 0:
            raise ValueError(f"home_from must be an int >= 0, not {home_from!r}")
        regions = [c.region.uuid for c in caches]
        if len(set(regions)) != len(regions):
            raise ValueError("each device of a pool needs its own region: two caches share one")
        first = caches[0]
        for i, c in enumerate(caches[1:], 1):
            if c.block_bytes != first.block_bytes:
                raise ValueError(f"device {i}'s cache has {c.block_bytes}-byte blocks and "
                                 f"device 0's {first.block_bytes}: one pool holds one model's KV")
            if (c.block_tokens, c.algorithm, c.salt_digest) != (
                    first.block_tokens, first.algorithm, first.salt_digest):
                raise ValueError(f"device {i}'s cache hashes tokens differently from device "
                                 "0's (block_tokens, algorithm or salt): its keys would not "
                                 "name the same chains")
        self.caches = caches
        self.placement = placement
        self.home_from = home_from
        self.block_bytes = first.block_bytes
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._last = [0] * len(caches)  # turn each device was last placed on
        self.placed = [0] * len(caches)  # chains this pool object placed and stored, per device

    def block_hashes(self, tokens, *, parent=None) -> list[bytes]:
        """The chain keys of `tokens`, as every device's cache names them."""
        return self.caches[0].block_hashes(tokens, parent=parent)

    def _longest(self, keys: list) -> tuple[int, Hit]:
        """(device, Hit) of the longest run of `keys` any device holds (ties to the
        lower index); the other devices' hits are released."""
        best_i, best = 0, None
        try:
            for i, c in enumerate(self.caches):
                if c.closed:
                    raise ValueError(f"device {i}'s cache {c.name!r} is closed")
                hit = c.lookup(keys)
                if best is None or len(hit) > len(best):
                    best, hit = hit, best
                    best_i = i
                if hit is not None:
                    hit.release()
        except BaseException:
            if best is not None:  # no pin outlives a failed call
                best.release()
            raise
        return best_i, best

    def _owns(self, n: int, nkeys: int) -> bool:
        """Whether holding the first n of a chain's nkeys blocks makes a device its home."""
        return n > min(self.home_from, nkeys - 1)

    def home(self, keys: Sequence[bytes]) -> int | None:
        """The chain's home device, or None when it has none yet."""
        keys = list(keys)
        if not keys:
            return None
        i, hit = self._longest(keys)
        with hit:
            return i if self._owns(len(hit), len(keys)) else None

    def lookup(self, keys: Sequence[bytes]) -> Hit:
        """The pinned leading blocks of `keys` from the device holding the longest run
        of them (``hit.cache`` is that device's cache); an empty Hit when none holds
        any. Release it, or use it in ``with``."""
        keys = list(keys)
        return self._longest(keys)[1] if keys else self.caches[0].lookup(keys)

    def _place(self) -> int:
        with self._lock:
            turn = next(self._turn)
            if self.placement == "round_robin":
                i = turn % len(self.caches)
            else:
                fill = [c.occupancy / max(1, c.capacity) for c in self.caches]
                i = min(range(len(self.caches)), key=lambda j: (fill[j], self._last[j]))
            self._last[i] = turn + 1
            return i

    def _write(self, keys: list, write):
        """write(cache) on the chain's home, placing a chain that has none; a placement
        counts once something was written."""
        i = self.home(keys)
        if i is not None:
            return write(self.caches[i])
        i = self._place()
        out = write(self.caches[i])
        if out:
            with self._lock:
                self.placed[i] += 1
        return out

    def store(self, keys: Sequence[bytes], blocks) -> list[bytes]:
        """Store the chain's blocks on its home (a chain with none gets one placed);
        returns the keys stored, as KVCache.store does."""
        keys = list(keys)
        return self._write(keys, lambda c: c.store(keys, blocks)) if keys else []

    def admit(self, keys: Sequence[bytes], blocks) -> bool:
        """KVCache.admit on the chain's home: False when that device's write buffer
        has no room now (nothing stored; a chain is not moved elsewhere, since its
        blocks must stay together)."""
        keys = list(keys)
        return self._write(keys, lambda c: c.admit(keys, blocks)) if keys else True

    def device_of(self, hit: Hit) -> int:
        """Which device a Hit from this pool reads."""
        for i, c in enumerate(self.caches):
            if hit.cache is c:
                return i
        raise ValueError("this Hit is not from one of the pool's caches")

    def stats(self) -> dict:
        """Per device: its cache's stats and the chains this pool placed there."""
        return {"placement": self.placement,
                "devices": [dict(c.stats(), placed=n)
                            for c, n in zip(self.caches, self.placed, strict=True)]}

    def __len__(self) -> int:
        return len(self.caches)

    def __repr__(self) -> str:
        return (f"<cxlrt.KVPool {len(self.caches)} devices, placement={self.placement}, "
                f"home_from={self.home_from}>")
