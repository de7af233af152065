"""The optional serving engines (vLLM, LMCache) of the integration tests.

A test module that needs one calls :func:`require` at import. Without the
engine it skips with the install hint, as every optional part does; but when
``CXLRT_REQUIRE_ENGINES=1`` (set by ``.ci/engine-tests``, which installs them)
a missing engine is an import error that fails the run: an engine test that
skips there would pass CI without having run.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import pytest

REQUIRE_ENV = "CXLRT_REQUIRE_ENGINES"


def required() -> bool:
    """Whether this run must have every engine (``CXLRT_REQUIRE_ENGINES=1``)."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def require(module: str, hint: str) -> ModuleType:
    """Import ``module``; skip with ``hint`` when it is missing, unless engines are required.

    Imported with DeprecationWarnings ignored: LMCache's logger (and vLLM's
    dependencies) warn at import time about APIs of their own dependencies.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if not required():
            return pytest.importorskip(module, reason=hint)
        try:
            return importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"{REQUIRE_ENV}=1 but {module} cannot be imported ({e}); "
                              f"{hint}") from e
