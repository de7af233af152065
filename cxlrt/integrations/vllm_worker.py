"""The worker half of the vLLM connector: cxlrt blocks in and out of vLLM's pages.

A cxlrt block is the byte image of one vLLM block in every layer, the layers
back to back in the order the salt names them. Loads run before the forward
pass (synchronous loads: vLLM orders them after it zeroes new blocks); saves
run in ``wait_for_save``, after the forward pass wrote the step's KV.

A load that cannot deliver a block (evicted since the scheduler's lookup, a
payload whose header no longer names the key, a region error, the step's load
budget spent) reports the block through ``get_block_ids_with_load_errors``;
vLLM then recomputes from the first such block. Nothing half-loaded is used.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

log = logging.getLogger("cxlrt.integrations.vllm")


class WorkerSide:
    """Worker-side state of :class:`CxlrtConnector` (one per worker, one TP rank)."""

    def __init__(self, settings: Any, cache: Any, rank: int, layers: list[str],
                 num_blocks: int):
        self.settings = settings
        self.cache = cache
        self.rank = rank
        self.layer_names = layers
        self.num_blocks = num_blocks
        self.pages: list[torch.Tensor] = []   # per layer: (num_blocks, page bytes) uint8 views
        self.invalid: set[int] = set()
        self.loaded: set[str] = set()
        self.counters = {"loaded_blocks": 0, "loaded_bytes": 0, "load_errors": 0,
                         "stored_blocks": 0, "stored_bytes": 0, "store_errors": 0}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"CxlrtConnector: vLLM registered no KV tensor for {missing}")
        pages, total = [], 0
        for name in self.layer_names:
            t = kv_caches[name]
            if t.shape[0] != self.num_blocks or not t.is_contiguous():
                raise ValueError(
                    f"CxlrtConnector: KV tensor of {name} has shape {tuple(t.shape)} and "
                    f"strides {t.stride()}; the connector needs blocks on dim 0 "
                    f"({self.num_blocks} of them), contiguous")
            page = t.view(self.num_blocks, -1).view(torch.uint8)
            pages.append(page)
            total += page.shape[1]
        if total != self.cache.block_bytes:
            raise ValueError(f"CxlrtConnector: the registered KV tensors hold {total} bytes per "
                             f"block; the cache's blocks are {self.cache.block_bytes}")
        self.pages = pages

    # --- load ------------------------------------------------------------------------------

    def start_load_kv(self, meta: Any) -> None:
        deadline = time.monotonic() + self.settings.load_timeout_s
        for move in meta.loads:
            self.loaded.add(move.req_id)
            if time.monotonic() > deadline:
                # HyMCache's rule: a bounded wait, then recompute.
                self._fail(move.block_ids, "the step's load budget "
                           f"({self.settings.load_timeout_s} s) is spent")
                continue
            if self.settings._fault == "evict-before-load":
                self._evict_everything()
            n = self._load(move)
            if n < len(move.block_ids):
                self._fail(move.block_ids[n:], f"{len(move.block_ids) - n} of "
                           f"{len(move.block_ids)} blocks are gone since the lookup")

    def _load(self, move: Any) -> int:
        """Load the leading cached run of the move; returns the blocks delivered."""
        try:
            hit = self.cache.lookup(move.keys[self.rank])
        except Exception as e:  # a region error must not fail the request: recompute
            log.warning("CxlrtConnector: lookup failed, recomputing: %s", e)
            return 0
        with hit:
            n = len(hit)
            if not n:
                return 0
            buf = torch.empty((n, self.cache.block_bytes), dtype=torch.uint8)
            try:
                self.cache.load(hit, buf.numpy())
            except Exception as e:  # header mismatch, reused payload, region error
                log.warning("CxlrtConnector: load failed, recomputing: %s", e)
                return 0
        ids = torch.tensor(move.block_ids[:n], dtype=torch.long)
        off = 0
        for page in self.pages:
            w = page.shape[1]
            page[ids] = buf[:, off:off + w].to(page.device)
            off += w
        self.counters["loaded_blocks"] += n
        self.counters["loaded_bytes"] += n * self.cache.block_bytes
        return n

    def _fail(self, block_ids: list[int], why: str) -> None:
        log.info("CxlrtConnector: %s; vLLM recomputes %d blocks", why, len(block_ids))
        self.invalid.update(block_ids)
        self.counters["load_errors"] += len(block_ids)

    def _evict_everything(self) -> None:
        """Test fault: fill the cache with other blocks, so LRU evicts every unpinned one."""
        n = self.cache.capacity
        keys = [os.urandom(16) for _ in range(n)]
        self.cache.store(keys, bytes(n * self.cache.block_bytes))

    # --- save ------------------------------------------------------------------------------

    def wait_for_save(self, meta: Any) -> None:
        for move in meta.saves:
            ids = torch.tensor(move.block_ids, dtype=torch.long)
            buf = torch.empty((len(ids), self.cache.block_bytes), dtype=torch.uint8)
            off = 0
            for page in self.pages:
                w = page.shape[1]
                buf[:, off:off + w] = page[ids].cpu()
                off += w
            try:
                stored = self.cache.store(move.keys[self.rank], buf.numpy())
            except Exception as e:  # a failed save is only a future miss
                log.warning("CxlrtConnector: store failed: %s", e)
                self.counters["store_errors"] += 1
                continue
            self.counters["stored_blocks"] += len(stored)
            self.counters["stored_bytes"] += len(stored) * self.cache.block_bytes

    # --- reports ---------------------------------------------------------------------------

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_loaded(self) -> set[str]:
        out, self.loaded = self.loaded, set()
        return out
