# cython: language_level=3
"""The node-local file: robust mutexes and caches shared by one node's processes."""

import fcntl
import glob
import os
import struct
import tempfile

from cxlrt.layout cimport CXL_MAX_LOCKS
from cxlrt.mapping cimport Mapping

from cxlrt.shm import init_robust_mutexes

MAGIC = int.from_bytes(b"CXLLOCL1", "little")
HEADER = struct.Struct("<QQII")  # magic, region uuid, node, max locks
LOCKS_OFF = 4096
HEAP_OFF = LOCKS_OFF + CXL_MAX_LOCKS * CXL_LOCAL_LOCK_BYTES
TOTAL = HEAP_OFF + 4096

assert sizeof(cxl_local_lock) <= CXL_LOCAL_LOCK_BYTES
assert sizeof(cxl_local_heap) <= 4096


def local_dir():
    """Where node-local files live: $CXLRT_LOCAL_DIR, else /dev/shm, else the temp dir."""
    d = os.environ.get("CXLRT_LOCAL_DIR")
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def local_path(unsigned long long uuid, int node):
    return os.path.join(local_dir(), f"cxlrt-{uuid:016x}-node{node}.local")


def _valid(path, uuid, node):
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return False
    if len(raw) < HEADER.size or size != TOTAL:
        return False
    return HEADER.unpack(raw) == (MAGIC, uuid, node, CXL_MAX_LOCKS)


def _build(path, uuid, node):
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(path))
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, TOTAL)
    finally:
        os.close(fd)
    m = Mapping(tmp, TOTAL)
    try:
        init_robust_mutexes(m, LOCKS_OFF, CXL_MAX_LOCKS, CXL_LOCAL_LOCK_BYTES)
        init_robust_mutexes(m, HEAP_OFF, 1, 4096)
        HEADER.pack_into(m, 0, MAGIC, uuid, node, CXL_MAX_LOCKS)
    finally:
        m.close()
    return tmp


cdef class NodeLocal:
    """Map (creating if needed) the node-local file of (region format `uuid`, `node`)."""

    def __init__(self, unsigned long long uuid, int node):
        self.path = local_path(uuid, node)
        lock_path = self.path + ".init"
        # Creation is serialised so every process of the node maps the same file.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.fresh = False
            if not _valid(self.path, uuid, node):
                os.replace(_build(self.path, uuid, node), self.path)
                self.fresh = True
            self.mapping = Mapping(self.path, TOTAL)
        finally:
            os.close(fd)
        self.locks = <cxl_local_lock*>(self.mapping.base + <size_t>LOCKS_OFF)
        self.heap = <cxl_local_heap*>(self.mapping.base + <size_t>HEAP_OFF)

    def close(self):
        self.mapping.close()

    def lock_slot(self, int i):
        """Holder pid, tid, global_held and recovered count of local lock slot i."""
        cdef cxl_local_lock* s = <cxl_local_lock*>(<char*>self.locks + i * CXL_LOCAL_LOCK_BYTES)
        return {"holder_pid": s.holder_pid, "holder_tid": s.holder_tid,
                "global_held": s.global_held, "recovered": s.recovered}


def remove_files(unsigned long long uuid, int nodes):
    """Delete a region's node-local files (after a reformat they are orphans)."""
    for n in range(nodes):
        for suffix in ("", ".init"):
            try:
                os.unlink(local_path(uuid, n) + suffix)
            except FileNotFoundError:
                pass
        for path in glob.glob(os.path.join(local_dir(), f"cxlrt-{uuid:016x}-node{n}-kv*.pins")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
