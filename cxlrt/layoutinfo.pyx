# cython: language_level=3
"""The on-media structures as the C compiler lays them out, for Python readers.

Python code that reads or writes region bytes (``cxlrt info``, ``cxlrt check``,
the directory, heap scans, the fuzzer) takes its offsets and formats from here,
never from a copy: the offsets and widths below come from the compiled structs
of ``layout.pxd`` (and the KV entry and claim lines of ``kvcache.pxd``), so a
moved or resized field moves every reader with it. A field added to a struct
but not listed here leaves a gap, which fails the import.
"""

cimport cython

from cxlrt.layout cimport (CXL_CHUNK, CXL_CK_LARGE, CXL_CK_SMALL, CXL_CK_TAIL, CXL_DIR_ENTRIES,
                           CXL_DIR_ENTRY, CXL_DIR_NAME, CXL_LAYOUT_VERSION, CXL_LINE_SIZE,
                           CXL_LOCK_NAME, CXL_MAX_LOCKS, CXL_MAX_NODES, CXL_MAX_SECTIONS,
                           CXL_MIN_CHUNKS, CXL_NODE_AREA, CXL_NODE_ATTACHED, CXL_NODE_DETACHED,
                           CXL_NODE_NEVER, CXL_OFF_MASK, CXL_RFREE_APPLIED, CXL_RFREE_PENDING,
                           CXL_SB_PAGE, CXL_SMALL_MAGIC, cxl_chan_claim,
                           cxl_chan_header, cxl_chan_run, cxl_dir_entry, cxl_lock_grant_line,
                           cxl_lock_header, cxl_lock_node_line, cxl_mgr_claim, cxl_node_area,
                           cxl_rfree_link, cxl_rfree_queue, cxl_section, cxl_small_header,
                           cxl_superblock, kv_counters, kv_geometry, kv_header, kv_layout,
                           kv_payload_header)
from cxlrt.kvcache cimport kv_claim, kv_entry, kv_stats

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
                              f"but the members listed before it end at {at} (a member of "
                              f"{name} in the .pxd is not listed in layoutinfo.pyx?)")
        at += f.width
    if at != size:
        raise ImportError(f"layoutinfo: the members of {name} cover {at} of its {size} bytes "
                          "(a member in the .pxd is not listed in layoutinfo.pyx?)")
    _STRUCTS[name] = (size, fields)


cdef _Members m
cdef cxl_section sec
m = _begin(&sec)
m.add("off", &sec.off, sizeof(sec.off), cython.typeof(sec.off))
m.add("size", &sec.size, sizeof(sec.size), cython.typeof(sec.size))
_register("cxl_section", sizeof(sec), m)

cdef cxl_superblock sb
m = _begin(&sb)
m.add("magic", &sb.magic, sizeof(sb.magic), cython.typeof(sb.magic))
m.add("version", &sb.version, sizeof(sb.version), cython.typeof(sb.version))
m.add("line_size", &sb.line_size, sizeof(sb.line_size), cython.typeof(sb.line_size))
m.add("size", &sb.size, sizeof(sb.size), cython.typeof(sb.size))
m.add("nodes", &sb.nodes, sizeof(sb.nodes), cython.typeof(sb.nodes))
m.add("nsections", &sb.nsections, sizeof(sb.nsections), cython.typeof(sb.nsections))
m.add("uuid", &sb.uuid, sizeof(sb.uuid), cython.typeof(sb.uuid))
m.add("created_ns", &sb.created_ns, sizeof(sb.created_ns), cython.typeof(sb.created_ns))
m.add("sections", &sb.sections, sizeof(sb.sections), cython.typeof(sb.sections))
m.add("lease_ms", &sb.lease_ms, sizeof(sb.lease_ms), cython.typeof(sb.lease_ms))
m.add("chunk_size", &sb.chunk_size, sizeof(sb.chunk_size), cython.typeof(sb.chunk_size))
m.add("checksum", &sb.checksum, sizeof(sb.checksum), cython.typeof(sb.checksum))
_register("cxl_superblock", sizeof(sb), m)

cdef cxl_node_area na
m = _begin(&na)
m.add("beat", &na.beat, sizeof(na.beat), cython.typeof(na.beat))
m.add("state", &na.state, sizeof(na.state), cython.typeof(na.state))
m.add("incarnation", &na.incarnation, sizeof(na.incarnation), cython.typeof(na.incarnation))
m.add("host_id", &na.host_id, sizeof(na.host_id), cython.typeof(na.host_id))
m.add("boot_id", &na.boot_id, sizeof(na.boot_id), cython.typeof(na.boot_id))
m.add("pid", &na.pid, sizeof(na.pid), cython.typeof(na.pid))
m.add("attaches", &na.attaches, sizeof(na.attaches), cython.typeof(na.attaches))
m.add("beat_wall_ns", &na.beat_wall_ns, sizeof(na.beat_wall_ns), cython.typeof(na.beat_wall_ns))
m.add("mgr_epoch", &na.mgr_epoch, sizeof(na.mgr_epoch), cython.typeof(na.mgr_epoch))
m.add("mgr_beat", &na.mgr_beat, sizeof(na.mgr_beat), cython.typeof(na.mgr_beat))
m.add("mgr_pid", &na.mgr_pid, sizeof(na.mgr_pid), cython.typeof(na.mgr_pid))
m.add("reserved", &na.reserved, sizeof(na.reserved), cython.typeof(na.reserved))
_register("cxl_node_area", sizeof(na), m)

cdef cxl_lock_header lh
m = _begin(&lh)
m.add("state", &lh.state, sizeof(lh.state), cython.typeof(lh.state))
m.add("mode", &lh.mode, sizeof(lh.mode), cython.typeof(lh.mode))
m.add("name_len", &lh.name_len, sizeof(lh.name_len), cython.typeof(lh.name_len))
m.add("name", &lh.name, sizeof(lh.name), cython.typeof(lh.name))
m.add("reserved", &lh.reserved, sizeof(lh.reserved), cython.typeof(lh.reserved))
_register("cxl_lock_header", sizeof(lh), m)

cdef cxl_lock_node_line ln
m = _begin(&ln)
m.add("choosing", &ln.choosing, sizeof(ln.choosing), cython.typeof(ln.choosing))
m.add("number", &ln.number, sizeof(ln.number), cython.typeof(ln.number))
m.add("req_seq", &ln.req_seq, sizeof(ln.req_seq), cython.typeof(ln.req_seq))
m.add("rel_seq", &ln.rel_seq, sizeof(ln.rel_seq), cython.typeof(ln.rel_seq))
m.add("acquisitions", &ln.acquisitions, sizeof(ln.acquisitions), cython.typeof(ln.acquisitions))
m.add("accepted", &ln.accepted, sizeof(ln.accepted), cython.typeof(ln.accepted))
m.add("reserved", &ln.reserved, sizeof(ln.reserved), cython.typeof(ln.reserved))
_register("cxl_lock_node_line", sizeof(ln), m)

cdef cxl_lock_grant_line gl
m = _begin(&gl)
m.add("grant", &gl.grant, sizeof(gl.grant), cython.typeof(gl.grant))
m.add("reserved", &gl.reserved, sizeof(gl.reserved), cython.typeof(gl.reserved))
_register("cxl_lock_grant_line", sizeof(gl), m)

cdef cxl_mgr_claim mc
m = _begin(&mc)
m.add("node_plus1", &mc.node_plus1, sizeof(mc.node_plus1), cython.typeof(mc.node_plus1))
m.add("epoch", &mc.epoch, sizeof(mc.epoch), cython.typeof(mc.epoch))
m.add("incarnation", &mc.incarnation, sizeof(mc.incarnation), cython.typeof(mc.incarnation))
m.add("pid", &mc.pid, sizeof(mc.pid), cython.typeof(mc.pid))
m.add("reserved", &mc.reserved, sizeof(mc.reserved), cython.typeof(mc.reserved))
_register("cxl_mgr_claim", sizeof(mc), m)

cdef cxl_dir_entry de
m = _begin(&de)
m.add("state", &de.state, sizeof(de.state), cython.typeof(de.state))
m.add("off", &de.off, sizeof(de.off), cython.typeof(de.off))
m.add("name_len", &de.name_len, sizeof(de.name_len), cython.typeof(de.name_len))
m.add("generation", &de.generation, sizeof(de.generation), cython.typeof(de.generation))
m.add("redo", &de.redo, sizeof(de.redo), cython.typeof(de.redo))
m.add("redo_off", &de.redo_off, sizeof(de.redo_off), cython.typeof(de.redo_off))
m.add("redo_tag", &de.redo_tag, sizeof(de.redo_tag), cython.typeof(de.redo_tag))
m.add("redo_seal", &de.redo_seal, sizeof(de.redo_seal), cython.typeof(de.redo_seal))
m.add("name", &de.name, sizeof(de.name), cython.typeof(de.name))
_register("cxl_dir_entry", sizeof(de), m)

cdef cxl_small_header sh
m = _begin(&sh)
m.add("magic", &sh.magic, sizeof(sh.magic), cython.typeof(sh.magic))
m.add("size_class", &sh.size_class, sizeof(sh.size_class), cython.typeof(sh.size_class))
m.add("owner", &sh.owner, sizeof(sh.owner), cython.typeof(sh.owner))
m.add("nslots", &sh.nslots, sizeof(sh.nslots), cython.typeof(sh.nslots))
m.add("data_start", &sh.data_start, sizeof(sh.data_start), cython.typeof(sh.data_start))
m.add("reserved0", &sh.reserved0, sizeof(sh.reserved0), cython.typeof(sh.reserved0))
m.add("reserved", &sh.reserved, sizeof(sh.reserved), cython.typeof(sh.reserved))
_register("cxl_small_header", sizeof(sh), m)

cdef cxl_rfree_queue rq
m = _begin(&rq)
m.add("head", &rq.head, sizeof(rq.head), cython.typeof(rq.head))
m.add("count", &rq.count, sizeof(rq.count), cython.typeof(rq.count))
m.add("seq", &rq.seq, sizeof(rq.seq), cython.typeof(rq.seq))
m.add("reserved0", &rq.reserved0, sizeof(rq.reserved0), cython.typeof(rq.reserved0))
m.add("jword", &rq.jword, sizeof(rq.jword), cython.typeof(rq.jword))
m.add("jcount", &rq.jcount, sizeof(rq.jcount), cython.typeof(rq.jcount))
m.add("reserved1", &rq.reserved1, sizeof(rq.reserved1), cython.typeof(rq.reserved1))
m.add("reserved", &rq.reserved, sizeof(rq.reserved), cython.typeof(rq.reserved))
_register("cxl_rfree_queue", sizeof(rq), m)

cdef cxl_rfree_link rl
m = _begin(&rl)
m.add("next", &rl.next, sizeof(rl.next), cython.typeof(rl.next))
m.add("mark", &rl.mark, sizeof(rl.mark), cython.typeof(rl.mark))
m.add("batch", &rl.batch, sizeof(rl.batch), cython.typeof(rl.batch))
_register("cxl_rfree_link", sizeof(rl), m)

cdef kv_geometry kg
m = _begin(&kg)
m.add("magic", &kg.magic, sizeof(kg.magic), cython.typeof(kg.magic))
m.add("version", &kg.version, sizeof(kg.version), cython.typeof(kg.version))
m.add("key_bytes", &kg.key_bytes, sizeof(kg.key_bytes), cython.typeof(kg.key_bytes))
m.add("slots", &kg.slots, sizeof(kg.slots), cython.typeof(kg.slots))
m.add("capacity", &kg.capacity, sizeof(kg.capacity), cython.typeof(kg.capacity))
m.add("block_bytes", &kg.block_bytes, sizeof(kg.block_bytes), cython.typeof(kg.block_bytes))
m.add("block_tokens", &kg.block_tokens, sizeof(kg.block_tokens), cython.typeof(kg.block_tokens))
m.add("algorithm", &kg.algorithm, sizeof(kg.algorithm), cython.typeof(kg.algorithm))
m.add("salt_digest", &kg.salt_digest, sizeof(kg.salt_digest), cython.typeof(kg.salt_digest))
_register("kv_geometry", sizeof(kg), m)

cdef kv_layout kl
m = _begin(&kl)
m.add("nodes", &kl.nodes, sizeof(kl.nodes), cython.typeof(kl.nodes))
m.add("entries", &kl.entries, sizeof(kl.entries), cython.typeof(kl.entries))
m.add("pins", &kl.pins, sizeof(kl.pins), cython.typeof(kl.pins))
m.add("stats", &kl.stats, sizeof(kl.stats), cython.typeof(kl.stats))
m.add("created_ns", &kl.created_ns, sizeof(kl.created_ns), cython.typeof(kl.created_ns))
m.add("total", &kl.total, sizeof(kl.total), cython.typeof(kl.total))
m.add("claims", &kl.claims, sizeof(kl.claims), cython.typeof(kl.claims))
m.add("checksum", &kl.checksum, sizeof(kl.checksum), cython.typeof(kl.checksum))
_register("kv_layout", sizeof(kl), m)

cdef kv_counters kc
m = _begin(&kc)
m.add("occupancy", &kc.occupancy, sizeof(kc.occupancy), cython.typeof(kc.occupancy))
m.add("payload_bytes", &kc.payload_bytes, sizeof(kc.payload_bytes),
      cython.typeof(kc.payload_bytes))
m.add("records", &kc.records, sizeof(kc.records), cython.typeof(kc.records))
m.add("reserved", &kc.reserved, sizeof(kc.reserved), cython.typeof(kc.reserved))
_register("kv_counters", sizeof(kc), m)

cdef kv_header kh
m = _begin(&kh)
m.add("geometry", &kh.geometry, sizeof(kh.geometry), cython.typeof(kh.geometry))
m.add("layout", &kh.layout, sizeof(kh.layout), cython.typeof(kh.layout))
m.add("counters", &kh.counters, sizeof(kh.counters), cython.typeof(kh.counters))
_register("kv_header", sizeof(kh), m)

cdef kv_payload_header kp
m = _begin(&kp)
m.add("magic", &kp.magic, sizeof(kp.magic), cython.typeof(kp.magic))
m.add("key", &kp.key, sizeof(kp.key), cython.typeof(kp.key))
m.add("generation", &kp.generation, sizeof(kp.generation), cython.typeof(kp.generation))
m.add("block_bytes", &kp.block_bytes, sizeof(kp.block_bytes), cython.typeof(kp.block_bytes))
m.add("cache", &kp.cache, sizeof(kp.cache), cython.typeof(kp.cache))
m.add("progress", &kp.progress, sizeof(kp.progress), cython.typeof(kp.progress))
m.add("writer", &kp.writer, sizeof(kp.writer), cython.typeof(kp.writer))
_register("kv_payload_header", sizeof(kp), m)

cdef kv_stats ks
m = _begin(&ks)
m.add("lookups", &ks.lookups, sizeof(ks.lookups), cython.typeof(ks.lookups))
m.add("hits", &ks.hits, sizeof(ks.hits), cython.typeof(ks.hits))
m.add("misses", &ks.misses, sizeof(ks.misses), cython.typeof(ks.misses))
m.add("stores", &ks.stores, sizeof(ks.stores), cython.typeof(ks.stores))
m.add("skipped", &ks.skipped, sizeof(ks.skipped), cython.typeof(ks.skipped))
m.add("evictions", &ks.evictions, sizeof(ks.evictions), cython.typeof(ks.evictions))
m.add("bytes_stored", &ks.bytes_stored, sizeof(ks.bytes_stored), cython.typeof(ks.bytes_stored))
m.add("bytes_loaded", &ks.bytes_loaded, sizeof(ks.bytes_loaded), cython.typeof(ks.bytes_loaded))
_register("kv_stats", sizeof(ks), m)

cdef kv_entry ke
m = _begin(&ke)
m.add("key", &ke.key, sizeof(ke.key), cython.typeof(ke.key))
m.add("meta", &ke.meta, sizeof(ke.meta), cython.typeof(ke.meta))
m.add("off", &ke.off, sizeof(ke.off), cython.typeof(ke.off))
m.add("len", &ke.len, sizeof(ke.len), cython.typeof(ke.len))
m.add("owner", &ke.owner, sizeof(ke.owner), cython.typeof(ke.owner))
m.add("stamp_ns", &ke.stamp_ns, sizeof(ke.stamp_ns), cython.typeof(ke.stamp_ns))
m.add("check", &ke.check, sizeof(ke.check), cython.typeof(ke.check))
_register("kv_entry", sizeof(ke), m)

cdef kv_claim kc2
m = _begin(&kc2)
m.add("tag", &kc2.tag, sizeof(kc2.tag), cython.typeof(kc2.tag))
m.add("off", &kc2.off, sizeof(kc2.off), cython.typeof(kc2.off))
m.add("epoch", &kc2.epoch, sizeof(kc2.epoch), cython.typeof(kc2.epoch))
m.add("slot", &kc2.slot, sizeof(kc2.slot), cython.typeof(kc2.slot))
m.add("inc", &kc2.inc, sizeof(kc2.inc), cython.typeof(kc2.inc))
m.add("start", &kc2.start, sizeof(kc2.start), cython.typeof(kc2.start))
m.add("where", &kc2.where, sizeof(kc2.where), cython.typeof(kc2.where))
m.add("check", &kc2.check, sizeof(kc2.check), cython.typeof(kc2.check))
_register("kv_claim", sizeof(kc2), m)

cdef cxl_chan_header ch
m = _begin(&ch)
m.add("magic", &ch.magic, sizeof(ch.magic), cython.typeof(ch.magic))
m.add("version", &ch.version, sizeof(ch.version), cython.typeof(ch.version))
m.add("slots", &ch.slots, sizeof(ch.slots), cython.typeof(ch.slots))
m.add("msg_bytes", &ch.msg_bytes, sizeof(ch.msg_bytes), cython.typeof(ch.msg_bytes))
m.add("slot_bytes", &ch.slot_bytes, sizeof(ch.slot_bytes), cython.typeof(ch.slot_bytes))
m.add("ring", &ch.ring, sizeof(ch.ring), cython.typeof(ch.ring))
m.add("runs", &ch.runs, sizeof(ch.runs), cython.typeof(ch.runs))
m.add("created_ns", &ch.created_ns, sizeof(ch.created_ns), cython.typeof(ch.created_ns))
_register("cxl_chan_header", sizeof(ch), m)

cdef cxl_chan_claim cc
m = _begin(&cc)
m.add("epoch", &cc.epoch, sizeof(cc.epoch), cython.typeof(cc.epoch))
m.add("run", &cc.run, sizeof(cc.run), cython.typeof(cc.run))
m.add("src", &cc.src, sizeof(cc.src), cython.typeof(cc.src))
m.add("owner", &cc.owner, sizeof(cc.owner), cython.typeof(cc.owner))
m.add("incarnation", &cc.incarnation, sizeof(cc.incarnation), cython.typeof(cc.incarnation))
m.add("start", &cc.start, sizeof(cc.start), cython.typeof(cc.start))
m.add("pidns", &cc.pidns, sizeof(cc.pidns), cython.typeof(cc.pidns))
m.add("boot", &cc.boot, sizeof(cc.boot), cython.typeof(cc.boot))
_register("cxl_chan_claim", sizeof(cc), m)

cdef cxl_chan_run cr
m = _begin(&cr)
m.add("seq", &cr.seq, sizeof(cr.seq), cython.typeof(cr.seq))
m.add("run", &cr.run, sizeof(cr.run), cython.typeof(cr.run))
m.add("base", &cr.base, sizeof(cr.base), cython.typeof(cr.base))
m.add("src", &cr.src, sizeof(cr.src), cython.typeof(cr.src))
m.add("flags", &cr.flags, sizeof(cr.flags), cython.typeof(cr.flags))
m.add("epoch", &cr.epoch, sizeof(cr.epoch), cython.typeof(cr.epoch))
m.add("reserved", &cr.reserved, sizeof(cr.reserved), cython.typeof(cr.reserved))
_register("cxl_chan_run", sizeof(cr), m)

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
