"""Prefetch budgets for concurrent requests: HyMCache's KV manager.

Each request that will read a prefix gets a StagingWindow of its own, so its objects
stage in its own order and no request waits behind another's. The manager bounds
what those windows take: at most `per_request` bytes each (128 MiB by default, the
paper's figure: 8 blocks of 16 MiB) and at most `budget` bytes among all open
requests. A request that arrives when the budget is spent gets a smaller window, down
to `min_window`, or None, and then loads directly, without prefetch: admission never
waits for another request to finish (skip, never stall). With ``device=True`` the
windows live in the device's own memory (``StagingWindow(device=True)``: a CXL-HM
device's DRAM, HyMCache's design), and the budget is what the manager lets its
requests hold there.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

from cxlrt.spec import parse_size
from cxlrt.staging import MAX_SLOTS, StagingWindow


def _bytes(what: str, v: int | str) -> int:
    n = parse_size(v) if isinstance(v, str) else v
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{what} must be a size > 0 (bytes or '128M'), not {v!r}")
    return n


class KVManager:
    """Hands out per-request staging windows of a region within a byte budget.

    ``open(request)`` returns the request's window (or None when the budget has less
    than `min_window` left); ``close(request)`` closes it and gives its bytes back.
    ``with manager.request(r) as window:`` does both. Thread-safe.
    """

    def __init__(self, region, *, budget: int | str = "1G", per_request: int | str = "128M",
                 slots: int = 8, min_window: int | str | None = None,
                 device: bool = False) -> None:
        self.region = region
        if not isinstance(device, bool):
            raise ValueError(f"device must be True or False, not {device!r}")
        self.device = device
        self.budget = _bytes("budget", budget)
        self.per_request = min(_bytes("per_request", per_request), self.budget)
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be an int in 1..{MAX_SLOTS}, not {slots!r}")
        self.slots = slots
        self.min_window = (self.per_request // slots if min_window is None
                           else _bytes("min_window", min_window))
        if self.min_window > self.per_request:
            raise ValueError(f"min_window ({self.min_window} bytes) is larger than "
                             f"per_request ({self.per_request} bytes)")
        self._lock = threading.Lock()
        self._open: dict[Hashable, StagingWindow] = {}
        self._in_use = 0
        self._opened = 0
        self._refused = 0
        self._shrunk = 0

    def open(self, request: Hashable) -> StagingWindow | None:
        """The window of a new request: `per_request` bytes when the budget has them,
        less when it does not (down to `min_window`), else None (load directly)."""
        with self._lock:
            if request in self._open:
                raise ValueError(f"request {request!r} already has a window")
            size = min(self.per_request, self.budget - self._in_use)
            if size < self.min_window:
                self._refused += 1
                return None
            w = StagingWindow(self.region, size=size, slots=self.slots, device=self.device)
            self._open[request] = w
            self._in_use += size
            self._opened += 1
            self._shrunk += size < self.per_request
            return w

    def close(self, request: Hashable) -> None:
        """Close the request's window and give its bytes back to the budget."""
        with self._lock:
            w = self._open.pop(request, None)
            if w is None:
                raise KeyError(f"request {request!r} has no open window")
            self._in_use -= w.size
        w.close()

    @contextmanager
    def request(self, request: Hashable) -> Iterator[StagingWindow | None]:
        """``open`` on entry, ``close`` on exit (nothing to close when it was None)."""
        w = self.open(request)
        try:
            yield w
        finally:
            if w is not None:
                self.close(request)

    def close_all(self) -> None:
        for request in list(self._open):
            self.close(request)

    def stats(self) -> dict[str, int]:
        """budget, in_use (bytes the open windows hold), open, opened, shrunk (windows
        smaller than per_request), refused (requests that got None)."""
        with self._lock:
            return {"budget": self.budget, "in_use": self._in_use, "open": len(self._open),
                    "opened": self._opened, "shrunk": self._shrunk, "refused": self._refused}
