# cython: language_level=3
"""The node-local file: robust mutexes and caches shared by one node's processes."""

import contextlib
import fcntl
import glob
import os
import struct
import tempfile
import time

cimport cython
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from cxlrt.layout cimport CXL_MAX_LOCKS
from cxlrt.mapping cimport Mapping

from cxlrt.shm import init_robust_mutexes

MAGIC = int.from_bytes(b"CXLLOCL3", "little")
LOCKS_OFF = 4096
HEAP_OFF = LOCKS_OFF + CXL_MAX_LOCKS * CXL_LOCAL_LOCK_BYTES
MAGS_OFF = HEAP_OFF + 4096
TOTAL = MAGS_OFF + CXL_LOCAL_MAGS * CXL_LOCAL_MAG_BYTES

assert sizeof(cxl_local_lock) <= CXL_LOCAL_LOCK_BYTES
assert sizeof(cxl_local_heap) <= 4096
assert sizeof(cxl_local_proc) == CXL_LOCAL_PROC_BYTES
assert sizeof(cxl_local_mag) <= CXL_LOCAL_MAG_BYTES and CXL_LOCAL_MAG_BYTES % 64 == 0
assert CXL_MAG_CLASSES <= 5 and CXL_MAG_SLOTS == 16  # the record's slot[5][16]
assert CXL_LOCAL_PROCS_OFF + CXL_LOCAL_PROCS * CXL_LOCAL_PROC_BYTES <= LOCKS_OFF


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
            raw = f.read(sizeof(cxl_local_header))
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return False
    return size == TOTAL and raw == _header(uuid, node)


def _header(uint64_t uuid, int node):
    """The bytes of the file header that (region format `uuid`, `node`) expects."""
    cdef cxl_local_header h
    h.magic = MAGIC
    h.uuid = uuid
    h.node = node
    h.max_locks = CXL_MAX_LOCKS
    return (<char*>&h)[:sizeof(h)]


def _build(path, uuid, node):
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(path))
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, TOTAL)
    finally:
        os.close(fd)
    cdef Mapping m = Mapping(tmp, TOTAL)
    try:
        init_robust_mutexes(m, LOCKS_OFF, CXL_MAX_LOCKS, CXL_LOCAL_LOCK_BYTES)
        init_robust_mutexes(m, HEAP_OFF, 1, 4096)
        hdr = _header(uuid, node)
        memcpy(m.base, <const char*>hdr, len(hdr))
    finally:
        m.close()
    return tmp


# (st_dev, st_ino) -> the one Mapping of that node-local file in this process. Never
# unmapped: a thread may hold one of its robust mutexes across its Region's close, or
# until the process exits (a leaked hold, an exception between acquire and release);
# the kernel then marks the mutex owner-dead through the holder's robust list, which
# names this address. Unmapped, the mark would miss and the node's lock or heap would
# stay owned for good. 16 KiB per node file of each region this process used.
_mappings = {}


def _mapping(path):
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    m = _mappings.get(key)
    if m is None:
        m = Mapping(path, TOTAL)
        m.keep()
        _mappings[key] = m
    return m


@cython.no_gc_clear  # a beat thread may still use the mapping: the GC must not drop it first
cdef class NodeLocal:
    """Map (creating if needed) the node-local file of (region format `uuid`, `node`).

    `on_open(self)`, when given, runs while the file's flock is still held: no
    other process of the node can map the file before it returns, so what it
    does to a fresh file (forget an earlier life of the node) cannot race a
    sibling's attach.
    """

    def __cinit__(self):
        self.user_fd = -1

    def __init__(self, unsigned long long uuid, int node, on_open=None):
        self.path = local_path(uuid, node)
        with self.serialised():
            self.fresh = False
            if not _valid(self.path, uuid, node):
                if os.path.exists(self.path) and in_use(self.path):
                    # Another build's layout (or a torn file) that a live process still
                    # maps: a second file would give this node two heap mutexes and two
                    # lock tables, each "the" node's.
                    from cxlrt.errors import RegionError
                    raise RegionError(
                        f"{self.path}: node {node}'s node-local file has another cxlrt "
                        "build's layout and a live process uses it; close that "
                        "process's regions (or stop it) before attaching with this build")
                os.replace(_build(self.path, uuid, node), self.path)
                self.fresh = True
            self.mapping = _mapping(self.path)
            self.locks = <cxl_local_lock*>(self.mapping.base + <size_t>LOCKS_OFF)
            self.heap = <cxl_local_heap*>(self.mapping.base + <size_t>HEAP_OFF)
            self.counter = <uint64_t*>(self.mapping.base + <size_t>CXL_LOCAL_COUNTER_OFF)
            self.inc = <uint64_t*>(self.mapping.base + <size_t>CXL_LOCAL_INC_OFF)
            self.procs = <cxl_local_proc*>(self.mapping.base + <size_t>CXL_LOCAL_PROCS_OFF)
            self.mags = <cxl_local_mag*>(self.mapping.base + <size_t>MAGS_OFF)
            self.user_fd = _use(self.path)
            if on_open is not None:
                try:
                    on_open(self)
                except BaseException:
                    self.close()  # not attached: the file must not look in use for it
                    raise

    @contextlib.contextmanager
    def serialised(self):
        """Hold the node's flock: attach, detach and file creation are one at a time."""
        fd = _lock_init(self.path + ".init")
        try:
            yield
        finally:
            os.close(fd)

    def close(self):
        """Nothing is unmapped (see _mappings): a thread still inside one of its mutex
        sections when its Region closes lets go of the real mutex, not of a retired
        copy that would leave it owned for good."""
        self.closed = True
        if self.user_fd >= 0 and self.user_fd in _users:
            _users.discard(self.user_fd)
            os.close(self.user_fd)
        self.user_fd = -1

    @property
    def incarnation(self):
        """The node's incarnation this file serves (0 before the first attach)."""
        return self.inc[0]

    @incarnation.setter
    def incarnation(self, uint64_t v):
        self.inc[0] = v

    def forget_owed(self):
        """Drop what an earlier life of the node left in the heap's state: a large run it
        owed (cxl_local_heap.owed_n), a magazine give-back it noted (drop_x) and the
        size classes' chunk hints. Other lives may have used those chunks and slots
        since, so giving the run or the slot back could free theirs (each stays a
        leak), and a hint could name a chunk that is no longer ours."""
        cdef int i
        self.heap.owed_n = 0
        self.heap.drop_x = 0
        for i in range(16):
            self.heap.current[i] = 0
            self.heap.spare[i] = 0

    def lock_slot(self, int i):
        """Holder pid, tid, global_held, recovered count and pending repair of local
        lock slot i."""
        cdef cxl_local_lock* s = <cxl_local_lock*>(<char*>self.locks + i * CXL_LOCAL_LOCK_BYTES)
        return {"holder_pid": s.holder_pid, "holder_tid": s.holder_tid,
                "global_held": s.global_held, "recovered": s.recovered,
                "repair": bool(s.repair)}

    def busy_slots(self):
        """Indexes of lock slots a process of this node holds or held when it died."""
        cdef cxl_local_lock* s
        cdef int i
        out = []
        for i in range(CXL_MAX_LOCKS):
            s = <cxl_local_lock*>(<char*>self.locks + i * CXL_LOCAL_LOCK_BYTES)
            if s.holder_pid or s.global_held:
                out.append(i)
        return out

    # process table (callers hold serialised()) ----------------------------------
    def procs_list(self):
        """[(slot, pid, start, pidns)] of the recorded processes."""
        cdef int i
        return [(i, self.procs[i].pid, self.procs[i].start, self.procs[i].pidns)
                for i in range(CXL_LOCAL_PROCS) if self.procs[i].pid]

    def proc_add(self, uint64_t pid, uint64_t start, uint64_t pidns):
        """Record a process; its slot, or -1 when the table is full."""
        cdef int i
        for i in range(CXL_LOCAL_PROCS):
            if self.procs[i].pid == 0:
                self.procs[i].start = start
                self.procs[i].pidns = pidns
                self.procs[i].pid = pid
                return i
        return -1

    def proc_remove(self, int i):
        if 0 <= i < CXL_LOCAL_PROCS:
            self.procs[i].pid = 0


# An attached process holds a read lock on byte 0 of its node-local file, an
# open-file-description lock, which the kernel drops when the process dies, whatever
# its pid namespace. `cxlrt clean` asks for a write lock there: refused means a live
# process uses the file, even one whose pid this host cannot look up.
_OFD = "hhxxxxqqixxxx"  # struct flock: type, whence, start, len, pid
_users = set()          # fds holding such locks: a forked child lets go of its copies


def _forget_after_fork():
    for fd in _users:
        try:
            os.close(fd)
        except OSError:
            pass
    _users.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _use(path):
    """An fd holding the read lock that says a live process uses the file at `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_OFD, fcntl.F_RDLCK, os.SEEK_SET, 0, 1, 0))
    except BaseException:
        os.close(fd)
        raise
    _users.add(fd)
    return fd


def in_use(path):
    """True while a live process (any pid namespace, this one included) has the node-local
    file at `path` open as an attached node; False when none has; raises OSError when
    the file cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK,
                          struct.pack(_OFD, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    finally:
        os.close(fd)
    return struct.unpack(_OFD, got)[0] != fcntl.F_UNLCK


def _lock_init(path, wait=None):
    """An fd holding the flock of `path`, the node's current one.

    `cxlrt delete` and `cxlrt clean` unlink the file while they hold its flock. A
    process that opened it before that and was waiting would otherwise lock a
    name nobody else sees, and attach beside a sibling that locked the new file.
    With `wait` (seconds), BlockingIOError when it stays held that long."""
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if deadline is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise
                        time.sleep(0.01)
            held = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


def node_files(unsigned long long uuid, int node, directory=None):
    """The paths of (region format `uuid`, `node`)'s node-local files that exist here:
    the file itself, its flock file, its channel roles, its KV caches' pin tables and
    the temporary files of a build that did not finish."""
    d = directory or local_dir()
    stem = os.path.join(d, f"cxlrt-{uuid:016x}-node{node}")
    found = [p for p in (stem + ".local", stem + ".local.roles") if os.path.lexists(p)]
    found += sorted(glob.glob(glob.escape(stem) + "-kv*.pins"))
    found += sorted(glob.glob(glob.escape(stem) + ".local.*.tmp"))
    if os.path.lexists(stem + ".local.init"):
        found.append(stem + ".local.init")  # last: whoever removes them holds its flock
    return found


def recorded_procs(path):
    """[(pid, start, pidns)] the node-local file at `path` records as attached, read
    without mapping it; [] when it is missing, short or not a node-local file."""
    cdef cxl_local_proc rec
    cdef const char* buf
    cdef int i
    try:
        with open(path, "rb") as f:
            raw = f.read(LOCKS_OFF)
    except FileNotFoundError:
        return []
    if len(raw) < LOCKS_OFF or int.from_bytes(raw[:8], "little") != MAGIC:
        return []
    out = []
    buf = raw
    for i in range(CXL_LOCAL_PROCS):
        memcpy(&rec, buf + CXL_LOCAL_PROCS_OFF + i * CXL_LOCAL_PROC_BYTES, sizeof(rec))
        if rec.pid:
            out.append((rec.pid, rec.start, rec.pidns))
    return out


def remove_files(unsigned long long uuid, int nodes):
    """Delete a region's node-local files (after a reformat they are orphans)."""
    for n in range(nodes):
        for suffix in ("", ".init", ".roles"):
            try:
                os.unlink(local_path(uuid, n) + suffix)
            except FileNotFoundError:
                pass
        for path in glob.glob(os.path.join(local_dir(), f"cxlrt-{uuid:016x}-node{n}-kv*.pins")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def mag_records(path):
    """[(index, pid, tid, pidns, [offsets cached])] of the claimed magazine records in
    the node-local file at `path`, read without mapping it; [] when it is missing or
    not a node-local file of this build."""
    cdef cxl_local_mag rec
    cdef const char* buf
    cdef int i, c, j
    try:
        with open(path, "rb") as f:
            raw = f.read(TOTAL)
    except FileNotFoundError:
        return []
    if len(raw) != TOTAL or int.from_bytes(raw[:8], "little") != MAGIC:
        return []
    out = []
    buf = raw
    for i in range(CXL_LOCAL_MAGS):
        memcpy(&rec, buf + <size_t>MAGS_OFF + i * CXL_LOCAL_MAG_BYTES, sizeof(rec))
        if rec.pid:
            offs = [rec.slot[c][j] for c in range(CXL_MAG_CLASSES)
                    for j in range(min(rec.n[c], CXL_MAG_SLOTS))]
            out.append((i, rec.pid, rec.tid, rec.pidns, offs))
    return out
