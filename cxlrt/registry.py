"""Backend registry: scheme -> lazily imported backend class, with install hints.

Modelled on fsspec's registry: built-in entries are known up front but imported
only when used, third parties register through the ``cxlrt.backends`` entry-point
group or :func:`register`, and ``CXLRT_BACKEND`` names the default scheme.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType


@dataclass(frozen=True)
class Entry:
    """Where a backend lives and what to do when it cannot be imported."""

    module: str
    cls: str
    hint: str
    description: str


_known: dict[str, Entry] = {
    "file": Entry("cxlrt.backends.file", "FileBackend",
                  "part of cxlrt; reinstall with `pip install -e .`",
                  "coherent shared file mapping (tmpfs or any filesystem)"),
    "numa": Entry("cxlrt.backends.numa", "NumaBackend",
                  "part of cxlrt on Linux; needs /sys/devices/system/node",
                  "shared memory bound to one NUMA node (a CXL expander is a CPU-less node)"),
    "dax": Entry("cxlrt.backends.dax", "DaxBackend",
                 "part of cxlrt on Linux; needs a devdax device or a file on a DAX filesystem",
                 "devdax device or fsdax file mapped directly; real clflush, non-coherent"),
    "emu": Entry("cxlrt.emulation.noncoherent", "EmuBackend",
                 "part of cxlrt; reinstall with `pip install -e .`",
                 "non-coherent emulation with fault injection and a checker"),
    "chm": Entry("cxlrt.emulation.chm", "ChmBackend",
                 "part of cxlrt; reinstall with `pip install -e .`",
                 "CXL hybrid-memory device model: device DRAM (lru or staging) over an SSD file"),
    "rdma": Entry("cxlrt.backends.rdma", "RdmaBackend",
                  "built where libibverbs' headers are (apt-get install libibverbs-dev, then "
                  "reinstall cxlrt); needs an RDMA device at run time",
                  "a region another host serves over RDMA (`cxlrt serve`), read and written "
                  "one-sided"),
}
known = MappingProxyType(_known)
"""Read-only view of every registered scheme."""

PLANNED: dict[str, str] = {}
DEFAULT_SCHEME = "file"


def register(scheme: str, module: str, cls: str, *, hint: str = "", description: str = "",
             clobber: bool = False) -> None:
    """Add a backend; refuses to replace an existing scheme unless ``clobber``."""
    if scheme in _known and not clobber:
        raise ValueError(f"backend {scheme!r} is already registered "
                         f"({_known[scheme].module}); pass clobber=True to replace it")
    _known[scheme] = Entry(module, cls, hint, description)


def _load_entry_points() -> None:
    for ep in entry_points(group="cxlrt.backends"):
        if ep.name not in _known:
            module, _, cls = ep.value.partition(":")
            _known[ep.name] = Entry(module, cls, f"installed by {ep.dist.name if ep.dist else '?'}",
                                    "")


def get(scheme: str):
    """The backend class for `scheme`; ValueError if unknown, ImportError with a hint."""
    if scheme not in _known:
        _load_entry_points()
    if scheme not in _known:
        planned = f" ({PLANNED[scheme]} is not built yet)" if scheme in PLANNED else ""
        raise ValueError(f"unknown region scheme {scheme!r}{planned}; available: "
                         f"{', '.join(sorted(_known))}")
    e = _known[scheme]
    try:
        mod = importlib.import_module(e.module)
    except ImportError as err:  # re-raise the first error, with what to do about it
        raise ImportError(f"backend {scheme!r} cannot be imported ({err}); {e.hint}") from err
    return getattr(mod, e.cls), getattr(mod, "PARAMS", {})


def hook(scheme: str, name: str):
    """A backend module's optional hook (medium_size, is_device, ...), or None."""
    return getattr(importlib.import_module(_known[scheme].module), name, None)


def medium_path(scheme: str, spec_path: str) -> str:
    """The file a spec's path names: the path itself, unless the backend maps it."""
    mod = importlib.import_module(_known[scheme].module)
    fn = getattr(mod, "medium_path", None)
    return fn(spec_path) if fn is not None else spec_path


def available() -> list[str]:
    """Schemes whose modules import on this machine."""
    _load_entry_points()
    out = []
    for name in sorted(_known):
        try:
            get(name)
        except ImportError:
            continue
        out.append(name)
    return out


def default_scheme() -> str:
    """``CXLRT_BACKEND`` if set, else ``file``."""
    return os.environ.get("CXLRT_BACKEND", DEFAULT_SCHEME)
