"""Status codes and the one place that turns them into exceptions.

Every C path returns a status (``cxlrt/status.pxd``); every Python layer hands a
failing one to :func:`check_rc`. A caller that knows more than the code says (the
offset that was out of range, the slot that was corrupt) passes it as ``detail``;
which exception a code becomes is decided here alone.
"""

import os

from cxlrt.errors import (ChannelRoleLostError, CoherenceError, InvalidFreeError, LeaseLost,
                          LockTimeout, MediumError, NoLockManager, OutOfMemory,
                          OutOfRangeError,
                          RegionClosedError, RegionError, UnsupportedError)

# code: (name, exception class, what it means when the caller has nothing to add)
_MEANING = {
    CXLRT_E_RANGE: ("CXLRT_E_RANGE", OutOfRangeError, "outside the region or misaligned"),
    CXLRT_E_COHERENCE: ("CXLRT_E_COHERENCE", CoherenceError,
                        "the emulation's checker caught a violation of the memory model"),
    CXLRT_E_CLOSED: ("CXLRT_E_CLOSED", RegionClosedError, "the region is closed"),
    CXLRT_E_IO: ("CXLRT_E_IO", MediumError, "the medium failed"),
    CXLRT_E_UNSUPPORTED: ("CXLRT_E_UNSUPPORTED", UnsupportedError,
                          "not supported by this backend"),
    CXLRT_E_TIMEOUT: ("CXLRT_E_TIMEOUT", LockTimeout, "timed out"),
    CXLRT_E_LOCKSTATE: ("CXLRT_E_LOCKSTATE", RegionError,
                        "the lock's record is unusable (not created, or another mode)"),
    CXLRT_E_FENCED: ("CXLRT_E_FENCED", LeaseLost,
                     "this process was silent past its lease, or its node was taken over: "
                     "it stopped before writing more"),
    CXLRT_E_NOMANAGER: ("CXLRT_E_NOMANAGER", NoLockManager, "no lock manager is running"),
    CXLRT_E_NOMEM: ("CXLRT_E_NOMEM", OutOfMemory, "out of memory"),
    CXLRT_E_BADFREE: ("CXLRT_E_BADFREE", InvalidFreeError, "not the start of a live allocation"),
    CXLRT_E_DOUBLEFREE: ("CXLRT_E_DOUBLEFREE", InvalidFreeError, "already free (double free)"),
    CXLRT_E_CORRUPT: ("CXLRT_E_CORRUPT", RegionError,
                      "allocator metadata is corrupt (`cxlrt check`)"),
    CXLRT_E_SUSPECT: ("CXLRT_E_SUSPECT", LeaseLost,
                      "this process was silent past its lease while it published under a "
                      "lock: the write may have overlapped another node's hold"),
    CXLRT_E_KVCORRUPT: ("CXLRT_E_KVCORRUPT", RegionError,
                        "an entry or payload that cannot be right (corrupt region; run "
                        "`cxlrt check`)"),
    CXLRT_E_KVPINS: ("CXLRT_E_KVPINS", RuntimeError,
                     "this node holds the most pins one block can carry; release hits"),
    CXLRT_E_KVNOREC: ("CXLRT_E_KVNOREC", RuntimeError,
                      "this process has no record in the node's pin table"),
    CXLRT_E_CHANCORRUPT: ("CXLRT_E_CHANCORRUPT", RegionError,
                          "a channel word that cannot be right (corrupt region)"),
    CXLRT_E_CHANLOST: ("CXLRT_E_CHANLOST", ChannelRoleLostError,
                       "this process's channel role was taken over"),
}

# name -> code, for tools and tests that speak the names
CODES = {name: code for code, (name, _, _) in _MEANING.items()}


cdef int check_rc(int rc, str where, str detail=None, dict extra=None) except -1:
    if rc >= 0:
        return 0
    if rc > CXLRT_E_BASE:
        raise OSError(-rc, f"{where}: {detail or os.strerror(-rc)}")
    meaning = _MEANING.get(rc)
    if meaning is None:
        raise RegionError(f"{where}: unknown status {rc}")
    _, cls, text = meaning
    msg = f"{where}: {detail or text}"
    if extra:
        raise cls(msg, **extra)
    raise cls(msg)


def raise_for(int rc, str where, str detail=None, dict extra=None):
    """:func:`check_rc` for Python code: raise what status `rc` means, or return."""
    check_rc(rc, where, detail, extra)


def name_of(int rc):
    """The CXLRT_E_* name of a status, or ``str(rc)`` for one that is not ours."""
    meaning = _MEANING.get(rc)
    return meaning[0] if meaning else str(rc)
