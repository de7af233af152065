"""The Python readers of region bytes agree with the compiled structs, field by field.

cxlrt.layoutinfo reports what the C compiler made of layout.pxd; each reader's
formats and offsets are compared with it member by member. For the lines that
Cython code still writes by byte offset (KV header and payload header, channel
header, node area, small-chunk header, remote-free queue), a live region is read
back through the structs and compared with what the writer says it wrote.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

import cxlrt
from cxlrt import _layoutgen, api, directory, fuzz, heapscan
from cxlrt import layoutinfo as L
from cxlrt import superblock as sb
from cxlrt.alloc import class_geometry
from cxlrt.formats import Format
from cxlrt.hashing import block_hashes
from cxlrt.kvinspect import describe
from cxlrt.lock import read_header, record_offset

FORMATS = {
    "api._NODE": api._NODE,
    "directory._LINE0": directory._LINE0,
    "directory._BODY": directory._BODY,
    "directory._REDO": directory._REDO,
    "heapscan._SMALL": heapscan._SMALL,
    "heapscan._LINK": heapscan._LINK,
    "heapscan._QUEUE": heapscan._QUEUE,
}

# reader's constant -> (struct, member or None, what it must equal: offset, width or size)
CONSTANTS = {
    "directory.ENTRY": (directory.ENTRY, "cxl_dir_entry", None, "size"),
    "directory.NAME_BYTES": (directory.NAME_BYTES, "cxl_dir_entry", "name", "width"),
    "directory._GEN": (directory._GEN, "cxl_dir_entry", "generation", "offset"),
    "directory._NAME": (directory._NAME, "cxl_dir_entry", "name", "offset"),
    "heapscan.RFREE_BYTES": (heapscan.RFREE_BYTES, "cxl_rfree_queue", None, "size"),
    "heapscan._BITMAP": (heapscan._BITMAP, "cxl_small_header", None, "size"),
    "heapscan._JWORD": (heapscan._JWORD, "cxl_rfree_queue", "jword", "offset"),
    "fuzz._SB_SUM": (fuzz._SB_SUM, "cxl_superblock", "checksum", "offset"),
    "fuzz._KV_ENTRY": (fuzz._KV_ENTRY, "kv_entry", None, "size"),
    "fuzz._KV_CHECK": (fuzz._KV_CHECK, "kv_entry", "check", "offset"),
    "fuzz._DIR_ENTRY": (fuzz._DIR_ENTRY, "cxl_dir_entry", None, "size"),
    "fuzz._DIR_GEN": (fuzz._DIR_GEN, "cxl_dir_entry", "generation", "offset"),
    "superblock.SB_BYTES": (sb.SB_BYTES, "cxl_superblock", None, "size"),
    "superblock.NODE_AREA": (sb.NODE_AREA, "cxl_node_area", None, "size"),
    "superblock.RFREE_BYTES": (sb.RFREE_BYTES, "cxl_rfree_queue", None, "size"),
    "superblock.DIR_ENTRY": (sb.DIR_ENTRY, "cxl_dir_entry", None, "size"),
}


@pytest.mark.parametrize("name", L.names())
def test_members_tile_the_struct(name):
    at = 0
    for f in L.fields(name):
        assert f.offset == at, f"{name}.{f.name}: a gap or overlap before it"
        assert struct.calcsize("<" + f.format) == f.width, f"{name}.{f.name}"
        at += f.width
    assert at == L.size(name)


@pytest.mark.parametrize("reader", sorted(FORMATS))
def test_reader_formats_match_the_structs(reader):
    fmt = FORMATS[reader]
    at = fmt.offset
    for m in fmt.members:
        f = L.field(fmt.struct_name, m.name)
        width = struct.calcsize("<" + m.format)
        assert (at, width) == (f.offset, f.width), f"{reader}: {fmt.struct_name}.{m.name}"
        at += width
    assert at - fmt.offset == fmt.struct.size == fmt.size


@pytest.mark.parametrize("reader", sorted(CONSTANTS))
def test_reader_offsets_match_the_structs(reader):
    value, name, member, what = CONSTANTS[reader]
    truth = L.size(name) if what == "size" else getattr(L.field(name, member), what)
    assert value == truth, f"{reader} = {value}, but {name} says {truth}"


def test_fuzz_kv_header_checksum_is_the_layout_line_checksum():
    assert fuzz._KV_SUM == L.offset("kv_header", "layout") + L.offset("kv_layout", "checksum")


def test_format_refuses_a_gap_and_round_trips_by_name():
    with pytest.raises(ValueError, match="would be skipped"):
        Format("cxl_dir_entry", "state", "generation")
    with pytest.raises(KeyError):
        Format("cxl_dir_entry", "nope")
    f = Format("cxl_lock_header")
    raw = f.pack(state=1, mode=2, name_len=3, name=b"abc")
    assert f.unpack(raw) == (1, 2, 3, b"abc".ljust(40, b"\0"), 0)
    with pytest.raises(TypeError, match="nope"):
        f.pack(nope=1)


def test_constants_are_layout_pxd():
    c = L.CONSTANTS
    assert c["CXL_LAYOUT_VERSION"] == sb.VERSION
    assert c["CXL_NODE_AREA"] == L.size("cxl_node_area")
    assert c["CXL_DIR_ENTRY"] == L.size("cxl_dir_entry")
    assert c["CXL_DIR_NAME"] == L.field("cxl_dir_entry", "name").width
    assert c["CXL_LOCK_NAME"] == L.field("cxl_lock_header", "name").width


# --- cxlrt/_layoutgen.py: where layoutinfo's member names come from ---------------------


def test_layoutinfo_lists_every_member_of_the_pxd():
    root = os.path.dirname(os.path.dirname(os.path.abspath(cxlrt.__file__)))
    declared = {name: members for _, path, strict in _layoutgen.SOURCES
                for name, members in _layoutgen.structs(os.path.join(root, path), strict)}
    assert {n: [f.name for f in L.fields(n)] for n in L.names()} == declared


def _structs(tmp_path, text, strict=True):
    path = tmp_path / "x.pxd"
    path.write_text(text)
    return _layoutgen.structs(str(path), strict)


def test_layoutgen_reads_a_body_with_comments(tmp_path):
    text = ("ctypedef struct a:  # a line\n"
            "    uint64_t x                # one\n"
            "# a comment in column 0\n"
            "\n"
            "    char name[40]\n"
            "    cxl_section sections[8]\n"
            "\n"
            "cdef inline uint64_t f(): return 0\n")
    assert _structs(tmp_path, text) == [("a", ["x", "name", "sections"])]


@pytest.mark.parametrize("member, match", [
    ("uint64_t x, y", "cannot read"),
    ("const char* p", "is a pointer"),  # in a strict source (layout.pxd): on-media only
])
def test_layoutgen_refuses_what_it_cannot_list(tmp_path, member, match):
    with pytest.raises(ValueError, match=match):
        _structs(tmp_path, f"ctypedef struct a:\n    {member}\n")


def test_layoutgen_leaves_out_process_memory_structs_where_not_strict(tmp_path):
    text = "ctypedef struct job:\n    uint64_t slot\n    const char* key\n"
    assert _structs(tmp_path, text, strict=False) == []


# --- the structs against what the Cython writers put in a live region --------------------


@pytest.fixture
def region(region_dir):
    r = cxlrt.open(os.path.join(region_dir, "r"), node=0, create=True, size="4M", nodes=2)
    yield r
    r.close()


def _read(r, name, at, *members):
    f = Format(name, *members)
    return f.unpack(r.dma_read(at + f.offset, f.size))


def test_directory_dma_items_match_the_directory(region):
    region.put("layout/a", region.heap[0])
    region.put("layout/b", region.heap[0] + 64)
    region.delete("layout/a")
    items = directory.dma_items(region, region.sections["directory"][0])
    assert items == region.directory.items() == [("layout/b", region.heap[0] + 64)]


def test_superblock_struct(region):
    s = _read(region, "cxl_superblock", 0)
    assert s.magic == sb.MAGIC and s.version == sb.VERSION
    assert (s.size, s.nodes, s.lease_ms, s.chunk_size) == (region.size, 2, region.lease_ms,
                                                           sb.CHUNK)
    sections = sb.layout(region.size, 2)
    assert s.nsections == len(sections)
    for i, (off, size) in enumerate(sections.values()):
        assert s.sections[2 * i:2 * i + 2] == (off, size)
    assert s.checksum == sb.checksum(region.dma_read(0, sb.SB_BYTES))


def test_node_area_struct(region):
    a = _read(region, "cxl_node_area", region.node_area(0), *api._NODE.names)
    assert a.state == L.CONSTANTS["CXL_NODE_ATTACHED"]
    assert a.pid == os.getpid() and a.incarnation > 0 and a.attaches == 1


def test_lock_header_struct(region):
    region.lock("layout.test")
    i = next(i for i in range(L.CONSTANTS["CXL_MAX_LOCKS"])
             if (read_header(region, i) or ("",))[0] == "layout.test")
    h = _read(region, "cxl_lock_header", record_offset(region, i))
    assert h.name[:h.name_len] == b"layout.test" and h.state == 1


def test_small_header_and_remote_free_structs(region_dir, region):
    off = region.alloc(100)
    heap_off = region.heap[0]
    base = heap_off + (off - heap_off) // sb.CHUNK * sb.CHUNK
    h = _read(region, "cxl_small_header", base)
    size, nslots, start = class_geometry()[1]
    assert (h.magic, h.size_class, h.owner, h.nslots, h.data_start) == (
        L.CONSTANTS["CXL_SMALL_MAGIC"], size, 0, nslots, start)
    other = cxlrt.open(os.path.join(region_dir, "r"), node=1)
    try:
        other.free(off)  # node 0's object freed by node 1: node 0's remote-free queue
        assert heapscan.scan(region).queued == {0: [off]}
        link = _read(region, "cxl_rfree_link", off)
        assert link.mark == heapscan.RFREE_PENDING ^ off and link.next == 0
    finally:
        other.close()


def test_kv_structs_and_describe(region):
    kv = cxlrt.KVCache(region, "layout", block_bytes=128, capacity_blocks=4, block_tokens=2,
                       salt=b"layout")
    try:
        keys = block_hashes(list(range(6)), 2, salt=b"layout")
        kv.store(keys, np.arange(3 * 128, dtype=np.uint8).reshape(3, 128))
        at = kv.offset
        g = _read(region, "kv_geometry", at + L.offset("kv_header", "geometry"))
        lay = _read(region, "kv_layout", at + L.offset("kv_header", "layout"))
        c = _read(region, "kv_counters", at + L.offset("kv_header", "counters"))
        assert g.magic.to_bytes(8, "little") == b"CXLKVC01"
        assert (g.key_bytes, g.slots, g.capacity, g.block_bytes, g.block_tokens) == (
            16, kv.slots, 4, 128, 2)
        assert g.salt_digest == kv.salt_digest
        assert (lay.nodes, lay.entries) == (2, kv.slot_offset(0))
        assert c.occupancy == 3
        (d,) = describe(region, region.sections["directory"][0])
        assert (d["slots"], d["capacity_blocks"], d["block_bytes"], d["block_tokens"],
                d["occupancy"], d["salt_digest"]) == (g.slots, g.capacity, g.block_bytes,
                                                      g.block_tokens, c.occupancy,
                                                      g.salt_digest.hex())
        for e in kv.entries():
            ent = _read(region, "kv_entry", kv.slot_offset(e["slot"]))
            assert (ent.off, ent.len, ent.meta >> 8) == (e["offset"], e["length"],
                                                         e["generation"])
            assert b"".join(k.to_bytes(8, "little") for k in ent.key) == e["key"]
            p = _read(region, "kv_payload_header", e["offset"])
            assert p.magic.to_bytes(8, "little") == b"CXLKVB02"
            assert (p.generation, p.block_bytes, p.cache) == (e["generation"], 128, kv.offset)
            assert p.key == ent.key
    finally:
        kv.close()


def test_channel_structs(region):
    ch = cxlrt.Channel(region, "layout", slots=4, msg_bytes=100)
    try:
        h = _read(region, "cxl_chan_header", ch.offset)
        assert (h.slots, h.msg_bytes, h.slot_bytes, h.ring) == (
            4, 100, ch.slot_bytes, ch.ring_offset - ch.offset)
        line = L.size("cxl_chan_header")
        assert h.ring == line + 2 * L.size("cxl_chan_claim") + 2 * h.runs * L.size("cxl_chan_run")
    finally:
        ch.close()
