"""cxlrt's vLLM KV connector, with the real vLLM engine (the `vllm` extra).

Engine tests run each engine in its own process (tests/vllm_job.py), on a tiny
Llama with fixed random weights; every engine of this file shares one region in
/dev/shm, each as its own node. Engines are shared across tests where one run
answers several questions (an engine takes ~20 s to start on two cores).
Scheduler-side unit tests drive the connector's scheduler half with vLLM's own
Request and KVCacheBlocks objects over every backend, and inside vLLM's own
Scheduler (partial hits, hits shorter than a block, failed loads, preempted and
aborted requests; no pin outlives its request). Without vLLM the file skips,
unless CXLRT_REQUIRE_ENGINES=1 (.ci/engine-tests), where that is an error.
"""

import json
import os
import random
import subprocess
import sys
import uuid

import pytest

from tests.engines import require  # noqa: E402

require("vllm", "vLLM is not installed (bash .ci/install-vllm)")

import cxlrt  # noqa: E402
from cxlrt.cleanup import delete  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "vllm_job.py")
BLOCK = 32
ENGINE_TIMEOUT = 400

# vLLM and torch raise DeprecationWarnings of their own at import: not ours to fix.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(ENGINE_TIMEOUT * 3),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _job(tmp, name, job, *, ok=True):
    """Run one engine job in a fresh process; its JSON result (or the CompletedProcess)."""
    path, out = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.out.json")
    with open(path, "w") as f:
        json.dump(job, f)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
               VLLM_LOGGING_LEVEL="WARNING")
    p = subprocess.run([sys.executable, JOB, path, out], capture_output=True, text=True,
                       timeout=ENGINE_TIMEOUT, env=env)
    if not ok:
        return p
    assert p.returncode == 0, f"engine job {name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    with open(out) as f:
        return json.load(f)


def _prompts(seed, n, system, tail):
    rng = random.Random(seed)
    sysp = [rng.randrange(1, 1000) for _ in range(system)]
    return [sysp + [rng.randrange(1, 1000) for _ in range(tail + 7 * i)] for i in range(n)]


# P: a shared 100-token system prompt (3 full blocks) and 20-34 token tails.
# Q: two unrelated prompts for the prefill -> decode hand-off (4 full blocks each).
P = _prompts(1, 3, 100, 20)
Q = _prompts(2, 2, 0, 150)


def _delete(spec):
    """The region and its node-local files (the engines that used them have exited)."""
    try:
        delete(spec, force=True)
    except FileNotFoundError:
        pass  # a test that failed before making it


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """(work folder, model folder): the tiny random-weight Llama every engine runs."""
    tmp = str(tmp_path_factory.mktemp("vllm"))
    model = os.path.join(tmp, "model")
    _job(tmp, "model", {"make_model": True, "model": model})
    return tmp, model


@pytest.fixture(scope="module")
def env(tiny_model):
    tmp, model = tiny_model
    spec = f"file:/dev/shm/cxlrt-vllm-test-{uuid.uuid4().hex[:8]}"
    base = _job(tmp, "baseline", {"model": model, "rounds": [{"prompts": P}, {"prompts": Q}]})
    yield {"tmp": tmp, "model": model, "spec": spec, "base": base}
    _delete(spec)


def _extra(env, node, name="t", **kw):
    return {"spec": env["spec"], "node": node, "name": name, "size": "256M", **kw}


def _same(got, want, where):
    assert got["tokens"] == want["tokens"], where
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4), where


@pytest.fixture(scope="module")
def both(env):
    """One kv_both engine on node 0: serve P, reset vLLM's cache, serve P again, then
    overwrite every block's KV in the region and serve P once more."""
    return _job(env["tmp"], "both", {
        "model": env["model"], "connector": "cxlrt", "extra": _extra(env, 0),
        "rounds": [{"prompts": P}, {"prompts": P, "reset": True},
                   {"prompts": P, "reset": True, "alter": True}]})


def test_tokens_and_logprobs_equal_those_without_the_connector(env, both):
    _same(both["rounds"][0], env["base"]["rounds"][0], "first serve")
    _same(both["rounds"][1], env["base"]["rounds"][0], "served from cxlrt")


def test_after_reset_prefix_cache_the_cached_tokens_come_from_cxlrt(both):
    second = both["rounds"][1]
    # vLLM's own prefix cache was just reset: every cached token was loaded from cxlrt.
    assert all(c >= 3 * BLOCK for c in second["cached"]), second["cached"]
    w = both["worker"]
    assert w["load_errors"] == 0
    assert w["loaded_blocks"] >= 3, w
    assert both["held"] == 0, "the scheduler still holds pins after every request finished"


def test_an_altered_block_in_the_region_changes_the_logprobs(env, both):
    assert both["altered"] >= 3
    third, ref = both["rounds"][2], env["base"]["rounds"][0]
    worst = max(abs(a - b) for got, want in zip(third["logprobs"], ref["logprobs"], strict=True)
                for a, b in zip(got, want, strict=True))
    assert worst > 1e-2, "KV overwritten in the region did not change the output: unused?"


@pytest.fixture(scope="module")
def handoff(env, both):
    """Prefill on node 1 (kv_producer, max_tokens=1), then decode on node 2 (kv_consumer)."""
    pre = _job(env["tmp"], "prefill", {
        "model": env["model"], "connector": "cxlrt", "role": "kv_producer",
        "extra": _extra(env, 1), "max_tokens": 1, "rounds": [{"prompts": Q}]})
    dec = _job(env["tmp"], "decode", {
        "model": env["model"], "connector": "cxlrt", "role": "kv_consumer",
        "extra": _extra(env, 2), "rounds": [{"prompts": Q}]})
    return pre, dec


def test_prefill_to_decode_through_the_cache(env, handoff):
    pre, dec = handoff
    full = [(len(q) - 1) // BLOCK for q in Q]  # every full block but a last token's
    assert pre["worker"]["stored_blocks"] == sum(full)
    assert pre["worker"]["loaded_blocks"] == 0  # a producer does not load
    d = dec["rounds"][0]
    assert d["cached"] == [n * BLOCK for n in full]
    assert dec["worker"]["loaded_blocks"] == sum(full)
    assert dec["worker"]["stored_blocks"] == 0  # a consumer does not store
    _same(d, env["base"]["rounds"][1], "decode after the hand-off")
    # The first token is the prefill's: both engines agree on it.
    assert [t[:1] for t in d["tokens"]] == pre["rounds"][0]["tokens"]


def test_a_second_engine_on_another_node_hits_the_firsts_blocks(env, both):
    other = _job(env["tmp"], "other", {
        "model": env["model"], "connector": "cxlrt", "role": "kv_consumer",
        "extra": _extra(env, 3, name="t2"),
        "rounds": [{"prompts": P[:1]}]})
    assert other["worker"]["loaded_blocks"] == 0  # another cache name: nothing shared
    # Node 0 served P into cache "t" (then altered it): node 3's engine loads those bytes.
    hit = _job(env["tmp"], "hit", {
        "model": env["model"], "connector": "cxlrt", "role": "kv_consumer",
        "extra": _extra(env, 3), "rounds": [{"prompts": P[:1]}]})
    assert hit["worker"]["loaded_blocks"] == 3
    assert hit["rounds"][0]["cached"] == [3 * BLOCK]


def test_an_engine_on_a_cxl_hm_device_prefetches_at_the_lookup(env):
    """HyMCache's request-level prefetch from a real engine: the scheduler's lookup asks
    the device to stage the hit, the worker's load reads it from device DRAM, and the
    tokens are those of the engine without the connector."""
    path = f"/dev/shm/cxlrt-vllm-chm-{uuid.uuid4().hex[:8]}"
    spec = f"chm:{path}?policy=staging&dram=16M&page=64K&lat=20000&bw=4"
    try:
        got = _job(env["tmp"], "chm", {
            "model": env["model"], "connector": "cxlrt",
            "extra": {**_extra(env, 0, name="chm"), "spec": spec},
            "rounds": [{"prompts": P}, {"prompts": P, "reset": True}]})
    finally:
        _delete(spec)
    _same(got["rounds"][1], env["base"]["rounds"][0], "served from the device")
    assert all(c >= 3 * BLOCK for c in got["rounds"][1]["cached"])
    assert got["scheduler"]["prefetched_blocks"] >= 3, got["scheduler"]
    assert got["worker"]["loaded_blocks"] >= 3 and got["worker"]["load_errors"] == 0
    assert got["device"]["stats"]["prefetched"] > 0, got["device"]
    assert got["device"]["pinned"] == [0, 0] and got["held"] == 0


def test_a_block_evicted_between_lookup_and_load_is_recomputed(env):
    ev = _job(env["tmp"], "evict", {
        "model": env["model"], "connector": "cxlrt",
        "extra": _extra(env, 4, name="evict", capacity_blocks=16, pin_until_load=False,
                        _fault="evict-before-load"),
        "rounds": [{"prompts": P}, {"prompts": P, "reset": True}]})
    assert ev["scheduler"]["hit_blocks"] >= 3  # the scheduler saw the blocks ...
    assert ev["worker"]["load_errors"] >= 3    # ... the worker found them gone ...
    assert ev["worker"]["loaded_blocks"] == 0
    _same(ev["rounds"][1], env["base"]["rounds"][0], "recomputed")  # ... and vLLM recomputed


@pytest.mark.parametrize("change, says", [
    ({"extra": {"model_id": "another-model"}}, "salt"),
    ({"dtype": "bfloat16"}, "block_bytes"),
], ids=["salt", "geometry"])
def test_a_scheme_mismatch_is_a_clear_error_at_start_up(env, both, change, says):
    job = {"model": env["model"], "connector": "cxlrt", "extra": _extra(env, 5),
           "rounds": [{"prompts": P[:1]}]}
    job["extra"].update(change.pop("extra", {}))
    job.update(change)
    p = _job(env["tmp"], f"mismatch-{says}", job, ok=False)
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert "SchemeMismatchError" in err and "was created with a different scheme" in err, \
        err[-3000:]
    assert says in err


# --- scheduler side, on vLLM's request objects --------------------------------------------

def _request(rid, tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), None)


def _blocks(ids):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


@pytest.fixture
def sched(backend):
    from cxlrt.integrations.vllm_config import Settings
    from cxlrt.integrations.vllm_scheduler import SchedulerSide
    r = backend.create(size="8M", nodes=4)
    cache = cxlrt.KVCache(r, "unit", block_bytes=256, capacity_blocks=8, block_tokens=BLOCK,
                          salt="unit")
    side = SchedulerSide(Settings.from_extra({}), [cache], BLOCK, load=True, save=True)
    yield side, cache
    side.close()
    cache.close()
    r.close()


TOKENS = list(range(1, 1 + 5 * BLOCK + 9))  # 5 full blocks and 9 tokens


def _seed(cache, nblocks):
    keys = cache.block_hashes(TOKENS[:nblocks * BLOCK])
    assert cache.store(keys, bytes(nblocks * 256)) == keys
    return keys


def _evictable(cache, n):
    """How many of n fresh blocks a full cache takes: pinned blocks cannot make room."""
    return len(cache.store([os.urandom(16) for _ in range(n)], bytes(n * 256)))


def test_partial_hit_returns_the_cached_blocks_past_the_local_hit(sched):
    side, cache = sched
    _seed(cache, 3)
    req = _request("a", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == 3 * BLOCK
    assert side.get_num_new_matched_tokens(req, BLOCK) == 2 * BLOCK  # vLLM has block 0
    side.update_state_after_alloc(req, _blocks([10, 11, 12, 13, 14, 15]), 2 * BLOCK)
    move = side.reqs["a"].load
    assert move.block_ids == [11, 12] and move.keys[0] == cache.block_hashes(TOKENS)[1:3]
    assert side.held() == 1
    side.request_finished(req)
    assert side.held() == 0


def test_a_hit_shorter_than_one_block_is_no_hit(sched):
    side, cache = sched
    _seed(cache, 2)
    assert side.get_num_new_matched_tokens(_request("short", TOKENS[:BLOCK - 5]), 0) == 0
    # A prompt of exactly one block: its last token must be computed, so nothing loads.
    assert side.get_num_new_matched_tokens(_request("one", TOKENS[:BLOCK]), 0) == 0
    # vLLM's own hit already covers what cxlrt has.
    assert side.get_num_new_matched_tokens(_request("local", TOKENS), 2 * BLOCK) == 0
    assert side.held() == 0


def test_a_whole_cached_prompt_leaves_its_last_token_to_compute(sched):
    side, cache = sched
    _seed(cache, 5)
    req = _request("all", TOKENS[:5 * BLOCK])
    assert side.get_num_new_matched_tokens(req, 0) == 4 * BLOCK
    side.request_finished(req)


def test_aborted_requests_leave_no_pins(sched):
    side, cache = sched
    _seed(cache, 3)
    waiting, loading = _request("w", TOKENS), _request("l", TOKENS)
    assert side.get_num_new_matched_tokens(waiting, 0) == 3 * BLOCK  # never scheduled
    assert side.get_num_new_matched_tokens(loading, 0) == 3 * BLOCK
    side.update_state_after_alloc(loading, _blocks(range(6)), 3 * BLOCK)
    assert side.held() == 2
    assert _evictable(cache, 8) == 5  # 3 pinned blocks stay: a full cache takes 5 more
    side.request_finished(waiting)  # aborted while waiting
    side.request_finished(loading)  # aborted after its load was planned
    assert side.held() == 0
    assert _evictable(cache, 8) == 8  # nothing pinned: every old block could go


def test_preempted_and_relooked_up_requests_leave_no_pins(sched):
    from types import SimpleNamespace
    side, cache = sched
    _seed(cache, 3)
    req = _request("p", TOKENS)
    # vLLM may ask twice for one request: the second lookup replaces the first's pins.
    assert side.get_num_new_matched_tokens(req, 0) == 3 * BLOCK
    assert side.get_num_new_matched_tokens(req, 0) == 3 * BLOCK
    assert side.held() == 1
    side.update_state_after_alloc(req, _blocks(range(6)), 0)  # not scheduled after all
    assert side.held() == 0
    assert side.get_num_new_matched_tokens(req, 0) == 3 * BLOCK
    side.update_state_after_alloc(req, _blocks(range(6)), 3 * BLOCK)
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                                                                num_computed_tokens=[]),
                          preempted_req_ids=set())
    meta = side.build_connector_meta(out)
    assert [m.req_id for m in meta.loads] == ["p"] and side.held() == 1  # until loaded
    # Preempted before the worker reported: it is looked up again when it resumes.
    out.preempted_req_ids = {"p"}
    side.build_connector_meta(out)
    assert side.get_num_new_matched_tokens(req, 0) == 3 * BLOCK
    assert side.held() == 2
    side.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=SimpleNamespace(loaded={"p"})))
    assert side.held() == 1
    side.request_finished(req)
    assert side.held() == 0
    assert _evictable(cache, 8) == 8


def test_the_lookup_prefetches_the_hit_into_the_device_until_the_load_is_reported(sched):
    """HyMCache's request-level prefetch from the engine: issued at the lookup, held
    until the worker reports the load. Only a device that stages objects takes it."""
    from types import SimpleNamespace
    side, cache = sched
    _seed(cache, 4)
    stages = cache.region.backend.scheme == "chm" and "staging" in cache.region.spec
    req = _request("pf", TOKENS)
    assert side.get_num_new_matched_tokens(req, BLOCK) == 3 * BLOCK
    assert side.counters["prefetched_blocks"] == (3 if stages else 0)  # past vLLM's block 0
    if stages:
        assert cache.region.backend.pinned()[0] > 0
    side.update_state_after_alloc(req, _blocks(range(6)), 3 * BLOCK)
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                                                                num_computed_tokens=[]),
                          preempted_req_ids=set())
    side.build_connector_meta(out)
    side.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=SimpleNamespace(loaded={"pf"})))
    if stages:
        assert cache.region.backend.pinned() == (0, 0)  # given back with the pins
    side.request_finished(req)
    assert side.held() == 0


def test_prefetch_can_be_turned_off_and_options_are_checked(backend):
    from cxlrt.integrations.vllm_config import Settings
    from cxlrt.integrations.vllm_scheduler import SchedulerSide
    r = backend.create(size="8M", nodes=4)
    cache = cxlrt.KVCache(r, "unit", block_bytes=256, capacity_blocks=8, block_tokens=BLOCK,
                          salt="unit")
    side = SchedulerSide(Settings.from_extra({"prefetch": False}), [cache], BLOCK, load=True,
                         save=True)
    _seed(cache, 3)
    assert side.get_num_new_matched_tokens(_request("n", TOKENS), 0) == 3 * BLOCK
    assert side.counters["prefetched_blocks"] == 0
    side.close()
    with pytest.raises(ValueError, match="prefetch must be true or false"):
        Settings.from_extra({"prefetch": "yes"})
    cache.close()
    r.close()


# --- worker side, on tensors shaped like vLLM's CPU KV cache ------------------------------

@pytest.fixture
def worker(backend):
    import torch

    from cxlrt.integrations.vllm_config import Settings
    from cxlrt.integrations.vllm_worker import WorkerSide
    r = backend.create(size="8M", nodes=4)
    # Two layers of (blocks, heads=2, block tokens, 2 x head size 2) float32: 1 KiB a block.
    shape = (6, 2, BLOCK, 4)
    cache = cxlrt.KVCache(r, "w", block_bytes=2 * 1024, capacity_blocks=8, block_tokens=BLOCK,
                          salt="unit")

    def make(**extra):
        w = WorkerSide(Settings.from_extra(extra), cache, 0, ["l0", "l1"], shape[0])
        g = torch.Generator().manual_seed(0)
        w.register_kv_caches({n: torch.randn(shape, generator=g) for n in ("l0", "l1")})
        return w
    yield cache, make
    cache.close()
    r.close()


def _move(cache, nblocks, block_ids):
    from cxlrt.integrations.vllm_meta import BlockMove, CxlrtMetadata
    keys = cache.block_hashes(TOKENS[:nblocks * BLOCK])
    return CxlrtMetadata(saves=[BlockMove("r", [keys], block_ids)]), \
        CxlrtMetadata(loads=[BlockMove("r", [keys], block_ids)])


def test_worker_saves_and_loads_every_layers_pages(worker):
    cache, make = worker
    src, dst = make(), make()
    save, _ = _move(cache, 3, [1, 2, 3])
    src.wait_for_save(save)
    _, load = _move(cache, 3, [4, 5, 0])
    dst.start_load_kv(load)
    assert dst.take_invalid() == set() and dst.take_loaded() == {"r"}
    for a, b in zip(src.pages, dst.pages, strict=True):
        assert a[[1, 2, 3]].equal(b[[4, 5, 0]])


def test_a_corrupt_block_is_reported_for_recompute_not_loaded(worker):
    cache, make = worker
    src, dst = make(), make()
    save, load = _move(cache, 3, [1, 2, 3])
    src.wait_for_save(save)
    before = [p.clone() for p in dst.pages]
    off = next(e["offset"] for e in cache.entries() if e["key"] == load.loads[0].keys[0][1])
    cache.region.dma_write(off + 8, bytes(16))  # the header's copy of the key
    dst.start_load_kv(load)
    assert dst.take_invalid() == {1, 2, 3}  # the run is cut: vLLM recomputes all of it
    assert all(a.equal(b) for a, b in zip(before, dst.pages, strict=True))


def test_loads_past_the_time_budget_are_recomputed(worker):
    cache, make = worker
    src, dst = make(), make(load_timeout_s=-1.0)
    save, load = _move(cache, 2, [1, 2])
    src.wait_for_save(save)
    dst.start_load_kv(load)
    assert dst.take_invalid() == {1, 2} and dst.counters["loaded_blocks"] == 0


# --- scheduler side, inside vLLM's own Scheduler ---------------------------------------------
#
# vLLM's v1 Scheduler builds the connector itself from a KVTransferConfig and calls every
# scheduler hook in its own order (lookup, allocation, metadata, preemption, abort,
# finish). The model runner is played by `VllmScheduler.step`: it samples one token for a
# request whose prompt is done, stores each planned save as cxlrt blocks, and reports the
# planned loads as done (or failed) through the connector's worker metadata.

class VllmScheduler:
    """vLLM's Scheduler with a CxlrtConnector on a fresh region, and a stand-in worker."""

    def __init__(self, model: str, spec: str, num_blocks: int):
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager
        cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cache_config.num_gpu_blocks = num_blocks
        vc = VllmConfig(
            model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32",
                                     max_model_len=1024, seed=0),
            cache_config=cache_config, device_config=DeviceConfig("cpu"),
            scheduler_config=SchedulerConfig(max_model_len=1024, max_num_seqs=8,
                                             max_num_batched_tokens=2048,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(
                kv_connector="CxlrtConnector", kv_connector_module_path="cxlrt.integrations.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"spec": spec, "size": "64M", "name": "sched"}))
        # The tiny Llama's geometry: 2 layers of 2 KV heads of 64 (float32).
        attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                 dtype=torch.float32)
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], attn)])
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.s = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BLOCK)
        self.side = self.s.connector.scheduler
        self.cache = self.s.connector.caches[0]
        self.loads: dict[str, list[int]] = {}   # req id -> block ids of every planned load

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request
        self.s.add_request(Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens,
                                                                     ignore_eos=True),
                                   None, block_hasher=self.hasher))

    def seed(self, tokens: list[int], nblocks: int) -> list[bytes]:
        """Put the first nblocks of `tokens` in cxlrt, as another engine would have."""
        keys = self.cache.block_hashes(tokens[:nblocks * BLOCK])
        assert self.cache.store(keys, bytes(nblocks * self.cache.block_bytes)) == keys
        return keys

    def schedule(self):
        out = self.s.schedule()
        for m in out.kv_connector_metadata.loads:
            self.loads.setdefault(m.req_id, []).extend(m.block_ids)
        return out

    def finish_step(self, out, *, fail: frozenset[int] = frozenset()):
        """The model runner's part of one step: saves, load reports, sampled tokens."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from cxlrt.integrations.vllm_meta import CxlrtWorkerMetadata
        meta = out.kv_connector_metadata
        for m in meta.saves:
            self.cache.store(m.keys[0], bytes(len(m.block_ids) * self.cache.block_bytes))
        loaded = {m.req_id for m in meta.loads}
        ids = list(out.num_scheduled_tokens)
        reqs = self.s.requests
        sampled = [[7] if r in reqs and reqs[r].num_computed_tokens >= reqs[r].num_tokens
                   else [] for r in ids]
        self.s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=CxlrtWorkerMetadata(loaded) if loaded else None,
                invalid_block_ids=set(fail))))

    def step(self, **kw):
        out = self.schedule()
        self.finish_step(out, **kw)
        return out

    def run(self, steps: int = 400) -> None:
        for _ in range(steps):
            if not self.s.has_requests():
                return
            self.step()
        raise AssertionError("requests still unfinished")

    def unpinned(self, keys: list[bytes]) -> bool:
        """No node holds a pin on these blocks: every one of them can be deleted."""
        return self.cache.delete(keys) == keys

    def close(self) -> None:
        self.s.shutdown()


@pytest.fixture
def vsched(tiny_model):
    spec = f"file:/dev/shm/cxlrt-vllm-sched-{uuid.uuid4().hex[:8]}"
    made = []

    def make(num_blocks=64):
        made.append(VllmScheduler(tiny_model[1], spec, num_blocks))
        return made[-1]
    yield make
    for m in made:
        m.close()
    _delete(spec)


def _new(out, rid):
    return next(r for r in out.scheduled_new_reqs if r.req_id == rid)


def test_vllm_scheduler_partial_hit_loads_only_past_vllms_own_hit(vsched):
    v = vsched()
    keys = v.seed(TOKENS, 3)
    v.add("b", TOKENS[:40], 1)             # leaves block 0 in vLLM's own prefix cache
    v.run()
    v.add("a", TOKENS, 2)
    out = v.schedule()
    a = _new(out, "a")
    # vLLM's cache has block 0; cxlrt adds blocks 1 and 2; the rest is computed.
    assert a.num_computed_tokens == 3 * BLOCK
    assert out.num_scheduled_tokens["a"] == len(TOKENS) - 3 * BLOCK
    assert v.loads["a"] == list(a.block_ids[0][1:3])
    assert v.side.held() == 1              # pinned until the worker reports the load
    v.finish_step(out)
    assert v.side.held() == 0
    v.run()
    assert v.side.held() == 0 and v.unpinned(keys)


def test_vllm_scheduler_a_failed_load_is_recomputed(vsched):
    v = vsched()
    keys = v.seed(TOKENS, 3)
    v.add("a", TOKENS, 1)
    out = v.schedule()
    assert _new(out, "a").num_computed_tokens == 3 * BLOCK
    v.finish_step(out, fail=frozenset(v.loads["a"][1:]))  # blocks 1 and 2 did not arrive
    # vLLM rolls the request back to the first bad block and computes from there.
    out = v.schedule()
    assert v.s.requests["a"].num_computed_tokens == len(TOKENS)
    assert out.num_scheduled_tokens["a"] == len(TOKENS) - BLOCK
    v.finish_step(out)
    v.run()
    assert v.side.held() == 0 and v.unpinned(keys)


def test_vllm_scheduler_hits_shorter_than_one_block_load_nothing(vsched):
    v = vsched()
    keys = v.seed(TOKENS, 3)
    v.add("short", TOKENS[:BLOCK - 5] + [999] * 40, 1)  # 27 shared tokens: no whole block
    v.add("one", TOKENS[:BLOCK], 1)                       # its one block holds the last token
    out = v.schedule()
    assert _new(out, "short").num_computed_tokens == 0
    assert _new(out, "one").num_computed_tokens == 0
    assert not out.kv_connector_metadata.loads and v.side.held() == 0
    v.finish_step(out)
    v.run()
    assert v.side.held() == 0 and v.unpinned(keys)


def test_vllm_scheduler_preempted_requests_leave_no_pins(vsched):
    v = vsched(num_blocks=10)                # 9 usable: two 4-block prompts, then one more
    r1 = TOKENS[:100]
    r2 = [t + 500 for t in TOKENS[:100]]
    k1, k2 = v.seed(r1, 3), v.seed(r2, 3)
    v.add("r1", r1, 40)
    v.add("r2", r2, 40)
    out = v.step()
    assert {m.req_id for m in out.kv_connector_metadata.loads} == {"r1", "r2"}
    preempted = set()
    for _ in range(200):
        out = v.step()
        preempted |= set(out.preempted_req_ids or ())
        if preempted:
            assert v.side.held() == 0      # a preempted request holds nothing
        if not v.s.has_requests():
            break
    assert preempted, "nothing was preempted: the test did not test preemption"
    assert not v.s.requests and v.side.held() == 0  # both finished after the preemption
    assert v.side.reqs == {} and v.side.inflight == {}
    assert v.unpinned(k1) and v.unpinned(k2)


def test_vllm_scheduler_aborted_requests_leave_no_pins(vsched):
    from vllm.v1.request import RequestStatus
    v = vsched(num_blocks=10)
    keys = v.seed(TOKENS, 3)
    v.add("big", [t + 500 for t in range(8 * BLOCK + 5)], 100)  # takes all 9 blocks
    v.step()
    # "waits" is looked up (a pinned hit) but finds no free block: it stays waiting.
    v.add("waits", TOKENS, 1)
    v.step()
    assert v.s.requests["waits"].status == RequestStatus.WAITING
    assert v.side.held() == 1
    v.s.finish_requests(["waits", "big"], RequestStatus.FINISHED_ABORTED)
    assert v.side.held() == 0
    # Aborted between the scheduler's plan and the worker's report of the load.
    v.add("loads", TOKENS, 1)
    out = v.schedule()
    assert v.loads["loads"] and v.side.held() == 1
    v.s.finish_requests("loads", RequestStatus.FINISHED_ABORTED)
    v.finish_step(out)
    assert v.side.held() == 0 and v.side.reqs == {} and v.side.inflight == {}
    assert v.unpinned(keys)
