"""One vLLM engine in its own process, for tests/test_vllm_connector.py.

``python tests/vllm_job.py JOB.json OUT.json`` builds an in-process engine from
the job (model folder, connector options) and runs its rounds: each round
optionally resets vLLM's own prefix cache and then generates greedily. The
output is the tokens, logprobs and cached-token counts of every round, plus the
connector's counters on both sides.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 32


def make_model(path):
    """A tiny Llama with fixed random weights (real weights: dummy ones are degenerate)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=1024)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


def _engine(job):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None
    if job.get("connector") == "cxlrt":
        kv = KVTransferConfig(kv_connector="CxlrtConnector",
                              kv_connector_module_path="cxlrt.integrations.vllm",
                              kv_role=job.get("role", "kv_both"),
                              kv_connector_extra_config=job["extra"])
    elif job.get("connector") == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role=job.get("role", "kv_both"),
                              kv_connector_extra_config=job["extra"])
    return LLM(model=job["model"], skip_tokenizer_init=True, block_size=BLOCK,
               dtype=job.get("dtype", "float32"), max_model_len=1024, enforce_eager=True,
               kv_cache_memory_bytes=64 << 20, kv_transfer_config=kv, seed=0,
               max_num_seqs=8, enable_prefix_caching=True)


def _connectors(llm):
    """(scheduler side, worker side) of the engine's connector, or (None, None)."""
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        sched = None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return sched, worker


def _alter_blocks(llm):
    """Overwrite the KV bytes (not the headers) of every block in the engine's cache."""
    import numpy as np
    cache = _connectors(llm)[1].worker.cache
    rng = np.random.default_rng(0)
    n = 0
    for e in cache.entries():
        if e["state"] == "ready":
            junk = rng.standard_normal(cache.block_bytes // 4).astype(np.float32).tobytes()
            cache.region.dma_write(e["offset"] + 64, junk)  # 64: the payload header
            n += 1
    return n


def run(job):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.monotonic()
    llm = _engine(job)
    out = {"start_s": time.monotonic() - t0, "rounds": []}
    sp = SamplingParams(max_tokens=job.get("max_tokens", 4), temperature=0.0, logprobs=1)
    for rnd in job["rounds"]:
        if rnd.get("alter"):
            out["altered"] = _alter_blocks(llm)
        if rnd.get("reset"):
            assert llm.reset_prefix_cache()
        t = time.monotonic()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in rnd["prompts"]], sp,
                           use_tqdm=False)
        out["rounds"].append({
            "seconds": time.monotonic() - t,
            "tokens": [list(r.outputs[0].token_ids) for r in res],
            "logprobs": [[lp[tok].logprob for lp, tok in zip(r.outputs[0].logprobs,
                                                              r.outputs[0].token_ids, strict=True)]
                         for r in res],
            "cached": [r.num_cached_tokens for r in res]})
    sched, worker = _connectors(llm)
    if sched is not None and hasattr(sched, "stats"):
        out["scheduler"] = sched.stats()
        out["held"] = sched.scheduler.held()
    if worker is not None and hasattr(worker, "stats"):
        out["worker"] = worker.stats()
        device = worker.worker.cache.region.backend if worker.worker is not None else None
        if hasattr(device, "pinned"):  # a chm: device: what it staged, and what it still holds
            out["device"] = {"stats": device.stats(), "pinned": list(device.pinned())}
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    if job.get("make_model"):
        make_model(job["model"])
        result = {}
    else:
        result = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown
