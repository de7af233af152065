"""Little-endian struct formats of the on-media structures, for Python readers.

Built from :mod:`cxlrt.layoutinfo` (the offsets and widths the C compiler gave the
structs of layout.pxd), so a reader never keeps its own copy of a format.
"""

from __future__ import annotations

import struct
from collections import namedtuple
from typing import Any

from cxlrt.layoutinfo import fields


class Format:
    """Members `first` .. `last` of a struct, back to back, as a little-endian struct.

    `unpack` returns a named tuple (an array or nested-struct member is a tuple of
    its values, a char array is bytes), and `pack` takes the members by name, so a
    reader follows a moved member. The members must be contiguous: a format never
    skips bytes it was not asked to.

    Parameters
    ----------
    struct_name : str
        A name from :func:`cxlrt.layoutinfo.names`.
    first, last : str, optional
        The first and last member (default: the whole struct).
    """

    def __init__(self, struct_name: str, first: str | None = None,
                 last: str | None = None) -> None:
        members = fields(struct_name)
        order = [f.name for f in members]
        lo = order.index(first) if first else 0
        hi = order.index(last) if last else len(members) - 1
        if hi < lo:
            raise ValueError(f"{struct_name}: {last} comes before {first}")
        run = members[lo:hi + 1]
        self.struct_name = struct_name
        self.members = run
        self.offset = run[0].offset
        self.size = run[-1].offset + run[-1].width - self.offset
        self.struct = struct.Struct("<" + "".join(f.format for f in run))
        if self.struct.size != self.size:
            raise ValueError(f"{struct_name}: {first}..{last} is not contiguous")
        # What an all-zero member unpacks to: its arity, and its value when left out.
        self._zeros = [(f.name, struct.unpack("<" + f.format, bytes(f.width))) for f in run]
        self._tuple = namedtuple(struct_name, [f.name for f in run])
        self._flat = all(len(z) == 1 for _, z in self._zeros)

    def unpack(self, raw: Any, at: int = 0) -> Any:
        """The members read from `raw` at byte `at` (a named tuple)."""
        values = self.struct.unpack_from(raw, at)
        if self._flat:
            return self._tuple._make(values)
        out: list[Any] = []
        i = 0
        for _, zero in self._zeros:
            n = len(zero)
            out.append(values[i] if n == 1 else values[i:i + n])
            i += n
        return self._tuple._make(out)

    def pack(self, **members: Any) -> bytes:
        """The bytes of the members given by name; a member left out is zero."""
        values: list[Any] = []
        for name, zero in self._zeros:
            v = members.pop(name, None)
            if v is None:
                values.extend(zero)
            elif len(zero) == 1:
                values.append(v)
            else:
                values.extend(v)
        if members:
            raise TypeError(f"{self.struct_name} has no member(s) {sorted(members)}")
        return self.struct.pack(*values)

    def __repr__(self) -> str:
        return f"Format({self.struct_name!r}, {self.struct.format!r} at +{self.offset})"
