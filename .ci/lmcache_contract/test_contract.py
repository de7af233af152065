"""LMCache's L2 adapter test classes, collected here so that conftest's `adapter` is theirs."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

SUITE_DIR = os.environ["LMCACHE_SUITE_DIR"]
# The suites written as test classes over one `adapter` fixture (and a variant), against the
# L2AdapterInterface contract (public methods only).
SUITES = ("test_mock_l2_adapter.py", "test_native_connector_l2_adapter.py")


def _load(fname: str):
    name = "lmcache_suite_" + fname[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(SUITE_DIR, fname))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _over_adapter(cls: type) -> bool:
    return any({"adapter", "adapter_with_capacity"} & set(inspect.signature(f).parameters)
               for n, f in vars(cls).items() if n.startswith("test_") and callable(f))


for _fname in SUITES:
    _suite = _fname[len("test_"):-len(".py")]
    for _name, _cls in vars(_load(_fname)).items():
        if _name.startswith("Test") and isinstance(_cls, type) and _over_adapter(_cls):
            globals()[f"Test_{_suite}__{_name}"] = _cls
