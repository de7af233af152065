"""The demo's time to first token: cxlrt (c) against no cache (a) and KV over TCP (b).

Groups ``demo_ttft_vs_nocache`` and ``demo_ttft_vs_tcp`` each have a baseline
row, (a) or (b), and a ``(c) cxlrt`` row whose every round is paired with a
baseline request run just before it. All three modes' workers are those of
``cxlrt demo`` (1 prefill + 1 decode process, (a) colocated), started once.
One benchmark call issues one request and returns when its first token is out
at the decode worker: a later turn of a conversation, 1024 tokens of shared
system prompt and 256 of history (in the cxlrt cache since the warm-up round),
plus 64 new user tokens. The request asks for one token, so nothing runs on
after the call; its time is the TTFT plus the control plane's queue hops, the
same in every mode. So the ratio is the TTFT ratio of an unloaded server.

Group ``demo_run`` runs the whole demo once (a smaller workload, every
conversation in flight at once, so TTFT includes queueing) and reports its
overall TTFT ratios in the row's note and in ``extra_info["demo"]``: the same
numbers ``cxlrt demo`` prints, measured with its baselines in the same run.

Checks after timing: every mode generates the same token for the same prompt;
the cxlrt rows hit the whole cached prefix and decode loads every block;
the demo run's tokens equal its monolithic run's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import numpy as np
import pytest

from cxlrt import demo
from cxlrt.serving.scheduler import Cluster
from cxlrt.serving.workers import Request
from cxlrt.serving.workload import make_workload

CFG = demo.DemoConfig(system_tokens=1024, user_tokens=64, new_tokens=1)
HISTORY = 256   # tokens of earlier turns, after the system prompt (80 blocks in all)
ROUNDS = 5
WARMUP = 1      # fills the cxlrt cache with the prefix; not what we time
LABELS = {"nocache": "(a) no cache", "tcp": "(b) TCP", "cxlrt": "(c) cxlrt"}


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[str, Cluster]]:
    """A running cluster per mode; the cxlrt one on a fresh emulated rack."""
    with demo.rack(CFG) as rack, ExitStack() as stack:
        yield {mode: stack.enter_context(Cluster(mode, rack.plan))
               for mode in ("nocache", "tcp", "cxlrt")}


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
    return {mode: Turns() for mode in ("nocache", "tcp", "cxlrt")}


def _ttft(cluster: Cluster, turns: Turns) -> Callable[[], tuple]:
    def call() -> tuple:
        req = turns.request()
        cluster.submit(req)
        rid, _t_first, tokens, info = cluster.next_done()
        assert rid == req.rid
        return req, tokens, info
    return call


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
])
def test_demo_ttft(bench, clusters, turns, group, base, case):
    baseline = LABELS[base] if case == base else None
    bench.describe(group, LABELS[case], baseline=baseline,
                   note="one request, 1280-token prefix cached, 64 new tokens; issue -> "
                        "first token at decode")
    paired = None if baseline else (LABELS[base], _ttft(clusters[base], turns[base]))
    last = bench.run(_ttft(clusters[case], turns[case]), rounds=ROUNDS, warmup=WARMUP,
                     paired=paired)
    if case == "cxlrt":
        _check(clusters, turns, last)


def test_demo_run(bench):
    cfg = demo.DemoConfig(conversations=2, turns=3, system_tokens=512)
    bench.describe("demo_run", "whole demo (ratios from its own run)", note="")
    report = bench.run(lambda: demo.run(cfg, show=False, out=lambda s: None), rounds=1,
                       warmup=0)
    assert report["ok"] is True
    r = report["ratios"]
    a, b = r["cxlrt/nocache"], r["cxlrt/tcp"]
    bench.extra_info["demo"] = r
    bench.extra_info["note"] = (f"TTFT (c)/(a) mean {a['ttft_mean']:.2f}x p99 "
                                f"{a['ttft_p99']:.2f}x; (c)/(b) mean {b['ttft_mean']:.2f}x "
                                f"p99 {b['ttft_p99']:.2f}x; {cfg.conversations} x {cfg.turns} "
                                f"turns, {cfg.system_tokens}-token system prompt")
