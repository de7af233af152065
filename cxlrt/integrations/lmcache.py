"""An LMCache L2 adapter over a cxlrt :class:`~cxlrt.KVCache` (LMCache 0.5.6).

Load it as an LMCache L2 plugin::

    {"type": "plugin", "module_path": "cxlrt.integrations.lmcache",
     "class_name": "CxlrtL2Adapter",
     "adapter_params": {"spec": "file:/dev/shm/rack0", "node": 0,
                        "max_object_bytes": 4194304}}

How LMCache's L2 contract maps onto the cache:

* **Keys.** An ``ObjectKey`` (model name, KV rank, object group, cache salt,
  chunk hash) becomes one 16-byte cxlrt key: keyed BLAKE2b over an unambiguous
  encoding of every field, keyed by the cache's salt digest. Two tenants (cache
  salts), models or ranks never share a block, and every host derives the same key.
* **Objects.** One LMCache object is one cxlrt block. A block is a 64-byte
  header (magic, the object's byte length, CRC-32 of the bytes, the key) and
  then the bytes, so ``block_bytes = 64 + max_object_bytes`` rounded up to 64.
  A larger object is not stored and fails its store task.
* **Layout.** The bytes are stored as LMCache hands them over (``byte_array``),
  and a load succeeds only into a buffer of exactly the stored length, after the
  CRC matches: a block of another size or a damaged block is a failed load (bit 0),
  never wrong bytes.
* **Lookup and lock = a pinned** :class:`~cxlrt.Hit` per key (LMCache unlocks key
  by key). cxlrt never evicts or deletes a pinned block, on any node.
  **Unlock = release**: the adapter keeps no pin past ``submit_unlock`` (or
  ``close``). A load of a locked key reads through its pin; a load of an unlocked
  key pins the block only for the copy.
* **Completion.** Each task runs on one worker thread (the KV cache's calls are
  made from that thread only); its result is recorded before its event fd
  (LMCache's notifier, one per kind) is signalled, so a poller that wakes always
  finds it.
* **Errors.** A store task fails (``L2StoreResult(False, ...)``) when any of its
  objects ends up neither stored nor already present; a lookup or load maps
  every per-key error (corrupt entry, lost pin, bad header) to a 0 bit.
  ``submit_unlock`` never raises.
* **Accounting.** ``get_usage`` counts the bytes this adapter stored and
  deleted (LMCache's own convention); the capacity declared to LMCache is the
  cache's, in object bytes, unless ``max_capacity_bytes`` says otherwise (0
  keeps LMCache's global eviction off). The cache is shared by every node and
  evicts by itself (rack-wide LRU), so LMCache's per-instance count does not
  see blocks that other nodes store or that cxlrt evicts.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

import cxlrt
from cxlrt.heapscan import footprint
from cxlrt.spec import parse_size

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<8sQI4x16s24x")  # magic, nbytes, crc32, key; one 64-byte line
MAGIC = b"CXLLMC01"
KEY_PERSON = b"cxlrt-lmcache1"  # BLAKE2b personalisation: keys of this scheme only

_DEFAULTS: dict[str, Any] = {
    "spec": "file:/dev/shm/cxlrt-lmcache", "node": 0, "nodes": 8, "size": "1G",
    "name": "lmcache", "max_object_bytes": 4 << 20, "capacity_blocks": None, "salt": "",
    "create": True, "max_capacity_bytes": None,
}


class CxlrtL2AdapterConfig(L2AdapterConfigBase):
    """Where the cache lives and how large its objects are.

    Fields (all optional): ``spec`` (region spec, formatted when missing and
    ``create``; the KV cache is made in it when missing), ``node`` (this
    engine's node id), ``nodes`` and ``size`` (the region's node count and bytes
    when it is created), ``name`` (the KV cache),
    ``max_object_bytes`` (the largest LMCache object, i.e. one chunk's KV bytes),
    ``capacity_blocks`` (default: what the region's heap holds), ``salt`` (part
    of the cache's recorded scheme), ``create``, ``max_capacity_bytes`` (what
    the adapter declares to LMCache; default the cache's capacity in object bytes;
    0 declares none, which keeps LMCache's global eviction off and leaves eviction
    to cxlrt's rack-wide LRU).
    """

    def __init__(self, **fields: Any) -> None:
        unknown = set(fields) - set(_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown cxlrt adapter fields {sorted(unknown)}; "
                             f"accepted: {sorted(_DEFAULTS)}")
        merged = {**_DEFAULTS, **fields}
        self.spec = _typed(merged, "spec", str)
        self.node = _typed(merged, "node", int)
        self.nodes = _typed(merged, "nodes", int)
        self.size = parse_size(merged["size"])
        self.name = _typed(merged, "name", str)
        self.max_object_bytes = _typed(merged, "max_object_bytes", int)
        self.capacity_blocks = merged["capacity_blocks"]
        if self.capacity_blocks is not None:
            self.capacity_blocks = _typed(merged, "capacity_blocks", int)
        self.max_capacity_bytes = merged["max_capacity_bytes"]
        if self.max_capacity_bytes is not None:
            self.max_capacity_bytes = _typed(merged, "max_capacity_bytes", int)
            if self.max_capacity_bytes < 0:
                raise ValueError(f"max_capacity_bytes must be >= 0, got {self.max_capacity_bytes}")
        self.salt = _typed(merged, "salt", str)
        self.create = _typed(merged, "create", bool)
        for what in ("nodes", "max_object_bytes"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be >= 1, got {getattr(self, what)}")

    @classmethod
    def from_dict(cls, d: dict) -> CxlrtL2AdapterConfig:
        return cls(**d)

    @classmethod
    def help(cls) -> str:
        return ("cxlrt L2 adapter fields: " + ", ".join(
            f"{k} (default {v!r})" for k, v in _DEFAULTS.items())
            + ". Example: {\"type\": \"plugin\", \"module_path\": "
              "\"cxlrt.integrations.lmcache\", \"class_name\": \"CxlrtL2Adapter\", "
              "\"adapter_params\": {\"spec\": \"file:/dev/shm/rack0\", \"node\": 0}}")


def _typed(d: dict[str, Any], name: str, kind: type) -> Any:
    v = d[name]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ValueError(f"{name} must be {kind.__name__}, got {v!r}")
    return v


def object_key(key: ObjectKey, salt_digest: bytes) -> bytes:
    """The 16-byte cxlrt key of an LMCache ``ObjectKey`` (every field counts)."""
    h = hashlib.blake2b(digest_size=16, key=salt_digest[:64], person=KEY_PERSON)
    for part in (key.model_name.encode(), key.cache_salt.encode(), bytes(key.chunk_hash)):
        h.update(struct.pack("<Q", len(part)))  # length-prefixed: no two encodings alias
        h.update(part)
    h.update(struct.pack("<qq", key.kv_rank, key.object_group_id))
    return h.digest()


def _object_bytes(obj: Any, writable: bool) -> memoryview:
    """The logical bytes of a MemoryObj (CPU memory only: L1 is host memory)."""
    t = getattr(obj, "raw_tensor", None)
    if t is not None and t.device.type != "cpu":
        raise TypeError(f"memory object on {t.device}, the adapter reads host memory only")
    mv = memoryview(obj.byte_array).cast("B")
    if writable and mv.readonly:
        raise TypeError("the load buffer is read-only")
    return mv


class CxlrtL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over a cxlrt KV cache (see the module docstring)."""

    def __init__(self, config: CxlrtL2AdapterConfig | dict | None = None,
                 l1_memory_desc: Any = None) -> None:
        if not isinstance(config, CxlrtL2AdapterConfig):
            config = CxlrtL2AdapterConfig.from_dict(dict(config or {}))
        self._config = config
        self._region = cxlrt.open(config.spec, node=config.node, create=config.create,
                                  size=config.size if config.create else None,
                                  nodes=config.nodes if config.create else None)
        try:
            bb = -(-(HEADER.size + config.max_object_bytes) // 64) * 64
            cap = config.capacity_blocks or self._fitting_blocks(bb)
            self._cache = cxlrt.KVCache(self._region, config.name, block_bytes=bb,
                                        capacity_blocks=cap, salt=config.salt)
        except BaseException:
            self._region.close()
            raise
        self._max_object = self._cache.block_bytes - HEADER.size
        declared = config.max_capacity_bytes
        super().__init__(max_capacity_bytes=self._cache.capacity * self._max_object
                         if declared is None else declared)
        self._stage = np.empty(self._cache.block_bytes, dtype=np.uint8)  # worker only
        self._locks: dict[ObjectKey, list[cxlrt.Hit]] = {}  # worker only
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._next_id = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._mutex = threading.Lock()  # task ids and the three result tables
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cxlrt-l2")
        self._closed = False

    def _fitting_blocks(self, bb: int) -> int:
        # A payload (cxlrt's 64-byte header and the block) as the allocator places
        # it, plus the block's share of the index (up to four slots of entry, claim,
        # record and per-node pin words); a tenth of the heap left for the rest.
        per_block = footprint(64 + bb) + 4 * (136 + 8 * self._region.nodes)
        return max(1, int(self._region.heap[1] * 0.9 // per_block))

    @property
    def cache(self) -> cxlrt.KVCache:
        return self._cache

    def _key(self, key: ObjectKey) -> bytes:
        return object_key(key, self._cache.salt_digest)

    def _task_id(self) -> L2TaskId:
        with self._mutex:
            self._next_id += 1
            return self._next_id

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._closed:
            raise RuntimeError("the cxlrt L2 adapter is closed")
        self._worker.submit(fn, *args)

    def _pairs_task(self, fn: Callable[..., None], keys: list[ObjectKey],
                    objects: list[Any]) -> L2TaskId:
        """Queue a task over (key, memory object) pairs; returns its id."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        tid = self._task_id()
        self._submit(fn, tid, list(keys), list(objects))
        return tid

    # --- event fds ----------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # --- store --------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._pairs_task(self._run_store, keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._mutex:
            done, self._stores = self._stores, {}
        return done

    def _run_store(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[Any]) -> None:
        result = L2StoreResult(False, 0)
        try:
            result = self._store(keys, objects)
        except Exception:
            logger.exception("cxlrt L2 store task %d failed", tid)
        with self._mutex:
            self._stores[tid] = result
        self._store_efd.notify()

    def _store(self, keys: list[ObjectKey], objects: list[Any]) -> L2StoreResult:
        ok = True
        ks: list[bytes] = []
        blocks: list[bytearray] = []
        meta: dict[bytes, tuple[ObjectKey, int]] = {}
        for key, obj in zip(keys, objects, strict=True):
            try:
                data = _object_bytes(obj, writable=False)
            except (TypeError, ValueError, AttributeError) as e:
                logger.warning("cxlrt L2: cannot store %s: %s", key, e)
                ok = False
                continue
            if data.nbytes > self._max_object:
                logger.warning("cxlrt L2: object of %d bytes for %s exceeds max_object_bytes "
                               "%d; not stored", data.nbytes, key, self._max_object)
                ok = False
                continue
            k = self._key(key)
            if k in meta:
                continue  # the same key twice in one task: one copy
            block = bytearray(self._cache.block_bytes)
            HEADER.pack_into(block, 0, MAGIC, data.nbytes, zlib.crc32(data), k)
            block[HEADER.size:HEADER.size + data.nbytes] = data
            ks.append(k)
            blocks.append(block)
            meta[k] = (key, data.nbytes)
        stored: list[bytes] = []
        if ks:
            try:
                stored = self._cache.store(ks, blocks)
            except cxlrt.ClaimLost as e:  # stalled past the lease: some blocks taken over
                logger.warning("cxlrt L2: %s", e)
                stored, ok = list(e.stored), False
        done = set(stored)
        for k in ks:  # skipped: present already (fine), or no room (a failed task)
            if k not in done and not self._present(k):
                ok = False
        if stored:
            self._notify_keys_stored([meta[k][0] for k in stored], [meta[k][1] for k in stored])
        return L2StoreResult(ok, sum(meta[k][1] for k in stored))

    def _present(self, k: bytes) -> bool:
        with self._cache.lookup([k]) as hit:
            return len(hit) == 1

    # --- lookup and lock ----------------------------------------------------------

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, Any]) -> L2TaskId:
        tid = self._task_id()
        self._submit(self._run_lookup, tid, list(keys))
        return tid

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._mutex:
            return self._lookups.pop(task_id, None)

    def _run_lookup(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            try:
                hit = self._cache.lookup([self._key(key)])
            except Exception as e:  # a corrupt entry, a closed region: a miss
                logger.warning("cxlrt L2: lookup of %s failed: %s", key, e)
                continue
            if len(hit):
                self._locks.setdefault(key, []).append(hit)
                bitmap.set(i)
        with self._mutex:
            self._lookups[tid] = bitmap
        self._lookup_efd.notify()

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._submit(self._run_unlock, list(keys))

    def _run_unlock(self, keys: list[ObjectKey]) -> None:
        for key in keys:
            held = self._locks.get(key)
            if not held:
                continue  # never locked (a miss), or unlocked already
            hit = held.pop()
            if not held:
                del self._locks[key]
            _release(hit)

    # --- load ---------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._pairs_task(self._run_load, keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._mutex:
            return self._loads.pop(task_id, None)

    def _run_load(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            try:
                if self._load(key, obj):
                    bitmap.set(i)
                    loaded.append(key)
            except Exception as e:  # a payload reused under us, a closed region: failed
                logger.warning("cxlrt L2: load of %s failed: %s", key, e)
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._mutex:
            self._loads[tid] = bitmap
        self._load_efd.notify()

    def _load(self, key: ObjectKey, obj: Any) -> bool:
        dst = _object_bytes(obj, writable=True)
        k = self._key(key)
        held = self._locks.get(key)
        hit = held[-1] if held else self._cache.lookup([k])
        try:
            if not len(hit):
                return False
            payload = self._read_block(hit, k)
        finally:
            if not held:
                _release(hit)
        if payload is None or payload.nbytes != dst.nbytes:
            if payload is not None:
                logger.warning("cxlrt L2: %s holds %d bytes, the load buffer has %d", key,
                               payload.nbytes, dst.nbytes)
            return False
        dst[:] = payload
        return True

    def _read_block(self, hit: cxlrt.Hit, k: bytes) -> memoryview | None:
        """The object bytes of a pinned block (in the staging buffer), or None if damaged."""
        self._cache.load(hit, self._stage)
        stage = memoryview(self._stage)
        magic, nbytes, crc, key = HEADER.unpack_from(stage, 0)
        if magic != MAGIC or key != k or nbytes > self._max_object:
            logger.warning("cxlrt L2: block %s has a bad header", k.hex())
            return None
        payload = stage[HEADER.size:HEADER.size + nbytes]
        if zlib.crc32(payload) != crc:
            logger.warning("cxlrt L2: block %s fails its CRC", k.hex())
            return None
        return payload

    # --- eviction -----------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Drop `keys` now (LMCache's eviction controller); pinned blocks stay."""
        if self._closed or not keys:
            return
        fut = self._worker.submit(self._delete, list(keys))
        dropped = fut.result()
        if dropped:
            self._notify_keys_deleted([k for k, _ in dropped], [n for _, n in dropped])

    def _delete(self, keys: list[ObjectKey]) -> list[tuple[ObjectKey, int]]:
        sizes: dict[bytes, tuple[ObjectKey, int]] = {}
        for key in keys:
            k = self._key(key)
            with self._cache.lookup([k]) as hit:  # its size, for LMCache's byte count
                payload = self._read_block(hit, k) if len(hit) else None
            if payload is not None:
                sizes[k] = (key, payload.nbytes)
        return [sizes[k] for k in self._cache.delete(list(sizes))]

    # --- status and close ---------------------------------------------------------

    def report_status(self) -> dict:
        status: dict[str, Any] = {"is_healthy": not self._closed, "type": "CxlrtL2Adapter",
                                  "spec": self._config.spec, "node": self._config.node,
                                  "cache": self._config.name}
        if not self._closed:
            status.update(self._cache.stats())
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker.submit(self._release_all)
        self._worker.shutdown(wait=True)
        try:
            self._cache.close()
        finally:
            self._region.close()
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()

    def _release_all(self) -> None:
        for held in self._locks.values():
            for hit in held:
                _release(hit)
        self._locks.clear()


def _release(hit: cxlrt.Hit) -> None:
    """Unpin; LMCache never retries an unlock, so a failure is logged, not raised.

    The node's pins of a process are given back when the process detaches or dies.
    """
    try:
        hit.release()
    except Exception as e:
        logger.warning("cxlrt L2: release of a pinned block failed: %s", e)
