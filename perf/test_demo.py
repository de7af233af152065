"""The demo's time to first token: cxlrt (c) against no cache (a), KV over TCP (b) and
KV over TCP from a per-worker prefix cache (b').

Groups ``demo_ttft_vs_nocache``, ``demo_ttft_vs_tcp`` and ``demo_ttft_vs_tcp_cache``
each have a baseline row, (a), (b) or (b'), and a ``(c) cxlrt`` row whose every
round is paired with a baseline request run just before it. All four modes'
workers are those of ``cxlrt demo`` (1 prefill + 1 decode process, (a)
colocated), started once.
One benchmark call issues one request and returns when its first token is out
at the decode worker: a later turn of a conversation, 1024 tokens of shared
system prompt and 256 of history (in the cxlrt cache since the warm-up round),
plus 64 new user tokens. The request asks for one token, so nothing runs on
after the call; its time is the TTFT plus the control plane's queue hops, the
same in every mode. So the ratio is the TTFT ratio of an unloaded server. Each
row's ``extra_info["ttft_split_ms"]`` holds the median TTFT split of its timed
requests (queue, KV load, compute, hand-off, and the hand-off's ``transit``: from
the prefill side's send to the decode side starting on it).

Group ``demo_run`` runs the whole demo once (a smaller workload, every
conversation in flight at once, so TTFT includes queueing) and reports its
overall TTFT ratios in the row's note and in ``extra_info["demo"]``: the same
numbers ``cxlrt demo`` prints, measured with its baselines in the same run.

Group ``demo_turns`` runs the default ``cxlrt demo`` workload (4 conversations x
5 turns, 1 and 2 prefill workers) once per row and reports, per turn, (c)/(a) and
(c)/(b') (mean TTFT, all modes measured in the same run) and every mode's mean
TTFT split, in ``extra_info["turns"]``; the note lists (c)/(a) per turn.

Checks after timing: every mode generates the same token for the same prompt;
the cxlrt rows hit the whole cached prefix and decode loads every block;
the demo run's tokens equal its monolithic run's.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import numpy as np
import pytest

from cxlrt import demo
from cxlrt.serving import report
from cxlrt.serving.scheduler import Cluster, RequestResult
from cxlrt.serving.workers import Request
from cxlrt.serving.workload import make_workload

CFG = demo.DemoConfig(system_tokens=1024, user_tokens=64, new_tokens=1)
HISTORY = 256   # tokens of earlier turns, after the system prompt (80 blocks in all)
ROUNDS = 5
WARMUP = 1      # fills the cxlrt cache with the prefix; not what we time
LABELS = report.LABELS
MODES = tuple(LABELS)


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[str, Cluster]]:
    """A running cluster per mode; the cxlrt one on a fresh emulated rack."""
    with demo.rack(CFG) as rack, ExitStack() as stack:
        yield {mode: stack.enter_context(Cluster(mode, rack.plan))
               for mode in MODES}


class Turns:
    """Later turns of one conversation: the same prefix, fresh user tokens each call."""

    def __init__(self) -> None:
        wl = make_workload(CFG.workload)
        self.rng = np.random.default_rng(20261201)
        self.prefix = wl.system + self.rng.integers(0, 512, HISTORY).tolist()
        self.rids = itertools.count()

    def request(self, tokens: list[int] | None = None) -> Request:
        new = tokens or self.rng.integers(0, 512, CFG.user_tokens).tolist()
        return Request(next(self.rids), 0, 1, self.prefix + new, 1, 0)


@pytest.fixture(scope="module")
def turns() -> dict[str, Turns]:
    return {mode: Turns() for mode in MODES}


def _ttft(cluster: Cluster, turns: Turns, seen: list | None = None) -> Callable[[], tuple]:
    def call() -> tuple:
        req = turns.request()
        t_issue = cluster.submit(req)
        rid, t_first, tokens, info = cluster.next_done()
        assert rid == req.rid
        if seen is not None:
            seen.append((req, t_issue, t_first, info))
        return req, tokens, info
    return call


def _split_ms(cluster: Cluster, seen: list) -> dict[str, float]:
    """Median TTFT split (ms) of the timed requests in ``seen``."""
    parts = []
    for req, t_issue, t_first, info in seen:
        info = {**info, **(cluster.prefill_info(req.rid) if cluster.mode != "nocache" else {})}
        r = RequestResult(req.rid, 0, 1, len(req.tokens), t_first - t_issue, [], info, None,
                          t_issue)
        split = report.ttft_split(r)
        split["transit"] = info["t_start"] - info.get("t_sent", info["t_start"])
        parts.append(split)
    return {k: 1e3 * statistics.median(p[k] for p in parts) for k in parts[0]}


def _check(clusters: dict[str, Cluster], turns: dict[str, Turns], last: tuple) -> None:
    req, _tokens, info = last
    c = clusters["cxlrt"]
    blocks = (len(req.tokens) - 1) // CFG.block_tokens
    assert info["decode_recomputed_blocks"] == 0
    assert info["decode_loaded_bytes"] == blocks * c.plan.block_bytes
    assert c.prefill_info(req.rid)["hit_blocks"] == (1024 + HISTORY) // CFG.block_tokens
    same = [1] * CFG.user_tokens  # one prompt through every mode: one answer
    firsts = {}
    for mode, cluster in clusters.items():
        cluster.submit(turns[mode].request(same))
        firsts[mode] = cluster.next_done()[2]
    assert firsts["cxlrt"] == firsts["tcp"] == firsts["nocache"]


@pytest.mark.parametrize("group,base,case", [
    ("demo_ttft_vs_nocache", "nocache", "nocache"),
    ("demo_ttft_vs_nocache", "nocache", "cxlrt"),
    ("demo_ttft_vs_tcp", "tcp", "tcp"),
    ("demo_ttft_vs_tcp", "tcp", "cxlrt"),
    ("demo_ttft_vs_tcp_cache", "tcp_cache", "tcp_cache"),
    ("demo_ttft_vs_tcp_cache", "tcp_cache", "cxlrt"),
])
def test_demo_ttft(bench, clusters, turns, group, base, case):
    baseline = LABELS[base] if case == base else None
    note = "one request, 1280-token prefix cached, 64 new tokens; issue -> first token at decode"
    bench.describe(group, LABELS[case], baseline=baseline, note=note)
    seen: list = []
    paired = None if baseline else (LABELS[base], _ttft(clusters[base], turns[base]))
    _ttft(clusters[case], turns[case])()  # the prefix cached, also under --benchmark-disable
    last = bench.run(_ttft(clusters[case], turns[case], seen), rounds=ROUNDS, warmup=WARMUP,
                     paired=paired)
    split = _split_ms(clusters[case], seen[-ROUNDS:])  # the timed calls (all, if one)
    bench.extra_info["ttft_split_ms"] = split
    bench.extra_info["note"] = (note + "; median split ms " + " + ".join(
        f"{k} {split[k]:.2f}" for k in report.PARTS) + f" (transit {split['transit']:.3f})")
    if case == "cxlrt":
        _check(clusters, turns, last)
    if case == "tcp_cache":  # the prefix came from the worker's own cache
        assert clusters[case].prefill_info(last[0].rid)["hit_blocks"] == (
            (1024 + HISTORY) // CFG.block_tokens)


def test_demo_run(bench):
    cfg = demo.DemoConfig(conversations=2, turns=3, system_tokens=512)
    bench.describe("demo_run", "whole demo (ratios from its own run)", note="")
    out = bench.run(lambda: demo.run(cfg, show=False, out=lambda s: None), rounds=1,
                    warmup=0)
    assert out["ok"] is True
    r = out["ratios"]
    a, b, bc = r["cxlrt/nocache"], r["cxlrt/tcp"], r["cxlrt/tcp_cache"]
    bench.extra_info["demo"] = r
    bench.extra_info["note"] = (f"TTFT (c)/(a) mean {a['ttft_mean']:.2f}x p99 "
                                f"{a['ttft_p99']:.2f}x; (c)/(b) mean {b['ttft_mean']:.2f}x "
                                f"p99 {b['ttft_p99']:.2f}x; (c)/(b') mean {bc['ttft_mean']:.2f}x; "
                                f"{cfg.conversations} x {cfg.turns} turns, "
                                f"{cfg.system_tokens}-token system prompt")


@pytest.mark.parametrize("prefill", [1, 2])
def test_demo_turns(bench, prefill):
    """The default workload: (c)/(a) and (c)/(b') per turn, and the split that explains them."""
    cfg = demo.DemoConfig(prefill=prefill)
    bench.describe("demo_turns", f"default demo, P={prefill} (ratios from its own run)",
                   note="")
    t0 = time.monotonic()
    out = bench.run(lambda: demo.run(cfg, show=False, out=lambda s: None), rounds=1,
                    warmup=0)
    assert out["ok"] is True
    r, modes = out["ratios"], out["modes"]
    turns = []
    for t in range(cfg.turns):
        turns.append({
            "turn": t + 1,
            "c_over_a": r["cxlrt/nocache"]["turns"][t]["ttft_mean"],
            "c_over_b_cache": r["cxlrt/tcp_cache"]["turns"][t]["ttft_mean"],
            "c_over_b": r["cxlrt/tcp"]["turns"][t]["ttft_mean"],
            "ttft_ms": {m: 1e3 * modes[m]["turns"][t]["ttft_mean_s"] for m in modes},
            "split_ms": {m: {k: 1e3 * v for k, v in modes[m]["turns"][t]["ttft_split_s"].items()}
                         for m in modes},
        })
    bench.extra_info["turns"] = turns
    bench.extra_info["note"] = (
        "(c)/(a) per turn " + " ".join(f"{x['c_over_a']:.2f}x" for x in turns)
        + "; (c)/(b') " + " ".join(f"{x['c_over_b_cache']:.2f}x" for x in turns)
        + f"; turns 2+ <= 0.20x: {all(x['c_over_a'] <= 0.20 for x in turns[1:])}"
        + f"; {time.monotonic() - t0:.0f} s")
