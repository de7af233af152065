"""cxlrt: a memory runtime for rack-scale LLM KV caches on CXL shared memory.

Open a region with :func:`cxlrt.open`; see README.md for the memory model.
"""

from cxlrt.api import format, inspect, open
from cxlrt.caps import Caps
from cxlrt.channel import Channel
from cxlrt.errors import (
    ChannelBusyError,
    ChannelRoleLostError,
    ChecksumError,
    ClaimLost,
    CoherenceError,
    CxlrtError,
    InvalidFreeError,
    LayoutVersionError,
    LeaseLost,
    LockTimeout,
    MediumError,
    NodeClaimError,
    NodeRangeError,
    NoLockManager,
    NotARegionError,
    OutOfMemory,
    OutOfRangeError,
    RegionClosedError,
    RegionError,
    RegionSizeError,
    SchemeMismatchError,
    StagingError,
    StagingHandleError,
    StagingStalled,
    StagingTimeout,
    UnsupportedError,
)
from cxlrt.hashing import block_hashes
from cxlrt.kvcache import Hit, KVCache
from cxlrt.kvmanager import KVManager
from cxlrt.kvpool import KVPool
from cxlrt.region import Region
from cxlrt.spec import parse_size, parse_spec
from cxlrt.staging import StagingWindow

__version__ = "0.1.0"

__all__ = [
    "Caps", "Channel", "ChannelBusyError", "ChannelRoleLostError", "ChecksumError", "ClaimLost",
    "CoherenceError", "CxlrtError", "Hit", "InvalidFreeError", "KVCache", "KVManager", "KVPool",
    "LayoutVersionError", "LeaseLost", "LockTimeout", "MediumError", "NoLockManager",
    "NodeClaimError", "NodeRangeError",
    "NotARegionError", "OutOfMemory", "OutOfRangeError", "Region", "RegionClosedError",
    "RegionError", "RegionSizeError", "SchemeMismatchError", "StagingError", "StagingHandleError",
    "StagingStalled", "StagingTimeout", "StagingWindow", "UnsupportedError", "block_hashes",
    "format", "inspect", "open", "parse_size", "parse_spec",
]
