"""The scheduler half of the vLLM connector: lookups, pins and the step's plan.

A lookup pins the hit blocks (per-node pin counters, no global lock) so that
nothing evicts them before the worker loads them; the pins are given back when
the worker reports the load (``CxlrtWorkerMetadata.loaded``), when the request
is looked up again (vLLM may ask more than once, and asks again after a
preemption), when it gets no external tokens, and when it finishes or is
aborted. The worker pins again on its own, so a pin given back early can only
turn a hit into a recomputation, never into wrong KV.

On a device that stages objects in its own memory (a CXL-HM device, ``chm:`` under
policy=staging) the lookup also asks it to stage the blocks vLLM will load
(HyMCache's request-level prefetch, issued at get_num_new_matched_tokens). The
device's holds go with the hits' pins. The worker needs no handle: its reads in
start_load_kv find the blocks in device DRAM, and a read of a block still landing
waits for it there. Prefetch is advice: where the device has no room, or takes
none, the worker reads the capacity tier.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cxlrt.integrations.vllm_config import Settings, request_parent
from cxlrt.integrations.vllm_meta import BlockMove, CxlrtMetadata

log = logging.getLogger(__name__)


@dataclass
class _ReqState:
    request: Any
    parent: bytes | None
    keys: list[list[bytes]]                      # per rank, grown on demand
    hits: list[Any] = field(default_factory=list)  # pinned Hits of the last lookup, per rank
    hit_blocks: int = 0
    saved: int = 0                               # leading blocks known to be in cxlrt
    load: BlockMove | None = None                # planned, not yet sent to the workers


class SchedulerSide:
    """Scheduler-side state of :class:`CxlrtConnector` (one per engine)."""

    def __init__(self, settings: Settings, caches: list[Any], block_tokens: int, *,
                 load: bool, save: bool):
        self.settings = settings
        self.caches = caches
        self.bs = block_tokens
        self.can_load = load
        self.can_save = save
        self.reqs: dict[str, _ReqState] = {}
        self.inflight: dict[str, list[Any]] = {}  # req id -> Hits until the worker loaded
        self.kv_cache_manager: Any = None
        self.counters = {"lookups": 0, "hit_blocks": 0, "planned_loads": 0,
                         "planned_saves": 0, "prefetched_blocks": 0}

    # --- keys ------------------------------------------------------------------------------

    def _state(self, request: Any) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            if st is not None:
                self._release(st)
            st = _ReqState(request, request_parent(request), [[] for _ in self.caches])
            self.reqs[request.request_id] = st
        return st

    def _keys(self, st: _ReqState, nblocks: int) -> list[list[bytes]]:
        have = len(st.keys[0])
        if nblocks > have:
            tokens = list(st.request.all_token_ids[have * self.bs:nblocks * self.bs])
            for r, cache in enumerate(self.caches):
                parent = st.keys[r][-1] if have else st.parent
                st.keys[r].extend(cache.block_hashes(tokens, parent=parent))
        return [k[:nblocks] for k in st.keys]

    @staticmethod
    def supported(request: Any) -> bool:
        """Text requests only: multimodal KV depends on more than the token ids."""
        return not getattr(request, "mm_features", None)

    # --- vLLM's scheduler hooks ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if not self.supported(request):
            return 0
        st = self._state(request)
        self._release(st)  # an earlier lookup of this request: this one replaces it
        if not self.can_load:
            return 0
        # The last token is always computed: vLLM needs its logits.
        limit = (request.num_tokens - 1) // self.bs
        if limit * self.bs <= num_computed_tokens:
            return 0
        keys = self._keys(st, limit)
        hits = []
        try:
            for cache, ks in zip(self.caches, keys, strict=True):
                hits.append(cache.lookup(ks))
        except BaseException:
            for h in hits:
                h.release()
            raise
        n = min(len(h) for h in hits)
        self.counters["lookups"] += 1
        if n * self.bs <= num_computed_tokens:
            for h in hits:
                h.release()
            return 0
        self.counters["hit_blocks"] += n
        st.hit_blocks = n
        if self.settings.pin_until_load:
            st.hits = hits
            if self.settings.prefetch:
                self._prefetch(hits, num_computed_tokens // self.bs)
        else:
            for h in hits:
                h.release()
        return n * self.bs - num_computed_tokens

    def _prefetch(self, hits: list[Any], start: int) -> None:
        """Ask the device to stage the blocks past vLLM's own hit, in order."""
        for h in hits:
            try:
                self.counters["prefetched_blocks"] += h.cache.prefetch(h, start=start)
            except Exception as e:  # advice only: a block gone stale is the load's to report
                log.debug("CxlrtConnector: prefetch skipped: %s", e)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0 or st.hit_blocks == 0:
            self._release(st)
            return
        n = st.hit_blocks
        start = n - num_external_tokens // self.bs
        block_ids = blocks.get_block_ids()[0]
        keys = self._keys(st, n)
        st.load = BlockMove(request.request_id, [k[start:n] for k in keys],
                            list(block_ids[start:n]))
        st.saved = max(st.saved, n)

    def build_connector_meta(self, scheduler_output: Any) -> CxlrtMetadata:
        meta = CxlrtMetadata()
        for req_id, st in self.reqs.items():
            if st.load is not None:
                meta.loads.append(st.load)
                self.counters["planned_loads"] += len(st.load.block_ids)
                st.load = None
                if st.hits:
                    self.inflight[req_id] = st.hits
                    st.hits = []
                st.hit_blocks = 0
        if self.can_save:
            self._plan_saves(scheduler_output, meta)
        for req_id in scheduler_output.preempted_req_ids or ():
            st = self.reqs.get(req_id)
            if st is not None:
                self._release(st)
        return meta

    def _plan_saves(self, out: Any, meta: CxlrtMetadata) -> None:
        """Store every block that this step fills: its KV exists once the step ran."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n_sched in out.num_scheduled_tokens.items():
            st = self.reqs.get(req_id)
            if st is None or req_id not in computed:
                continue
            known = len(st.request.all_token_ids)
            full = min(computed[req_id] + n_sched, known) // self.bs
            if full <= st.saved:
                continue
            keys = self._keys(st, full)
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            if len(block_ids) < full:
                continue
            meta.saves.append(BlockMove(req_id, [k[st.saved:full] for k in keys],
                                        list(block_ids[st.saved:full])))
            self.counters["planned_saves"] += full - st.saved
            st.saved = full

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        for req_id in getattr(wm, "loaded", ()):
            for h in self.inflight.pop(req_id, ()):
                h.release()

    def request_finished(self, request: Any) -> None:
        st = self.reqs.pop(request.request_id, None)
        if st is not None:
            self._release(st)
        for h in self.inflight.pop(request.request_id, ()):
            h.release()

    # --- pins --------------------------------------------------------------------------------

    def _release(self, st: _ReqState) -> None:
        hits, st.hits = st.hits, []
        st.load = None
        st.hit_blocks = 0
        for h in hits:
            h.release()

    def held(self) -> int:
        """Hits this side holds pinned (tests assert that finished requests leave none)."""
        return (sum(len(st.hits) for st in self.reqs.values())
                + sum(len(v) for v in self.inflight.values()))

    def close(self) -> None:
        for st in self.reqs.values():
            self._release(st)
        for hits in self.inflight.values():
            for h in hits:
                h.release()
        self.reqs.clear()
        self.inflight.clear()
