"""`cxlrt demo`: disaggregated LLM serving on an emulated CXL rack, four ways side by side.

A tiny transformer with fixed random weights (:mod:`cxlrt.serving.model`)
serves a multi-turn chat workload whose conversations share one system prompt
(:mod:`cxlrt.serving.workload`), with P prefill and D decode worker processes,
in four modes:

(a) no cache
    P + D colocated workers, each prefilling every prompt whole and decoding
    it: no cache, no KV transfer.
(b) TCP
    prefill workers compute the KV of every prompt and send it to a decode
    worker over a loopback TCP socket, as a NIC-based KV transfer does.
(b') TCP + cache
    as (b), but each prefill worker keeps a bounded LRU prefix cache of the KV
    it computed in its own memory (LMCache-local style), computes only the
    blocks past its hit, and sends the whole prompt's KV over TCP: (c)/(b')
    isolates the transport.
(c) cxlrt
    prefill workers look the prompt's blocks up in a :class:`cxlrt.KVCache` in
    the shared region, load the hit prefix, compute and store only the missing
    blocks, and tell a decode worker "request R: these keys are ready" over a
    :class:`cxlrt.Channel`; decode loads every block through cxlrt.

The region is an emulated rack on tmpfs (``emu:`` on /dev/shm) unless ``spec``
names another; each worker attaches as its own node. Before the modes run, a
monolithic reference (each prompt prefilled in one call, then decoded) gives
the tokens every mode must reproduce exactly.

:func:`run` returns the report that ``cxlrt demo --json`` prints:

``ok``
    every mode's tokens equal the reference's (the exit status is 0 only then).
``config``, ``model``, ``region``
    what ran: workload and worker counts; model shape and KV block geometry;
    the region's spec, size and node count (``null`` when cxlrt mode is off).
``reference``
    ``wall_s`` of the monolithic reference run.
``modes``
    per mode (``nocache``, ``tcp``, ``tcp_cache``, ``cxlrt``): ``label``, ``wall_s``,
    ``tokens_equal``, ``overall`` and ``turns`` (a list, turn 1 first), each
    with ``requests``, ``prompt_tokens``, ``prefix_hit_rate`` (``null`` without a
    cache), ``kv_bytes_moved``, ``ttft_mean_s``, ``ttft_p99_s`` and
    ``tokens_equal``, ``ttft_split_s`` (mean ``queue``, ``kv_load``, ``compute``,
    ``handoff`` seconds: they sum to ``ttft_mean_s``) and ``handoff_detail_s``
    (``send``, ``transit``); tcp and tcp_cache add ``blocks`` and
    ``computed_blocks``, tcp_cache ``hit_blocks``; cxlrt adds ``hit_blocks``,
    ``blocks``, ``computed_blocks``, ``decode_recomputed_blocks`` and ``kv_bytes``
    (``stored_bytes``, ``prefill_loaded_bytes``, ``decode_loaded_bytes``); ``workers`` holds each
    worker's exit stats (cxlrt: its ``cache.stats()``); ``ttft_parts_s`` lists
    each request's ``rid``, ``conv``, ``turn``, ``issued_s`` (after the mode's first
    request), ``ttft_s`` and its four parts.
``ratios``
    ``cxlrt/nocache``, ``cxlrt/tcp`` and ``cxlrt/tcp_cache``: ``ttft_mean`` and
    ``ttft_p99`` (below 1: cxlrt is faster), overall and per turn in ``turns``.
``ttft_parts``
    the names of the TTFT split's parts, in order.
``cache``
    the cache's ``stats()`` read by the scheduler's node after the cxlrt run.
``wall_s``
    the whole demo.

See :mod:`cxlrt.serving.report` for how each number is defined.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from cxlrt.progress import Progress
from cxlrt.serving import handoff, report
from cxlrt.serving.config import MODES, ModelConfig, Plan
from cxlrt.serving.workload import WorkloadConfig, make_workload

CHUNK = 64 << 10  # the allocator's chunk: large objects are whole chunks


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. The defaults take about 25 s on 2 cores.

    Parameters
    ----------
    prefill, decode : int
        Prefill workers (P) and decode workers (D), each a process and a node.
    conversations, turns, system_tokens, user_tokens, new_tokens : int
        The workload (see :class:`cxlrt.serving.workload.WorkloadConfig`).
    block_tokens : int
        Tokens per KV block (per cache key).
    seed : int
        Seeds the model's weights, the workload's tokens and the emulation.
    spec : str, optional
        Region to format and use instead of a fresh ``emu:`` file on /dev/shm
        (``file:``, ``numa:``, ``dax:``...). It is reformatted: its contents are lost.
    cache_blocks : int, optional
        Cache capacity in blocks; default: room for every block of the workload.
        Smaller makes the cache evict (decode then recomputes what it misses).
    modes : tuple of str
        Which of ``nocache``, ``tcp``, ``tcp_cache``, ``cxlrt`` to run.
    model : ModelConfig
        The model's shape (its seed is replaced by ``seed``).
    """

    prefill: int = 1
    decode: int = 1
    conversations: int = 4
    turns: int = 5
    system_tokens: int = 1024
    user_tokens: int = 64
    new_tokens: int = 32
    block_tokens: int = 16
    seed: int = 0
    spec: str | None = None
    cache_blocks: int | None = None
    modes: tuple[str, ...] = MODES
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "conversations", "turns", "system_tokens",
                     "user_tokens", "new_tokens", "block_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prefill + self.decode + 1 > 64:
            raise ValueError(f"prefill + decode + 1 nodes must be at most 64, got "
                             f"{self.prefill + self.decode + 1}")
        if self.cache_blocks is not None and self.cache_blocks < 1:
            raise ValueError(f"cache_blocks must be >= 1, got {self.cache_blocks}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be some of {', '.join(MODES)}, got {self.modes}")

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        """A small run (a few seconds per mode) for tests and a first look."""
        base = dict(conversations=2, turns=3, system_tokens=128, user_tokens=32, new_tokens=8)
        return cls(**{**base, **overrides})

    @property
    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(self.conversations, self.turns, self.system_tokens,
                              self.user_tokens, self.new_tokens, self.model.vocab, self.seed)


@dataclass(frozen=True)
class Rack:
    """A formatted region holding the demo's cache and channels (see :func:`rack`)."""

    spec: str
    size: int
    nodes: int
    plan: Plan  # with ``spec`` filled in


def plan_for(cfg: DemoConfig, spec: str = "") -> Plan:
    """The workers' plan for ``cfg``: model, block geometry, cache and channel sizes."""
    wl = cfg.workload
    model = dataclasses.replace(cfg.model, seed=cfg.seed)
    bt = cfg.block_tokens
    per_conv = (wl.max_prompt_tokens - 1) // bt
    blocks = cfg.cache_blocks or cfg.conversations * per_conv + 1
    msg = -(-handoff.message_bytes(wl.max_prompt_tokens, bt) // 256) * 256
    return Plan(model, bt, cfg.prefill, cfg.decode, spec, cache_blocks=blocks, msg_bytes=msg)


def _region_bytes(plan: Plan) -> int:
    # Each block is an allocator object with a small header: whole 64 KiB chunks.
    per_block = -(-(plan.block_bytes + 4096) // CHUNK) * CHUNK
    channels = plan.prefill * plan.decode * plan.channel_slots * (plan.msg_bytes + 256)
    total = plan.cache_blocks * per_block + 2 * channels + (16 << 20)
    return -(-total // (1 << 20)) << 20


def _device_size(spec: str) -> int | None:
    """A device's size (a region on a device spans all of it), else None."""
    from cxlrt import api
    s, _cls, _params, fs = api._resolve(spec)
    return api._medium_size(fs, spec, scheme=s.scheme) if api._is_device(s.scheme, fs) else None


@contextmanager
def rack(cfg: DemoConfig) -> Iterator[Rack]:
    """Format the demo's region for ``cfg`` and create the cache and the channels in it.

    The region is a fresh ``emu:`` file in a private folder under /dev/shm (or
    the temporary directory), or ``cfg.spec``, reformatted, with P + D + 1 nodes;
    node 0 (this process) creates the objects and detaches. Leaving the block
    removes what the demo created: the folder or region file it made, and the
    node-local files of every node.
    """
    import cxlrt
    from cxlrt import api
    from cxlrt.nodelocal import remove_files

    tmpdir = None
    if cfg.spec is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        tmpdir = tempfile.mkdtemp(prefix="cxlrt-demo-", dir=base)
        spec = f"emu:{os.path.join(tmpdir, 'rack')}?seed={cfg.seed}"
        made = None
    else:
        spec = cfg.spec
        made = api._resolve(spec)[3]
        if os.path.exists(made):
            made = None  # the user's file: reformatted, but left in place
    plan = plan_for(cfg, spec)
    nodes = plan.prefill + plan.decode + 1
    size = _device_size(spec) or _region_bytes(plan)
    uuid = None
    try:
        info = cxlrt.format(spec, size=size, nodes=nodes, force=True)
        uuid = int(info["uuid"], 16)
        with cxlrt.open(spec, node=0) as r:
            cache = cxlrt.KVCache(r, plan.cache_name, block_bytes=plan.block_bytes, salt=plan.salt,
                                  capacity_blocks=plan.cache_blocks,
                                  block_tokens=plan.block_tokens, create=True)
            cache.close()
            for p in range(plan.prefill):
                for d in range(plan.decode):
                    cxlrt.Channel(r, plan.channel_name(p, d), slots=plan.channel_slots,
                                  msg_bytes=plan.msg_bytes, create=True).close()
        yield Rack(spec, size, nodes, plan)
    finally:
        if uuid is not None:
            remove_files(uuid, nodes)
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        elif made:
            for path in (made, made + ".emu"):
                if os.path.exists(path):
                    os.unlink(path)


def _cache_stats(plan: Plan) -> dict[str, Any]:
    import cxlrt
    with cxlrt.open(plan.spec, node=0) as r:
        cache = cxlrt.KVCache(r, plan.cache_name, block_bytes=plan.block_bytes, salt=plan.salt,
                              capacity_blocks=plan.cache_blocks, block_tokens=plan.block_tokens,
                              create=False)
        try:
            return dict(cache.stats())
        finally:
            cache.close()


def _bar(total: int, label: str, show: bool) -> Progress:
    bar = Progress(total, f"{label:<20}")
    bar.enabled = bar.enabled and show
    return bar


def run(cfg: DemoConfig | None = None, *, show: bool = True,
        out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo and return its report (see the module docstring).

    Parameters
    ----------
    cfg : DemoConfig, optional
        What to run (default ``DemoConfig()``).
    show : bool
        Draw progress bars (on a terminal's stderr only).
    out : callable
        Where the human-readable lines go (``print``; a no-op for ``--json``).
    """
    cfg = cfg or DemoConfig()
    from cxlrt.serving import scheduler
    t0 = time.monotonic()
    wl = make_workload(cfg.workload)
    plan = plan_for(cfg)
    with rack(cfg) if "cxlrt" in cfg.modes else nullcontext() as region:
        plan = region.plan if region else plan
        m = plan.model
        out(f"cxlrt demo: {cfg.conversations} conversations x {cfg.turns} turns sharing a "
            f"{cfg.system_tokens}-token system prompt; {cfg.user_tokens} new user tokens and "
            f"{cfg.new_tokens} generated tokens per turn")
        out(f"  model: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab "
            f"{m.vocab}, float32, random weights (seed {cfg.seed}); KV block "
            f"{cfg.block_tokens} tokens = {report.human_bytes(plan.block_bytes)}")
        out(f"  workers: {cfg.prefill} prefill + {cfg.decode} decode processes "
            f"((a) runs {cfg.prefill + cfg.decode} colocated workers)")
        if region:
            out(f"  region: {region.spec}, {report.human_bytes(region.size)}, "
                f"{region.nodes} nodes; cache of {plan.cache_blocks} blocks")
        total = cfg.workload.requests
        bar = _bar(total, "monolithic reference", show)
        t_ref = time.monotonic()
        ref = scheduler.reference(m, wl, cfg.prefill + cfg.decode, bar.update)
        t_ref = time.monotonic() - t_ref
        bar.close()
        runs = {}
        for mode in MODES:
            if mode in cfg.modes:
                bar = _bar(total, report.LABELS[mode], show)
                runs[mode] = scheduler.serve(mode, plan, wl, bar.update)
                bar.close()
        cache = _cache_stats(plan) if "cxlrt" in cfg.modes else None
    summary = report.summarize(runs, ref, cfg.turns)
    equal = {mode: s["tokens_equal"] for mode, s in summary["modes"].items()}
    close = {mode: s["logits_match"] for mode, s in summary["modes"].items()}
    ok = all(equal.values()) and all(close.values())
    out(f"wall time: monolithic reference {t_ref:.1f} s ({total} requests), "
        + ", ".join(f"{report.LABELS[k]} {r.wall_s:.1f} s" for k, r in runs.items()))
    out("")
    for line in report.table(summary):
        out(line)
    out("")
    for line in report.split_table(summary):
        out(line)
    out("")
    for line in report.notes(summary, cfg.prefill):
        out(line)
    out("tokens equal to the monolithic run: "
        + ", ".join(f"{report.LABELS[k]} {'yes' if v else 'NO'}" for k, v in equal.items()))
    out(f"first-token logits within {report.LOGITS_TOL:g} of the monolithic run: "
        + ", ".join(f"{report.LABELS[k]} {'yes' if close[k] else 'NO'} (max diff "
                    f"{summary['modes'][k]['overall']['logits_max_diff']:.1e})" for k in close))
    out("result: " + ("every mode generated exactly the monolithic run's tokens from the same "
                      "KV" if ok else "MISMATCH: a mode's tokens or logits differ (see above)"))
    model = dataclasses.asdict(plan.model)
    model.update(block_tokens=plan.block_tokens, block_bytes=plan.block_bytes, dtype="float32")
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"}
    config["cache_blocks"] = plan.cache_blocks
    return {
        "ok": ok,
        "config": config,
        "model": model,
        "region": ({"spec": region.spec, "size": region.size, "nodes": region.nodes}
                   if region else None),
        "reference": {"wall_s": t_ref},
        "modes": summary["modes"],
        "ratios": summary["ratios"],
        "ttft_parts": summary["ttft_parts"],
        "cache": cache,
        "wall_s": time.monotonic() - t0,
    }
