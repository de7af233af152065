"""Removing a region (`cxlrt delete`) and node-local files nobody uses (`cxlrt clean`).

A node-local file holds only locks and caches that the region can rebuild, so losing
it is what a host reboot does (nodelocal.pxd). Removing one is safe exactly when no
live process of its node would go on using it: none is recorded in its process table
and none still maps it (a process that closed its Region keeps the mapping for its
robust mutexes, nodelocal._mappings). A removal holds the node's flock, the one an
attach takes, and unlinks the flock file last: an attach that was waiting on it
finds the name gone and locks the new one (nodelocal._lock_init).
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field
from typing import Any

from cxlrt import nodelocal
from cxlrt.errors import RegionError
from cxlrt.liveness import pid_namespace, process_alive

_NAME = re.compile(r"^cxlrt-([0-9a-f]{16})-node(\d+)(?:\.local|-kv[0-9a-f]+\.pins)")


@dataclass
class NodeFiles:
    """One node's node-local files in one folder, and what became of them."""

    uuid: str                     # the region format they serve, 16 hex digits
    node: int
    paths: list[str]
    removed: bool = False
    users: list[str] = field(default_factory=list)  # why they were kept: who uses them

    def as_dict(self) -> dict:
        return {"uuid": self.uuid, "node": self.node, "paths": self.paths,
                "removed": self.removed, "users": self.users}


def survey(directory: str | None = None) -> list[tuple[int, int]]:
    """(uuid, node) of every node whose node-local files are in `directory`."""
    d = directory or nodelocal.local_dir()
    found = set()
    for name in os.listdir(d):
        m = _NAME.match(name)
        if m:
            found.add((int(m.group(1), 16), int(m.group(2))))
    return sorted(found)


def _mappers(paths: list[str]) -> dict[int, str]:
    """{pid: path} of other processes of our pid namespace that map one of `paths`."""
    want = {}
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        want[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = p
    if not want:
        return {}
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) < 5 or fields[4] == "0":
                        continue
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    hit = want.get((major, minor, int(fields[4])))
                    if hit is not None:
                        out[int(entry)] = hit
                        break
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read: its record still counts
    return out


def _users(local: str, paths: list[str]) -> list[str]:
    """Why the files are still in use; [] when nobody alive uses them."""
    try:
        held = nodelocal.in_use(local) if os.path.exists(local) else False
        recorded = nodelocal.recorded_procs(local)
    except PermissionError:
        return [f"not readable by this user (uid {os.geteuid()}): clean as its owner"]
    ours = pid_namespace()
    why, named = [], set()  # named: pids of our namespace already given as attached
    for pid, start, pidns in recorded:
        if pidns != ours:
            # No pid of another namespace can be looked up from here; the read lock
            # every attached process holds tells whether any is still alive.
            if held:
                why.append(f"attached by pid {pid} of another pid namespace ({pidns})")
        elif pid == os.getpid():
            why.append(f"attached by this process (pid {pid}): close its Region first")
            named.add(pid)
        elif process_alive(pid, start, pidns):
            why.append(f"attached by pid {pid}")
            named.add(pid)
    if held and not why:
        why.append("held open by an attached process this host cannot name")
    why += [f"mapped by pid {pid} ({os.path.basename(p)})"
            for pid, p in sorted(_mappers(paths).items()) if pid not in named]
    return why


def _strangers(paths: list[str]) -> list[str]:
    """Why a node's files are not ours to remove: another user owns one ([] if none)."""
    if os.geteuid() == 0:
        return []  # root may remove any (and the owner's processes are still looked for)
    out = set()
    for p in paths:
        try:
            uid = os.lstat(p).st_uid
        except FileNotFoundError:
            continue
        if uid != os.geteuid():
            out.add(uid)
    return [f"owned by uid {u}, not by this user (uid {os.geteuid()}): clean as its owner"
            for u in sorted(out)]


FLOCK_WAIT_S = 2.0  # an attach holds the node's flock for milliseconds, unless it waits


def remove_node(uuid: int, node: int, directory: str | None = None, *,
                dry_run: bool = False) -> NodeFiles:
    """Remove one node's node-local files unless a live process uses them.

    A dry run only looks: it takes no lock and creates nothing."""
    d = directory or nodelocal.local_dir()
    local = os.path.join(d, f"cxlrt-{uuid:016x}-node{node}.local")
    out = NodeFiles(f"{uuid:016x}", node, nodelocal.node_files(uuid, node, d))
    if not out.paths:
        return out
    out.users = _strangers(out.paths)
    if out.users:
        return out  # before we lock: a flock file of ours would lock its owner out
    if dry_run:
        out.users = _users(local, out.paths)
        return out
    init = local + ".init"
    had_init = os.path.lexists(init)
    try:
        fd = nodelocal._lock_init(init, FLOCK_WAIT_S)  # no sibling attaches meanwhile
    except PermissionError:
        out.users = [f"not writable by this user (uid {os.geteuid()}): clean as its owner"]
        return out
    except BlockingIOError:
        out.users = [f"busy: a process of the node held its flock for {FLOCK_WAIT_S:g} s "
                     "(attaching, detaching, or stopped there)"]
        return out
    try:
        if not had_init and os.geteuid() == 0:
            _give_to_owner(fd, out.paths)
        out.paths = nodelocal.node_files(uuid, node, d)
        out.users = _users(local, out.paths) or _strangers(out.paths)
        if not out.users:
            try:
                for p in out.paths:
                    if p != init:
                        _unlink(p)
            except PermissionError as e:
                out.users = [f"not removable by this user (uid {os.geteuid()}): {e}"]
            else:
                _unlink(init)  # under its own flock: a waiter finds the name gone, retries
                out.removed = True
    finally:
        if not out.removed and not had_init:
            _unlink(init)  # we made it only to lock it; a waiter retries
            out.paths = [p for p in out.paths if p != init]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return out


def _give_to_owner(fd: int, paths: list[str]) -> None:
    """Root made the node's flock file: its owner's next attach must still open it."""
    for p in paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if st.st_uid != 0:
            os.fchown(fd, st.st_uid, st.st_gid)
        return


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def clean(directory: str | None = None, *, dry_run: bool = False) -> list[NodeFiles]:
    """Remove every node's node-local files in `directory` that no live process uses."""
    return [remove_node(u, n, directory, dry_run=dry_run) for u, n in survey(directory)]


def _sidecars(fs: str) -> list[str]:
    """Every file that some backend keeps beside a region file (a region made under
    another scheme than the one named to delete it has its sidecar too)."""
    from cxlrt import registry
    out = []
    for scheme in ("emu", "chm"):
        try:
            fn = registry.hook(scheme, "sidecars")
        except ImportError:
            continue
        out += fn(fs) if fn else []
    return out


def delete(spec: str, *, force: bool = False, window: float | None = None,
           say=None) -> dict[str, Any]:
    """Delete a region: its medium (a file and the emulation's sidecar; a device is
    left as it is) and this host's node-local files of every node.

    Refuses, deleting nothing, while a node's heartbeat moves during `window` seconds
    (default: the region's lease) or while a live process of this host uses one of
    its node-local files (a process stopped past its lease looks dead to the first
    look, not to the second). ``force`` deletes under them, but node-local files a
    live process uses are kept even then (another attach would make a second file
    beside them: two holders of one node-local lock); they are reported, and
    `cxlrt clean` removes them once their processes are gone. `say(text)` hears of a
    wait.
    """
    import cxlrt
    from cxlrt import api
    from cxlrt.liveness import survey as heartbeats

    s, _cls, _params, fs = api._resolve(spec)
    device = api._is_device(s.scheme, fs)
    if not device and not os.path.lexists(fs):
        raise FileNotFoundError(f"{s}: no file at {fs}: nothing to delete")
    if not device and os.path.islink(fs):
        raise ValueError(f"{s}: {fs} is a symbolic link to {os.path.realpath(fs)}; name the "
                         "region's file itself")
    info = api.inspect(spec)  # NotARegionError: a file that is no region is not ours to remove
    uuid = int(info["uuid"], 16)
    if not force:
        busy = []
        if any(a["state"] == "attached" for a in info["node_areas"]):
            with cxlrt.open(spec, node=0, observer=True) as region:
                look = region.lease_ms / 1000 if window is None else window
                if say is not None:
                    say(f"watching the attached nodes' heartbeats for up to {look:g} s "
                        "(a lease)")
                busy = [f"node {n['node']} {n['state']} (pid {n['pid']}, host {n['host_id']})"
                        for n in heartbeats(region, look) if n["state"] in ("alive", "silent")]
        for n in range(info["nodes"]):
            x = remove_node(uuid, n, dry_run=True)
            if not _strangers(x.paths):  # another user's are kept, and named, not waited for
                busy += [f"node {n}'s node-local files are {u}" for u in x.users]
        if busy:
            raise RegionError(f"{s}: not deleted: {'; '.join(busy)}. Close those processes "
                              "first, or pass --force (force=True) to delete it under them.")
    medium = []
    if not device:
        for p in [fs, *_sidecars(fs)]:
            if os.path.lexists(p):
                _unlink(p)
                medium.append(p)
    local = [remove_node(uuid, n) for n in range(info["nodes"])]
    return {"spec": str(s), "uuid": info["uuid"], "medium": medium, "device": device,
            "node_files": [x.as_dict() for x in local]}
