"""The demo's numbers: per turn and overall, per mode, and the table that shows them.

Definitions (the same in the table and in ``--json``):

prefix hit rate
    Of the prompt's full KV blocks, the share the prefill side found in the
    cache (cxlrt mode only; the other modes have no cache: ``None``).
KV bytes moved
    Bytes of KV that crossed the data plane: sent over TCP (b), or written to
    and read from the cxlrt region (c: stores, the prefill side's loads of the
    hit prefix, and the decode side's loads of every block). (a) moves none.
TTFT
    Request issue at the scheduler to the first token at the decode (or
    colocated) worker, seconds; mean and 99th percentile (linear interpolation).
prefill_s_mean
    Seconds a prefill worker spent on a request (taking it from the queue to
    handing it off), mean; ``None`` in (a), which has no prefill workers.
to_first_token_s_mean
    Seconds from a hand-off's arrival at the decode worker (in (a): the
    request's) to its first token, mean: KV loads or receives, recomputed
    blocks, the prompt's tail. TTFT less these two is time spent waiting.
TTFT split (``ttft_split_s``)
    Each request's TTFT cut at the moments its workers stamped (see
    :mod:`cxlrt.serving.workers`) into four parts that sum to it exactly:

    - ``queue``: issue to a prefill worker taking the request ((a): a colocated
      worker taking it);
    - ``kv_load``: looking the prompt's blocks up and loading the cached KV, at
      the prefill side ((b'), (c): hashing, lookup, the hit prefix) and at the
      decode side ((c): every block from the region);
    - ``compute``: the model's prefill at the prefill worker, and at the decode
      worker the prompt's last tokens up to the first token (and any block
      recomputed there);
    - ``handoff``: prefill done to decode starting on the request: (b), (b')
      the KV's send and receive over TCP, (c) the store into the cache and the
      channel message; both include any wait for a busy decode worker.
      ``handoff_detail_s`` splits it into ``send`` (store/send at the prefill
      worker) and ``transit`` (the rest).

    Per mode and turn the means; ``ttft_parts_s`` lists every request's parts, when
    it was issued (``issued_s``, after the mode's first request: queueing shows as
    requests issued together), and where they happened: ``handoff_send``,
    ``handoff_transit``, ``prefill_kv_load``, ``decode_kv_load``, ``prefill_compute``,
    ``decode_compute``.
tokens equal
    Every generated token equals the monolithic run's (whole prompt in one
    prefill, then greedy decode) for the same conversation and turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cxlrt.serving.scheduler import ModeRun, Reference, RequestResult

LABELS = {"nocache": "(a) no cache", "tcp": "(b) TCP", "tcp_cache": "(b') TCP+cache",
          "cxlrt": "(c) cxlrt"}
SHORT = {"nocache": "(a)", "tcp": "(b)", "tcp_cache": "(b')", "cxlrt": "(c)"}
_MOVED = {"nocache": (), "tcp": ("sent_bytes",), "tcp_cache": ("sent_bytes",),
          "cxlrt": ("stored_bytes", "prefill_loaded_bytes", "decode_loaded_bytes")}
_CACHED = ("tcp_cache", "cxlrt")  # modes with a prefix cache
PARTS = ("queue", "kv_load", "compute", "handoff")
"""The parts of a TTFT, in the order a request passes them (see the module docstring)."""


def ttft_split(r: RequestResult) -> dict[str, float]:
    """``r``'s TTFT in :data:`PARTS` (seconds), from its workers' time stamps; they sum to
    ``r.ttft_s`` (up to float rounding)."""
    i, t0 = r.info, r.t_issue
    t_first = t0 + r.ttft_s
    if "t_take" not in i:  # (a): one worker did it all
        return {"queue": i["t_start"] - t0, "kv_load": i["t_kv"] - i["t_start"],
                "compute": t_first - i["t_kv"], "handoff": 0.0}
    return {"queue": i["t_take"] - t0,
            "kv_load": (i["t_loaded"] - i["t_take"]) + (i["t_kv"] - i["t_start"]),
            "compute": (i["t_computed"] - i["t_loaded"]) + (t_first - i["t_kv"]),
            "handoff": i["t_start"] - i["t_computed"]}


def _handoff_detail(r: RequestResult) -> dict[str, float]:
    i = r.info
    if "t_take" not in i:
        return {"send": 0.0, "transit": 0.0}
    return {"send": i["t_sent"] - i["t_computed"], "transit": i["t_start"] - i["t_sent"]}


def _sides(r: RequestResult) -> dict[str, float]:
    """Where ``r``'s KV load and compute happened: the prefill or the decode side."""
    i = r.info
    pre = "t_take" in i
    return {"prefill_kv_load": i["t_loaded"] - i["t_take"] if pre else 0.0,
            "decode_kv_load": i["t_kv"] - i["t_start"],
            "prefill_compute": i["t_computed"] - i["t_loaded"] if pre else 0.0,
            "decode_compute": r.t_issue + r.ttft_s - i["t_kv"]}


def _mean_parts(parts: list[dict[str, float]], names: Iterable[str]) -> dict[str, float]:
    return {k: float(np.mean([p[k] for p in parts])) if parts else 0.0 for k in names}


def _sum(rs: Iterable[RequestResult], key: str) -> float:
    return sum(r.info.get(key, 0) for r in rs)


LOGITS_TOL = 1e-3
"""Largest first-token logit difference from the monolithic run that still counts as the
same KV: prefill in pieces differs from prefill at once by about 1e-5 in float32, while a
wrong block moves the logits by far more (and may or may not change a greedy token)."""


def _logits_diff(rs: list[RequestResult], ref: Reference) -> float:
    return max((float(np.abs(r.first_logits - ref.logits[r.conv][r.turn]).max()) for r in rs),
               default=0.0)


def _stats(mode: str, rs: list[RequestResult], ref: Reference) -> dict[str, Any]:
    ttft = np.array([r.ttft_s for r in rs])
    diff = _logits_diff(rs, ref)
    blocks = _sum(rs, "blocks")
    out: dict[str, Any] = {
        "requests": len(rs),
        "prompt_tokens": sum(r.prompt_tokens for r in rs),
        "prefix_hit_rate": (_sum(rs, "hit_blocks") / blocks if blocks else 0.0)
        if mode in _CACHED else None,
        "kv_bytes_moved": sum(_sum(rs, k) for k in _MOVED[mode]),
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tokens_equal": all(r.tokens == ref.tokens[r.conv][r.turn] for r in rs),
        "logits_max_diff": diff,
        "logits_match": diff <= LOGITS_TOL,
        "prefill_s_mean": _sum(rs, "prefill_s") / len(rs) if mode != "nocache" else None,
        "to_first_token_s_mean": _sum(rs, "to_first_token_s") / len(rs),
        "ttft_split_s": _mean_parts([ttft_split(r) for r in rs], PARTS),
        "handoff_detail_s": _mean_parts([_handoff_detail(r) for r in rs], ("send", "transit")),
    }
    if mode != "nocache":
        out["blocks"] = blocks
        out["computed_blocks"] = _sum(rs, "computed_blocks")
    if mode == "tcp_cache":
        out["hit_blocks"] = _sum(rs, "hit_blocks")
    if mode == "cxlrt":
        out["hit_blocks"] = _sum(rs, "hit_blocks")
        out["kv_bytes"] = {k: _sum(rs, k) for k in _MOVED[mode]}
        out["decode_recomputed_blocks"] = _sum(rs, "decode_recomputed_blocks")
    return out


def _ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    return {"ttft_mean": a["ttft_mean_s"] / b["ttft_mean_s"],
            "ttft_p99": a["ttft_p99_s"] / b["ttft_p99_s"]}


def summarize(runs: dict[str, ModeRun], ref: Reference, turns: int) -> dict[str, Any]:
    """Per mode: ``overall``, ``turns`` (a list, turn 1 first) and the run's facts;
    plus ``ratios`` of cxlrt to each other mode, overall and per turn, and ``ttft_parts``
    (the names of the TTFT split's parts, in order)."""
    modes: dict[str, Any] = {}
    for mode, run in runs.items():
        t0 = min((r.t_issue for r in run.requests), default=0.0)
        modes[mode] = {
            "label": LABELS[mode],
            "wall_s": run.wall_s,
            "overall": _stats(mode, run.requests, ref),
            "turns": [dict(turn=t + 1, **_stats(mode, [r for r in run.requests if r.turn == t],
                                                 ref))
                      for t in range(turns)],
            "workers": run.workers,
            "ttft_parts_s": [dict(rid=r.rid, conv=r.conv, turn=r.turn + 1,
                                  issued_s=r.t_issue - t0, ttft_s=r.ttft_s, **ttft_split(r),
                                  **{f"handoff_{k}": v for k, v in _handoff_detail(r).items()},
                                  **_sides(r))
                             for r in run.requests],
        }
        modes[mode]["tokens_equal"] = modes[mode]["overall"]["tokens_equal"]
        modes[mode]["logits_match"] = modes[mode]["overall"]["logits_match"]
    ratios: dict[str, Any] = {}
    if "cxlrt" in modes:
        c = modes["cxlrt"]
        for other in ("nocache", "tcp", "tcp_cache"):
            if other in modes:
                o = modes[other]
                ratios[f"cxlrt/{other}"] = dict(
                    _ratios(c["overall"], o["overall"]),
                    turns=[_ratios(ct, ot) for ct, ot in zip(c["turns"], o["turns"],
                                                             strict=True)])
    return {"modes": modes, "ratios": ratios, "ttft_parts": list(PARTS)}


# --- the table ---------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


def _verdict(s: dict[str, Any]) -> str:
    if not s["tokens_equal"]:
        return "DIFFER"
    return "equal" if s["logits_match"] else "LOGITS DIFFER"


def table(summary: dict[str, Any]) -> list[str]:
    """The report as lines: one row per (turn, mode), then the overall rows."""
    modes, ratios = summary["modes"], summary["ratios"]
    others = [o for o in ("nocache", "tcp", "tcp_cache") if f"cxlrt/{o}" in ratios]
    head = (f"{'turn':>4}  {'mode':<15}{'prefix hit':>10}  {'KV moved':>10}  "
            f"{'TTFT mean':>9}  {'TTFT p99':>9}  "
            + "".join(f"{'(c)/' + SHORT[o]:>9}  " for o in others) + "tokens")
    lines = [head, "-" * len(head)]
    n_turns = len(next(iter(modes.values()))["turns"])

    def row(label: str, mode: str, s: dict[str, Any], t: int | None) -> str:
        hit = "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.0%}"
        cells = ""
        for other in others:
            r = ratios[f"cxlrt/{other}"] if mode == "cxlrt" else None
            ratio = "" if r is None else f"{(r if t is None else r['turns'][t])['ttft_mean']:.2f}x"
            cells += f"{ratio:>9}  "
        return (f"{label:>4}  {LABELS[mode]:<15}{hit:>10}  {human_bytes(s['kv_bytes_moved']):>10}  "
                f"{_ms(s['ttft_mean_s']):>9}  {_ms(s['ttft_p99_s']):>9}  {cells}{_verdict(s)}")

    for t in range(n_turns):
        for mode, m in modes.items():
            lines.append(row(str(t + 1), mode, m["turns"][t], t))
    lines.append("-" * len(head))
    for mode, m in modes.items():
        lines.append(row("all", mode, m["overall"], None))
    return lines


def split_table(summary: dict[str, Any]) -> list[str]:
    """Mean TTFT per (turn, mode) split into queueing, KV load, compute and hand-off."""
    modes = summary["modes"]
    head = (f"{'turn':>4}  {'mode':<15}{'TTFT mean':>9} = {'queue':>8} + {'KV load':>8} + "
            f"{'compute':>8} + {'hand-off':>8}   (hand-off: send + transit)")
    lines = ["mean TTFT split per turn:", head, "-" * len(head)]
    n_turns = len(next(iter(modes.values()))["turns"])

    def row(label: str, mode: str, s: dict[str, Any]) -> str:
        p, h = s["ttft_split_s"], s["handoff_detail_s"]
        return (f"{label:>4}  {LABELS[mode]:<15}{_ms(s['ttft_mean_s']):>9} = "
                + " + ".join(f"{_ms(p[k]):>8}" for k in PARTS)
                + ("" if mode == "nocache" else
                   f"   ({_ms(h['send'])} + {_ms(h['transit'])})"))

    for t in range(n_turns):
        for mode, m in modes.items():
            lines.append(row(str(t + 1), mode, m["turns"][t]))
    lines.append("-" * len(head))
    for mode, m in modes.items():
        lines.append(row("all", mode, m["overall"]))
    return lines


def notes(summary: dict[str, Any], prefill_workers: int) -> list[str]:
    """The lines under the table: overall ratios, where TTFT goes, what each mode moved."""
    modes, lines = summary["modes"], []
    for key, r in summary["ratios"].items():
        other = LABELS[key.split("/")[1]]
        lines.append(f"cxlrt TTFT vs {other}: mean {r['ttft_mean']:.2f}x, "
                     f"p99 {r['ttft_p99']:.2f}x")
    if "tcp" in modes:
        t = modes["tcp"]["overall"]
        lines.append(f"(b) TCP: {prefill_workers} prefill worker(s) computed all "
                     f"{t['computed_blocks']} prompt blocks and sent "
                     f"{human_bytes(t['kv_bytes_moved'])} over loopback TCP")
    if "tcp_cache" in modes:
        t = modes["tcp_cache"]["overall"]
        lines.append(f"(b') TCP+cache: {t['hit_blocks']} of {t['blocks']} prompt blocks came "
                     f"from the prefill workers' own caches, {t['computed_blocks']} were "
                     f"computed; {human_bytes(t['kv_bytes_moved'])} sent over loopback TCP")
    if "cxlrt" in modes:
        c = modes["cxlrt"]["overall"]
        moved = ", ".join(f"{human_bytes(v)} {k.replace('_bytes', '').replace('_', ' ')}"
                          for k, v in c["kv_bytes"].items())
        lines.append(f"(c) cxlrt: {c['hit_blocks']} of {c['blocks']} prompt blocks came from "
                     f"the cache, {c['computed_blocks']} were computed; {moved}; "
                     f"{c['decode_recomputed_blocks']} blocks recomputed at decode (evicted)")
    return lines

