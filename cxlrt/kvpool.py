"""KV caches on several devices used as one: HyMCache's unified address space with
request-level placement.

A prefix chain lives whole on one device, its home: the device that holds the chain's
first block. A request's blocks then come from one device, in order, so its prefetch
is one sequential stream there, and requests spread over the devices by the chains
they read. A chain that no device holds yet is placed by `placement`: ``round_robin``
takes the devices in turn, ``load`` the one whose cache is least full (occupancy over
capacity; ties to the device placed on longest ago).

The home is found, not remembered: a lookup asks each device for the chain's first
block, so every process and node agrees on it with no shared directory, and a chain
whose first block was evicted simply finds a new home. Two processes that place one
new chain at the same moment may each store it whole on a different device; either
copy serves it (the lookup takes the first device in pool order that has it).
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
        How a chain no device holds yet picks its home.
    """

    def __init__(self, caches: Sequence[KVCache], *, placement: str = "load") -> None:
        caches = list(caches)
        if not caches:
            raise ValueError("a KVPool needs at least one KVCache")
        for c in caches:
            if not isinstance(c, KVCache):
                raise TypeError(f"caches must be KVCache objects, not {type(c).__name__}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, "
                             f"not {placement!r}")
        regions = [id(c.region) for c in caches]
        if len(set(regions)) != len(regions):
            raise ValueError("each device of a pool needs its own region: two caches share one")
        probe = list(range(64))
        first = caches[0]
        for i, c in enumerate(caches[1:], 1):
            if c.block_bytes != first.block_bytes:
                raise ValueError(f"device {i}'s cache has {c.block_bytes}-byte blocks and "
                                 f"device 0's {first.block_bytes}: one pool holds one model's KV")
            if c.block_hashes(probe) != first.block_hashes(probe):
                raise ValueError(f"device {i}'s cache hashes tokens differently from device "
                                 "0's (block_tokens, algorithm or salt): its keys would not "
                                 "name the same chains")
        self.caches = caches
        self.placement = placement
        self.block_bytes = first.block_bytes
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._last = [0] * len(caches)  # turn each device was last placed on
        self.placed = [0] * len(caches)  # chains this pool object placed, per device

    def block_hashes(self, tokens, *, parent=None) -> list[bytes]:
        """The chain keys of `tokens`, as every device's cache names them."""
        return self.caches[0].block_hashes(tokens, parent=parent)

    def home(self, keys: Sequence[bytes]) -> int | None:
        """The device holding the chain of `keys` (its first block), or None."""
        if not keys:
            return None
        for i, c in enumerate(self.caches):
            with c.lookup(list(keys[:1])) as hit:
                if len(hit):
                    return i
        return None

    def lookup(self, keys: Sequence[bytes]) -> Hit:
        """The pinned leading blocks of `keys`, all from the chain's home device
        (``hit.cache`` is that device's cache); an empty Hit when no device has the
        chain. Release it, or use it in ``with``."""
        keys = list(keys)
        i = self.home(keys)
        return self.caches[0 if i is None else i].lookup(keys)

    def _place(self) -> int:
        with self._lock:
            turn = next(self._turn)
            if self.placement == "round_robin":
                i = turn % len(self.caches)
            else:
                fill = [c.occupancy / max(1, c.capacity) for c in self.caches]
                i = min(range(len(self.caches)), key=lambda j: (fill[j], self._last[j]))
            self._last[i] = turn + 1
            self.placed[i] += 1
            return i

    def _target(self, keys: list) -> KVCache:
        i = self.home(keys)
        return self.caches[self._place() if i is None else i]

    def store(self, keys: Sequence[bytes], blocks) -> list[bytes]:
        """Store the chain's blocks on its home (a new chain gets one placed); returns
        the keys stored, as KVCache.store does."""
        keys = list(keys)
        return self._target(keys).store(keys, blocks) if keys else []

    def admit(self, keys: Sequence[bytes], blocks) -> bool:
        """KVCache.admit on the chain's home: False when that device's write buffer
        has no room now (nothing stored; the chain is not moved elsewhere, since its
        blocks must stay together)."""
        keys = list(keys)
        return self._target(keys).admit(keys, blocks) if keys else True

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
        return f"<cxlrt.KVPool {len(self.caches)} devices, placement={self.placement}>"
