"""Forged KV cache lines for tests that corrupt a cache on purpose.

Packed through cxlrt.formats (the compiled kv_entry layout) and sealed with the
cache's own check word (cxlrt.kvcache.line_check), so a forged line is one the
cache reads as whole: the tests then see what the cache does with its contents.
"""

from __future__ import annotations

from cxlrt.formats import Format
from cxlrt.kvcache import line_check

_ENTRY = Format("kv_entry")
_BODY = Format("kv_entry", "key", "meta", "off", "len", "owner", "stamp_ns")


def forge_entry(key: bytes, state: int, gen: int, off: int, length: int, owner: int = 0,
                stamp_ns: int = 0) -> bytes:
    """The 64 bytes of an entry with a valid check word."""
    if len(key) != 16:
        raise ValueError("key must be 16 bytes")
    fields = dict(key=(int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")),
                  meta=(gen << 8) | state, off=off, len=length, owner=owner, stamp_ns=stamp_ns)
    return _ENTRY.pack(**fields, check=line_check(_BODY.pack(**fields)))
