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


class MediumError(RegionError, OSError):
    """The medium failed: an RDMA completion error or timeout, a device I/O error.
    ``rdma:``'s ``r.backend.failure()`` says which."""


class NodeClaimError(RegionError):
    """A node id that another host holds (``rdma:``'s server refused the claim)."""


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


class LockTimeout(CxlrtError, TimeoutError):
    """A lock was not acquired within the timeout."""


class NoLockManager(CxlrtError):
    """A manager-mode lock was waited on while no lock manager ran (LockService.manager_wait)."""


class LeaseLost(CxlrtError):
    """This node was silent longer than the lease while holding a lock.

    Other nodes may have broken the hold, so the critical section may have
    overlapped another holder's: treat what it protected as suspect. `host_stall`
    is True when the silence was the OS's doing alone (the process was stopped, or
    its host did not schedule it), not a heartbeat that the medium or a lock blocked.
    """

    host_stall = False


class ChannelBusyError(CxlrtError, RuntimeError):
    """The producer (or consumer) role of a channel is held by another live process."""


class ChannelRoleLostError(ChannelBusyError):
    """This process held the role, and another process took it over.

    Raised by the first send()/recv() after the takeover (the old owner was judged
    gone while it was silent: stopped, paused, or its node judged dead). That call
    did not send (or receive) its message; the message says so. The Channel object
    no longer holds the role: a later call claims it again like a new process.
    """


class SchemeMismatchError(RegionError, ValueError):
    """A KV cache exists under this name with another hash scheme or geometry."""


class ClaimLost(LeaseLost):
    """store(): another node took over some of this call's blocks while this process
    made no progress for longer than the lease (a stall); they were not stored.

    Attributes
    ----------
    stored : list of bytes
        The keys this call did store.
    lost : list of bytes
        The keys taken over (store them again if they are still wanted).
    """

    def __init__(self, message, stored=(), lost=()):
        super().__init__(message)
        self.stored = list(stored)
        self.lost = list(lost)

    def __reduce__(self):
        return (ClaimLost, (str(self), self.stored, self.lost))


class StagingError(CxlrtError):
    """A staging window (cxlrt.StagingWindow) refused a call or failed a copy."""


class StagingHandleError(StagingError, ValueError):
    """A handle this window never issued, or one already released."""


class StagingStalled(StagingError, RuntimeError):
    """wait() on a handle that can only be staged after a release, with no copy in
    flight: every staged handle is complete and held. Release earlier handles first."""


class StagingTimeout(StagingError, TimeoutError):
    """wait() ran out of time before the handle's bytes were staged."""


class DebugBuildRequired(CxlrtError, RuntimeError):
    """A test hook was called on a release build: hooks exist only in debug builds.

    The hooks (``cxlrt.channel._test_skip_observe``, ``cxlrt.kvcache._break_pin_protocol``
    and the like) break a protocol on purpose, for negative-control tests; a release
    build compiles their branches out of the hot paths.
    """

    HINT = "test hooks need a debug build: CXLRT_DEBUG=1 pip install -e ."

    def __init__(self, message: str = HINT) -> None:
        super().__init__(message)
