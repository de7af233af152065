"""The demo's worker processes: what runs inside each prefill, decode or colocated worker.

Roles by mode:

- ``nocache`` (a): P + D colocated workers; each serves whole requests,
  prefilling the entire prompt (no cache, no transfer).
- ``tcp`` (b): prefill workers compute the KV of every full block of the
  prompt and send it to a decode worker over a loopback TCP socket.
- ``tcp_cache`` (b'): as (b), but each prefill worker keeps the KV it computed
  in a bounded LRU prefix cache in its own memory (:class:`LocalPrefixCache`,
  LMCache-local style, keyed by the same chained block hashes as cxlrt's): it
  computes only the blocks past the cached prefix, and still sends the whole
  prompt's KV to decode over TCP. (c)/(b') isolates the transport.
- ``cxlrt`` (c): prefill workers look the prompt's blocks up in the shared
  :class:`cxlrt.KVCache`, load the hit prefix, compute only the missing blocks,
  store them, and send "request R: these keys are ready" over a
  :class:`cxlrt.Channel`; decode workers load every block from the cache
  (recomputing any that was evicted meanwhile, and counting it).

The prompt's last, partial block (at least one token) is always left to the
decode side: computing it yields the first token, so time to first token is
measured where the tokens are generated. Every decode and colocated worker runs
the same small engine (:func:`_serve`): it admits each arriving request at once
(prefill priority, as serving engines do) and interleaves one-token decode
steps of the requests it holds.

Workers are forked; each builds the model from the seed (same weights in every
process), limits BLAS to one thread, opens the region as its own node, and reports
to the scheduler through one ``results`` queue (the control plane): ``ready``,
``prefill`` (per-request prefill facts), ``done`` (tokens and the time of the
first one), ``stats`` at exit, or ``error`` with a traceback.

Every worker stamps the moments a request passes (``time.monotonic()``: CLOCK_MONOTONIC,
shared by every process of a host) and reports them with its facts, so that the
scheduler can split each TTFT into queueing, KV load, compute and hand-off
(:func:`cxlrt.serving.report.ttft_split`). The prefill side reports ``t_take`` (it
took the request from the queue), ``t_loaded`` (cached prefix looked up and
loaded), ``t_computed`` (its prefill done) and ``t_sent`` (stored and handed
off); the decode side ``t_start`` (the hand-off is here, KV received in (b),
(b')), ``t_kv`` (KV loaded from the cache in (c)) and ``t_first``.
"""

from __future__ import annotations

import ctypes
import queue
import selectors
import signal
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from cxlrt.serving import handoff
from cxlrt.serving.config import ModelConfig, Plan
from cxlrt.serving.model import TinyLM

WAIT_S = 0.05  # an idle decode worker's blocking recv() on its only channel, per call
WAIT_SLICE_S = 0.0002  # ... on one of several channels, in turn: the others wait this long


@dataclass
class Request:
    """One turn of one conversation, as the scheduler hands it out."""

    rid: int
    conv: int
    turn: int
    tokens: list[int]
    n_new: int
    target: int  # decode worker that generates the answer (modes b and c)


@dataclass
class _Job:
    """A request arrived at a decode-side worker, with ``kv[:ready]`` filled."""

    rid: int
    tokens: np.ndarray
    n_new: int
    kv: np.ndarray
    ready: int
    t_arrive: float  # when the hand-off (or the request) reached this worker
    info: dict[str, Any] = field(default_factory=dict)
    t_start: float | None = None  # hand-off complete, work on it starts (default t_arrive)
    t_kv: float | None = None  # KV loaded from the cache (default t_start)


@dataclass
class _Active:
    """A request being decoded."""

    rid: int
    kv: np.ndarray
    pos: int
    n_new: int
    t_first: float
    info: dict[str, Any]
    out: list[int]


def _die_with_parent() -> None:
    """Ask the kernel to kill this worker when the demo dies (SIGKILL, OOM, timeout):
    a worker outliving it would poll its channels, and hold the region, forever."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def entry(fn: Callable[..., None], who: str, results: Any, *args: Any) -> None:
    """Process target: one BLAS thread, and any failure reported with its traceback.

    Ctrl-C reaches the whole process group; the parent stops the workers, so they
    ignore it rather than each printing a traceback.
    """
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The workers share the host's cores: one BLAS thread each, or each worker's
    # sgemm would spread over every core and they would fight for them. An env var
    # (OPENBLAS_NUM_THREADS) is too late here: the worker is forked from a parent
    # that has loaded numpy and its BLAS already, so set the loaded library's count.
    # (Measured on 2 cores: `cxlrt demo --quick` took 3.9 s with it, 16.5 s without.)
    threadpool_limits(1, user_api="blas")
    try:
        fn(who, results, *args)
    except BaseException:
        results.put(("error", who, traceback.format_exc()))
        raise SystemExit(1) from None


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, shared (what sockets send and fill)."""
    if not a.flags.c_contiguous:  # reshape would copy: a fill would land in the copy
        raise ValueError("KV bytes need a C-contiguous array")
    return a.reshape(-1).view(np.uint8).data


def _load(cache: Any, hit: Any, dst: np.ndarray) -> None:
    """Load a hit, its blocks first issued to the device in order (HyMCache's request-
    level prefetch: on a device that stages in its DRAM the copy of block i overlaps
    the staging of block i+1; elsewhere the device takes nothing and this is a load)."""
    cache.prefetch(hit)
    cache.load(hit, dst)


def _attach(plan: Plan, node: int) -> tuple[Any, Any]:
    """Open the region as ``node`` and attach to the demo's cache (made by the scheduler)."""
    import cxlrt
    region = cxlrt.open(plan.spec, node=node)
    cache = cxlrt.KVCache(region, plan.cache_name, block_bytes=plan.block_bytes, salt=plan.salt,
                          capacity_blocks=plan.cache_blocks, block_tokens=plan.block_tokens,
                          create=False)
    return region, cache


def _channel(region: Any, plan: Plan, p: int, d: int) -> Any:
    import cxlrt
    return cxlrt.Channel(region, plan.channel_name(p, d), slots=plan.channel_slots,
                         msg_bytes=plan.msg_bytes, create=False)


def _model(plan: Plan) -> TinyLM:
    model = TinyLM(plan.model)
    kv = model.new_kv(2 * plan.block_tokens)  # warm up BLAS and the allocator off the clock
    model.decode(model.prefill(list(range(plan.block_tokens)), kv), kv, plan.block_tokens, 2)
    return model


# --- decode side ------------------------------------------------------------------


def _serve(model: TinyLM, poll: Callable[[bool], _Job | None], finished: Callable[[], bool],
           results: Any) -> None:
    """The decode engine: admit arrivals first, then one decode step per request in turn."""
    active: deque[_Active] = deque()
    while active or not finished():
        job = poll(not active)
        if job is not None:
            n = len(job.tokens)
            logits = model.prefill(job.tokens[job.ready:], job.kv, job.ready)
            out = [int(np.argmax(logits))]
            t_first = time.monotonic()
            job.info["to_first_token_s"] = t_first - job.t_arrive
            t_start = job.t_arrive if job.t_start is None else job.t_start
            job.info.update(t_start=t_start, t_kv=t_start if job.t_kv is None else job.t_kv,
                            t_first=t_first)
            job.info["first_logits"] = logits  # a fresh array; checked against the reference
            r = _Active(job.rid, job.kv, n, job.n_new, t_first, job.info, out)
            if r.n_new > 1:
                active.append(r)
            else:
                results.put(("done", r.rid, r.t_first, r.out, r.info))
            continue
        if not active:
            continue
        r = active.popleft()
        r.out.append(int(np.argmax(model.prefill(r.out[-1:], r.kv, r.pos))))
        r.pos += 1
        if len(r.out) < r.n_new:
            active.append(r)
        else:
            results.put(("done", r.rid, r.t_first, r.out, r.info))


def colocated(who: str, results: Any, plan: Plan, requests: Any) -> None:
    """(a) no cache: whole requests from ``requests``; the entire prompt is prefilled."""
    model = _model(plan)
    done = False

    def poll(block: bool) -> _Job | None:
        nonlocal done
        try:
            req = requests.get() if block else requests.get_nowait()
        except queue.Empty:
            return None
        if req is None:
            done = True
            return None
        kv = model.new_kv(len(req.tokens) + req.n_new)
        return _Job(req.rid, np.asarray(req.tokens, np.int32), req.n_new, kv, 0,
                    time.monotonic())

    results.put(("ready", who))
    _serve(model, poll, lambda: done, results)
    results.put(("stats", who, {}))


def decode_tcp(who: str, results: Any, plan: Plan, server: socket.socket) -> None:
    """(b), (b') decode: one connection per prefill worker; KV arrives with the request.

    Waits in ``select()``: the kernel wakes it when bytes arrive."""
    model = _model(plan)
    sel = selectors.DefaultSelector()
    for _ in range(plan.prefill):
        conn, _addr = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sel.register(conn, selectors.EVENT_READ)
    server.close()
    received = 0

    def poll(block: bool) -> _Job | None:
        nonlocal received
        for key, _ in sel.select(None if block else 0):
            conn = key.fileobj
            t_arrive = time.monotonic()
            h, nbytes = handoff.recv_tcp_header(conn)  # type: ignore[arg-type]
            if h.is_stop:
                sel.unregister(conn)
                conn.close()  # type: ignore[union-attr]
                continue
            ready = h.n_blocks * plan.block_tokens
            if nbytes != ready * plan.model.kv_bytes_per_token:
                raise ValueError(f"request {h.rid}: {nbytes} KV bytes for {h.n_blocks} blocks")
            kv = model.new_kv(len(h.tokens) + h.n_new)
            handoff.recv_into(conn, _bytes(kv[:ready]))  # type: ignore[arg-type]
            received += nbytes
            return _Job(h.rid, h.tokens, h.n_new, kv, ready, t_arrive, {"received_bytes": nbytes},
                        t_start=time.monotonic())
        return None

    results.put(("ready", who))
    _serve(model, poll, lambda: not sel.get_map(), results)
    results.put(("stats", who, {"received_bytes": received}))


def decode_cxlrt(who: str, results: Any, plan: Plan, d: int) -> None:
    """(c) decode: keys arrive over cxlrt Channels; every block is loaded from the cache."""
    model = _model(plan)
    region, cache = _attach(plan, plan.decode_node(d))
    channels = [_channel(region, plan, p, d) for p in range(plan.prefill)]
    live = list(channels)
    bt = plan.block_tokens

    def job(h: handoff.Handoff, t_arrive: float) -> _Job:
        ready = h.n_blocks * bt
        kv = model.new_kv(len(h.tokens) + h.n_new)
        with cache.lookup(h.keys) as hit:
            n_hit = len(hit)
            if n_hit:
                _load(cache, hit, kv[:n_hit * bt])
        t_kv = time.monotonic()
        if n_hit < h.n_blocks:  # evicted (or never stored: no room): recompute, and say so
            model.prefill(h.tokens[n_hit * bt:ready], kv, n_hit * bt)
        return _Job(h.rid, h.tokens, h.n_new, kv, ready, t_arrive,
                    {"decode_loaded_bytes": n_hit * plan.block_bytes,
                     "decode_recomputed_blocks": h.n_blocks - n_hit}, t_kv=t_kv)

    def take(ch: Any, msg: bytes) -> _Job | None:
        t_arrive = time.monotonic()
        h = handoff.decode(msg)
        if h.is_stop:
            live.remove(ch)
            return None
        return job(h, t_arrive)

    turn = 0

    def poll(block: bool) -> _Job | None:
        # Idle, it blocks in Channel.recv(), which spins, yields, then naps 2 us at a
        # time without the GIL: a hand-off is seen in microseconds. (It used to poll
        # with sleeps of up to 0.5 ms, which cost ~0.3 ms per hand-off.)
        nonlocal turn
        while live:
            for ch in list(live):
                msg = ch.try_recv()
                if msg is not None and (j := take(ch, msg)) is not None:
                    return j
            if not block or not live:
                return None
            turn = (turn + 1) % len(live)
            ch = live[turn]
            try:
                msg = ch.recv(timeout=WAIT_S if len(live) == 1 else WAIT_SLICE_S)
            except TimeoutError:
                continue
            if (j := take(ch, msg)) is not None:
                return j
        return None

    results.put(("ready", who))
    _serve(model, poll, lambda: not live, results)
    for ch in channels:
        ch.close()
    cache.close()
    region.close()
    results.put(("stats", who, {}))


# --- prefill side -----------------------------------------------------------------


class LocalPrefixCache:
    """(b')'s per-worker prefix cache: KV blocks in this process's memory, LRU, bounded.

    Keyed by the chained block hashes cxlrt uses (a key names its block's tokens and
    every token before them), so a hit is the leading run of a prompt's keys that is
    present, as in :meth:`cxlrt.KVCache.lookup`. A hit touches its blocks last to
    first, so a prefix outlives its extensions when the cache is full.

    Parameters
    ----------
    capacity : int
        Blocks kept; the least recently used go first.
    """

    def __init__(self, capacity: int) -> None:
        from collections import OrderedDict
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.evicted = 0

    def lookup(self, keys: list[bytes]) -> list[np.ndarray]:
        """The cached blocks of the leading run of ``keys`` (the cache's own arrays)."""
        hit = []
        for k in keys:
            b = self.blocks.get(k)
            if b is None:
                break
            hit.append(b)
        for k in reversed(keys[:len(hit)]):
            self.blocks.move_to_end(k)
        return hit

    def store(self, keys: list[bytes], kv: np.ndarray, block_tokens: int) -> int:
        """Keep a copy of block ``i`` of ``kv`` under ``keys[i]``; returns blocks stored."""
        n = 0
        for i in reversed(range(min(len(keys), self.capacity))):
            if keys[i] not in self.blocks:
                self.blocks[keys[i]] = kv[i * block_tokens:(i + 1) * block_tokens].copy()
                n += 1
            self.blocks.move_to_end(keys[i])
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            self.evicted += 1
        return n


def prefill_tcp(who: str, results: Any, plan: Plan, requests: Any, ports: list[int],
                cache_blocks: int = 0) -> None:
    """(b) prefill: compute the KV of every full block and send it to the decode worker.

    (b') with ``cache_blocks``: keep a :class:`LocalPrefixCache` of that many blocks,
    compute only the blocks past its hit, send the whole prompt's KV.
    """
    import cxlrt
    model = _model(plan)
    bt = plan.block_tokens
    local = LocalPrefixCache(cache_blocks) if cache_blocks else None
    socks = []
    for port in ports:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(s)
    results.put(("ready", who))
    sent = 0
    while (req := requests.get()) is not None:
        t0 = time.monotonic()
        n_blocks = plan.full_blocks(len(req.tokens))
        ready = n_blocks * bt
        kv = model.new_kv(ready)
        hit: list[np.ndarray] = []
        keys: list[bytes] = []
        if local is not None and ready:
            keys = cxlrt.block_hashes(req.tokens[:ready], bt, salt=plan.salt)
            hit = local.lookup(keys)
            if 0 < len(hit) < n_blocks:  # the prefix is needed only to go on
                for i, b in enumerate(hit):
                    kv[i * bt:(i + 1) * bt] = b
        n_hit = len(hit)
        t_loaded = time.monotonic()
        if n_hit < n_blocks:
            model.prefill(req.tokens[n_hit * bt:ready], kv, n_hit * bt)
        t_computed = time.monotonic()
        h = handoff.Handoff(req.rid, np.asarray(req.tokens, np.int32), req.n_new, n_blocks, [])
        if n_hit == n_blocks and n_hit:  # all cached: send the blocks as they are
            nbytes = handoff.send_tcp(socks[req.target], h, [_bytes(b) for b in hit])
        else:
            nbytes = handoff.send_tcp(socks[req.target], h, _bytes(kv))
        t_sent = time.monotonic()
        sent += nbytes
        stored = local.store(keys[n_hit:], kv[n_hit * bt:], bt) if local is not None else 0
        info = {"blocks": n_blocks, "computed_blocks": n_blocks - n_hit, "sent_bytes": nbytes,
                "prefill_s": t_sent - t0, "t_take": t0, "t_loaded": t_loaded,
                "t_computed": t_computed, "t_sent": t_sent}
        if local is not None:
            info.update(hit_blocks=n_hit, stored_blocks=stored)
        results.put(("prefill", req.rid, info))
    for s in socks:
        handoff.send_tcp(s, handoff.stop(), None)
        s.close()
    stats: dict[str, Any] = {"sent_bytes": sent}
    if local is not None:
        stats.update(cached_blocks=len(local.blocks), evicted_blocks=local.evicted)
    results.put(("stats", who, stats))


def prefill_cxlrt(who: str, results: Any, plan: Plan, requests: Any, p: int) -> None:
    """(c) prefill: look up, load the hit prefix, compute and store the rest, hand off keys."""
    model = _model(plan)
    region, cache = _attach(plan, plan.prefill_node(p))
    channels = [_channel(region, plan, p, d) for d in range(plan.decode)]
    bt, bb = plan.block_tokens, plan.block_bytes
    results.put(("ready", who))
    while (req := requests.get()) is not None:
        t0 = time.monotonic()
        n_blocks = plan.full_blocks(len(req.tokens))
        ready = n_blocks * bt
        keys = cache.block_hashes(req.tokens[:ready]) if ready else []
        kv = model.new_kv(ready)
        with cache.lookup(keys) as hit:
            n_hit = len(hit)
            loaded = n_hit < n_blocks and n_hit > 0  # the prefix is needed only to go on
            if loaded:
                _load(cache, hit, kv[:n_hit * bt])
        t_loaded = time.monotonic()
        if n_hit < n_blocks:
            model.prefill(req.tokens[n_hit * bt:ready], kv, n_hit * bt)
        t_computed = time.monotonic()
        stored = cache.store(keys[n_hit:], kv[n_hit * bt:]) if n_hit < n_blocks else []
        h = handoff.Handoff(req.rid, np.asarray(req.tokens, np.int32), req.n_new, n_blocks, keys)
        channels[req.target].send(handoff.encode(h))
        t_sent = time.monotonic()
        results.put(("prefill", req.rid, {
            "blocks": n_blocks, "hit_blocks": n_hit, "computed_blocks": n_blocks - n_hit,
            "stored_blocks": len(stored), "prefill_loaded_bytes": n_hit * bb if loaded else 0,
            "stored_bytes": len(stored) * bb, "prefill_s": t_sent - t0, "t_take": t0,
            "t_loaded": t_loaded, "t_computed": t_computed, "t_sent": t_sent}))
    for ch in channels:
        ch.send(handoff.encode(handoff.stop()))
    for ch in channels:
        ch.close()
    cache.close()
    region.close()
    results.put(("stats", who, {}))


# --- the monolithic reference -----------------------------------------------------


def reference(who: str, results: Any, model_cfg: ModelConfig, workload: Any,
              convs: list[int]) -> None:
    """Serve ``convs`` the monolithic way (whole prompt in one prefill, then decode)."""
    model = TinyLM(model_cfg)
    for c in convs:
        answers: list[list[int]] = []
        for t in range(workload.cfg.turns):
            prompt = workload.prompt(c, t, answers)
            kv = model.new_kv(len(prompt) + workload.cfg.new_tokens)
            logits = model.prefill(prompt, kv, 0)
            out = model.decode(logits, kv, len(prompt), workload.cfg.new_tokens)
            answers.append(out)
            results.put(("ref", c, t, out, logits))
    results.put(("stats", who, {}))
