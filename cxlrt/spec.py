"""Region specs: ``scheme:path?key=value&key=value``.

Examples: ``file:/dev/shm/rack0``, ``emu:/dev/shm/rack0?seed=7&evict=0.01&check=1``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the backend scheme, the medium path and raw parameters."""

    scheme: str
    path: str
    params: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        q = "&".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.scheme}:{self.path}" + (f"?{q}" if q else "")


def parse_spec(text: str) -> Spec:
    """Split a spec into scheme, path and parameters; ValueError if malformed."""
    if not isinstance(text, str):
        raise TypeError(f"spec must be a str, not {type(text).__name__}")
    m = re.match(r"^([a-z][a-z0-9_+.-]*):(.*)$", text)
    if not m:
        raise ValueError(f"bad region spec {text!r}: expected SCHEME:PATH[?key=value&...], "
                         "e.g. file:/dev/shm/rack0 or emu:/dev/shm/rack0?evict=0.01&check=1")
    scheme, rest = m.group(1), m.group(2)
    path, _, query = rest.partition("?")
    if path.startswith("//"):
        path = path[2:] if not path.startswith("///") else path[2:]
    if not path:
        raise ValueError(f"bad region spec {text!r}: the path after '{scheme}:' is empty")
    params: dict[str, str] = {}
    if query:
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise ValueError(f"bad parameters {query!r} in spec {text!r}: "
                             "expected key=value pairs joined by '&'") from None
        for k, v in pairs:
            if k in params:
                raise ValueError(f"parameter {k!r} given twice in spec {text!r}")
            params[k] = v
    return Spec(scheme, path, params)


def coerce_params(scheme: str, schema: dict[str, tuple[Callable[[str], Any], Any, str]],
                  raw: dict[str, str]) -> dict[str, Any]:
    """Validate raw spec parameters against a backend's schema, filling defaults."""
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        known = ", ".join(sorted(schema)) or "none"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for {scheme}: "
                         f"(accepted: {known})")
    out = {}
    for name, (parse, default, doc) in schema.items():
        if name in raw:
            try:
                out[name] = parse(raw[name])
            except ValueError as e:
                raise ValueError(f"{scheme}: parameter {name}={raw[name]!r}: {e} ({doc})") from None
        else:
            out[name] = default
    return out


def parse_size(text: str | int) -> int:
    """Bytes from ``4096``, ``64K``, ``256M``, ``1G``, ``1GiB``; ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 256M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 0 or 1")


def parse_int_range(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            raise ValueError("expected an integer") from None
        if not lo <= v <= hi:
            raise ValueError(f"expected {lo} <= value <= {hi}")
        return v
    return parse


def parse_float_range(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise ValueError("expected a number") from None
        if not lo <= v <= hi:  # also rejects nan
            raise ValueError(f"expected {lo} <= value <= {hi}")
        return v
    return parse
