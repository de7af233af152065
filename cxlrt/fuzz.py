"""Fuzzer of region images (issue 9): corrupt a region, then use it.

Every open, lookup, load, store, alloc, free, recv and check on a corrupted image
must end in a Python exception: never a signal, never a hang.

Seeds: two small regions (three nodes, 704 KiB: the minimum for three nodes plus
the six chunks the seed's objects and one image's allocations need), built in a
child process so that every pid they record is dead: allocations from every
node, a large run, a queued remote free, directory names, a ``KVCache`` with five
stored blocks, a ``Channel`` with two messages in flight, a bakery and a manager
lock. ``clean`` closes everything (heartbeats 0: detached nodes); ``crashed``
leaves with ``os._exit`` (stale heartbeats, channel roles and a pinned hit held
by a dead process).

Images: each applies 1 to 4 seeded mutations to a copy of a seed, aimed at the
fields of the superblock, node areas, lock records, directory, chunk table and
small-chunk headers, remote-free queues, KV index (geometry, layout, entries,
pins), payload headers and channel lines: boundary values (0, 2**63, 2**64-1,
the region size and just past it, counts like 504), other objects' offsets, bit
flips, nudges, a copied line, random bytes, a truncated file. A mutation is
often followed by a fix-up of the check word that guards its field (superblock
and KV header checksums, KV entry check words, even directory generations), so
that the corruption reaches the code behind the check.

Operations: a worker process writes the image to a file in /dev/shm and runs, in
order: open as a node, names/get, the user locks (with a timeout), alloc/free,
put/delete, KVCache attach/lookup/load/views/store/stats, Channel
attach/recv/send/pending/close, close, ``cxlrt.check.check`` and ``cxlrt.inspect``.
Any exception is a pass (counted by type and operation). The parent watches:

- a worker killed by a signal is a *crash*: the image, its mutations, the
  operation and the worker's faulthandler stack go to ``OUT/crashes/``, and a new
  worker takes the next image;
- a worker silent for ``--timeout`` seconds on one image is a *hang*: the parent
  dumps its Python stacks (SIGUSR1, faulthandler) and its C stacks (gdb, when
  installed: Cython frames show only there), kills it and saves the case the same
  way.

``python -X faulthandler -m cxlrt.fuzz --replay DIR`` replays a saved case in one
process; ``--minimize DIR`` drops the mutations it does not need.

Feedback: there is no coverage of the compiled code to follow (atheris sees only
Python bytecode, and instrumenting the extensions needs clang, which this build
does not use), so the guidance is by outcome: an image whose operations end in a
way never seen before (an exception type, or an error message once its numbers
are blanked out, per operation) joins a corpus, and half of the later images
stack one or two more mutations on a corpus entry. Images are made in batches
from the corpus as it stood after the previous batch, so a run is a function of
``--seed`` whatever ``--jobs`` is, up to what timing decides (heartbeat ages, lease
gaps, LRU ties between blocks used in the same millisecond).

Locks: ``Lock.acquire`` takes a timeout, but the acquisitions inside ``alloc``,
``free``, ``put``, ``KVCache.store``, channel role claims and lock creation have
none. A corrupt ticket on the line of a node that is not alive stops counting
(liveness.pxd), so these operations must end by themselves: by default nothing
guards them, and a wedge is a hang. ``--guard`` first tries every lock those
operations take with a short timeout and skips an operation whose lock is wedged
(counted as ``GuardTimeout``), to look past a known wedge while another is fixed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cxlrt import layoutinfo as _layout
from cxlrt.alloc import table_word
from cxlrt.kvcache import line_check
from cxlrt.kvformat import header_checksum
from cxlrt.superblock import checksum as sb_checksum

NODES = 3
EXTRA_CHUNKS = 6          # heap chunks beyond the minimum region's, for the seed's objects
# The seed's nodes are dead (silent past the lease) when fuzzing starts. Short, so that
# the liveness waits of an image (a takeover at open, the survey of `check`) cost
# milliseconds: at 0.25 s they were most of an image's time (issue 9's note).
LEASE_S = 0.02
KV_NAME = "fuzz"
KV_ARGS = {"block_bytes": 192, "capacity_blocks": 8, "block_tokens": 4, "salt": b"fuzz"}
KV_TOKENS = 36            # 9 keys: 5 stored in the seed, 4 more stored by each image
CHAN_NAME = "fuzz"
CHAN_SLOTS = 4
CHAN_MSG = 100
LEASE_MAX_MS = 100        # leases the fuzzer writes stay short too (see new_mutations)
# A manager-mode lock with no manager (the seed's manager is dead, or a mutated mode)
# raises NoLockManager after this; the library's 3 s would let two such operations
# overrun the per-image watchdog.
MANAGER_WAIT_S = 0.2
GUARD_TIMEOUT_S = 0.02    # how long the lock guard waits for a lock before calling it wedged
OP_TIMEOUT_S = 0.01       # recv/send timeouts inside an image
STARTUP_S = 120.0         # a worker that does not start within this is a broken harness
SLOW_OP_MS = 1000         # an operation this slow is listed (a loop bounded by a corrupt count?)
SEED_MODES = ("clean", "crashed")
SEED_TRIES = 5           # builds of a seed that may end in LeaseLost on a loaded machine


class GuardTimeout(Exception):
    """The lock guard found a lock that an operation would wait on for ever."""


# --- the seed region --------------------------------------------------------------------


def _kv_keys():
    from cxlrt.hashing import block_hashes
    return block_hashes(list(range(KV_TOKENS)), KV_ARGS["block_tokens"], salt=KV_ARGS["salt"])


def seed_size() -> int:
    """Bytes of the seed region: the minimum for NODES nodes plus EXTRA_CHUNKS chunks."""
    from cxlrt import superblock as sb
    return sb.min_size(NODES) + EXTRA_CHUNKS * sb.CHUNK


def _build_seed(path: str, mode: str) -> None:
    """Make the seed region at `path` and its description at `path`.json (run in a child,
    so that every pid recorded in the region is dead by the time images are fuzzed).

    ``clean`` closes everything (heartbeats 0: detached nodes); ``crashed`` leaves with
    os._exit: heartbeats stale, channel roles and one KV hit still held by a dead pid.
    """
    import numpy as np

    import cxlrt
    from cxlrt import superblock as sb
    from cxlrt.lock import read_header, record_offset
    spec = "file:" + path
    rs = [cxlrt.open(spec, node=0, create=True, size=seed_size(), nodes=NODES, lease=LEASE_S)]
    rs += [cxlrt.open(spec, node=n) for n in range(1, NODES)]
    kvs = [cxlrt.KVCache(r, KV_NAME, **KV_ARGS) for r in rs]
    keys = _kv_keys()
    kvs[1].store(keys[:3], np.full((3, KV_ARGS["block_bytes"]), 7, np.uint8))
    kvs[2].store(keys[3:5], np.full((2, KV_ARGS["block_bytes"]), 9, np.uint8))
    hit = kvs[0].lookup(keys)
    assert len(hit) == 5, len(hit)
    objs = {"obj/a": rs[1].alloc(200), "obj/b": rs[2].alloc(70000), "obj/c": rs[0].alloc(200)}
    rs[1].put("obj/a", objs["obj/a"])
    rs[2].put("obj/b", objs["obj/b"])
    rs[0].put("obj/c", objs["obj/c"])
    queued = rs[2].alloc(200)
    rs[0].free(queued)  # node 2's object freed by node 0: an entry in node 2's queue
    prod = cxlrt.Channel(rs[0], CHAN_NAME, slots=CHAN_SLOTS, msg_bytes=CHAN_MSG)
    cons = cxlrt.Channel(rs[1], CHAN_NAME, slots=None, msg_bytes=None)
    for i in range(3):
        prod.send(bytes([65 + i]) * (1 + 40 * i))
    assert cons.recv(timeout=1.0) == b"A"
    rs[0].lock("fuzz.mgr", mode="manager")
    rs[0].lock("fuzz.lock")
    r = rs[0]
    heap_off, heap_len = r.sections["heap"]
    alloc_off = r.sections["alloc"][0]
    nchunks = heap_len // sb.CHUNK
    table = [r.load64(alloc_off + _WORD * k) for k in range(nchunks)]
    kv = kvs[0]
    entries = [e["slot"] for e in kv.entries()]
    meta: dict[str, Any] = {
        "mode": mode, "size": r.size, "nodes": r.nodes, "sections": r.sections,
        "locks": [(i, read_header(r, i)[0], record_offset(r, i))
                  for i in range(64) if read_header(r, i) is not None],
        "dir": {name: r.get(name) for name in r.names()},
        "alloc": {"table": alloc_off, "nchunks": nchunks,
                  "rfree": alloc_off + sb.rfree_offset(nchunks), "words": table,
                  "small": [heap_off + k * sb.CHUNK for k, w in enumerate(table)
                            if table_word(w)[0] == _SMALL_KIND]},
        "kv": {"off": kv.offset, "slots": kv.slots, "entries": kv.slot_offset(0),
               "used": [kv.slot_offset(s) for s in entries],
               "payloads": [e["offset"] for e in kv.entries()],
               "pins": kv.slot_offset(0) + kv.slots * _KV_ENTRY,
               "stats": kv.slot_offset(0) + kv.slots * _KV_ENTRY + NODES * kv.slots * _WORD},
        "chan": {"off": prod.offset, "ring": prod.ring_offset, "slot_bytes": prod.slot_bytes,
                 "slots": prod.slots},
        "objs": objs, "queued": queued,
    }
    with open(path + ".json", "w") as f:
        json.dump(meta, f)
    if mode == "crashed":
        os._exit(0)  # no close: stale heartbeats, held roles, a pinned hit
    hit.release()
    prod.close()
    cons.close()
    for k in kvs:
        k.close()
    for r in rs:
        r.close()


@dataclass
class Seed:
    """A seed image, its description and the fields the mutator aims at."""

    name: str
    image: bytes
    meta: dict
    targets: dict = field(default_factory=dict)   # group -> [(label, offset, width)]


def make_seeds(folder: str) -> dict[str, Seed]:
    """Build (in child processes) and load both seed images into `folder`."""
    os.makedirs(folder, exist_ok=True)
    out = {}
    for mode in SEED_MODES:
        path = os.path.join(folder, f"{mode}.img")
        for p in (path, path + ".json"):
            if os.path.exists(p):
                os.unlink(p)
        # A seed is built with the seed's short lease (LEASE_S): on a loaded machine the
        # builder itself can be silent past it and get LeaseLost, which is the lock
        # telling the truth, not a fuzz finding. Build again, a few times, then give up.
        for attempt in range(SEED_TRIES):
            env = dict(os.environ, CXLRT_LOCAL_DIR=tempfile.mkdtemp(prefix="cxlrt-fuzz-seed-"))
            try:
                p = subprocess.run([sys.executable, "-m", "cxlrt.fuzz", "--build-seed", path,
                                    "--seed-mode", mode], env=env, timeout=120,
                                   capture_output=True, text=True)
            finally:
                shutil.rmtree(env["CXLRT_LOCAL_DIR"], ignore_errors=True)
            if p.returncode == 0:
                break
            if "LeaseLost" not in p.stderr or attempt == SEED_TRIES - 1:
                raise RuntimeError(f"building the {mode} seed failed (exit {p.returncode}):\n"
                                   + p.stderr[-2000:])
        out[mode] = load_seed(folder, mode)
    return out


def load_seed(folder: str, mode: str) -> Seed:
    path = os.path.join(folder, f"{mode}.img")
    with open(path, "rb") as f:
        image = f.read()
    with open(path + ".json") as f:
        meta = json.load(f)
    s = Seed(mode, image, meta)
    s.targets = _targets(meta)
    return s


_WORD = 8  # chunk-table, bitmap, pin and stats words are uint64_t (layout.pxd, kvcache.pxd)
_LINE = _layout.CONSTANTS["CXL_LINE_SIZE"]
_SMALL_KIND = _layout.CONSTANTS["CXL_CK_SMALL"]


def _members(label, struct_name, base, *names):
    """(label.member, offset, width) of the named members of `struct_name` at `base`
    (default: every member but the reserved ones), offsets from cxlrt.layoutinfo. An
    array or nested struct is aimed at word by word; a char array at its first word."""
    out = []
    for f in _layout.fields(struct_name):
        if names and f.name not in names or not names and f.name.startswith("reserved"):
            continue
        if f.format[-1] == "s" or f.format in ("Q", "I", "H", "B"):
            out.append((f"{label}.{f.name}", base + f.offset, min(f.width, _WORD)))
        else:
            out += [(f"{label}.{f.name}[{i}]", base + f.offset + i * _WORD, _WORD)
                    for i in range(f.width // _WORD)]
    return out


def _targets(m: dict) -> dict[str, list[tuple[str, int, int]]]:
    """Every field worth corrupting, grouped by the structure it belongs to."""
    size = _layout.size
    t: dict[str, list[tuple[str, int, int]]] = {}
    t["superblock"] = _members("sb", "cxl_superblock", 0)
    nodes_off = m["sections"]["nodes"][0]
    t["nodes"] = [f for n in range(m["nodes"])
                  for f in _members(f"node{n}", "cxl_node_area", nodes_off
                                    + n * size("cxl_node_area"))]
    locks_off = m["sections"]["locks"][0]
    lk = _members("mgrclaim", "cxl_mgr_claim", locks_off)
    record = size("cxl_lock_header") + m["nodes"] * size("cxl_lock_node_line") \
        + size("cxl_lock_grant_line")
    for i, name, rec in m["locks"]:
        lk += _members(f"lock{i}", "cxl_lock_header", rec)
        for j in range(m["nodes"]):
            lk += _members(f"lock{i}({name}).node{j}", "cxl_lock_node_line",
                           rec + size("cxl_lock_header") + j * size("cxl_lock_node_line"))
        lk += _members(f"lock{i}", "cxl_lock_grant_line", rec + record
                       - size("cxl_lock_grant_line"))
    free_rec = locks_off + size("cxl_mgr_claim") + (len(m["locks"]) + 1) * record
    lk += _members("lockfree", "cxl_lock_header", free_rec, "state", "mode", "name_len")
    t["locks"] = lk
    dir_off = m["sections"]["directory"][0]
    used = len(m["dir"])
    t["directory"] = [f for i in range(used + 2)
                      for f in _members(f"dir{i}", "cxl_dir_entry",
                                        dir_off + i * size("cxl_dir_entry"), "state", "off",
                                        "name_len", "generation", "name")]
    a = m["alloc"]
    al = [(f"table{k}", a["table"] + _WORD * k, _WORD) for k in range(a["nchunks"])]
    for n in range(m["nodes"]):
        al += _members(f"rfree{n}", "cxl_rfree_queue", a["rfree"] + n * size("cxl_rfree_queue"),
                       "head", "count", "seq", "jword", "jcount")
    bitmap = size("cxl_small_header")  # the slot bitmap follows the header
    for base in a["small"]:
        al += _members(f"small@{base:#x}", "cxl_small_header", base)
        al += [(f"small@{base:#x}.bitmap{i}", base + bitmap + i * _WORD, _WORD) for i in (0, 1)]
    t["alloc"] = al
    kv = m["kv"]
    kl = _members("kv.geo", "kv_geometry", kv["off"] + _layout.offset("kv_header", "geometry"))
    kl += _members("kv.layout", "kv_layout", kv["off"] + _layout.offset("kv_header", "layout"))
    kl += _members("kv.occupancy", "kv_counters",
                   kv["off"] + _layout.offset("kv_header", "counters"))
    empty = [kv["entries"] + size("kv_entry") * s for s in range(kv["slots"])]
    for at in kv["used"] + [e for e in empty if e not in kv["used"]][:2]:
        kl += _members(f"kv.entry@{at:#x}", "kv_entry", at)
    for n in range(m["nodes"]):
        kl += [(f"kv.pins.node{n}.slot{s}", kv["pins"] + _WORD * (n * kv["slots"] + s), _WORD)
               for s in range(0, kv["slots"], 3)]
        kl += [(f"kv.stats.node{n}", kv["stats"] + _LINE * n, _WORD)]
    t["kv"] = kl
    t["payload"] = [f for p in kv["payloads"]
                    for f in _members(f"payload@{p:#x}", "kv_payload_header", p)]
    c = m["chan"]
    claim = c["off"] + size("cxl_chan_header")
    cl = _members("chan.hdr", "cxl_chan_header", c["off"])
    cl += _members("chan.prod", "cxl_chan_claim", claim)
    cl += _members("chan.cons", "cxl_chan_claim", claim + size("cxl_chan_claim"))
    cl += [(f"chan.slot{i}.len", c["ring"] + i * c["slot_bytes"], _WORD)
           for i in range(c["slots"])]
    t["channel"] = cl
    return t


# --- mutations --------------------------------------------------------------------------
#
# A mutation is a JSON list, applied in order to a copy of the seed image:
#   ["w", off, width, value, label]   store `value` little-endian in `width` bytes
#   ["b", off, hexbytes, label]       overwrite raw bytes
#   ["fix", kind, off]                recompute a check word so the corruption gets past it:
#                                     "sb" superblock checksum, "kvhdr" KV header checksum,
#                                     "kventry" KV entry check word, "dirgen" even generation
#   ["len", n]                        truncate or extend the image to n bytes

# Where the check words are that a "fix" recomputes (the checksum covers what precedes it).
_SB_SUM = _layout.offset("cxl_superblock", "checksum")
_KV_SUM = _layout.offset("kv_header", "layout") + _layout.offset("kv_layout", "checksum")
_KV_ENTRY = _layout.size("kv_entry")
_KV_CHECK = _layout.offset("kv_entry", "check")
_DIR_ENTRY = _layout.size("cxl_dir_entry")
_DIR_GEN = _layout.offset("cxl_dir_entry", "generation")


def apply(image: bytes, muts: list) -> bytearray:
    """A copy of `image` with `muts` applied in order."""
    img = bytearray(image)
    for m in muts:
        kind = m[0]
        if kind == "w":
            _, off, width, value = m[:4]
            if 0 <= off <= len(img) - width:
                img[off:off + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        elif kind == "b":
            raw = bytes.fromhex(m[2])
            if 0 <= m[1] <= len(img) - len(raw):
                img[m[1]:m[1] + len(raw)] = raw
        elif kind == "fix":
            _fix(img, m[1], m[2])
        elif kind == "len":
            n = m[1]
            del img[n:]
            img.extend(bytes(max(0, n - len(img))))
    return img


def _fix(img: bytearray, kind: str, off: int) -> None:
    if kind == "sb" and len(img) >= _SB_SUM + 8:
        img[_SB_SUM:_SB_SUM + 8] = sb_checksum(bytes(img[:_SB_SUM + 8])).to_bytes(8, "little")
    elif kind == "kvhdr" and 0 <= off <= len(img) - _KV_SUM - 8:
        at = off + _KV_SUM
        img[at:at + 8] = header_checksum(bytes(img[off:at])).to_bytes(8, "little")
    elif kind == "kventry" and 0 <= off <= len(img) - _KV_ENTRY:
        at = off + _KV_CHECK
        img[at:at + 8] = line_check(bytes(img[off:at])).to_bytes(8, "little")
    elif kind == "dirgen" and 0 <= off <= len(img) - _DIR_GEN - 8:
        gen = struct.unpack_from("<Q", img, off + _DIR_GEN)[0]
        struct.pack_into("<Q", img, off + _DIR_GEN, gen & ~1)


def _label(m: list) -> str:
    """A mutation in words: "lock1(cxlrt.alloc).node2.number = 0xffffffffffffffff"."""
    if m[0] == "w":
        return f"{m[4]} @{m[1]:#x} = {m[3]:#x}"
    if m[0] == "b":
        return f"{m[3]} <- {len(m[2]) // 2} bytes"
    if m[0] == "fix":
        return f"fix {m[1]} @{m[2]:#x}"
    return f"length = {m[1]}"


def _interesting(rng: random.Random, old: int, width: int, seed: Seed) -> int:
    """A value for a `width`-byte field that held `old`: boundaries, offsets, nudges."""
    size = seed.meta["size"]
    heap_off, heap_len = seed.meta["sections"]["heap"]
    top = (1 << (8 * width)) - 1
    choices = [
        lambda: 0, lambda: 1, lambda: 2, lambda: 3, lambda: 0x7F, lambda: 0xFF, lambda: 0xFFFF,
        lambda: (1 << 31) - 1, lambda: 1 << 31, lambda: (1 << 32) - 1, lambda: 1 << 32,
        lambda: (1 << 63) - 1, lambda: 1 << 63, lambda: top, lambda: top - 1,
        lambda: size, lambda: size - 1, lambda: size - 8, lambda: size - 64, lambda: size + 64,
        lambda: size + 4096, lambda: heap_off, lambda: heap_off + heap_len,
        lambda: heap_off + heap_len - 64, lambda: rng.randrange(0, size, 64),
        lambda: rng.randrange(0, size), lambda: rng.choice(list(seed.meta["dir"].values())),
        lambda: old + 1, lambda: old - 1, lambda: old + 64, lambda: old - 64, lambda: old * 2,
        lambda: old ^ (1 << rng.randrange(8 * width)), lambda: old | (1 << 63),
        lambda: rng.getrandbits(8 * width), lambda: 64, lambda: 504, lambda: 505,
        lambda: 4096, lambda: 65535, lambda: 65536, lambda: 1 << 62,  # 1 << 62 ns: year 2116
        lambda: (old & ~0xFF) | rng.randrange(256),
    ]
    return rng.choice(choices)() & top


_FIXUPS = {"superblock": ("sb", 0.8), "kv": ("kvhdr", 0.6), "directory": ("dirgen", 0.6)}


def new_mutations(rng: random.Random, seed: Seed, count: int) -> list:
    """`count` fresh structure-aware mutations of `seed`."""
    muts: list = []
    image = seed.image
    groups = sorted(seed.targets)
    for _ in range(count):
        roll = rng.random()
        if roll < 0.04:  # havoc: random bytes somewhere in the metadata or the used heap
            end = seed.meta["sections"]["heap"][0] + 7 * 65536
            off = rng.randrange(0, min(end, len(image)) - 8)
            raw = bytes(rng.getrandbits(8) for _ in range(rng.choice((1, 2, 8, 64))))
            muts.append(["b", off, raw.hex(), f"havoc@{off:#x}"])
            continue
        if roll < 0.06:  # copy one 64-byte line over another (structure confusion)
            src = rng.randrange(0, len(image) // 64) * 64
            dst = rng.choice([off for g in groups for _, off, _ in seed.targets[g]]) // 64 * 64
            muts.append(["b", dst, image[src:src + 64].hex(), f"line@{src:#x}->{dst:#x}"])
            continue
        if roll < 0.065:
            n = rng.choice((0, 100, 4096, len(image) // 2, len(image) - 4096,
                            len(image) + 4096))
            muts.append(["len", n])
            continue
        group = rng.choice(groups)
        label, off, width = rng.choice(seed.targets[group])
        if rng.random() < 0.15:  # flip one bit
            old = int.from_bytes(image[off:off + width], "little")
            value = old ^ (1 << rng.randrange(8 * width))
        else:
            old = int.from_bytes(image[off:off + width], "little")
            value = _interesting(rng, old, width, seed)
        if label == "sb.lease_ms" and value > LEASE_MAX_MS:
            # A longer lease is a valid configuration whose liveness waits (watching a
            # silent node for a lease) outlast the watchdog by design: not a hang.
            value = 1 + value % LEASE_MAX_MS
        muts.append(["w", off, width, value, label])
        if group == "kv" and label.startswith("kv.entry@"):
            # Mostly with a valid check word: without one, every reader of the slot
            # retries for ~50 ms and then raises, which a few images show well enough.
            if rng.random() < 0.85:
                muts.append(["fix", "kventry", off // _KV_ENTRY * _KV_ENTRY])
        elif group in _FIXUPS:
            kind, p = _FIXUPS[group]
            if rng.random() < p:
                base = {"sb": 0, "kvhdr": seed.meta["kv"]["off"],
                        "dirgen": off - (off - seed.meta["sections"]["directory"][0])
                        % _DIR_ENTRY}[kind]
                muts.append(["fix", kind, base])
    return muts


# --- the worker: run the operations on one image ----------------------------------------


_TIMING = frozenset({"LockTimeout", "GuardTimeout", "LeaseLost", "TimeoutError"})


def _norm(msg: str) -> str:
    """An error message with numbers and offsets blanked: one feature per message kind."""
    return re.sub(r"0x[0-9a-fA-F]+|\d+", "N", msg)[:160]


class _Runner:
    """Runs the image operations in order, recording how each ended and how long it took."""

    def __init__(self, path: str, case: dict, report_op) -> None:
        self.path = path
        self.spec = "file:" + path
        self.case = case
        self.report_op = report_op
        self.out: dict[str, str] = {}
        self.msgs: dict[str, str] = {}
        self.ms: dict[str, float] = {}
        self.wedged: set[str] = set()
        self.lock_table: dict[str, tuple[int, int]] = {}

    def op(self, name: str, fn, *args, **kw):
        self.report_op(name)
        t = time.perf_counter()
        try:
            v = fn(*args, **kw)
        except Exception as e:  # every exception is a pass; only signals and hangs fail
            self.out[name] = type(e).__name__
            # The image's path differs from worker to worker: out of the message.
            self.msgs[name] = str(e).replace(self.path, "IMAGE")[:300]
            v = None
        else:
            self.out.setdefault(name, "ok")
        self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t) * 1000
        return v

    def needs(self, *locks: str) -> None:
        bad = self.wedged.intersection(locks)
        if bad:
            raise GuardTimeout(f"lock(s) {', '.join(sorted(bad))} did not come free within "
                               f"{GUARD_TIMEOUT_S} s: the operation would wait for ever")

    def run(self) -> dict:
        import cxlrt
        import cxlrt.lock
        from cxlrt import check as _check
        cxlrt.lock.MANAGER_WAIT_S = MANAGER_WAIT_S
        case = self.case
        if case.get("inject"):
            self.op("inject", _inject, case["inject"])
        r = self.op("open", cxlrt.open, self.spec, node=case["node"])
        if r is not None:
            try:
                self._region_ops(r, case.get("guard", True))
            finally:
                self.op("close", r.close)
        self.op("check", _check.check, self.spec)
        self.op("inspect", cxlrt.inspect, self.spec)
        return {"ops": self.out, "msgs": self.msgs, "ms": self.ms}

    def _scan_locks(self, r) -> None:
        """Read the lock table once into {name: (index, mode)}; a corrupt record raises,
        after the others have been read (the guard still needs them)."""
        from cxlrt import RegionError
        from cxlrt.lock import read_header
        bad = None
        for i in range(64):
            try:
                h = read_header(r, i)
            except RegionError as e:
                bad = bad or e
                continue
            if h is not None:
                self.lock_table.setdefault(h[0], (i, h[1]))
        if bad is not None:
            raise bad

    def _lock(self, r, name: str):
        from cxlrt.lock import Lock
        svc = r.locks
        if name in ("meta", "alloc"):
            return svc.builtin(0 if name == "meta" else 1)
        i, mode = self.lock_table[name]
        return Lock(svc, i, name, mode)

    def _guard(self, r) -> None:
        """Find the locks this image's operations would wait on for ever.

        ``r.locks`` may fail once and then succeed (a corrupt record read while the
        node-local file was new), and the operations after us retry it the same way,
        so the guard does too. A lock it cannot even reach is left to the operation,
        which will fail to reach it as well.
        """
        from cxlrt import RegionError
        try:
            svc = r.locks
        except RegionError:
            svc = r.locks  # the second attach of the LockService
        del svc
        for name in ("meta", "alloc", "kv:" + KV_NAME, "cxlrt.channel"):
            try:
                if name in ("meta", "alloc") or name in self.lock_table:
                    lock = self._lock(r, name)
                elif "meta" in self.wedged:  # created on first use, under the meta lock
                    self.wedged.add(name)
                    continue
                else:  # create it now, as its first user would: a reused record may
                    lock = r.lock(name)  # still hold another node's ticket
            except RegionError:
                continue  # the operation will fail to reach the lock the same way
            if lock.acquire(timeout=GUARD_TIMEOUT_S):
                lock.release()
            else:
                self.wedged.add(name)

    def _region_ops(self, r, guard: bool) -> None:
        import cxlrt
        names = self.op("names", r.names) or []
        self.op("get", _get_all, r, names)
        self.op("lock", self._scan_locks, r)
        if guard:
            self.op("guard", self._guard, r)
        self.op("lock", self._try_locks, r)
        if not (guard and "alloc" in self.wedged):
            # (with the alloc lock wedged, the allocator is never made: its heartbeat
            # drain would wait for ever)
            self.op("alloc", self._alloc, r)
            self.op("free", self._free, r)
        self.op("put", self._put, r)
        kv = self.op("kv.attach", self._kv_attach, r)
        if kv is not None:
            keys = _kv_keys()
            hit = self.op("kv.lookup", kv.lookup, keys)
            if hit is not None:
                if len(hit):
                    self.op("kv.load", _load_and_view, kv, hit)
                self.op("kv.lookup", hit.release)
            self.op("kv.store", self._kv_store, kv, keys)
            self.op("kv.stats", lambda: (kv.stats(), kv.entries(), kv.close()))
        ch = self.op("chan.attach", cxlrt.Channel, r, CHAN_NAME, slots=None, msg_bytes=None,
                     create=False)
        if ch is not None:
            self.op("chan.recv", self._recv, ch)
            self.op("chan.send", self._send, ch)
            self.op("chan.pending", ch.pending)
            self.op("chan.close", self._chan_close, ch)

    def _try_locks(self, r) -> None:
        """Take the seed's user locks with a timeout: a corrupt record is a LockTimeout."""
        from cxlrt.lock import LockTimeout
        for name in ("fuzz.lock", "fuzz.mgr"):
            if name not in self.lock_table:
                continue
            lock = self._lock(r, name)
            manager = lock.mode == "manager"  # no lock manager runs: it times out
            if lock.acquire(timeout=0 if manager else GUARD_TIMEOUT_S):
                lock.release()
            elif not manager:
                raise LockTimeout(f"{name}: not acquired within {GUARD_TIMEOUT_S} s")

    def _alloc(self, r) -> None:
        self.needs("alloc")
        offs = [r.alloc(n) for n in (200, 1000, 70000)]
        for off in offs:
            r.free(off)

    def _free(self, r) -> None:
        self.needs("alloc")
        for off in self.case.get("free", []):
            r.free(off)

    def _put(self, r) -> None:
        self.needs("meta")
        r.put("fuzz/new", r.heap[0])
        r.delete("fuzz/new")

    def _kv_attach(self, r):
        import cxlrt
        for name in ("kv:" + KV_NAME, "kvp:" + KV_NAME):
            if name not in self.lock_table:
                self.needs("meta")  # the lock record is created on first use
        if self.case.get("kv_recorded"):  # the geometry the region records, whatever it is
            args = dict(KV_ARGS, block_bytes=None, capacity_blocks=None)
            return cxlrt.KVCache(r, KV_NAME, create=False, **args)
        return cxlrt.KVCache(r, KV_NAME, create=False, **KV_ARGS)

    def _kv_store(self, kv, keys) -> None:
        import numpy as np
        self.needs("kv:" + KV_NAME, "alloc")
        # Blocks of the size the cache says it holds (a corrupt but checksummed header
        # may say anything: past 1 MiB, the usual size, and store() refuses them).
        bb = kv.block_bytes if kv.block_bytes <= 1 << 20 else KV_ARGS["block_bytes"]
        kv.store(keys[5:], np.full((len(keys) - 5, bb), 3, np.uint8))
        with kv.lookup(keys) as hit:
            if len(hit):
                kv.load(hit)

    def _recv(self, ch) -> None:
        self.needs("cxlrt.channel")
        ch.recv(timeout=OP_TIMEOUT_S)
        ch.try_recv()

    def _send(self, ch) -> None:
        self.needs("cxlrt.channel")
        ch.send(b"fuzz message", timeout=OP_TIMEOUT_S)

    def _chan_close(self, ch) -> None:
        self.needs("cxlrt.channel")
        ch.close()


def _load_and_view(kv, hit) -> None:
    kv.load(hit)
    for v in kv.views(hit):  # zero-copy: touch both ends of every view
        v[0], v[-1]


def _get_all(r, names) -> None:
    for n in list(names)[:8]:
        r.get(n)
    try:
        r.get("fuzz/missing")
    except KeyError:
        pass


def _inject(kind: str) -> None:
    """Test hook: a deliberately broken operation the harness must catch."""
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "hang":
        time.sleep(3600)


def _clear_dir(path: str) -> None:
    with os.scandir(path) as it:
        for e in it:
            os.unlink(e.path)


def worker_main(out_dir: str, local: str) -> int:
    """Read cases from stdin (JSON lines), run each, answer on stdout.

    ``READY`` once started, ``S op`` before each operation, ``R {...}`` after the
    image. Dies only of a signal. `local` (made by the parent, which removes it) is
    the node-local folder, emptied before each image; the image file is `local`.img.
    """
    import faulthandler
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["CXLRT_LOCAL_DIR"] = local
    img_path = local + ".img"
    seeds = {m: load_seed(os.path.join(out_dir, "seeds"), m) for m in SEED_MODES}
    # Imported before the first image, so that their time is not the image's.
    import numpy  # noqa: F401

    import cxlrt  # noqa: F401
    out = sys.stdout.buffer
    base_threads = threading.active_count()

    def report_op(name: str) -> None:
        out.write(f"S {name}\n".encode())
        out.flush()

    fd = os.open(img_path, os.O_RDWR | os.O_CREAT, 0o600)
    out.write(b"READY\n")  # the parent's watchdog starts with the first image, not before
    out.flush()
    try:
        for line in sys.stdin.buffer:
            case = json.loads(line)
            img = apply(seeds[case["seed"]].image, case["muts"])
            os.ftruncate(fd, len(img))
            os.pwrite(fd, img, 0)
            _clear_dir(local)
            t0 = time.perf_counter()
            res = _Runner(img_path, case, report_op).run()
            res["t"] = time.perf_counter() - t0
            res["i"] = case["i"]
            # A LockService whose attach failed may keep beating until its next beat
            # finds the region closed (lease/8): wait that long before calling it a leak.
            res["stray"] = threading.active_count() - base_threads
            deadline = time.monotonic() + LEASE_S
            while threading.active_count() > base_threads and time.monotonic() < deadline:
                time.sleep(0.005)
            res["leak"] = threading.active_count() - base_threads
            if res["leak"] > 0:
                res["threads"] = sorted(t.name for t in threading.enumerate())
            out.write(b"R " + json.dumps(res).encode() + b"\n")
            out.flush()
    finally:
        os.close(fd)
    return 0


# --- the parent -------------------------------------------------------------------------


class _Worker:
    def __init__(self, out_dir: str, k: int) -> None:
        self.k = k
        self.err_path = os.path.join(out_dir, "workers", f"w{k}.err")
        os.makedirs(os.path.dirname(self.err_path), exist_ok=True)
        self.err = open(self.err_path, "ab")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.local = tempfile.mkdtemp(prefix="cxlrt-fuzz-local-", dir=shm)
        self.p = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "cxlrt.fuzz", "--worker", out_dir,
             "--local", self.local],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, bufsize=0)
        self.buf = b""
        self.ready = False
        self.case: dict | None = None
        self.op = ""
        self.since = time.monotonic()  # until ready: when it started
        self.err_at = 0

    def send(self, case: dict) -> None:
        self.case = case
        self.op = "start"
        self.since = time.monotonic()
        self.err.flush()
        self.err_at = os.path.getsize(self.err_path)
        try:
            self.p.stdin.write(json.dumps(case).encode() + b"\n")
        except BrokenPipeError:
            pass  # it died between images: its stdout's end reports it (op "start")

    def lines(self) -> list[bytes]:
        chunk = os.read(self.p.stdout.fileno(), 1 << 16)
        if not chunk:
            return [b""]  # EOF: the worker is gone
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return done

    def stderr_since(self) -> str:
        with open(self.err_path, "rb") as f:
            f.seek(self.err_at)
            return f.read().decode("utf-8", "replace")

    def kill(self, grace: float = 0.0) -> int:
        """Stop the worker (after `grace` seconds to finish on its own) and clean up."""
        if grace:
            try:
                self.p.stdin.close()  # end of cases: it leaves its loop
                self.p.wait(grace)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            self.p.kill()
        except ProcessLookupError:
            pass
        rc = self.p.wait()
        for s in (self.p.stdin, self.p.stdout):
            try:
                s.close()
            except OSError:
                pass
        self.err.close()
        shutil.rmtree(self.local, ignore_errors=True)
        try:
            os.unlink(self.local + ".img")
        except FileNotFoundError:
            pass
        return rc


@dataclass
class Report:
    images: int = 0
    seconds: float = 0.0
    crashes: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    by_type: collections.Counter = field(default_factory=collections.Counter)
    by_op: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    features: int = 0
    corpus: int = 0
    leaks: list = field(default_factory=list)
    image_s: list = field(default_factory=list)
    examples: dict = field(default_factory=dict)
    op_ms: collections.Counter = field(default_factory=collections.Counter)
    slow: list = field(default_factory=list)
    stray: int = 0      # images that left a thread running past close() for a while
    interrupted: bool = False  # stopped (Ctrl-C, SIGTERM) before its last image

    @property
    def rate(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        t = sorted(self.image_s)
        q = (lambda f: round(t[min(len(t) - 1, int(f * len(t)))] * 1000, 2)) if t else None
        return {"images": self.images, "interrupted": self.interrupted,
                "seconds": round(self.seconds, 1), "images_per_s": round(self.rate, 1),
                "crashes": self.crashes, "hangs": self.hangs,
                "exceptions_by_type": dict(self.by_type.most_common()),
                "outcomes_by_op": {k: dict(v.most_common()) for k, v in sorted(self.by_op.items())},
                "features": self.features, "corpus": self.corpus, "worker_leaks": self.leaks,
                "slow_ops": self.slow, "images_with_stray_threads": self.stray,
                "image_ms_p50_p99_max": [q(0.5), q(0.99), q(1.0)] if t else None,
                "op_ms_per_image": {k: round(v / max(1, self.images), 3)
                                    for k, v in self.op_ms.most_common()},
                "examples": {f"{op} {exc}": v for (op, exc), v in sorted(self.examples.items())}}


class Fuzzer:
    """Drives `jobs` workers over `images` images made from `seed`.

    Parameters
    ----------
    out_dir : str
        Folder for the seeds, worker logs, ``crashes/`` and ``report.json``.
    timeout : float
        Seconds one image may take before its worker is declared hung.
    guard : bool
        Probe the locks un-timed operations take, and skip an operation whose lock is
        wedged (see the module docs); False lets such an operation hang.
    inject : dict, optional
        ``{image index: "segv" | "hang"}``: test hook, a broken operation on those images.
    """

    def __init__(self, out_dir: str, *, seed: int = 0, jobs: int = 1, timeout: float = 5.0,
                 guard: bool = False, inject: dict | None = None, progress: bool = True,
                 batch: int = 64) -> None:
        self.out_dir = os.path.abspath(out_dir)
        self.seed = seed
        self.jobs = max(1, jobs)
        self.timeout = timeout
        self.guard = guard
        self.inject = inject or {}
        self.progress = progress
        self.batch = batch
        self.seeds: dict[str, Seed] = {}
        self.corpus: list[dict] = []
        self.features: set = set()
        self.report = Report()

    # cases ---------------------------------------------------------------------------
    def case(self, i: int) -> dict:
        """Image `i` of this run: a pure function of (seed, i, corpus before i's batch)."""
        rng = random.Random(f"{self.seed}:{i}")
        if self.corpus and rng.random() < 0.5:
            parent = rng.choice(self.corpus)
            seed = self.seeds[parent["seed"]]
            muts = parent["muts"] + new_mutations(rng, seed, rng.choice((1, 1, 2)))
            node = parent["node"]
        else:
            seed = self.seeds[rng.choice(SEED_MODES)]
            muts = new_mutations(rng, seed, rng.choice((1, 1, 1, 2, 2, 3, 4)))
            node = rng.choice((0, 0, 1, 2))
        free = [seed.meta["objs"][rng.choice(sorted(seed.meta["objs"]))]]
        c = {"i": i, "seed": seed.name, "node": node, "muts": muts[-24:], "free": free,
             "guard": self.guard, "kv_recorded": rng.random() < 0.3}
        if i in self.inject:
            c["inject"] = self.inject[i]
        return c

    def _learn(self, case: dict, res: dict) -> None:
        new = False
        for op, outcome in res["ops"].items():
            # Outcomes that depend on timing do not steer the corpus: the run stays a
            # function of its seed.
            f = (op, "timing" if outcome in _TIMING else outcome,
                 "" if outcome in _TIMING else _norm(res["msgs"].get(op, "")))
            if f not in self.features:
                self.features.add(f)
                new = True
            if outcome != "ok" and (op, outcome) not in self.report.examples:
                self.report.examples[(op, outcome)] = {
                    "image": case["i"], "message": res["msgs"].get(op, ""),
                    "mutations": [_label(m) for m in case["muts"]]}
        if new and case["muts"]:
            self.corpus.append({"seed": case["seed"], "node": case["node"], "muts": case["muts"]})
            if len(self.corpus) > 4000:
                self.corpus.pop(random.Random(case["i"]).randrange(len(self.corpus)))

    # failures -------------------------------------------------------------------------
    def _save(self, kind: str, w: _Worker, detail: str, native: str) -> dict:
        case = w.case
        name = f"{kind}-{case['i']:08d}"
        d = os.path.join(self.out_dir, "crashes", name)
        os.makedirs(d, exist_ok=True)
        img = apply(self.seeds[case["seed"]].image, case["muts"])
        with open(os.path.join(d, "image.bin"), "wb") as f:
            f.write(img)
        stack = w.stderr_since() + native
        info = {"kind": kind, "op": w.op, "detail": detail, "run_seed": self.seed,
                "case": case, "stack": stack,
                "replay": f"python -X faulthandler -m cxlrt.fuzz --replay {d}"}
        with open(os.path.join(d, "case.json"), "w") as f:
            json.dump(info, f, indent=1)
        with open(os.path.join(d, "stack.txt"), "w") as f:
            f.write(stack)
        return {"image": case["i"], "op": w.op, "detail": detail, "dir": d,
                "mutations": [_label(m) for m in case["muts"]]}

    # the loop -------------------------------------------------------------------------
    def run(self, images: int, start: int = 0) -> Report:
        os.makedirs(self.out_dir, exist_ok=True)
        self.seeds = make_seeds(os.path.join(self.out_dir, "seeds"))
        workers = [_Worker(self.out_dir, k) for k in range(self.jobs)]
        rep = self.report
        t0 = time.monotonic()
        last = 0.0
        nxt = start
        end = start + images
        try:
            while nxt < end:
                batch = [self.case(i) for i in range(nxt, min(end, nxt + self.batch))]
                nxt += len(batch)
                results = self._run_batch(workers, batch)
                for case in batch:
                    if case["i"] in results:
                        self._learn(case, results[case["i"]])
                rep.seconds = time.monotonic() - t0
                rep.features, rep.corpus = len(self.features), len(self.corpus)
                if self.progress and (time.monotonic() - last > 2 or nxt >= end):
                    last = time.monotonic()
                    self._progress(end - start)
        except KeyboardInterrupt:
            rep.interrupted = True  # a soak stopped early still reports what it tried
        finally:
            for w in workers:
                w.kill(grace=5.0)
            rep.seconds = time.monotonic() - t0
            with open(os.path.join(self.out_dir, "report.json"), "w") as f:
                json.dump(rep.as_dict(), f, indent=1)
        return rep

    def _progress(self, total: int) -> None:
        rep = self.report
        top = ", ".join(f"{k} {v}" for k, v in rep.by_type.most_common(4))
        eta = (total - rep.images) / rep.rate if rep.rate else 0.0
        print(f"cxlrt.fuzz: {rep.images}/{total} images, {rep.rate:.1f}/s, eta {eta / 60:.0f} min, "
              f"{len(rep.crashes)} crashes, {len(rep.hangs)} hangs, corpus {rep.corpus}, "
              f"features {rep.features}; {top}", file=sys.stderr, flush=True)

    def _run_batch(self, workers: list[_Worker], batch: list[dict]) -> dict[int, dict]:
        todo = collections.deque(batch)
        results: dict[int, dict] = {}
        while todo or any(w.case is not None for w in workers):
            for w in workers:
                if w.ready and w.case is None and todo:
                    w.send(todo.popleft())
            watched = [w for w in workers if w.case is not None or not w.ready]
            now = time.monotonic()
            wait = min((w.since + (self.timeout if w.ready else STARTUP_S)) - now
                       for w in watched)
            ready, _, _ = select.select([w.p.stdout for w in watched], [], [],
                                        min(max(0.0, wait), 1.0))
            for w in watched:
                done = None
                if w.p.stdout in ready:
                    for line in w.lines():
                        if line == b"READY":
                            w.ready = True
                        elif line.startswith(b"S "):
                            w.op = line[2:].decode()
                        elif line.startswith(b"R "):
                            done = json.loads(line[2:])
                        elif line == b"":
                            done = "died"
                            break
                elif not w.ready and time.monotonic() - w.since > STARTUP_S:
                    raise RuntimeError(f"a fuzz worker did not start within {STARTUP_S} s: "
                                       f"see {w.err_path}")
                elif w.ready and time.monotonic() - w.since > self.timeout:
                    done = "hung"
                if done is None:
                    continue
                k = workers.index(w)
                if w.case is None:  # died before its first image: the harness is broken
                    raise RuntimeError(f"a fuzz worker died while starting: see {w.err_path}")
                if isinstance(done, dict):
                    results[done["i"]] = done
                    self._count(done)
                    w.case = None
                    if done["leak"] > 0:  # threads left behind (a close that failed)
                        self.report.leaks.append({"image": done["i"], "threads": done["threads"],
                                                  "ops": done["ops"]})
                        w.kill()
                        workers[k] = _Worker(self.out_dir, k)
                else:
                    self._failed(w, done)
                    workers[k] = _Worker(self.out_dir, k)
        return results

    def _count(self, done: dict) -> None:
        rep = self.report
        rep.images += 1
        rep.stray += done["stray"] > 0
        rep.image_s.append(done["t"])
        for op, ms in done["ms"].items():
            rep.op_ms[op] += ms
            if ms > SLOW_OP_MS and len(rep.slow) < 50:
                rep.slow.append({"image": done["i"], "op": op, "ms": round(ms),
                                 "outcome": done["ops"].get(op)})
        for op, outcome in done["ops"].items():
            rep.by_op[op][outcome] += 1
            if outcome != "ok":
                rep.by_type[outcome] += 1

    def _failed(self, w: _Worker, done: str) -> None:
        """Record a worker that died of its image ("died") or stopped answering ("hung")."""
        rep = self.report
        rep.images += 1
        if done == "hung":
            try:
                os.kill(w.p.pid, signal.SIGUSR1)  # faulthandler: every thread's Python stack
            except ProcessLookupError:
                pass
            time.sleep(0.5)
            native = _native_stack(w.p.pid)
            w.kill()
            rep.hangs.append(self._save("hang", w, f"no answer in {self.timeout} s", native))
            return
        rc = w.p.wait()
        w.kill()
        sig = -rc if rc < 0 else 0
        what = f"killed by {signal.Signals(sig).name}" if sig else f"exited with status {rc}"
        rep.crashes.append(self._save("crash", w, what, ""))


# --- replay and the command line -------------------------------------------------------


def replay(case_dir: str, local: str | None = None) -> dict:
    """Run a saved case's operations in this process (a crash kills it; see faulthandler).

    `local`: the node-local folder to use (the image goes to `local`.img); by default
    ``DIR/replay-local``, made afresh and removed afterwards (a crash leaves it there).
    """
    import faulthandler
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)["case"]
    if not faulthandler.is_enabled():
        faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks, on demand
    mine = local is None
    if local is None:
        local = os.path.join(case_dir, "replay-local")
        shutil.rmtree(local, ignore_errors=True)
        os.mkdir(local)
    os.environ["CXLRT_LOCAL_DIR"] = local
    path = local + ".img"
    shutil.copyfile(os.path.join(case_dir, "image.bin"), path)
    try:
        return _Runner(path, case, lambda op: print(f"op {op}", file=sys.stderr,
                                                     flush=True)).run()
    finally:
        if mine:
            os.unlink(path)
            shutil.rmtree(local, ignore_errors=True)


def _native_stack(pid: int) -> str:
    """Every thread's C stack of a stuck process, through gdb when it is installed
    (Cython code shows no Python frames: the loop that spins is only seen here)."""
    gdb = shutil.which("gdb")
    if not gdb:
        return ""
    try:
        p = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt"],
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln for ln in p.stdout.decode("utf-8", "replace").splitlines()
             if ln.startswith(("Thread ", "#"))]
    return "\nnative stacks (gdb):\n" + "\n".join(lines) + "\n"


def _try_case(case: dict, image: bytes, timeout: float,
              native_stack: bool = False) -> tuple[str, str, str]:
    """Replay (case, image) in a fresh process: (outcome, last op, stderr).

    The outcome is "crash:SIGNAME", "hang" or "pass".
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="cxlrt-fuzz-min-", dir=shm) as d:
        with open(os.path.join(d, "case.json"), "w") as f:
            json.dump({"case": case}, f)
        with open(os.path.join(d, "image.bin"), "wb") as f:
            f.write(image)
        os.mkdir(os.path.join(d, "local"))  # removed with d, even when the replay is killed
        p = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "cxlrt.fuzz",
                              "--replay", d, "--local", os.path.join(d, "local")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = p.communicate(timeout=timeout)
            outcome = f"crash:{signal.Signals(-p.returncode).name}" if p.returncode < 0 \
                else "pass"
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            native = _native_stack(p.pid) if native_stack else ""
            p.kill()
            _, err = p.communicate()
            err += native.encode()
            outcome = "hang"
    text = err.decode("utf-8", "replace")
    ops = re.findall(r"^op (\S+)$", text, re.M)
    return outcome, ops[-1] if ops else "", text


def minimize(case_dir: str, timeout: float = 3.0, guard: bool | None = None) -> dict:
    """Drop mutations from a saved crash or hang while it still fails the same way.

    Writes ``minimal.json`` (the case, its outcome, the operation and the stack) and
    ``minimal.bin`` next to the case, and returns the first.
    """
    with open(os.path.join(case_dir, "case.json")) as f:
        info = json.load(f)
    case = dict(info["case"], inject=info["case"].get("inject"))
    if guard is not None:  # e.g. a hang the guard has learnt to avoid since: without it
        case["guard"] = guard
    seed = load_seed(os.path.join(os.path.dirname(os.path.dirname(case_dir)), "seeds"),
                     case["seed"])
    want, op, err = _try_case(case, bytes(apply(seed.image, case["muts"])), timeout)
    if want == "pass":
        raise RuntimeError(f"{case_dir}: the case does not fail when replayed")
    muts = list(case["muts"])
    j = 0
    while j < len(muts):
        trial = muts[:j] + muts[j + 1:]
        c = dict(case, muts=trial)
        got, got_op, got_err = _try_case(c, bytes(apply(seed.image, trial)), timeout)
        if (got, got_op) == (want, op):
            muts, err = trial, got_err
        else:
            j += 1
    case["muts"] = muts
    if want == "hang":  # once more, for the C stack of the minimal case
        err = _try_case(case, bytes(apply(seed.image, muts)), timeout, native_stack=True)[2]
    out = {"case": case, "outcome": want, "op": op,
           "mutations": [_label(m) for m in muts], "stack": err}
    with open(os.path.join(case_dir, "minimal.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(case_dir, "minimal.bin"), "wb") as f:
        f.write(apply(seed.image, muts))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cxlrt.fuzz",
        description="Fuzz cxlrt with corrupted region images: every operation on one must end "
                    "in an exception, never a signal or a hang. Crashes and hangs are saved "
                    "under OUT/crashes/ with the image, its mutations and the stacks. Prints a "
                    "progress line every 2 s and a summary at the end (OUT/report.json has "
                    "it all); exits 1 if anything crashed or hung.",
        epilog="CI size: --images 20000 --jobs 2 (4-8 minutes on two cores). The long run "
               "of issue 9: --images 1000000 --jobs 2 --out DIR. Replay a saved case: python "
               "-X faulthandler -m cxlrt.fuzz --replay DIR/crashes/<case>.")
    p.add_argument("--images", type=int, default=10000, help="images to try (10000)")
    p.add_argument("--seed", type=int, default=0,
                   help="run seed: the images are a function of it (0)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (1)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds one image may take before its worker counts as hung (5)")
    p.add_argument("--out", default=None,
                   help="folder for seeds/, crashes/, workers/ and report.json (a new folder "
                        "in the temp dir)")
    p.add_argument("--guard", action="store_true",
                   help="probe the locks of operations that have no timeout first and skip "
                        "an operation whose lock is wedged (default: run everything, so a "
                        "wedge is a hang); with --minimize, replay with the guard")
    p.add_argument("--start", type=int, default=0, help="index of the first image (0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--replay", metavar="DIR", help="re-run a saved crash or hang in this process")
    p.add_argument("--minimize", metavar="DIR",
                   help="shrink a saved crash or hang to the mutations it needs (writes "
                        "DIR/minimal.json and DIR/minimal.bin)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--local", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--build-seed", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--seed-mode", choices=SEED_MODES, help=argparse.SUPPRESS)
    p.add_argument("--inject", action="append", default=[], metavar="I:KIND",
                   help=argparse.SUPPRESS)  # test hook: "7:segv", "9:hang"
    args = p.parse_args(argv)
    if args.build_seed:
        _build_seed(args.build_seed, args.seed_mode)
        return 0
    if args.worker:
        return worker_main(args.worker, args.local)
    if args.replay:
        res = replay(args.replay, args.local)
        print(json.dumps(res, indent=1))
        return 0
    if args.minimize:
        res = minimize(args.minimize, timeout=min(args.timeout, 3.0),
                       guard=True if args.guard else None)
        print(f"{res['outcome']} in {res['op']} with {len(res['mutations'])} mutation(s):")
        for m in res["mutations"]:
            print(f"  {m}")
        print(res["stack"])
        return 0
    out = args.out or tempfile.mkdtemp(prefix="cxlrt-fuzz-")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: report
    inject = {int(i): k for i, k in (x.split(":") for x in args.inject)}
    fz = Fuzzer(out, seed=args.seed, jobs=args.jobs, timeout=args.timeout, guard=args.guard,
                inject=inject, progress=not args.quiet)
    rep = fz.run(args.images, start=args.start)
    d = rep.as_dict()
    print(json.dumps({k: d[k] for k in ("images", "interrupted", "seconds", "images_per_s",
                                        "exceptions_by_type", "features", "corpus",
                                        "worker_leaks", "image_ms_p50_p99_max")}, indent=1))
    for kind in ("crashes", "hangs"):
        print(f"{kind}: {len(d[kind])}")
        for c in d[kind]:
            print(f"  image {c['image']} in {c['op']}: {c['detail']} -> {c['dir']}")
    print(f"report: {os.path.join(fz.out_dir, 'report.json')}")
    return 1 if d["crashes"] or d["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
