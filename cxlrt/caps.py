"""Capability bits of a backend (``Region.caps``), mirroring ``CXL_CAP_*`` in backend.pxd."""

from __future__ import annotations

import enum


class Caps(enum.IntFlag):
    COHERENT = 1
    """Every node sees every store at once; flushes are no-ops."""
    MAPPABLE = 2
    """The medium has a base pointer: ``Region.view`` and zero-copy DMA windows work."""
    PERSISTENT = 4
    """Contents survive power loss."""
    DMA_REGISTRABLE = 8
    """The memory can be registered for device (CUDA, RDMA) DMA."""
    SHARED_HOSTS = 16
    """The medium is reachable from several hosts."""
