"""The crash/stall harness's channel family: every ``chan.*`` point (issue 9).

One channel; the victim (node 1) holds one of its roles: the producer for ``chan.send*``,
the consumer for ``chan.recv*``, either (the variant) for ``chan.claim``. Node 0 holds
the other role for the whole case, and every other node is a *standby* for the victim's
role: it keeps asking for the role (ChannelBusyError while the victim lives) and, once
it has it, carries on in it. A standby that sees another standby holding the role stops
asking (so nobody takes over a live winner at the end of the case, when the winner
closes its channel).

Every message names its sender (the process's index in the case) and its number and
is derived from those, with a length that varies; every receiver checks each message's
bytes, and the ledgers record each send before (``m?``) and after (``m``) and each
receive (``r``). Afterwards:

- the messages received, in order (the victim's, then the winning standby's), are
  exactly the acknowledged sends in order: the victim's acknowledged messages, then the
  new producer's; where the victim was killed after publishing its tail
  (``chan.send.post``) its unacknowledged message follows its acknowledged ones; where a
  consumer was killed after publishing its head (``chan.recv.post``) exactly the message
  after its last acknowledged one is missing (at most once, documented), nothing more;
- no message a resumed stalled owner was told it did not send is received, and after
  resuming it never completes a second call (ChannelRoleLostError);
- no standby held the role before the victim's last acknowledged call, and at most one
  standby ever held it;
- the role was had again within the bound (the driver's recovery check, resource
  ``role``), and the other end went on (resource ``chan``).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import cxlrt
from cxlrt.channel import Channel, ChannelBusyError, ChannelRoleLostError
from cxlrt.harness import ACQUIRE_S, Case, CaseData, Ctx, HarnessError, Proc, Workload, family

CH_NAME = "hc"
CH_SLOTS = 8
CH_MSG = 256
DRAIN_S = 0.3           # s: a consumer told to finish drains until the ring stays empty


def chan_msg(sender: int, seq: int) -> bytes:
    """Message `seq` of `sender`: a head naming both, then a digest of it repeated, of a
    length that varies with seq (24..CH_MSG bytes)."""
    head = sender.to_bytes(4, "little") + seq.to_bytes(8, "little")
    body = hashlib.blake2b(head, digest_size=32).digest()
    n = 24 + (seq * 7919) % (CH_MSG - 23)
    return (head + body * (CH_MSG // 32 + 1))[:n]


def chan_parse(msg: bytes) -> tuple[int, int] | None:
    """(sender, seq) of a message that is exactly what chan_msg makes, else None."""
    if len(msg) < 12:
        return None
    sender = int.from_bytes(msg[:4], "little")
    seq = int.from_bytes(msg[4:12], "little")
    if sender > 1024 or seq > 1 << 32 or msg != chan_msg(sender, seq):
        return None
    return sender, seq


def _victim_role(case: Case) -> str:
    if case.point.startswith("chan.send"):
        return "producer"
    if case.point.startswith("chan.recv"):
        return "consumer"
    return case.variant


def _chan_variants(point: str) -> list[str]:
    return ["producer", "consumer"] if point == "chan.claim" else [""]


def _chan_setup(r: cxlrt.Region, case: Case) -> dict:
    with Channel(r, CH_NAME, slots=CH_SLOTS, msg_bytes=CH_MSG):
        pass
    return {}


def _open(r: cxlrt.Region) -> Channel:
    return Channel(r, CH_NAME, slots=None, msg_bytes=None, create=False)


def _received(ctx: Ctx, msg: bytes, **kw: Any) -> None:
    got = chan_parse(msg)
    if got is None:
        ctx.record("violation", what=f"received {len(msg)} bytes that no sender sent: "
                   f"{msg[:24].hex()}...")
        return
    ctx.record("r", src=got[0], seq=got[1], **kw)


# --- processes ---------------------------------------------------------------------------

def _send_loop(ctx: Ctx, ch: Channel, seq: int, res: str) -> None:
    """A survivor producer: send until told to stop."""
    while ctx.running():
        ctx.record("m?", seq=seq)
        t0 = time.monotonic()
        ch.send(chan_msg(ctx.index, seq), timeout=ACQUIRE_S)
        t1 = time.monotonic()
        ctx.record("m", seq=seq)
        ctx.op(res, t0, t1)
        seq += 1
        time.sleep(0.002)


def _recv_loop(ctx: Ctx, ch: Channel, res: str, drop: Any = None) -> None:
    """A survivor consumer: receive until told to stop, then drain."""
    t0 = time.monotonic()
    while ctx.running():
        try:
            msg = ch.recv(timeout=0.05)
        except TimeoutError:
            continue
        t1 = time.monotonic()
        if drop is None or not drop(ctx, msg):
            _received(ctx, msg)
        ctx.op(res, t0, t1)
        t0 = t1
    quiet = time.monotonic() + DRAIN_S
    while time.monotonic() < quiet:
        msg = ch.try_recv()
        if msg is None:
            time.sleep(0.005)
            continue
        if drop is None or not drop(ctx, msg):
            _received(ctx, msg)
        quiet = time.monotonic() + DRAIN_S


def _other_end(ctx: Ctx, role: str, drop: Any) -> None:
    """Node 0: the role the victim does not hold, for the whole case."""
    with cxlrt.open(ctx.spec, node=ctx.node) as r, _open(r) as ch:
        ctx.start()
        if role == "producer":
            _send_loop(ctx, ch, 0, "chan")
        else:
            _recv_loop(ctx, ch, "chan", drop)


def _victim_call(ctx: Ctx, ch: Channel, role: str, seq: int) -> int:
    """One call in the victim's role; the next seq."""
    if role == "producer":
        ctx.record("m?", seq=seq, post=ctx.reached())
        ch.send(chan_msg(ctx.index, seq), timeout=ACQUIRE_S)
        ctx.record("m", seq=seq, post=ctx.reached())
        return seq + 1
    try:
        msg = ch.recv(timeout=0.05)
    except TimeoutError:
        return seq
    _received(ctx, msg, post=ctx.reached())
    return seq


def _chan_victim(ctx: Ctx, role: str) -> None:
    with cxlrt.open(ctx.spec, node=ctx.node) as r, _open(r) as ch:
        seq = 0
        if ctx.case.point != "chan.claim":  # hold the role before anyone else is up
            if role == "producer":
                seq = _victim_call(ctx, ch, role, seq)
            else:
                ch.try_recv()
        ctx.start()
        ctx.arm()
        while ctx.running():
            seq = _victim_call(ctx, ch, role, seq)
        if not ctx.reached():
            return
        # Resumed from the stop (a killed victim never gets here): the call that
        # stopped at the point returned, so its role may be gone; the next call must
        # not complete if it is.
        outcome = {"first": "ok", "second": "ok"}
        try:
            _victim_call(ctx, ch, role, seq)
        except ChannelBusyError as e:  # ChannelRoleLostError included
            outcome["second"] = f"{type(e).__name__}: {e}"
        ctx.record("outcome", **outcome)


def _victim_main(ctx: Ctx, role: str) -> None:
    try:
        _chan_victim(ctx, role)
    except ChannelRoleLostError as e:  # the call at the point was told
        ctx.record("outcome", first=f"ChannelRoleLostError: {e}", second=None)


def _standby(ctx: Ctx, role: str, victim_node: int, drop: Any) -> None:
    """Ask for the victim's role until we have it, then carry on in it."""
    with cxlrt.open(ctx.spec, node=ctx.node) as r, _open(r) as ch:
        ctx.start()
        t0 = time.monotonic()
        busy = 0
        while ctx.running():
            try:
                if role == "producer":
                    ctx.record("m?", seq=0)
                    ch.send(chan_msg(ctx.index, 0), timeout=ACQUIRE_S)
                    ctx.record("m", seq=0)
                else:
                    msg = ch.try_recv()
                    if msg is not None:
                        _received(ctx, msg)
            except ChannelBusyError:
                busy += 1
                owner = ch.owner(role)
                if owner is not None and owner["node"] not in (victim_node, ctx.node):
                    ctx.record("gave-up", owner=owner["node"], busy=busy)
                    while ctx.running():
                        time.sleep(0.01)
                    return
                time.sleep(0.02)
                continue
            t1 = time.monotonic()
            ctx.record("took", busy=busy, waited=t1 - t0)
            ctx.op("role", t0, t1)
            if role == "producer":
                _send_loop(ctx, ch, 1, "role")
            else:
                _recv_loop(ctx, ch, "role", drop)
            return


# --- afterwards --------------------------------------------------------------------------

def _chan_verify(data: CaseData) -> list[str]:
    out: list[str] = []
    case = data.case
    role = _victim_role(case)
    vi = next(i for i, p in enumerate(data.procs) if p.role == "victim")
    oi = next(i for i, p in enumerate(data.procs) if p.role == "other")
    acked: dict[int, list[int]] = {}
    tried: dict[int, list[int]] = {}
    got: dict[int, list[tuple[int, int]]] = {}
    for i, recs in enumerate(data.ledgers):
        p = data.procs[i]
        for rec in recs:
            k = rec["k"]
            if k == "m":
                acked.setdefault(i, []).append(rec["seq"])
            elif k == "m?":
                tried.setdefault(i, []).append(rec["seq"])
            elif k == "r":
                got.setdefault(i, []).append((rec["src"], rec["seq"]))
            elif k == "violation":
                out.append(f"{p.role} of node {p.node}: {rec['what']}")
    holders = [i for i, p in enumerate(data.procs) if p.role == "standby"
               and any(r["k"] == "took" for r in data.ledgers[i])]
    if len(holders) > 1:
        out.append("two standbys held the victim's role: nodes "
                   + ", ".join(str(data.procs[i].node) for i in holders))
    winner = holders[0] if holders else None
    # No standby had the role before the victim's last acknowledged call (before its
    # point): the two would have held it at once.
    vrecs = [r for r in data.ledgers[vi] if r["k"] in ("m", "r") and not r.get("post")]
    if winner is not None and vrecs:
        took = next(r["t"] for r in data.ledgers[winner] if r["k"] == "took")
        if took < vrecs[-1]["t"]:
            out.append(f"standby node {data.procs[winner].node} took the {role} role "
                       f"{vrecs[-1]['t'] - took:.3f} s before the victim's last "
                       "acknowledged call: two live owners")
    # The stream: what was received, in order, against what was acknowledged.
    if role == "producer":
        stream = got.get(oi, [])
        v_acked = acked.get(vi, [])
        v_tried = tried.get(vi, [])
        want = [(vi, s) for s in v_acked]
        inflight = [s for s in v_tried if s not in v_acked]
        if case.mode == "kill" and case.point == "chan.send.post" and inflight:
            want.append((vi, inflight[-1]))  # its tail was published: it is delivered
        if winner is not None:
            want += [(winner, s) for s in acked.get(winner, [])]
        what = "messages whose send() was acknowledged"
    else:
        stream = got.get(vi, []) + (got.get(winner, []) if winner is not None else [])
        p_acked = acked.get(oi, [])
        k = len(got.get(vi, []))
        want = [(oi, s) for s in p_acked]
        inflight = [s for s in tried.get(oi, []) if s not in p_acked]
        if inflight and stream[-1:] == [(oi, inflight[-1])]:
            want.append((oi, inflight[-1]))  # the producer's last send was cut short
        if case.mode == "kill" and case.point == "chan.recv.post" and k < len(want):
            # Documented at-most-once: the consumer published its head for message k and
            # died before recv() returned it. Exactly that one is gone.
            data.details["lost_at_most_once"] = list(want.pop(k))
        what = "messages of the producer (all acknowledged)"
    data.details["messages"] = {"received": len(stream), "expected": len(want),
                                "winner": None if winner is None else data.procs[winner].node}
    if stream != want:
        out.append(_diff(stream, want, what, data))
    # The resumed victim: told, and it sent or took nothing after it was told.
    outcome = [r for r in data.ledgers[vi] if r["k"] == "outcome"]
    if case.mode == "stop":
        if not outcome:
            out.append("the resumed victim left no outcome (it neither returned nor was told)")
        else:
            o = outcome[-1]
            data.details["victim_outcome"] = {x: (o[x] or "")[:120] for x in ("first", "second")}
            if o["first"] == "ok" and o["second"] == "ok" and winner is not None:
                out.append(f"the resumed {role} completed a call after its role was taken "
                           f"over by node {data.procs[winner].node}: it was not fenced")
            elif o["first"] == "ok" and o["second"] is not None \
                    and not o["second"].startswith("ChannelRoleLostError"):
                out.append(f"the resumed {role}'s next call got {o['second'][:200]}, not "
                           "ChannelRoleLostError")
    return out


def _diff(stream: list[tuple[int, int]], want: list[tuple[int, int]], what: str,
          data: CaseData) -> str:
    n = next((i for i, (a, b) in enumerate(zip(stream, want, strict=False)) if a != b),
             min(len(stream), len(want)))
    names = {i: f"{p.role}@node{p.node}" for i, p in enumerate(data.procs)}

    def show(xs: list[tuple[int, int]]) -> str:
        return ", ".join(f"{names.get(s, s)}#{q}" for s, q in xs) or "nothing"

    lost = sorted(set(want) - set(stream))
    extra = sorted(set(stream) - set(want))
    dup = len(stream) - len(set(stream))
    return (f"the messages received ({len(stream)}) are not the {what} ({len(want)}), "
            f"in order, each once: first difference at #{n}: received "
            f"{show(stream[n:n + 3])}, expected {show(want[n:n + 3])}; lost {len(lost)} "
            f"({show(lost[:4])}), unexpected {len(extra)} ({show(extra[:4])}), "
            f"duplicates {dup}")


@family("chan", "chan.", variants=_chan_variants, max_nth=lambda p: 1 if p == "chan.claim"
        else 4)
def chan_workload(case: Case, *, drop: Any = None) -> Workload:
    """Channel points. `drop(ctx, msg)` runs in survivor consumers for each message
    received; when it returns True the message goes unrecorded (a negative control)."""
    if case.nodes < 3:
        raise HarnessError("the channel workload needs 3 nodes or more")
    role = _victim_role(case)
    other = "consumer" if role == "producer" else "producer"
    # The consumers finish last, so that they drain what the producers sent.
    pw, cw = 0, 1
    procs = [Proc("victim", 1, _victim_main, (role,), wave=pw if role == "producer" else cw),
             Proc("other", 0, _other_end, (other, drop), wave=pw if other == "producer" else cw)]
    procs += [Proc("standby", k, _standby, (role, 1, drop), wave=pw if role == "producer" else cw)
              for k in range(2, case.nodes)]
    return Workload(procs, verify=_chan_verify, resources=("role", "chan"), setup=_chan_setup,
                    size="8M", go_at_event=case.point == "chan.claim")
