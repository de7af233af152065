# cython: language_level=3
"""Named crash points: where a harness kills or stalls a process mid-protocol.

Every protocol step that publishes shared state names a point (see ``POINTS``).
A test or the harness arms one point, in this process or through the
environment of a child (``CXLRT_CRASH_AT=name[@nth][:kill|stop]``); the process
then SIGKILLs itself (``kill``) or SIGSTOPs itself (``stop``, resumed by the
driver with SIGCONT) at the `nth` time it reaches that point. Unarmed, a point
costs one load and one predictable branch.
"""

import os
import signal

from libc.signal cimport raise_ as c_raise
from libc.string cimport strcmp, strlen

cdef extern from "<signal.h>" nogil:
    int SIGKILL
    int SIGSTOP

# The protocol steps that have a point, with what a crash there leaves behind.
POINTS = {
    "lock.acquire.ticket": "bakery: ticket published, not yet held",
    "lock.acquire.held": "lock held (either mode), nothing protected written yet",
    "lock.release.before": "inside the critical section, about to release",
    "lock.mgr.request": "manager mode: request published, grant not yet seen",
    "lock.mgr.grant": "manager: about to publish a grant",
    "alloc.small": "slot bit set in the owner's bitmap, object not yet returned",
    "alloc.large": "chunk run written to the chunk table, not yet returned",
    "free.remote": "a remote free queued, count not yet published",
    "free.local": "a slot bit being cleared by its owner",
    "alloc.drain": "remote-free queue drain: some slots freed, queue not yet emptied",
    "dir.put.odd": "directory entry generation odd (mid-change), body not yet written",
    "dir.put.body": "directory entry body written, generation still odd",
    "dir.delete.odd": "directory delete: generation odd, body not yet cleared",
    "kv.store.writing": "KV entry claimed WRITING, payload not yet copied",
    "kv.store.copy": "KV payload half copied",
    "kv.store.publish": "KV payload copied, entry not yet READY",
    "kv.evict.tombstone": "eviction: entry tombstoned, payload not yet freed",
    "kv.pin": "KV pin word raised, entry not yet re-checked",
    "chan.claim": "channel role claim published (epoch, run), the run not yet set up",
    "chan.send": "channel message copied into its slot, tail not yet published",
    "chan.send.post": "channel tail published, the producer's epoch not yet re-checked",
    "chan.recv": "channel message read, head not yet published",
    "chan.recv.post": "channel head published, the consumer's epoch not yet re-checked",
}

cdef int _armed = 0
cdef char _name[64]
cdef long _nth = 1
cdef long _hits = 0
cdef int _sig = 0


cdef int* cxl_crash_armed_ptr() noexcept nogil:
    return &_armed


cdef void cxl_crash_hit(const char* name) noexcept nogil:
    global _hits
    if not _armed or strcmp(name, _name) != 0:
        return
    _hits += 1
    if _hits == _nth:
        c_raise(_sig)


def arm(str name, str mode="kill", long nth=1):
    """Arm point `name`: the `nth` time this process reaches it, SIGKILL or SIGSTOP it."""
    global _armed, _nth, _hits, _sig
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {', '.join(sorted(POINTS))}")
    if mode not in ("kill", "stop"):
        raise ValueError(f"crash mode is 'kill' or 'stop', not {mode!r}")
    if nth < 1:
        raise ValueError(f"nth counts from 1, got {nth}")
    raw = name.encode()
    _name[:len(raw)] = raw
    _name[len(raw)] = 0
    _nth = nth
    _hits = 0
    _sig = SIGKILL if mode == "kill" else SIGSTOP
    _armed = 1


def disarm():
    global _armed
    _armed = 0


def hits():
    """Times the armed point was reached so far (0 when nothing is armed)."""
    return _hits if _armed else 0


def point(str name):
    """Python-side crash point (for protocol steps written in Python)."""
    if _armed:
        raw = name.encode()
        cxl_crash_hit(raw)


def parse(str spec):
    """(name, mode, nth) from ``name[@nth][:kill|stop]``."""
    mode = "kill"
    if ":" in spec:
        spec, mode = spec.rsplit(":", 1)
    nth = 1
    if "@" in spec:
        spec, n = spec.rsplit("@", 1)
        nth = int(n)
    return spec, mode, nth


_env = os.environ.get("CXLRT_CRASH_AT")
if _env:
    arm(*parse(_env))
