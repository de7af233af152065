"""Installed names and layering (STYLE.md rules 2 and 6)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

import cxlrt
from cxlrt import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["cxlrt.backends.file", "cxlrt.emulation.noncoherent",
                                  "cxlrt.emulation.sidecar", "cxlrt.region", "cxlrt.backend",
                                  "cxlrt.microbench", "cxlrt.cli"])
def test_installed_names(name):
    assert importlib.import_module(name).__name__ == name


def test_registry_lists_builtin_backends():
    assert {"file", "emu"} <= set(registry.available())
    with pytest.raises(ValueError, match="already registered"):
        registry.register("file", "x", "Y")
    with pytest.raises(TypeError):
        registry.known["x"] = None  # read-only view


def test_default_scheme_for_bare_paths(region_dir, monkeypatch):
    monkeypatch.setenv("CXLRT_BACKEND", "emu")
    r = cxlrt.open(f"{region_dir}/r", node=0, create=True, size="1M", nodes=1)
    assert r.backend.scheme == "emu"
    r.close()


ALGORITHM_FILES = sorted(p for p in (ROOT / "cxlrt").glob("*.p*")
                         if p.suffix in (".py", ".pyx", ".pxd")
                         and p.name not in ("registry.py",))


@pytest.mark.parametrize("path", ALGORITHM_FILES, ids=lambda p: p.name)
def test_runtime_never_imports_a_backend(path):
    """Code in cxlrt/ reaches backends only through the registry and the contract."""
    text = path.read_text()
    bad = re.findall(r"^\s*(?:from|import|cimport)\s+(?:cxlrt\.)?(?:backends|emulation)\b.*$",
                     text, re.M)
    bad += re.findall(r"isinstance\([^)]*(?:FileBackend|EmuBackend)", text)
    assert not bad, f"{path.name} depends on a concrete backend: {bad}"
