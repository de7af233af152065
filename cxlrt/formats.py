"""Little-endian struct formats of the on-media structures, for Python readers.

Built from :mod:`cxlrt.layoutinfo` (the offsets and widths the C compiler gave the
structs of layout.pxd), so a reader never keeps its own copy of a format.
"""

from __future__ import annotations

import struct
from collections import namedtuple
from typing import Any

from cxlrt.layoutinfo import fields

_named_tuple: Any = namedtuple  # a type made at run time: mypy cannot follow it


class Format:
    """Some members of a struct, back to back, as a little-endian struct.

    The members are named, not counted from a position: they are laid out in the
    order and at the offset the struct gives them, `unpack` returns a named tuple
    (an array or nested-struct member is a tuple of its values, a char array is
    bytes) and `pack` takes the members by name, so a reader follows a moved
    member. The members must be contiguous in the struct: a format never skips
    bytes it was not asked for.

    Parameters
    ----------
    struct_name : str
        A name from :func:`cxlrt.layoutinfo.names`.
    *members : str
        The members to cover, in any order (default: the whole struct).
    """

    def __init__(self, struct_name: str, *members: str) -> None:
        every = fields(struct_name)
        unknown = set(members) - {f.name for f in every}
        if unknown:
            raise KeyError(f"{struct_name} has no member(s) {sorted(unknown)}")
        run = tuple(f for f in every if f.name in members) if members else every
        for a, b in zip(run, run[1:], strict=False):
            if a.offset + a.width != b.offset:
                raise ValueError(f"{struct_name}: {b.name} does not follow {a.name} (bytes "
                                 f"{a.offset + a.width}..{b.offset} would be skipped)")
        self.struct_name = struct_name
        self.members = run
        self.names = tuple(f.name for f in run)
        self.offset = run[0].offset
        self.size = run[-1].offset + run[-1].width - self.offset
        self.struct = struct.Struct("<" + "".join(f.format for f in run))
        # What an all-zero member unpacks to: its arity, and its value when left out.
        self._zeros = [(f.name, struct.unpack("<" + f.format, bytes(f.width))) for f in run]
        self._tuple = _named_tuple(struct_name, self.names)
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
