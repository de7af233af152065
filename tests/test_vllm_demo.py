"""`cxlrt demo --engine vllm` on a reduced workload: real vLLM engines, three ways.

One run (module fixture, about 3 minutes on two cores: six engines start) serves
2 conversations x 2 turns through a prefill and a decode engine per mode, each
its own process, and the tests read its report. Without vLLM the engine tests
skip (an error under CXLRT_REQUIRE_ENGINES=1); the command's missing-engine
message and the equality check are tested without it.
"""

import argparse

import pytest

from cxlrt.serving import vllm_demo

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def report():
    from tests.engines import require
    require("vllm", "vLLM is not installed (bash .ci/install-vllm)")
    return vllm_demo.run(vllm_demo.VllmDemoConfig.quick(), out=lambda *a: None)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_mode_equals_the_run_without_a_connector(report):
    assert report["ok"]
    for mode in vllm_demo.MODES:
        r = report["modes"][mode]
        assert r["tokens_equal"] and r["first_logprob_max_diff"] <= vllm_demo.LOGPROB_TOL, mode


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_connectors_move_kv_between_the_engines(report):
    m = report["modes"]
    assert m["nocache"]["kv_bytes_moved"] == 0
    for mode in ("example", "cxlrt"):
        assert m[mode]["prefill_stats"]["stored_bytes"] > 0, mode
        assert m[mode]["decode_stats"]["loaded_bytes"] > 0, mode
    assert m["cxlrt"]["decode_stats"]["load_errors"] == 0
    # Turn 1 of the decode engine: vLLM's own cache has nothing of conversation 0's prompt;
    # a connector gives it every full block the prefill engine stored.
    assert m["nocache"]["requests"][0]["cached"] == 0
    for mode in ("example", "cxlrt"):
        r = m[mode]["requests"][0]
        assert r["cached"] == (r["prompt_tokens"] - 1) // vllm_demo.BLOCK * vllm_demo.BLOCK
    assert set(report["ratios"]) == {"cxlrt/example", "cxlrt/nocache", "example/nocache"}


def test_a_changed_token_or_logprob_is_a_difference():
    ref = {"requests": [{"tokens": [1, 2], "first_logprob": -1.0}]}
    same = {"requests": [{"tokens": [1, 2], "first_logprob": -1.0 + 1e-5}]}
    other_token = {"requests": [{"tokens": [1, 3], "first_logprob": -1.0}]}
    other_logprob = {"requests": [{"tokens": [1, 2], "first_logprob": -1.1}]}
    assert vllm_demo._compare(same, ref)["equal"]
    assert not vllm_demo._compare(other_token, ref)["equal"]
    assert not vllm_demo._compare(other_logprob, ref)["equal"]


def test_without_vllm_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(vllm_demo, "vllm_available", lambda: False)
    assert vllm_demo.main(argparse.Namespace(json=False, quick=True)) == 2
    assert "install-vllm" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError, match="install-vllm"):
        vllm_demo.run(vllm_demo.VllmDemoConfig.quick())
