"""Opening, formatting and inspecting regions by spec."""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from cxlrt import registry
from cxlrt import superblock as _sb
from cxlrt.errors import NotARegionError, RegionError, RegionSizeError
from cxlrt.formats import Format
from cxlrt.layoutinfo import CONSTANTS
from cxlrt.region import Region
from cxlrt.spec import Spec, coerce_params, parse_size, parse_spec

CREATE_WAIT_S = 10.0
"""How long an attach waits for a concurrent formatter to publish the magic."""


def _resolve(spec: str) -> tuple[Spec, type, dict[str, Any], str]:
    """(spec, backend class, parameters, file behind the spec)."""
    if isinstance(spec, str) and spec.startswith(("/", "./", "../")):
        spec = f"{registry.default_scheme()}:{spec}"
    s = parse_spec(spec)
    cls, schema = registry.get(s.scheme)
    params = coerce_params(s.scheme, schema, s.params)
    return s, cls, params, registry.medium_path(s.scheme, s.path)


def _check_node(node: Any) -> int:
    if isinstance(node, bool) or not isinstance(node, int):
        raise TypeError(f"node must be an int, not {type(node).__name__}")
    if node < 0:
        raise ValueError(f"node must be >= 0, got {node}")
    return node


def _is_device(scheme: str, fs: str) -> bool:
    fn = registry.hook(scheme, "is_device")
    return bool(fn and fn(fs))


def _check_device_size(s: Spec, fs: str, size: int) -> None:
    have = registry.hook(s.scheme, "medium_size")(fs)
    if size != have:
        raise RegionSizeError(f"{s}: a region on a device uses the whole device: {have} bytes "
                              f"(asked for {size}); pass size={have}")


def _medium_size(path: str, spec: str, wait: float = 0.0, scheme: str = "") -> int:
    sized = registry.hook(scheme, "medium_size") if scheme else None
    if sized is not None and _is_device(scheme, path):
        return sized(path)
    deadline = time.monotonic() + wait
    # A concurrent creator sizes the file right after creating it; give it time.
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            break
        if st.st_size >= _sb.PAGE or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{spec}: no region at {path!r}; create it with `cxlrt format {spec} --size 64M "
            "--nodes 4` or cxlrt.open(..., create=True, size=..., nodes=...)") from None
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{spec}: {path!r} is not a regular file")
    if st.st_size < _sb.PAGE:
        raise RegionSizeError(f"{spec}: {path!r} is only {st.st_size} bytes, too small to be "
                              "a region (truncated, or not a region file)")
    return st.st_size


def _check_geometry(size: Any, nodes: Any) -> tuple[int, int]:
    if size is None or nodes is None:
        raise ValueError("creating a region needs both size= (bytes, or a string like '64M') "
                         "and nodes=")
    size = parse_size(size)
    if isinstance(nodes, bool) or not isinstance(nodes, int):
        raise TypeError(f"nodes must be an int, not {type(nodes).__name__}")
    if size % _sb.PAGE:
        raise RegionSizeError(f"region size {size} is not a multiple of {_sb.PAGE} bytes")
    _sb.layout(size, nodes)  # raises on too small / bad node count
    return size, nodes


def _create_file(path: str, size: int, *, exclusive: bool) -> bool:
    """Create the medium with mode 0600; False if it exists and `exclusive`."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return False
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return True


def open(spec: str, *, node: int, create: bool = False, size: int | str | None = None,
         nodes: int | None = None, wait: float | None = None, lease: float | None = None,
         lock_manager: bool = False, observer: bool = False) -> Region:
    """Attach to a region as `node`, formatting it first when asked to create it.

    Parameters
    ----------
    spec : str
        ``scheme:path[?key=value&...]``, e.g. ``file:/dev/shm/rack0`` or
        ``emu:/dev/shm/rack0?seed=7&evict=0.01&check=1``. A bare absolute path
        uses ``CXLRT_BACKEND`` (default ``file``).
    node : int
        This process's node id, ``0 <= node < nodes``.
    create : bool
        Create and format the region if it does not exist. If it exists, attach
        (racing creators are safe: one formats, the others wait for it).
    size : int or str, optional
        Region bytes when creating (``"64M"`` works); checked against the region
        when attaching.
    nodes : int, optional
        Node count when creating; checked when attaching.
    wait : float, optional
        Seconds to wait for a concurrent formatter (default 10 s with
        ``create=True``, else 0).
    lease : float, optional
        When creating: seconds of silence after which a node is presumed dead
        and its lock holds are broken (default 2.0).
    lock_manager : bool
        Start the lock manager (for ``mode="manager"`` locks) in this process.
    observer : bool
        Attach without announcing this node (no heartbeat, nothing written):
        for tools that only read, such as ``cxlrt check``.

    Raises
    ------
    ValueError
        Unknown scheme, bad parameter, bad node.
    FileNotFoundError
        No region at the path and ``create`` is false.
    cxlrt.RegionError
        A corrupt, truncated or mismatched region (see its subclasses).
    """
    s, cls, params, fs = _resolve(spec)
    node = _check_node(node)
    created = False
    device = _is_device(s.scheme, fs)
    if create:
        size, nodes = _check_geometry(size, nodes)
        if device:
            _check_device_size(s, fs, size)
        else:
            created = _create_file(fs, size, exclusive=True)
    elif size is not None:
        size = parse_size(size)
    medium = _medium_size(fs, str(s), wait=CREATE_WAIT_S if create and not created else 0,
                          scheme=s.scheme)
    backend = _construct(cls, s, params, node, medium, fs if created and not device else None)
    region = Region(backend, str(s))
    if device and create:
        try:
            region._read_superblock()
        except NotARegionError:
            created = True  # an unformatted device: format it (run `cxlrt format` first
            #                 when several processes may race to create it)
    try:
        if created:
            region._format(nodes, _sb.new_uuid(), _lease_ms(lease))
        else:
            patience = CREATE_WAIT_S if (create and wait is None) else (wait or 0.0)
            region._attach(size, nodes, patience, observer)
        if lock_manager:
            region.start_lock_manager()
    except BaseException:
        region.close()
        if created:
            if not device:
                os.unlink(fs)  # ours, never published: nothing is lost
        raise
    return region


def _construct(cls, s: Spec, params: dict[str, Any], node: int, size: int, ours: str | None):
    """The backend for a spec; a file we just created for it goes again if that fails
    (a parameter only the backend can judge, such as chm:'s dram against its page)."""
    try:
        return cls(s.path, params, node, size)
    except BaseException:
        if ours is not None:
            os.unlink(ours)  # ours, never formatted: nothing is lost
        raise


def _forget_node_files(spec: str) -> None:
    """Remove the node-local files of the format a reformat replaces (best effort)."""
    from cxlrt.nodelocal import remove_files
    try:
        old = inspect(spec)
    except (OSError, ValueError, RegionError):
        return
    remove_files(int(old["uuid"], 16), old["nodes"])


def _lease_ms(lease: float | None) -> int:
    if lease is None:
        return _sb.DEFAULT_LEASE_MS
    if not 0.001 <= lease <= 3600:
        raise ValueError(f"lease must be between 0.001 and 3600 seconds, got {lease}")
    return int(lease * 1000)


def format(spec: str, *, size: int | str, nodes: int, force: bool = False,
           lease: float | None = None) -> dict[str, Any]:
    """Create (or with ``force``, overwrite) and format a region; return :func:`inspect`."""
    s, cls, params, fs = _resolve(spec)
    size, nodes = _check_geometry(size, nodes)
    if _is_device(s.scheme, fs):
        _check_device_size(s, fs, size)
        region = Region(cls(s.path, params, 0, size), str(s))
        try:
            try:
                region._read_superblock()
                if not force:
                    raise FileExistsError(f"{s} already holds a cxlrt region; pass --force "
                                          "(force=True) to reformat it, which destroys it")
            except NotARegionError:
                pass
            region._format(nodes, _sb.new_uuid(), _lease_ms(lease))
        finally:
            region.close()
        return inspect(str(s))
    fresh = _create_file(fs, size, exclusive=True)
    if not fresh:
        if not force:
            raise FileExistsError(f"{fs!r} already exists; pass --force (force=True) to "
                                  "reformat it, which destroys its contents")
        _forget_node_files(str(s))
        _create_file(fs, size, exclusive=False)
    backend = _construct(cls, s, params, 0, size, fs if fresh else None)
    region = Region(backend, str(s))
    try:
        region._format(nodes, _sb.new_uuid(), _lease_ms(lease))
    finally:
        region.close()
    return inspect(str(s))


_NODE = Format("cxl_node_area", "beat", "state", "incarnation", "host_id", "boot_id", "pid",
               "attaches", "beat_wall_ns")  # line 0: liveness
_NODE_STATES = {CONSTANTS["CXL_NODE_NEVER"]: "never attached",
                CONSTANTS["CXL_NODE_ATTACHED"]: "attached",
                CONSTANTS["CXL_NODE_DETACHED"]: "detached"}


def _placement(cls, path, params, size, upto):
    """{numa node: pages} of the region's metadata pages, for backends that place pages."""
    b = cls(path, params, 0, size)
    try:
        return {str(k): v for k, v in b.placement(0, upto, touch=True).items()}
    finally:
        b.close()


def inspect(spec: str) -> dict[str, Any]:
    """Read a region's superblock and node areas by DMA, without attaching as a node."""
    s, cls, params, fs = _resolve(spec)
    medium = _medium_size(fs, str(s), scheme=s.scheme)
    backend = cls(s.path, params, 0, medium)
    region = Region(backend, str(s))
    try:
        info = region._read_superblock()
        base = info["sections"]["nodes"][0]
        now = time.time_ns()
        info["node_areas"] = []
        for n in range(info["nodes"]):
            a = _NODE.unpack(region.dma_read(base + n * _sb.NODE_AREA + _NODE.offset, _NODE.size))
            wall = a.beat_wall_ns
            info["node_areas"].append({
                "node": n, "pid": a.pid, "attaches": a.attaches, "host_id": f"{a.host_id:016x}",
                "state": _NODE_STATES.get(a.state, f"corrupt ({a.state})"), "beat": a.beat,
                "incarnation": a.incarnation,
                # Wall-clock age of the last beat, for people: liveness never uses it.
                "heartbeat_age_s": None if not wall else round((now - wall) / 1e9, 3)})
        from cxlrt.kvinspect import describe
        info["kv_caches"] = describe(region, info["sections"]["directory"][0])
    finally:
        region.close()
    info["spec"] = str(s)
    info["scheme"] = s.scheme
    info["path"] = fs
    if hasattr(backend, "placement"):
        # The metadata before the heap was written at format time: its pages exist.
        info["placement"] = _placement(cls, s.path, params, medium, info["sections"]["heap"][0])
    info["params"] = params
    info["uuid"] = f"{info['uuid']:016x}"
    return info


__all__ = ["open", "format", "inspect", "NotARegionError"]
