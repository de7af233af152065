"""`cxlrt delete` and `cxlrt clean`: a region and its node-local files go, and nothing a
live process uses does (cxlrt/cleanup.py)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest

import cxlrt
from cxlrt import cleanup, cli, nodelocal
from cxlrt.errors import NotARegionError, RegionError

LEASE = 0.5
DEVICES = ("devdax", "rdma")

# A process of node 1 that says "ready" once attached, then waits; with "close", it
# closes its Region first (its node-local mapping stays, nodelocal._mappings).
HOLDER = """
import sys, time, cxlrt
r = cxlrt.open(sys.argv[1], node=1)
if sys.argv[2] == "kv":
    cxlrt.KVCache(r, "kv", block_bytes=4096, capacity_blocks=8, create=False)
if sys.argv[2] == "close":
    r.close()
print("ready", flush=True)
time.sleep(120)
"""


def _holder(spec: str, what: str, wrap: tuple[str, ...] = ()) -> subprocess.Popen:
    p = subprocess.Popen([*wrap, sys.executable, "-c", HOLDER, spec, what],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _stop(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()
    p.stdout.close()


def _files(root: str, uuid: str, node: int | None = None) -> list[str]:
    tag = f"cxlrt-{uuid}-node" + ("" if node is None else f"{node}")
    return sorted(f for f in os.listdir(root) if f.startswith(tag) and
                  (node is None or f[len(tag)] in ".-"))


def _make(backend, nodes=2):
    """A region whose nodes 0 and 1 each attached and made a KV cache's pin table."""
    r = backend.create(size="8M", nodes=nodes, lease=LEASE)
    cxlrt.KVCache(r, "kv", block_bytes=4096, capacity_blocks=8)
    uuid = f"{r.uuid:016x}"
    r.close()
    with backend.open(1) as r1:
        cxlrt.KVCache(r1, "kv", block_bytes=4096, capacity_blocks=8, create=False)
    return uuid


def test_delete_removes_the_medium_its_sidecar_and_every_nodes_files(backend):
    uuid = _make(backend)
    for n in (0, 1):
        have = _files(backend.root, uuid, n)
        assert any(f.endswith(".local") for f in have) and any(f.endswith(".pins") for f in have)
    done = cleanup.delete(backend.spec())
    assert _files(backend.root, uuid) == []
    assert [x["removed"] for x in done["node_files"]] == [True, True]
    if backend.name in DEVICES:
        assert done["device"] and done["medium"] == []
        return
    assert done["medium"][0] == backend.path and not os.path.exists(backend.path)
    assert not [f for f in os.listdir(backend.root) if f.startswith("region")]
    # The name is free again: a new region there starts from nothing.
    r = backend.create(size="8M", nodes=2, lease=LEASE)
    assert f"{r.uuid:016x}" != uuid
    assert cxlrt.KVCache(r, "kv", block_bytes=4096, capacity_blocks=8).occupancy == 0
    r.close()


def test_delete_refuses_a_live_node_and_force_keeps_the_files_it_uses(backend):
    uuid = _make(backend)
    p = _holder(backend.spec(), "kv")
    try:
        with pytest.raises(RegionError, match="node 1 alive"):
            cleanup.delete(backend.spec())
        assert _files(backend.root, uuid, 0) and _files(backend.root, uuid, 1)
        if backend.name not in DEVICES:
            assert os.path.exists(backend.path)
        done = cleanup.delete(backend.spec(), force=True)
        kept = [x for x in done["node_files"] if not x["removed"]]
        assert [x["node"] for x in kept] == [1]
        assert kept[0]["users"] == [f"attached by pid {p.pid}"]
        assert _files(backend.root, uuid, 0) == []
        names = sorted(os.path.basename(f) for f in kept[0]["paths"])
        assert names == _files(backend.root, uuid, 1)
        assert any(f.endswith(".pins") for f in _files(backend.root, uuid, 1))
        # Stopped is not gone: only the kernel's word that it is dead frees its files.
        p.send_signal(signal.SIGSTOP)
        assert not [x for x in cleanup.clean(backend.root) if x.removed]
        assert _files(backend.root, uuid, 1)
    finally:
        _stop(p)
    gone = cleanup.clean(backend.root)
    assert [(x.uuid, x.node, x.removed) for x in gone] == [(uuid, 1, True)]
    assert _files(backend.root, uuid) == []


def test_clean_keeps_the_files_a_process_still_maps_after_closing_its_region(region_dir):
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = cxlrt.inspect(spec)["uuid"]
    p = _holder(spec, "close")
    try:
        assert nodelocal.recorded_procs(nodelocal.local_path(int(uuid, 16), 1)) == []
        done = {x.node: x for x in cleanup.clean(region_dir)}  # format attached node 0
        assert done[0].removed and not done[1].removed
        assert done[1].users == [f"mapped by pid {p.pid} (cxlrt-{uuid}-node1.local)"]
    finally:
        _stop(p)
    (x,) = cleanup.clean(region_dir)
    assert (x.node, x.removed) == (1, True) and _files(region_dir, uuid) == []


def _until_blocked_on(path: str) -> None:
    """Wait until some thread waits for the flock of `path` (the kernel lists it)."""
    ino = os.stat(path).st_ino
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open("/proc/locks") as f:
            if any("->" in line and f":{ino} " in line for line in f):
                return
        time.sleep(0.01)
    raise AssertionError("nobody came to wait for the flock")


def test_an_attach_waiting_on_a_removed_flock_file_locks_the_new_one(region_dir):
    """Remove the node's flock file while holding it, as clean does; a process waiting on
    the old one must not attach beside the one that locked the new one."""
    path = nodelocal.local_path(0x1234, 0) + ".init"
    old = nodelocal._lock_init(path)
    entered = threading.Event()

    def waiter():
        fd = nodelocal._lock_init(path)
        entered.set()
        os.close(fd)

    t = threading.Thread(target=waiter)
    t.start()
    _until_blocked_on(path)
    os.unlink(path)
    new = nodelocal._lock_init(path)  # a sibling that came later: it made the new file
    fcntl.flock(old, fcntl.LOCK_UN)
    os.close(old)
    assert not entered.wait(0.5), "the waiter locked a flock file nobody else sees"
    os.close(new)
    assert entered.wait(5)
    t.join()


def test_delete_refuses_a_file_that_is_not_a_region(region_dir):
    path = os.path.join(region_dir, "notes")
    with open(path, "wb") as f:
        f.write(b"not a region" * 1000)
    with pytest.raises(NotARegionError):
        cleanup.delete(f"file:{path}")
    assert os.path.getsize(path) == 12000


def test_the_cli_deletes_and_cleans(region_dir, capsys):
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = cxlrt.inspect(spec)["uuid"]
    with cxlrt.open(spec, node=0):
        pass
    # Left behind by hand: the region file removed without `cxlrt delete`.
    os.unlink(f"{region_dir}/r")
    assert cli.main(["clean", "--dir", region_dir, "--dry-run"]) == 0
    assert f"would remove node 0 of {uuid}: 2 file(s)" in capsys.readouterr().out
    assert _files(region_dir, uuid, 0)
    assert cli.main(["clean", "--json"]) == 0  # $CXLRT_LOCAL_DIR is region_dir
    (x,) = json.loads(capsys.readouterr().out)
    assert x["removed"] and _files(region_dir, uuid) == []

    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = cxlrt.inspect(spec)["uuid"]
    with cxlrt.open(spec, node=1):
        pass
    assert cli.main(["delete", spec]) == 0
    out = capsys.readouterr().out
    assert f"removed  {region_dir}/r\n" in out and f"removed  4 node-local file(s) of {uuid}" in out
    assert cli.main(["delete", spec]) == 2  # gone: nothing to delete
    assert "nothing to delete" in capsys.readouterr().err


def test_delete_refuses_a_process_stopped_past_its_lease(region_dir):
    """Its heartbeat says dead; its node-local files say it will come back and use them."""
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    p = _holder(spec, "attach")
    try:
        p.send_signal(signal.SIGSTOP)
        time.sleep(3 * LEASE)
        with pytest.raises(RegionError, match=f"node 1's node-local files are attached by "
                                              f"pid {p.pid}"):
            cleanup.delete(spec)
        assert os.path.exists(f"{region_dir}/r")
    finally:
        _stop(p)
    assert cleanup.delete(spec)["medium"] == [f"{region_dir}/r"]


def test_a_process_of_another_pid_namespace_counts_while_it_lives(region_dir):
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = cxlrt.inspect(spec)["uuid"]
    wrap = ("unshare", "--pid", "--kill-child", "--mount-proc")
    if subprocess.run([*wrap, "true"], capture_output=True).returncode != 0:
        pytest.skip("no new pid namespace here (unshare needs root)")
    p = _holder(spec, "attach", wrap)
    try:
        done = {x.node: x for x in cleanup.clean(region_dir)}
        assert done[0].removed and not done[1].removed
        # Its host pid maps the file too, which this namespace can see; the record names
        # the pid it has in its own.
        assert done[1].users[0].startswith("attached by pid 1 of another pid namespace")
    finally:
        _stop(p)
    # Its record stays, and its pid means nothing here: the kernel drops its lock when
    # it dies (the namespace's init goes a moment after unshare, by its death signal).
    assert nodelocal.recorded_procs(nodelocal.local_path(int(uuid, 16), 1))
    deadline = time.monotonic() + 10
    while True:
        (x,) = cleanup.clean(region_dir)
        if x.removed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (x.node, x.removed, x.users) == (1, True, [])


def test_clean_passes_over_a_node_whose_flock_stays_held(region_dir, monkeypatch):
    monkeypatch.setattr(cleanup, "FLOCK_WAIT_S", 0.2)
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = int(cxlrt.inspect(spec)["uuid"], 16)
    with cxlrt.open(spec, node=1):
        pass
    fd = nodelocal._lock_init(nodelocal.local_path(uuid, 1) + ".init")  # a stopped attach
    try:
        t0 = time.monotonic()
        done = {x.node: x for x in cleanup.clean(region_dir)}
        assert time.monotonic() - t0 < 5
        assert done[0].removed and not done[1].removed
        assert done[1].users[0].startswith("busy: a process of the node held its flock")
    finally:
        os.close(fd)
    assert [x.removed for x in cleanup.clean(region_dir)] == [True]


def test_a_role_taken_after_clean_removed_its_file_is_the_nodes_only_one(region_dir):
    """This process held and gave back a role, closed, and cleaned: its cached descriptor
    names the removed file, and a role taken on it would not exclude a sibling's."""
    from cxlrt import rolelock
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    with cxlrt.open(spec, node=0) as r:
        uuid = r.uuid
        assert rolelock.hold(uuid, 0, 7)
        rolelock.release(uuid, 0, 7)
    assert [x.removed for x in cleanup.clean(region_dir)] == [True]
    with cxlrt.open(spec, node=0):
        assert rolelock.hold(uuid, 0, 7)
        other = subprocess.run(
            [sys.executable, "-c", "import sys, cxlrt; from cxlrt import rolelock; "
             "r = cxlrt.open(sys.argv[1], node=0); print(rolelock.hold(r.uuid, 0, 7))", spec],
            capture_output=True, text=True, check=True)
        assert other.stdout.strip() == "False"
        rolelock.release(uuid, 0, 7)


def test_delete_refuses_a_symbolic_link(region_dir):
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    os.symlink(f"{region_dir}/r", f"{region_dir}/link")
    with pytest.raises(ValueError, match="symbolic link"):
        cleanup.delete(f"file:{region_dir}/link")
    assert os.path.exists(f"{region_dir}/r") and os.path.islink(f"{region_dir}/link")


def test_clean_keeps_a_node_it_may_not_touch_and_goes_on(region_dir, monkeypatch, capsys):
    """Another user's files (0600) on a shared /dev/shm: kept, named, and the rest cleaned."""
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=3, lease=LEASE)
    uuid = int(cxlrt.inspect(spec)["uuid"], 16)
    for n in (1, 2):
        with cxlrt.open(spec, node=n):
            pass
    theirs = nodelocal.local_path(uuid, 1) + ".init"
    lock = nodelocal._lock_init

    def lock_init(path, wait=None):
        if path == theirs:
            raise PermissionError(13, "Permission denied", path)
        return lock(path, wait)

    monkeypatch.setattr(nodelocal, "_lock_init", lock_init)
    assert cli.main(["clean", "--json", "--dir", region_dir]) == 0
    done = {x["node"]: x for x in json.loads(capsys.readouterr().out)}
    assert done[0]["removed"] and done[2]["removed"]  # before and after the one it can't
    assert not done[1]["removed"] and "not writable by this user" in done[1]["users"][0]
    assert _files(region_dir, f"{uuid:016x}", 1)


def test_a_stale_record_of_another_namespace_does_not_hide_a_live_mapper(region_dir):
    """A record of another pid namespace may carry the pid a process of ours has here."""
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = cxlrt.inspect(spec)["uuid"]
    p = _holder(spec, "close")
    try:
        with open(nodelocal.local_path(int(uuid, 16), 1), "r+b") as f:
            f.seek(128)  # the process table's first record: pid, start, pid namespace
            f.write(struct.pack("<QQQQ", p.pid, 12345, 4026599999, 0))
        done = {x.node: x for x in cleanup.clean(region_dir)}
        assert not done[1].removed
        assert f"mapped by pid {p.pid} (cxlrt-{uuid}-node1.local)" in done[1].users
    finally:
        _stop(p)


def test_delete_leaves_a_region_that_only_has_a_sidecars_name(region_dir):
    cxlrt.format(f"file:{region_dir}/rack.emu", size="4M", nodes=2, lease=LEASE)
    cxlrt.format(f"file:{region_dir}/rack", size="4M", nodes=2, lease=LEASE)
    assert cleanup.delete(f"file:{region_dir}/rack")["medium"] == [f"{region_dir}/rack"]
    assert cxlrt.inspect(f"file:{region_dir}/rack.emu")["nodes"] == 2


def test_clean_leaves_another_users_node_untouched(region_dir, monkeypatch):
    """Not root, and the files are another user's: nothing is locked, made or removed."""
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    uuid = cxlrt.inspect(spec)["uuid"]
    os.unlink(nodelocal.local_path(int(uuid, 16), 0) + ".init")
    before, me = _files(region_dir, uuid), os.geteuid()
    monkeypatch.setattr(cleanup.os, "geteuid", lambda: 4242)  # the files are `me`'s
    (x,) = cleanup.clean(region_dir)
    assert not x.removed and x.users == [
        f"owned by uid {me}, not by this user (uid 4242): clean as its owner"]
    assert _files(region_dir, uuid) == before  # and no flock file of ours among them
    # delete takes the region and leaves the node's files, named (exit code 3)
    done = cleanup.delete(spec)
    assert done["medium"] == [f"{region_dir}/r"]
    assert [x["removed"] for x in done["node_files"]] == [False, False]
    assert _files(region_dir, uuid) == before


def test_an_attach_refuses_a_node_local_file_of_another_build_that_a_live_process_uses(region_dir):
    """An upgrade beside a running process of the older build: its node-local file has
    another layout. Replacing it would give the node two files, so two heap mutexes
    (an object handed out twice); the attach refuses while that process uses it, and
    rebuilds the file once nobody does."""
    spec = f"file:{region_dir}/r"
    cxlrt.format(spec, size="4M", nodes=2, lease=LEASE)
    path = nodelocal.local_path(int(cxlrt.inspect(spec)["uuid"], 16), 1)
    with open(path, "wb") as f:  # an older build's file: other magic, other size
        f.write(b"CXLLOCL2" + bytes(4096 * 3))
    user = os.open(path, os.O_RDONLY)  # its process holds the in-use lock (nodelocal._use)
    try:
        fcntl.fcntl(user, fcntl.F_OFD_SETLK, struct.pack(nodelocal._OFD, fcntl.F_RDLCK,
                                                         os.SEEK_SET, 0, 1, 0))
        with pytest.raises(RegionError, match="another cxlrt build's layout"):
            cxlrt.open(spec, node=1)
        with open(path, "rb") as f:
            assert f.read(8) == b"CXLLOCL2", "the file in use was replaced"
    finally:
        os.close(user)
    with cxlrt.open(spec, node=1) as r:  # nobody uses it now: rebuilt
        r.free(r.alloc(64))
