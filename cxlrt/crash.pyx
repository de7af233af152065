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
    "alloc.large.tails": "large alloc: tail words persisted (allocator lock held), head not "
                         "yet written",
    "alloc.large": "chunk run written to the chunk table (allocator lock held), not yet returned",
    "free.large": "large free: head word cleared (allocator lock held), tail words not yet",
    "free.remote": "remote free: link line written into the object (allocator lock held), "
                   "queue head not yet published",
    "free.local": "owner's free: heap mutex held, slot bit not yet cleared",
    "alloc.mag": "alloc from the thread's magazine: its count lowered, object not yet returned",
    "free.mag": "free into the thread's magazine: tag and slot written, count not yet raised",
    "free.mag.drop": "magazine give-back: noted in the heap, count lowered (heap mutex held), "
                     "bit not yet cleared",
    "alloc.drain.detach": "drain: batch committed to the owner's journal (allocator lock "
                          "held), queue not yet emptied",
    "alloc.drain": "drain: one more object of the batch applied (heap mutex held), "
                   "journal not yet closed",
    "dir.put.name": "directory put of a new name: name line of a free entry written, no more",
    "dir.put.redo": "directory put: redo record (the new value) written, generation still even",
    "dir.put.odd": "directory put: generation odd (the change is decided), body not yet written",
    "dir.put.body": "directory put: body written, generation still odd",
    "dir.delete.redo": "directory delete: redo record written, generation still even",
    "dir.delete.odd": "directory delete: generation odd (decided), body not yet cleared",
    "dir.delete.body": "directory delete: body cleared, generation still odd",
    "dir.repair.body": "directory repair: a torn entry's body rolled forward, generation odd",
    "kv.store.writing": "KV claim line and WRITING entry published, payload not yet copied",
    "kv.store.copy": "KV payload partly copied: between two chunks, before the next epoch check",
    "kv.store.publish": "KV payload copied, epoch re-checked under the lock, entry not yet READY",
    "kv.evict.intent": "KV eviction or takeover: payload record written, entry not yet tombstoned",
    "kv.evict.tombstone": "KV eviction or takeover: entry tombstoned, payload not yet freed or "
                          "quarantined",
    "kv.pin.raised": "KV pin words raised in the region (pin mutex held), the process's "
                     "record of them not yet",
    "kv.unpin.lowered": "KV unpin: the process's record lowered (pin mutex held), the "
                        "region's pin words not yet",
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
