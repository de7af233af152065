"""Real vLLM engines, side by side: cxlrt vs vLLM's ExampleConnector vs no connector.

Group ``engine_ttft``: one benchmark call runs ``cxlrt demo --engine vllm``'s
workload once (4 conversations x 4 turns sharing a 1024-token system prompt,
a prefill and a decode engine per mode, each its own process), all three
modes in the same run. The timed value is the whole run (engine starts
included); what matters is in ``extra_info``: per mode, per turn and overall,
TTFT mean and p99, prefix hit rate and KV bytes moved, and the ratios, among
them the issue's target, cxlrt / ExampleConnector on the mean TTFT of the
turns with a cached prefix (turn 2 on). Checked after timing: every mode's
tokens and first-token logprobs equal the no-connector run's.

Skips (with the reason) when vLLM is not installed: bash .ci/install-vllm.
"""

from __future__ import annotations

import importlib.util

import pytest

from cxlrt.serving import vllm_demo

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (bash .ci/install-vllm)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

CFG = vllm_demo.VllmDemoConfig()


def test_engine_ttft(benchmark):
    benchmark.group = "engine_ttft"
    report = benchmark.pedantic(vllm_demo.run, args=(CFG,), kwargs={"out": lambda *a: None},
                                rounds=1, iterations=1)
    assert report["ok"], {m: (r["tokens_equal"], r["first_logprob_max_diff"])
                          for m, r in report["modes"].items()}
    for r in report["modes"].values():
        r.pop("requests")
    benchmark.extra_info["engine"] = report
    ratio = report["ratios"]["cxlrt/example"]
    benchmark.extra_info["note"] = (
        f"TTFT cxlrt/ExampleConnector: mean {ratio['ttft_mean']:.2f}x, p99 "
        f"{ratio['ttft_p99']:.2f}x, turns with a cached prefix "
        f"{ratio['ttft_mean_cached_turns']:.2f}x")
    lines: list[str] = []
    vllm_demo.show(report, lines.append)
    print("\n" + "\n".join(lines))
