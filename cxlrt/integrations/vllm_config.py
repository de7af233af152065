"""Settings, key scheme and the shared cache handle of the vLLM connector.

Both halves of :class:`cxlrt.integrations.vllm.CxlrtConnector` (the scheduler's
and each worker's) derive the same salt and geometry from vLLM's config, so a
key computed by the scheduler names exactly the bytes a worker stores. The salt
names everything that makes KV differ beyond token ids; the cache records it, and
an engine whose salt or geometry differs is refused at start-up
(:class:`cxlrt.SchemeMismatchError`), never served a silent zero hit rate.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import cxlrt
from cxlrt.hashing import KEY_BYTES

SCHEME_VERSION = 1
"""Bumped when the block layout inside a cxlrt block changes (it is in the salt)."""

DEFAULTS: dict[str, Any] = {
    "spec": "file:/dev/shm/cxlrt-vllm",  # the region; created when missing
    "node": 0,                           # this engine's node id in the region
    "name": "vllm",                      # the KV cache's name in the region
    "size": "1G",                        # region bytes, when this engine creates it
    "nodes": 8,                          # region node count, when this engine creates it
    "capacity_blocks": None,             # cache capacity when creating; None: 3/4 of the heap
    "model_id": None,                    # names the model in the salt; None: model path
    "load_timeout_s": 5.0,               # a step's loads past this are recomputed instead
    "pin_until_load": True,              # the scheduler's lookup pins until the worker loaded
    "prefetch": True,                    # the lookup asks the device to stage the hit (CXL-HM)
    "_fault": None,                      # test hook: "evict-before-load"
}


@dataclass(frozen=True)
class Settings:
    """`kv_connector_extra_config`, checked, with the laptop defaults filled in."""

    spec: str
    node: int
    name: str
    size: Any
    nodes: int
    capacity_blocks: int | None
    model_id: str | None
    load_timeout_s: float
    pin_until_load: bool
    prefetch: bool
    _fault: str | None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"CxlrtConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"accepted: {sorted(k for k in DEFAULTS if not k.startswith('_'))}")
        merged = {**DEFAULTS, **extra}
        for k in ("node", "nodes"):
            v = merged[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"CxlrtConnector: {k} must be a non-negative int, got {v!r}")
        for k in ("pin_until_load", "prefetch"):
            if not isinstance(merged[k], bool):
                raise ValueError(f"CxlrtConnector: {k} must be true or false, got {merged[k]!r}")
        if merged["_fault"] not in (None, "evict-before-load"):
            raise ValueError(f"CxlrtConnector: unknown _fault {merged['_fault']!r}")
        return cls(**merged)


def engine_geometry(vllm_config: Any, kv_cache_config: Any) -> tuple[int, int, list[str], str]:
    """(block_tokens, bytes of one cxlrt block, layer names in block order, layout text).

    One cxlrt block holds, for one vLLM block of tokens, every layer's K and V:
    the layers' pages back to back in the order of `layer names`.
    """
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("CxlrtConnector: pipeline parallelism is not supported (each stage "
                         "holds other layers; one cxlrt block holds all of them)")
    block_tokens = vllm_config.cache_config.block_size
    layers: list[str] = []
    parts: list[str] = []
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if getattr(spec, "block_size", block_tokens) != block_tokens:
            raise ValueError(f"CxlrtConnector: KV group block size {spec.block_size} differs "
                             f"from the engine's {block_tokens}")
        desc = (f"{type(spec).__name__}(heads={getattr(spec, 'num_kv_heads', '?')},"
                f"head={getattr(spec, 'head_size', '?')},dtype={getattr(spec, 'dtype', '?')},"
                f"page={spec.page_size_bytes})")
        for name in group.layer_names:
            layers.append(name)
            parts.append(f"{name}:{desc}")
            total += spec.page_size_bytes
    if not layers:
        raise ValueError("CxlrtConnector: the engine has no KV cache layers")
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    return block_tokens, total, layers, f"layout={layout};" + ";".join(parts)


def engine_salt(vllm_config: Any, layout: str, settings: Settings, tp_rank: int) -> str:
    """The salt: model, dtype, KV layout and tensor-parallel rank of this cache."""
    mc = vllm_config.model_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    model = settings.model_id or mc.model
    return (f"cxlrt-vllm/{SCHEME_VERSION};model={model};revision={mc.revision};"
            f"dtype={mc.dtype};kv_cache_dtype={vllm_config.cache_config.cache_dtype};"
            f"{layout};tp={tp_rank}/{tp}")


def cache_name(settings: Settings, vllm_config: Any, tp_rank: int) -> str:
    """One cache per tensor-parallel rank: each rank holds its own heads' KV."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return settings.name
    return f"{settings.name}.tp{tp_rank}"


def request_parent(request: Any) -> bytes | None:
    """The chain's starting key for a request: its adapter and tenant salt, or None.

    A LoRA adapter changes K and V; vLLM's per-request ``cache_salt`` isolates
    tenants. Both start the request's key chain from their own digest, so their
    blocks never alias those of the base model or of another tenant.
    """
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None and not salt:
        return None
    text = f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')};salt={salt}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


class _Shared:
    """One Region and KVCache per (region, node, cache) in a process, counted.

    The scheduler and the worker of an in-process engine live in one process:
    they share the attach, and so one pin table.
    """

    lock = threading.Lock()
    open: dict[tuple[str, int, str], list[Any]] = {}


def open_cache(settings: Settings, name: str, *, block_tokens: int, block_bytes: int,
               salt: str) -> cxlrt.KVCache:
    """Attach to (or create) the cache; raises SchemeMismatchError on another scheme."""
    key = (settings.spec, settings.node, name)
    with _Shared.lock:
        got = _Shared.open.get(key)
        if got is not None:
            got[2] += 1
            cache = got[1]
            if (cache.block_tokens, cache.block_bytes) != (block_tokens, block_bytes):
                raise cxlrt.SchemeMismatchError(
                    f"CxlrtConnector: cache {name!r} is open in this process with "
                    f"block_tokens={cache.block_tokens}, block_bytes={cache.block_bytes}; "
                    f"this engine needs {block_tokens}, {block_bytes}")
            return cache
        region = cxlrt.open(settings.spec, node=settings.node, create=True, size=settings.size,
                            nodes=settings.nodes)
        try:
            cache = _attach(region, settings, name, block_tokens, block_bytes, salt)
        except BaseException:
            region.close()
            raise
        _Shared.open[key] = [region, cache, 1]
        return cache


def _attach(region: cxlrt.Region, settings: Settings, name: str, block_tokens: int,
            block_bytes: int, salt: str) -> cxlrt.KVCache:
    common = dict(block_bytes=block_bytes, block_tokens=block_tokens, salt=salt)
    try:
        try:
            return cxlrt.KVCache(region, name, capacity_blocks=settings.capacity_blocks,
                                 create=False, **common)
        except KeyError:
            pass
        cap = settings.capacity_blocks
        if cap is None:  # 3/4 of the heap: payload headers and other objects need the rest
            cap = max(1, region.heap[1] * 3 // 4 // (block_bytes + 64))
        return cxlrt.KVCache(region, name, capacity_blocks=cap, create=True, **common)
    except cxlrt.SchemeMismatchError as e:
        raise cxlrt.SchemeMismatchError(
            f"CxlrtConnector: {e}. This engine's salt: {salt!r}") from None


def close_cache(cache: cxlrt.KVCache) -> None:
    """Drop one reference; the last one closes the cache and detaches the region."""
    with _Shared.lock:
        for key, got in list(_Shared.open.items()):
            if got[1] is cache:
                got[2] -= 1
                if got[2] == 0:
                    del _Shared.open[key]
                    cache.close()
                    got[0].close()
                return
