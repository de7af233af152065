# cython: language_level=3
"""The on-media structures as the C compiler lays them out, for Python readers.

Python code that reads or writes region bytes (``cxlrt info``, ``cxlrt check``,
the directory, heap scans, the fuzzer) takes its offsets and formats from here,
never from a copy: the offsets and widths below come from the compiled structs
of ``layout.pxd`` (and the KV entry and claim lines of ``kvcache.pxd``), so a
moved or resized field moves every reader with it. The member names are read from
those declarations at build time (``cxlrt/_layoutgen.py``); a member the compiler
padded, or one the generator missed, leaves a gap, which fails the import.
"""

cimport cython

from cxlrt.layout cimport (CXL_CHUNK, CXL_CK_LARGE, CXL_CK_SMALL, CXL_CK_TAIL, CXL_DIR_ENTRIES,
                           CXL_DIR_ENTRY, CXL_DIR_NAME, CXL_LAYOUT_VERSION, CXL_LINE_SIZE,
                           CXL_LOCK_NAME, CXL_MAX_LOCKS, CXL_MAX_NODES, CXL_MAX_SECTIONS,
                           CXL_MIN_CHUNKS, CXL_NODE_AREA, CXL_NODE_ATTACHED, CXL_NODE_DETACHED,
                           CXL_NODE_NEVER, CXL_OFF_MASK, CXL_RFREE_APPLIED, CXL_RFREE_PENDING,
                           CXL_SB_PAGE, CXL_SMALL_MAGIC)

import struct
from collections import namedtuple

Field = namedtuple("Field", "name offset width format")
Field.__doc__ = """A struct member: byte offset and width, and its little-endian
`struct` format ("Q", "2Q", "40s"; a nested struct's members flattened)."""

CONSTANTS = {
    "CXL_LAYOUT_VERSION": CXL_LAYOUT_VERSION, "CXL_LINE_SIZE": CXL_LINE_SIZE,
    "CXL_SB_PAGE": CXL_SB_PAGE, "CXL_MAX_SECTIONS": CXL_MAX_SECTIONS,
    "CXL_MAX_NODES": CXL_MAX_NODES, "CXL_NODE_AREA": CXL_NODE_AREA, "CXL_CHUNK": CXL_CHUNK,
    "CXL_MIN_CHUNKS": CXL_MIN_CHUNKS, "CXL_MAX_LOCKS": CXL_MAX_LOCKS,
    "CXL_LOCK_NAME": CXL_LOCK_NAME, "CXL_DIR_ENTRIES": CXL_DIR_ENTRIES,
    "CXL_DIR_ENTRY": CXL_DIR_ENTRY, "CXL_DIR_NAME": CXL_DIR_NAME,
    "CXL_NODE_NEVER": CXL_NODE_NEVER, "CXL_NODE_ATTACHED": CXL_NODE_ATTACHED,
    "CXL_NODE_DETACHED": CXL_NODE_DETACHED, "CXL_CK_SMALL": CXL_CK_SMALL,
    "CXL_CK_LARGE": CXL_CK_LARGE, "CXL_CK_TAIL": CXL_CK_TAIL,
    "CXL_SMALL_MAGIC": CXL_SMALL_MAGIC, "CXL_RFREE_PENDING": CXL_RFREE_PENDING,
    "CXL_RFREE_APPLIED": CXL_RFREE_APPLIED, "CXL_OFF_MASK": CXL_OFF_MASK,
}
"""The layout constants of layout.pxd, by their C names."""

# Element types as cython.typeof() names them; nested structs resolve through _STRUCTS.
_SCALARS = {"uint64_t": "Q", "uint32_t": "I", "uint16_t": "H", "uint8_t": "B", "char": "s"}
_STRUCTS = {}


cdef class _Members:
    """Collects one struct's members from a live instance (offsets by pointer difference)."""
    cdef const char* base
    cdef list fields

    cdef add(self, str name, const void* at, size_t width, str ctype):
        elem, _, count = ctype.partition(" [")
        n = int(count.rstrip("]")) if count else 1
        if elem in _SCALARS:
            code = _SCALARS[elem]
            fmt = f"{width}s" if code == "s" else (f"{n}{code}" if n > 1 else code)
        elif elem in _STRUCTS:
            fmt = _flat(elem) * n
        else:
            raise TypeError(f"layoutinfo: no struct format for member type {ctype!r}")
        self.fields.append(Field(name, <size_t>(<const char*>at - self.base), width, fmt))


cdef _Members _begin(const void* instance):
    cdef _Members m = _Members()
    m.base = <const char*>instance
    m.fields = []
    return m


def _flat(str name):
    """The struct format of a whole struct, members back to back (no byte order)."""
    return "".join(f.format for f in _STRUCTS[name][1])


def _register(str name, size_t size, _Members m):
    fields = tuple(sorted(m.fields, key=lambda f: f.offset))
    at = 0
    for f in fields:
        if f.offset != at or struct.calcsize("<" + f.format) != f.width:
            raise ImportError(f"layoutinfo: {name}.{f.name} is at {f.offset}, {f.width} bytes, "
                              f"but the members before it end at {at} (padding, or a member of "
                              f"{name} that cxlrt/_layoutgen.py did not read?)")
        at += f.width
    if at != size:
        raise ImportError(f"layoutinfo: the members of {name} cover {at} of its {size} bytes "
                          "(padding, or a member that cxlrt/_layoutgen.py did not read?)")
    _STRUCTS[name] = (size, fields)


# The members come from the struct declarations (cxlrt/_layoutgen.py writes this file
# at build time), in declaration order, so a nested struct is known before its user.
cdef _Members m
include "layoutinfo_members.pxi"
m = None


# --- Python readers' side ---------------------------------------------------------


def names():
    """The structs this module describes, by their C names."""
    return tuple(_STRUCTS)


def size(str name):
    """sizeof(`name`) in bytes."""
    return _STRUCTS[name][0]


def fields(str name):
    """The members of struct `name` in offset order, as :class:`Field`."""
    return _STRUCTS[name][1]


def field(str name, str member):
    """One member of struct `name`."""
    for f in _STRUCTS[name][1]:
        if f.name == member:
            return f
    raise KeyError(f"{name} has no member {member!r}")


def offset(str name, str member):
    """offsetof(`name`, `member`) in bytes."""
    return field(name, member).offset
