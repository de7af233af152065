"""Exceptions raised by cxlrt.

Every error a region or backend can report maps to one class here, so callers
catch by meaning (a corrupt region, a protocol violation) and not by backend.
"""

from __future__ import annotations


class CxlrtError(Exception):
    """Base class of every cxlrt error."""


class RegionError(CxlrtError):
    """A region cannot be used: bad, corrupt, truncated or misaddressed."""


class NotARegionError(RegionError):
    """The medium holds no cxlrt superblock (garbage, or formatting never finished)."""


class LayoutVersionError(RegionError):
    """The region was formatted with a layout version this build cannot read."""


class ChecksumError(RegionError):
    """The superblock checksum does not match its contents."""


class RegionSizeError(RegionError, ValueError):
    """The medium is truncated, too small, or not the size the superblock records."""


class NodeRangeError(RegionError, ValueError):
    """A node id outside ``0 .. nodes-1`` of the region."""


class OutOfRangeError(RegionError, IndexError):
    """An offset or length outside the region, or a misaligned 8-byte access."""


class RegionClosedError(RegionError):
    """The region (or its backend) has been closed."""


class UnsupportedError(CxlrtError, NotImplementedError):
    """The backend cannot do this operation (see ``Region.caps``)."""


class CoherenceError(CxlrtError):
    """The emulation's checker caught a violation of the memory model.

    Attributes
    ----------
    kind : str
        ``"dirty-in-two-nodes"``, ``"stale-read"``, ``"store-to-stale"``,
        ``"dma-over-dirty"`` or ``"dma-read-dirty"``.
    offset : int
        Byte offset of the 64-byte line concerned.
    node : int
        The node whose access was caught.
    other : int
        The other node involved, or -1 when there is none (a DMA, the medium).
    """

    def __init__(self, message: str, *, kind: str = "", offset: int = -1, node: int = -1,
                 other: int = -1) -> None:
        super().__init__(message)
        self.kind = kind
        self.offset = offset
        self.node = node
        self.other = other

    def __reduce__(self):
        # Keep the details when the error crosses a process boundary.
        return (_rebuild_coherence_error,
                (str(self), self.kind, self.offset, self.node, self.other))


def _rebuild_coherence_error(message: str, kind: str, offset: int, node: int,
                             other: int) -> CoherenceError:
    return CoherenceError(message, kind=kind, offset=offset, node=node, other=other)


class OutOfMemory(CxlrtError, MemoryError):
    """The region has no room for the allocation; the region is left consistent."""


class InvalidFreeError(CxlrtError, ValueError):
    """free() of an offset that is not a live allocation (never allocated, or freed twice)."""


class DebugBuildRequired(CxlrtError, RuntimeError):
    """A test hook was called on a release build: hooks exist only in debug builds.

    The hooks (``cxlrt.channel._test_skip_observe``, ``cxlrt.kvcache._break_pin_protocol``
    and the like) break a protocol on purpose, for negative-control tests; a release
    build compiles their branches out of the hot paths.
    """

    HINT = "test hooks need a debug build: CXLRT_DEBUG=1 pip install -e ."

    def __init__(self, message: str = HINT) -> None:
        super().__init__(message)
