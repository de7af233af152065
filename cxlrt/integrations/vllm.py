"""``CxlrtConnector``: vLLM's KV connector over a cxlrt prefix KV cache.

Load it with::

    KVTransferConfig(kv_connector="CxlrtConnector",
                     kv_connector_module_path="cxlrt.integrations.vllm",
                     kv_role="kv_both",   # or kv_producer (saves) / kv_consumer (loads)
                     kv_connector_extra_config={"spec": "file:/dev/shm/rack0",
                                                "node": 0, "name": "llama"})

Every engine that names the same region and cache shares its blocks: a prefill
engine (``kv_producer``) stores a prompt's full blocks, and a decode engine on
another node (``kv_consumer``) finds them and computes only the rest. Keys are
``cxlrt.block_hashes`` over the request's token ids with ``block_tokens`` =
vLLM's block size, salted with the model, dtype, KV layout and tensor-parallel
rank (``vllm_config.engine_salt``); an engine with another salt or geometry is
refused at start-up. Options: ``vllm_config.DEFAULTS``.

The connector never fails a request over a load: it sets vLLM's
``kv_load_failure_policy`` to ``recompute`` and reports blocks it could not
load, which vLLM recomputes.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cxlrt.integrations.vllm_config import (
    Settings,
    cache_name,
    close_cache,
    engine_geometry,
    engine_salt,
    open_cache,
)
from cxlrt.integrations.vllm_meta import CxlrtMetadata, CxlrtWorkerMetadata
from cxlrt.integrations.vllm_scheduler import SchedulerSide
from cxlrt.integrations.vllm_worker import WorkerSide

log = logging.getLogger("cxlrt.integrations.vllm")

__all__ = ["CxlrtConnector", "CxlrtMetadata", "CxlrtWorkerMetadata"]


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    try:
        return get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # no distributed group: a single worker
        return 0


class CxlrtConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector whose store is a cxlrt ``KVCache`` (see the module doc)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = Settings.from_extra(ktc.kv_connector_extra_config)
        bs, block_bytes, layers, layout = engine_geometry(vllm_config, kv_cache_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        ranks = range(tp) if role == KVConnectorRole.SCHEDULER else [_tp_rank()]
        self.caches = []
        try:
            for r in ranks:
                self.caches.append(open_cache(
                    self.settings, cache_name(self.settings, vllm_config, r), block_tokens=bs,
                    block_bytes=block_bytes, salt=engine_salt(vllm_config, layout,
                                                             self.settings, r)))
        except BaseException:
            for c in self.caches:
                close_cache(c)
            raise
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute":
                # A block cxlrt cannot deliver is recomputed, never an error.
                ktc.kv_load_failure_policy = "recompute"
            self.scheduler = SchedulerSide(self.settings, self.caches, bs,
                                           load=ktc.is_kv_consumer, save=ktc.is_kv_producer)
        else:
            self.worker = WorkerSide(self.settings, self.caches[0], ranks[0], layers,
                                     kv_cache_config.num_blocks)
        log.info("CxlrtConnector (%s): cache %s on %s, node %d, %d-token blocks of %d bytes",
                 role.name, self.caches[0].name, self.settings.spec, self.settings.node, bs,
                 block_bytes)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a prefix cache: a save dropped by a preemption is a later miss

    # --- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, CxlrtMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # one cxlrt block holds all layers: wait_for_save stores whole blocks

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, CxlrtMetadata)
            self.worker.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> CxlrtWorkerMetadata | None:
        if self.worker is None:
            return None
        loaded = self.worker.take_loaded()
        return CxlrtWorkerMetadata(loaded) if loaded else None

    # --- scheduler side --------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self.scheduler.request_finished(request)
        return False, None  # saves are synchronous: vLLM may free the blocks now

    # --- lifecycle -------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """This side's counters (lookups and plans, or blocks and bytes moved)."""
        side = self.scheduler or self.worker
        return dict(side.counters) if side is not None else {}

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        caches, self.caches = self.caches, []
        for c in caches:
            close_cache(c)
