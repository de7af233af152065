"""The crash/stall harness's KV-cache family: every ``kv.*`` point (issue 9).

One process per node stores and looks up blocks of one KV cache. Every block's bytes
name their key, their writer (the process's index in the case) and the writer's store
attempt, and are derived from those, so a load tells exactly whose block it returned.
Keys come from three places:

- ``v:<i>``, the victim's sequence: the victim stores ``v:i, v:i+1`` and says where it
  is (a shared counter); the survivors store the same keys now and then, so two writers
  race for one key, and a survivor meets the victim's claim (WRITING) when the victim
  dies or stalls in it and takes it over;
- ``n<node>:<i>``, a survivor's own keys (a fixed set, stored once: later stores of them
  are skipped, which still takes the cache lock);
- for the evict points (and the pin points), a small cache: every survivor stores fresh
  own keys, so every store evicts; the victim's stores evict too and reach its point,
  and at a pin point the victim looks up and loads what it stored.

When the victim is killed inside the pin mutex (``kv.pin.raised``, ``kv.unpin.lowered``),
a sibling shares its node and pins nothing: the node stays alive, so its pin words
keep counting, and once everyone else is done the sibling sweeps (as its heartbeat
would), gives back the victim's record, writes its node's view back, and the node's
words on the medium must come back to what its live records hold, none, within the
bound (the victim left its words and its record out of step). Everywhere else the
victim is its node's only process, so a stalled or dead node's pins are void.

The ledger records each store before (``s?``: keys, attempt) and after (``s``: the keys
store() returned, or ``s!``: ClaimLost's stored keys), and each lookup. Survivors load
what they look up and record a violation for any byte that is not the block of a store
of that key (and, when nothing evicts, for a miss of a key they stored themselves).

Afterwards, in a fresh process of node 0 (an observer cannot attach a cache): no key is
held by two entries; for every key some store acknowledged, no two acknowledgements
unless something evicts, and the block loads byte-identical to the last acknowledged
store (an evict point may have dropped it, never altered it); a key nobody acknowledged
is absent or loads the exact bytes of one of the victim's unacknowledged attempts; a
claim (WRITING) left behind is taken over by the next store of its key within the bound;
after a kill at a pin point, the blocks the dead reader pinned can be deleted within the
bound (its pins do not block eviction forever).
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import cxlrt
from cxlrt.harness import _CTX, Case, CaseData, Ctx, HarnessError, Proc, Workload, _in_child, family

KV_NAME = "hk"
KV_BB = 1024            # bytes per block: two copy chunks, so kv.store.copy has a middle
OWN_KEYS = 96           # a survivor's own keys when nothing evicts
SMALL_CACHE = 24        # blocks, for the evict points: every store evicts
PIN_POINTS = ("kv.pin", "kv.pin.raised", "kv.unpin.lowered")
IN_PIN_MUTEX = ("kv.pin.raised", "kv.unpin.lowered")
EVICT_POINTS = ("kv.evict.intent", "kv.evict.tombstone", *PIN_POINTS)
NEG_ATTEMPT = 1 << 40   # the attempt number a negative control writes as


def _key(space: str, i: int) -> bytes:
    return hashlib.blake2b(f"{space}:{i}".encode(), digest_size=16).digest()


def kv_block(key: bytes, writer: int, attempt: int) -> bytes:
    """The block `writer` stores under `key` in its store `attempt`: a 32-byte head
    (key, writer, attempt), then a digest of the head repeated."""
    head = key + writer.to_bytes(8, "little") + attempt.to_bytes(8, "little")
    body = hashlib.blake2b(head, digest_size=32).digest()
    return (head + body * (KV_BB // 32))[:KV_BB]


def kv_parse(block: bytes) -> tuple[bytes, int, int] | None:
    """(key, writer, attempt) of a block that is exactly what kv_block makes of its head,
    else None (bytes nobody stored)."""
    key = block[:16]
    writer = int.from_bytes(block[16:24], "little")
    attempt = int.from_bytes(block[24:32], "little")
    if writer > 1 << 20 or block != kv_block(key, writer, attempt):
        return None
    return key, writer, attempt


def _evicts(case: Case) -> bool:
    return case.point in EVICT_POINTS


def _capacity(case: Case) -> int:
    if _evicts(case):
        return SMALL_CACHE
    return 2 * (OWN_KEYS * case.nodes + 1024)


def _kv_setup(r: cxlrt.Region, case: Case) -> dict:
    with cxlrt.KVCache(r, KV_NAME, block_bytes=KV_BB, capacity_blocks=_capacity(case)):
        pass
    return {}


def _check_hit(ctx: Ctx, c: Any, keys: list[bytes], mine: dict[bytes, int]) -> tuple[int, int]:
    """Look `keys` up and load the hit; record a violation for a block that is not one
    stored under its key, or (when nothing evicts) for a miss of a key we stored."""
    with c.lookup(keys) as hit:
        n = len(hit)
        out = c.load(hit) if n else []
    for k, row in zip(keys, out, strict=False):
        got = kv_parse(row.tobytes())
        if got is None or got[0] != k:
            ctx.record("violation", what=f"key {k.hex()} loads {KV_BB} bytes that are no "
                       "block stored under it" + ("" if got is None else
                                                 f" (a block of key {got[0].hex()})"))
        elif not _evicts(ctx.case) and k in mine and (got[1], got[2]) != (ctx.index, mine[k]):
            ctx.record("violation", what=f"key {k.hex()}, stored by us (attempt {mine[k]}), "
                       f"loads the block of writer {got[1]} attempt {got[2]}")
    if not _evicts(ctx.case) and n < len(keys) and keys[n] in mine:
        ctx.record("violation", what=f"key {keys[n].hex()}, stored by us and nothing evicts, "
                   "is not found")
    return n, len(keys)


def _store(ctx: Ctx, c: Any, keys: list[bytes], attempt: int) -> list[bytes]:
    ctx.record("s?", keys=[k.hex() for k in keys], a=attempt)
    try:
        got = c.store(keys, [kv_block(k, ctx.index, attempt) for k in keys])
    except cxlrt.ClaimLost as e:
        ctx.record("s!", keys=[k.hex() for k in e.stored], a=attempt, lost=len(e.lost))
        raise
    ctx.record("s", keys=[k.hex() for k in got], a=attempt)
    return got


def _kv_victim(ctx: Ctx, vpos: Any) -> None:
    rnd = random.Random(ctx.seed * 7907 + ctx.node)
    with cxlrt.open(ctx.spec, node=ctx.node) as r, cxlrt.KVCache(r, KV_NAME) as c:
        ctx.start()
        ctx.arm()
        i = attempt = 0
        while ctx.running():
            keys = [_key("v", i), _key("v", i + 1)]
            vpos.value = i
            attempt += 1
            got = _store(ctx, c, keys, attempt)  # ClaimLost / LeaseLost end the victim
            if ctx.case.point in PIN_POINTS and got:
                ctx.record("l?", keys=[k.hex() for k in got])
                with c.lookup(got) as hit:  # the pin point
                    n = len(hit)
                    rows = c.load(hit) if n else []
                bad = [k.hex() for k, row in zip(got, rows, strict=False)
                       if (kv_parse(row.tobytes()) or (b"",))[0] != k]
                ctx.record("l", hits=n, bad=bad)
            i += 2
            time.sleep(rnd.uniform(0.002, 0.01))


def _kv_worker(ctx: Ctx, vpos: Any, after_store: Any) -> None:
    rnd = random.Random(ctx.seed * 7919 + ctx.node)
    evicts = _evicts(ctx.case)
    mine: dict[bytes, int] = {}   # keys we stored -> attempt (minus those evicted: moot)
    own = 0
    attempt = 0
    with cxlrt.open(ctx.spec, node=ctx.node) as r, cxlrt.KVCache(r, KV_NAME) as c:
        ctx.start()
        while ctx.running():
            x = rnd.random()
            if x < 0.55 or not mine:
                if x < 0.2:  # the victim's next keys: race it for them, take its claims over
                    v = vpos.value
                    keys = [_key("v", v + j) for j in rnd.sample(range(3), 2)]
                elif evicts:
                    keys = [_key(f"n{ctx.node}", own + j) for j in range(rnd.randint(1, 2))]
                    own += len(keys)
                else:
                    keys = [_key(f"n{ctx.node}", rnd.randrange(OWN_KEYS))
                            for _ in range(rnd.randint(1, 3))]
                    keys = list(dict.fromkeys(keys))
                attempt += 1
                t0 = time.monotonic()
                got = _store(ctx, c, keys, attempt)
                t1 = time.monotonic()
                ctx.op("kv", t0, t1, what="store", n=len(keys), stored=len(got))
                for k in got:
                    mine[k] = attempt
                if after_store is not None:
                    after_store(ctx, r, c, got)
            else:
                keys = rnd.sample(list(mine), min(len(mine), rnd.randint(1, 3)))
                t0 = time.monotonic()
                n, m = _check_hit(ctx, c, keys, mine)
                t1 = time.monotonic()
                ctx.op("kv", t0, t1, what="lookup", n=m, hits=n)
                if evicts:
                    for k in keys[n:n + 1]:
                        mine.pop(k, None)  # evicted: another store of it may win now
            time.sleep(rnd.uniform(0.001, 0.004))


def _kv_sibling(ctx: Ctx) -> None:
    with cxlrt.open(ctx.spec, node=ctx.node) as r, cxlrt.KVCache(r, KV_NAME) as c:
        ctx.start()
        while ctx.running():
            time.sleep(0.01)
        r.locks.sweep()  # takes a dead holder's pin mutex first, as the heartbeat may
        t0 = time.monotonic()
        while True:
            c.recover()
            r.flush(0, r.size)  # a word left in the node's view would reach the medium later
            (kv,) = cxlrt.inspect(ctx.spec)["kv_caches"]
            left = kv["pins_by_node"][ctx.node]
            if left == 0:
                ctx.record("pins", left=0, s=round(time.monotonic() - t0, 3))
                return
            if time.monotonic() - t0 > ctx.case.bound:
                ctx.record("violation", what=f"node {ctx.node}'s pin words still count {left} "
                           f"pin(s) {ctx.case.bound} s after its only other process was done, "
                           "and no live process of the node holds one")
                return
            time.sleep(0.05)


# --- afterwards --------------------------------------------------------------------------

def _final_state(spec: str, keys: list[bytes], pinned: list[bytes], bound: float) -> dict:
    """In a process of node 0: what each key loads, the entries, and how the leftovers
    answer (claims left WRITING, blocks a dead reader pinned)."""
    out: dict[str, Any] = {"blocks": {}, "dup": [], "writing": {}, "undeletable": [],
                           "errors": []}
    with cxlrt.open(spec, node=0) as r, cxlrt.KVCache(r, KV_NAME) as c:
        seen: dict[bytes, int] = {}
        writing = []
        for e in c.entries():
            if e["state"] in ("writing", "ready", "evicting"):
                seen[e["key"]] = seen.get(e["key"], 0) + 1
            if e["state"] == "writing":
                writing.append(e["key"])
        out["dup"] = [k.hex() for k, n in seen.items() if n > 1]
        for k in keys:
            try:
                with c.lookup([k]) as hit:
                    if len(hit):
                        out["blocks"][k.hex()] = c.load(hit)[0].tobytes().hex()
            except Exception as e:  # noqa: BLE001 (a load that raises is a finding)
                out["errors"].append(f"key {k.hex()}: {type(e).__name__}: {e}")
        # A claim left behind must not wedge its key: the next store takes it over.
        for k in writing:
            t0 = time.monotonic()
            while True:
                got = c.store([k], [kv_block(k, 1 << 19, 1)])
                with c.lookup([k]) as hit:
                    if got or len(hit):
                        out["writing"][k.hex()] = round(time.monotonic() - t0, 3)
                        break
                if time.monotonic() - t0 > bound:
                    out["writing"][k.hex()] = None
                    break
                time.sleep(0.02)
        # A dead reader's pins must not hold its blocks for ever.
        left = list(pinned)
        t0 = time.monotonic()
        while left:
            with c.lookup(left[:1]) as hit:
                present = len(hit) == 1
            if not present or c.delete(left[:1]):
                left.pop(0)
                continue
            if time.monotonic() - t0 > bound:
                out["undeletable"] = [k.hex() for k in left]
                break
            time.sleep(0.02)
    return out


def _kv_verify(data: CaseData) -> list[str]:
    out: list[str] = []
    case = data.case
    evicts = _evicts(case)
    tried: dict[bytes, set[tuple[int, int]]] = {}        # key -> (writer, attempt)
    acked: dict[bytes, list[tuple[float, int, int]]] = {}  # key -> (t, writer, attempt)
    unacked: dict[bytes, set[tuple[int, int]]] = {}       # the victim's, never answered
    pinned: list[bytes] = []
    for i, recs in enumerate(data.ledgers):
        p = data.procs[i]
        pending: dict[int, list[bytes]] = {}
        for rec in recs:
            k = rec["k"]
            if k == "s?":
                ks = [bytes.fromhex(x) for x in rec["keys"]]
                pending[rec["a"]] = ks
                for key in ks:
                    tried.setdefault(key, set()).add((i, rec["a"]))
            elif k in ("s", "s!"):
                ks = pending.pop(rec["a"], [])
                for x in rec["keys"]:
                    acked.setdefault(bytes.fromhex(x), []).append((rec["t"], i, rec["a"]))
                if k == "s!" and p.role != "victim":
                    out.append(f"{p.role} of node {p.node} (never stopped) lost "
                               f"{rec['lost']} claim(s) to a takeover (ClaimLost)")
            elif k == "l?" and p.role == "victim":
                pinned = [bytes.fromhex(x) for x in rec["keys"]]
            elif k == "l" and p.role == "victim" and rec["bad"]:
                out.append(f"the victim loaded keys {rec['bad']} it had just stored, and "
                           "they were not its blocks")
            elif k == "violation":
                out.append(f"{p.role} of node {p.node}: {rec['what']}")
        if p.role == "victim":
            for a, ks in pending.items():  # the attempt the point interrupted (or a raise)
                for key in ks:
                    unacked.setdefault(key, set()).add((i, a))
    if case.mode != "kill" or case.point not in PIN_POINTS:
        pinned = []  # a stopped reader resumed and let go; only a dead one is tested
    keys = sorted(tried)
    final = _in_child(_final_state, data.spec, keys, pinned, case.bound, timeout=120)
    data.details["kv"] = {"keys": len(keys), "acknowledged": len(acked),
                          "present": len(final["blocks"]),
                          "writing_left": len(final["writing"])}
    out += final["errors"]
    for k in final["dup"]:
        out.append(f"key {k} is held by two entries of the index")
    for key in keys:
        got_hex = final["blocks"].get(key.hex())
        acks = sorted(acked.get(key, []))
        if not evicts and len(acks) > 1:
            who = ", ".join(f"writer {w} attempt {a}" for _, w, a in acks)
            out.append(f"key {key.hex()}: two writers ended READY and were both "
                       f"acknowledged ({who}), and nothing evicts")
        if got_hex is None:
            if acks and not evicts:
                _, w, a = acks[-1]
                out.append(f"key {key.hex()}, acknowledged to writer {w} (attempt {a}) and "
                           "never evicted, is not in the cache")
            continue
        got = bytes.fromhex(got_hex)
        parsed = kv_parse(got)
        if parsed is None or parsed[0] != key:
            out.append(f"key {key.hex()} loads bytes that are not a block stored under it")
            continue
        who = (parsed[1], parsed[2])
        if acks and not evicts:
            if who != acks[-1][1:]:
                out.append(f"key {key.hex()} loads the block of writer {who[0]} attempt "
                           f"{who[1]}, but its acknowledged store is writer {acks[-1][1]} "
                           f"attempt {acks[-1][2]}")
        elif who not in {a[1:] for a in acks} | unacked.get(key, set()):
            out.append(f"key {key.hex()} loads the block of writer {who[0]} attempt {who[1]}, "
                       "which no acknowledged store and no interrupted store of the victim "
                       "wrote")
    for k, took in final["writing"].items():
        if took is None or took > case.bound:
            out.append(f"a claim (WRITING) on key {k} was left behind and a store of the key "
                       f"could not take it over within {case.bound} s")
    for k in final["undeletable"]:
        out.append(f"key {k}, pinned by the reader killed at {case.point}, still cannot be "
                   f"evicted {case.bound} s after the checks began: its pins block "
                   "eviction for ever")
    return out


@family("kv", "kv.")
def kv_workload(case: Case, *, after_store: Any = None) -> Workload:
    """KV-cache points. `after_store(ctx, region, cache, stored)` runs in survivors
    after each store (a negative control misbehaves there)."""
    if case.nodes < 3:
        raise HarnessError("the KV workload needs 3 nodes or more")
    vpos = _CTX.Value("q", 0, lock=False)
    procs = [Proc("victim", 1, _kv_victim, (vpos,)) if k == 1 else
             Proc("worker", k, _kv_worker, (vpos, after_store)) for k in range(case.nodes)]
    if case.point in IN_PIN_MUTEX and case.mode == "kill":
        procs.append(Proc("sibling", 1, _kv_sibling, wave=1))
    cap = _capacity(case)
    size = max(16, 8 + cap * 3 // 1024 + case.nodes)
    return Workload(procs, verify=_kv_verify, resources=("kv",), setup=_kv_setup,
                    size=f"{size}M")

