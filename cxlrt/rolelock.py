"""Role locks: whether a process of our node still exists, across pid namespaces.

A role (a channel's producer or consumer) names its owner by pid, start time and
pid namespace; a pid of another namespace cannot be looked up from ours, and the
node's heartbeat keeps moving while any process of the node lives. So the owner
also holds an open-file-description lock (``F_OFD_SETLK``) on one byte of a file
beside the node-local file. The kernel drops it when the last descriptor of that
open file closes, that is when the process is gone, whatever its namespace and
whichever of its threads took it. A claimant of the same node that gets the byte
knows no live process of the node holds the role.

Only meaningful within one node: its processes share the node-local folder
(``liveness`` refuses a second host as the same node), so they lock the same file.
"""

from __future__ import annotations

import fcntl
import os
import struct

from cxlrt.nodelocal import local_path

# struct flock on 64-bit Linux: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad).
_FLOCK = "hhxxxxqqixxxx"

_fds: dict[str, int] = {}


def _forget_after_fork() -> None:
    # The child's copy of a descriptor would keep the parent's locks alive after the
    # parent died: the child holds no role, so it lets go of its copies.
    for fd in _fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _fds.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _fd(uuid: int, node: int) -> int:
    path = local_path(uuid, node) + ".roles"
    fd = _fds.get(path)
    if fd is not None and not _same_file(fd, path):
        # `cxlrt clean` removed it while this process held no role (it was not attached):
        # the node's roles are in the file at the name now.
        os.close(fd)
        fd = None
    if fd is None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _fds[path] = fd
    return fd


def _same_file(fd: int, path: str) -> bool:
    held = os.fstat(fd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _lock(fd: int, kind: int, key: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, key, 1, 0))


def hold(uuid: int, node: int, key: int) -> bool:
    """Take role `key` of node `node` for this process; False if a live process of the
    node holds it (idempotent for the holder)."""
    try:
        _lock(_fd(uuid, node), fcntl.F_WRLCK, key)
    except BlockingIOError:
        return False
    except PermissionError:  # EACCES: the same conflict on some kernels
        return False
    return True


def release(uuid: int, node: int, key: int) -> None:
    """Let go of role `key` (nothing happens if we do not hold it)."""
    path = local_path(uuid, node) + ".roles"
    fd = _fds.get(path)
    if fd is not None:
        _lock(fd, fcntl.F_UNLCK, key)

