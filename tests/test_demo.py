"""The serving demo: the model's chunked prefill, and the three modes against the monolithic run.

The demo runs in this process (its workers are forked from it) with the quick
preset, once per configuration; `tests/test_cli.py` runs it through the command.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from cxlrt import demo
from cxlrt.serving import handoff, scheduler
from cxlrt.serving.model import ModelConfig, TinyLM
from cxlrt.serving.workload import WorkloadConfig, make_workload

STAT_FIELDS = {"requests", "prompt_tokens", "prefix_hit_rate", "kv_bytes_moved", "ttft_mean_s",
               "ttft_p99_s", "tokens_equal", "ttft_split_s", "handoff_detail_s"}
MODES = ("nocache", "tcp", "tcp_cache", "cxlrt")


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(ModelConfig(seed=3))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


# --- the model --------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [[0, 300], [0, 16, 160, 299, 300], [0, 1, 2, 150, 300]],
                         ids=["whole", "blocks+tail", "ragged"])
def test_chunked_prefill_equals_full_prefill(model, cuts):
    """Prefill in pieces (past KV + new tokens) = prefill at once: KV, logits, tokens."""
    tokens = _prompt(300)
    full = model.new_kv(300 + 12)
    logits_full = model.prefill(tokens, full, 0)
    kv = model.new_kv(300 + 12)
    for a, b in itertools.pairwise(cuts):
        logits = model.prefill(tokens[a:b], kv, a)
    np.testing.assert_allclose(kv[:300], full[:300], rtol=0, atol=1e-4)
    np.testing.assert_allclose(logits, logits_full, rtol=0, atol=1e-3)
    assert model.decode(logits, kv, 300, 12) == model.decode(logits_full, full, 300, 12)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_margin_dwarfs_chunking_rounding(model, seed):
    """The exactness argument (model docstring): chunked and full prefill differ by
    float32 rounding only, and ``logit_scale`` keeps the top two logits apart by far
    more, so the greedy token cannot flip."""
    tokens = _prompt(200, 10 + seed)
    full, kv = model.new_kv(200), model.new_kv(200)
    logits_full = model.prefill(tokens, full, 0)
    for a, b in itertools.pairwise([0, 16, 128, 199, 200]):
        logits = model.prefill(tokens[a:b], kv, a)
    diff = float(np.abs(logits - logits_full).max())
    top2 = np.sort(logits_full)[-2:]
    assert diff < 1e-3
    assert top2[1] - top2[0] > 100 * diff, (top2, diff)
    assert logits.dtype == logits_full.dtype == kv.dtype == np.float32


def test_attention_is_causal(model):
    """A later token's KV never reaches back: the KV of a prefix is the prefix's own."""
    tokens = _prompt(48, 5)
    a, b = model.new_kv(48), model.new_kv(48)
    model.prefill(tokens, a, 0)
    model.prefill(tokens[:32] + _prompt(16, 6), b, 0)
    np.testing.assert_array_equal(a[:32], b[:32])
    assert not np.allclose(a[32:], b[32:])


def test_prefill_depends_on_the_past(model):
    """A negative control: the same new tokens after a different past give other logits."""
    tokens, other = _prompt(64, 1), _prompt(64, 2)
    a, b = model.new_kv(80), model.new_kv(80)
    model.prefill(tokens[:48], a, 0)
    model.prefill(other[:48], b, 0)
    assert not np.allclose(model.prefill(tokens[48:], a, 48), model.prefill(tokens[48:], b, 48))


def test_kv_blocks_are_contiguous_and_sized(model):
    """A block of the KV is one contiguous slice of block_bytes: what cxlrt and TCP carry."""
    cfg = model.cfg
    kv = model.new_kv(64)
    model.prefill(_prompt(64), kv, 0)
    block = kv[16:32]
    assert block.flags.c_contiguous and block.dtype == np.float32
    assert block.nbytes == cfg.block_bytes(16) == 16 * 4 * 2 * 256 * 4
    copy = model.new_kv(64)  # blocks copied byte for byte continue the same way
    copy.reshape(-1).view(np.uint8)[:] = kv.reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(model.prefill([5], copy, 64 - 1), model.prefill([5], kv, 64 - 1))


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = TinyLM(ModelConfig(seed=1)), TinyLM(ModelConfig(seed=1)), TinyLM(ModelConfig(seed=2))
    for name in ("qkv", "o", "up", "down"):
        assert np.array_equal(a.layers[-1][name], b.layers[-1][name])
        assert not np.array_equal(a.layers[-1][name], c.layers[-1][name])
    assert np.array_equal(a.embed, b.embed) and np.array_equal(a.unembed, b.unembed)
    assert not np.array_equal(a.unembed, c.unembed)
    assert a.layers[0]["qkv"].dtype == np.float32


_WEIGHTS_DIGEST = """
import hashlib
from cxlrt.serving.model import ModelConfig, TinyLM
m = TinyLM(ModelConfig(seed=1))
h = hashlib.sha256(m.embed.tobytes() + m.unembed.tobytes())
for p in m.layers:
    for w in p.values():
        h.update(w.tobytes())
digest = h.hexdigest()
"""


def test_same_seed_same_weights_in_another_process():
    """Every worker builds the model itself: a fresh process gets the same bits."""
    import subprocess
    import sys
    here: dict = {}
    exec(_WEIGHTS_DIGEST, here)
    out = subprocess.run([sys.executable, "-c", _WEIGHTS_DIGEST + "print(digest)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here["digest"]


@pytest.mark.parametrize("bad,msg", [([], "non-empty"), ([512], r"\[0, 512\)"),
                                     ([-1], r"\[0, 512\)")])
def test_prefill_rejects_bad_tokens(model, bad, msg):
    with pytest.raises(ValueError, match=msg):
        model.prefill(bad, model.new_kv(4), 0)


def test_prefill_rejects_a_kv_buffer_too_small(model):
    with pytest.raises(ValueError, match="holds 4 tokens"):
        model.prefill([1, 2, 3], model.new_kv(4), 2)


# --- the workload and the hand-off -------------------------------------------------


def test_workload_prompts_grow_by_history_and_share_the_system_prompt():
    cfg = WorkloadConfig(conversations=2, turns=3, system_tokens=40, user_tokens=5, new_tokens=3)
    wl = make_workload(cfg)
    answers = [[7, 7, 7], [8, 8, 8]]
    p0, p2 = wl.prompt(0, 0, answers), wl.prompt(0, 2, answers)
    assert len(p0) == cfg.prompt_tokens(0) == 45 and len(p2) == cfg.prompt_tokens(2) == 61
    assert p2[:45] == p0 and p2[45:50] == [7, 7, 7] + wl.users[0][1][:2]
    assert wl.prompt(1, 0, [])[:40] == p0[:40] == wl.system
    assert wl.prompt(1, 0, [])[40:] != p0[40:]
    assert make_workload(cfg).users == wl.users  # deterministic
    with pytest.raises(ValueError, match="answers to 2 earlier turns"):
        wl.prompt(0, 2, answers[:1])


def test_handoff_message_round_trip_and_truncation():
    import numpy as np
    h = handoff.Handoff(9, np.arange(40, dtype=np.int32), 5, 2, [b"k" * 16, b"q" * 16])
    msg = handoff.encode(h)
    assert len(msg) <= handoff.message_bytes(40, 16)
    back = handoff.decode(msg)
    assert (back.rid, back.n_new, back.n_blocks, back.keys) == (9, 5, 2, h.keys)
    assert back.tokens.tolist() == list(range(40))
    with pytest.raises(ValueError, match="header says"):
        handoff.decode(msg[:-1])
    assert handoff.decode(handoff.encode(handoff.stop())).is_stop


# --- the demo ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick():
    lines: list[str] = []
    report = demo.run(demo.DemoConfig.quick(), show=False, out=lines.append)
    return report, lines


def test_every_mode_generates_the_monolithic_tokens(quick):
    report, lines = quick
    assert report["ok"] is True
    for mode in MODES:
        m = report["modes"][mode]
        assert m["tokens_equal"] is True
        assert m["logits_match"] is True and m["overall"]["logits_max_diff"] < 1e-4
        assert all(t["tokens_equal"] for t in m["turns"])
    assert any(line.startswith("tokens equal to the monolithic run:") and line.count("yes") == 4
               for line in lines)


def test_cxlrt_mode_hits_the_prefix_cache_after_turn_1(quick):
    report, _ = quick
    turns = report["modes"]["cxlrt"]["turns"]
    assert all(t["prefix_hit_rate"] > 0 for t in turns[1:])
    # each later turn repeats the whole earlier conversation: it hits more
    assert turns[-1]["prefix_hit_rate"] > turns[0]["prefix_hit_rate"]
    c = report["modes"]["cxlrt"]["overall"]
    assert c["computed_blocks"] == c["blocks"] - c["hit_blocks"] < c["blocks"]
    for mode in ("nocache", "tcp"):
        assert report["modes"][mode]["overall"]["prefix_hit_rate"] is None


def test_cxlrt_mode_moves_its_kv_through_cxlrt(quick):
    """Every prompt block reaches decode through the cache; the cache's own counters agree."""
    report, _ = quick
    bb = report["model"]["block_bytes"]
    c = report["modes"]["cxlrt"]["overall"]
    kv, cache = c["kv_bytes"], report["cache"]
    assert c["decode_recomputed_blocks"] == 0
    assert kv["decode_loaded_bytes"] == c["blocks"] * bb
    assert 0 < kv["prefill_loaded_bytes"] <= c["hit_blocks"] * bb  # only prefixes it extends
    assert kv["stored_bytes"] == c["computed_blocks"] * bb > 0
    assert c["kv_bytes_moved"] == sum(kv.values())
    assert cache["bytes_stored"] == kv["stored_bytes"]
    assert cache["bytes_loaded"] == kv["prefill_loaded_bytes"] + kv["decode_loaded_bytes"]
    assert cache["occupancy"] == c["computed_blocks"]
    tcp = report["modes"]["tcp"]["overall"]
    assert tcp["kv_bytes_moved"] == tcp["blocks"] * bb == c["blocks"] * bb
    assert report["modes"]["nocache"]["overall"]["kv_bytes_moved"] == 0


def test_report_has_the_documented_fields(quick):
    report, lines = quick
    assert {"ok", "config", "model", "region", "reference", "modes", "ratios", "cache",
            "wall_s"} <= set(report)
    cfg = demo.DemoConfig.quick()
    assert tuple(report["modes"]) == MODES
    assert report["ttft_parts"] == ["queue", "kv_load", "compute", "handoff"]
    for m in report["modes"].values():
        assert {"label", "wall_s", "tokens_equal", "overall", "turns", "workers"} <= set(m)
        assert STAT_FIELDS <= set(m["overall"])
        assert [t["turn"] for t in m["turns"]] == list(range(1, cfg.turns + 1))
        assert sum(t["requests"] for t in m["turns"]) == cfg.conversations * cfg.turns
        assert 0 < m["overall"]["ttft_mean_s"] <= m["overall"]["ttft_p99_s"]
    for key in ("cxlrt/nocache", "cxlrt/tcp", "cxlrt/tcp_cache"):
        r = report["ratios"][key]
        assert r["ttft_mean"] > 0 and r["ttft_p99"] > 0 and len(r["turns"]) == cfg.turns
    assert report["region"]["spec"].startswith("emu:/")
    assert report["region"]["nodes"] == cfg.prefill + cfg.decode + 1
    path = report["region"]["spec"][4:].split("?")[0]
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))  # cleaned up
    table = "\n".join(lines)
    assert "(c)/(a)" in table and "(c) cxlrt" in table and "DIFFER" not in table
    assert "(c)/(b')" in table and "(b') TCP+cache" in table and "mean TTFT split" in table


def test_ttft_split_sums_to_the_ttft_in_every_mode(quick):
    """Each request's queueing + KV load + compute + hand-off is its TTFT; the means too."""
    report, _ = quick
    cfg = demo.DemoConfig.quick()
    for mode in MODES:
        m = report["modes"][mode]
        parts = m["ttft_parts_s"]
        assert len(parts) == cfg.conversations * cfg.turns
        for p in parts:
            assert sum(p[k] for k in report["ttft_parts"]) == pytest.approx(p["ttft_s"], abs=1e-6)
            assert all(p[k] >= -1e-6 for k in report["ttft_parts"])  # stamps in time order
            assert p["compute"] > 0
        by_conv = sorted(parts, key=lambda p: (p["conv"], p["turn"]))
        assert min(p["issued_s"] for p in parts) == 0.0
        for p, nxt in zip(by_conv, by_conv[1:], strict=False):
            if nxt["conv"] == p["conv"]:  # a closed loop: the next turn after this answer
                assert nxt["issued_s"] >= p["issued_s"] + p["ttft_s"]
        for s in [m["overall"], *m["turns"]]:
            split = s["ttft_split_s"]
            assert set(split) == set(report["ttft_parts"])
            assert sum(split.values()) == pytest.approx(s["ttft_mean_s"], abs=1e-6)
        if mode == "nocache":
            assert m["overall"]["ttft_split_s"]["handoff"] == 0.0
        else:
            h = m["overall"]["handoff_detail_s"]
            assert h["send"] + h["transit"] == pytest.approx(
                m["overall"]["ttft_split_s"]["handoff"], abs=1e-6)
    # KV is loaded only where there is a cache to load it from
    assert report["modes"]["nocache"]["overall"]["ttft_split_s"]["kv_load"] == 0.0
    assert report["modes"]["cxlrt"]["overall"]["ttft_split_s"]["kv_load"] > 0


def test_tcp_cache_mode_hits_its_own_cache_and_sends_every_block(quick):
    """(b') computes what (c) computes and sends what (b) sends."""
    report, _ = quick
    b, bc, c = (report["modes"][m]["overall"] for m in ("tcp", "tcp_cache", "cxlrt"))
    assert bc["hit_blocks"] == c["hit_blocks"] > 0  # one prefill worker: the same hits
    assert bc["computed_blocks"] == c["computed_blocks"] < b["computed_blocks"]
    assert bc["kv_bytes_moved"] == b["kv_bytes_moved"] == bc["blocks"] * report["model"][
        "block_bytes"]
    assert report["modes"]["tcp_cache"]["turns"][-1]["prefix_hit_rate"] > 0


def test_local_prefix_cache_is_a_bounded_lru_of_leading_runs():
    from cxlrt.serving.workers import LocalPrefixCache
    kv = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)  # 3 blocks of 2 tokens
    cache = LocalPrefixCache(3)
    assert cache.lookup([b"a", b"b"]) == []
    assert cache.store([b"a", b"b", b"c"], kv, 2) == 3
    kv[:] = -1  # the cache keeps copies
    hit = cache.lookup([b"a", b"b", b"x", b"c"])  # a leading run: stops at the miss
    assert [h.tolist() for h in hit] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert cache.store([b"d"], kv[:2], 2) == 1  # full: the least recently used (c) goes
    assert len(cache.blocks) == 3 and cache.evicted == 1 and b"c" not in cache.blocks
    assert len(cache.lookup([b"a", b"b"])) == 2


def test_an_evicting_cache_is_recomputed_at_decode_and_still_exact():
    """A cache too small for one prompt: decode misses blocks, recomputes them, counts them."""
    report = demo.run(demo.DemoConfig.quick(cache_blocks=3, modes=("cxlrt",), prefill=2),
                      show=False, out=lambda s: None)
    c = report["modes"]["cxlrt"]["overall"]
    assert report["ok"] is True and c["tokens_equal"] is True
    assert c["decode_recomputed_blocks"] > 0
    assert report["cache"]["occupancy"] <= 3


def test_a_mismatch_is_reported_and_fails(monkeypatch):
    """If the reference differs (as a wrong KV would make it), the demo says so and fails."""
    real = scheduler.reference

    def wrong(*args, **kw):
        ref = real(*args, **kw)
        ref.tokens[1][1][0] = (ref.tokens[1][1][0] + 1) % 512
        return ref

    monkeypatch.setattr(scheduler, "reference", wrong)
    lines: list[str] = []
    report = demo.run(demo.DemoConfig.quick(modes=("tcp",)), show=False, out=lines.append)
    assert report["ok"] is False
    tcp = report["modes"]["tcp"]
    assert tcp["tokens_equal"] is False
    assert [t["tokens_equal"] for t in tcp["turns"]] == [True, False, True]
    assert any("MISMATCH" in line for line in lines)


@pytest.mark.parametrize("kw,msg", [({"prefill": 0}, "prefill must be"),
                                    ({"decode": -1}, "decode must be"),
                                    ({"turns": 1.5}, "turns must be"),
                                    ({"prefill": 40, "decode": 40}, "at most 64"),
                                    ({"modes": ("udp",)}, "modes must be"),
                                    ({"modes": ()}, "modes must be"),
                                    ({"cache_blocks": 0}, "cache_blocks")])
def test_bad_config_is_a_clear_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        demo.DemoConfig(**kw)


class _WrongBlockCache:
    """A decode node's view of the cache that loads wrong KV (the demo must notice)."""

    def __init__(self, cache, block_tokens, how):
        self._cache, self._bt, self._how = cache, block_tokens, how

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def load(self, hit, out, **kw):
        self._cache.load(hit, out, **kw)
        bt, n = self._bt, len(hit)
        if self._how == "swapped" and n > 1:  # block 1 gets block 0's KV
            out[bt:2 * bt] = out[:bt]
        elif self._how == "scaled" and n > 2:  # the middle block, off by a factor
            m = n // 2
            out[m * bt:(m + 1) * bt] *= 0.5
        elif self._how == "one-value" and n:  # one number of the last block's V
            out[n * bt - 1].reshape(-1)[-1] += 1.0  # a view: the row is contiguous
        return out


@pytest.mark.parametrize("how", ["swapped", "scaled", "one-value"])
def test_wrong_kv_at_decode_changes_the_tokens(monkeypatch, how):
    """The token check is a real check: one wrong KV block must make the tokens differ."""
    from cxlrt.serving import workers
    real = workers._attach

    def attach(plan, node):
        region, cache = real(plan, node)
        if node >= plan.decode_node(0):
            cache = _WrongBlockCache(cache, plan.block_tokens, how)
        return region, cache

    monkeypatch.setattr(workers, "_attach", attach)
    lines: list[str] = []
    report = demo.run(demo.DemoConfig.quick(modes=("cxlrt",)), show=False, out=lines.append)
    c = report["modes"]["cxlrt"]
    assert report["ok"] is False
    assert c["logits_match"] is False and c["overall"]["logits_max_diff"] > 1e-3
    if how != "one-value":  # a whole wrong block also changes greedy tokens here
        assert c["tokens_equal"] is False
    assert any("MISMATCH" in line for line in lines)


def test_a_failing_worker_stops_the_demo_cleanly(monkeypatch, capsys):
    """A worker that crashes: one error line, exit status 3, no process or file left."""
    import multiprocessing as mp

    from cxlrt import cli
    from cxlrt.serving import workers

    def broken(who, results, plan, d):
        raise RuntimeError("decode worker broke on purpose")

    monkeypatch.setattr(workers, "decode_cxlrt", broken)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert cli.main(["demo", "--quick"]) == 3
    err = capsys.readouterr().err
    assert "failed" in err and "broke on purpose" in err
    assert mp.active_children() == []
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {f for f in after - before if f.startswith("cxlrt-demo")}
