"""The scheduler: start a mode's workers, feed them requests, collect what they did.

This is the control plane, and it uses multiprocessing queues: requests go to
the prefill (or colocated) workers, and every worker reports on one results
queue. The KV never passes through here.

:class:`Cluster` is one mode's running workers; :func:`serve` runs a whole
workload through one as a closed loop per conversation (every conversation's
first turn is issued at once, each next turn as soon as the previous answer is
complete, since it is part of the next prompt); :func:`reference` computes the
monolithic answers. A request's time to first token runs from its issue here to
the first token at its decode worker; both read CLOCK_MONOTONIC, which every
process of a host shares. Workers are forked, so they start in milliseconds and
inherit the imported modules.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cxlrt.serving import workers
from cxlrt.serving.config import MODES, Plan
from cxlrt.serving.workers import Request
from cxlrt.serving.workload import Workload

_CTX = mp.get_context("fork")
START_TIMEOUT_S = 120.0  # worker start-up (model build, warm-up, attach)
STALL_TIMEOUT_S = 120.0  # no message from any worker for this long: give up


@dataclass
class RequestResult:
    """What happened to one request."""

    rid: int
    conv: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    tokens: list[int]
    info: dict[str, int] = field(default_factory=dict)
    first_logits: Any = None  # logits of the first token, as decode computed them
    t_issue: float = 0.0  # time.monotonic() when the scheduler issued it


@dataclass
class ModeRun:
    """One mode's run: per-request results, per-worker exit stats, wall time."""

    mode: str
    requests: list[RequestResult]
    workers: dict[str, dict]
    wall_s: float


class _Workers:
    """Started worker processes and their results queue; fails loudly and cleans up."""

    def __init__(self) -> None:
        self.results = _CTX.Queue()
        self.procs: dict[str, Any] = {}

    def add(self, who: str, fn: Callable[..., None], *args: Any) -> None:
        self.procs[who] = _CTX.Process(target=workers.entry, args=(fn, who, self.results, *args),
                                       name=f"cxlrt-demo {who}", daemon=True)

    def start(self) -> None:
        for p in self.procs.values():
            p.start()

    def get(self, timeout: float = STALL_TIMEOUT_S) -> tuple:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=0.2)
            except queue.Empty:
                dead = [w for w, p in self.procs.items() if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"demo worker {dead[0]} died (exit code "
                                       f"{self.procs[dead[0]].exitcode}) without a report"
                                       ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no word from the demo workers for {timeout:.0f} s"
                                       ) from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"demo worker {msg[1]} failed:\n{msg[2]}")
            return msg

    def wait_ready(self) -> None:
        for _ in self.procs:
            msg = self.get(START_TIMEOUT_S)
            if msg[0] != "ready":
                raise RuntimeError(f"unexpected message before start: {msg[:2]}")

    def close(self, graceful: bool = True) -> None:
        """Join the workers; after a failure (not ``graceful``) end them first."""
        for p in self.procs.values():
            if p.pid is None:
                continue  # never started
            if not graceful and p.is_alive():
                p.terminate()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


@dataclass
class Reference:
    """The monolithic run: ``tokens[conversation][turn]`` and the logits of each first token."""

    tokens: list[list[list[int]]]
    logits: list[list[Any]]


def reference(model_cfg: Any, wl: Workload, processes: int,
              progress: Callable[[int], None] = lambda n: None) -> Reference:
    """The monolithic run's answers and first-token logits, by conversation and turn.

    Conversations are split over ``processes`` processes (nothing else runs meanwhile).
    """
    c, t = wl.cfg.conversations, wl.cfg.turns
    answers: list[list[list[int]]] = [[[] for _ in range(t)] for _ in range(c)]
    logits: list[list[Any]] = [[None] * t for _ in range(c)]
    w = _Workers()
    n = max(1, min(processes, c))
    done = stopped = 0
    try:
        for i in range(n):
            w.add(f"reference {i}", workers.reference, model_cfg, wl, list(range(i, c, n)))
        w.start()
        while done < c * t or stopped < n:
            msg = w.get()
            if msg[0] == "stats":  # the worker is done
                stopped += 1
            elif msg[0] == "ref":
                answers[msg[1]][msg[2]] = msg[3]
                logits[msg[1]][msg[2]] = msg[4]
                done += 1
                progress(done)
            else:
                raise RuntimeError(f"unexpected message from a reference worker: {msg[:2]}")
    finally:
        w.close(graceful=stopped == n)
    return Reference(answers, logits)


class Cluster:
    """One mode's workers, started and warmed up: submit requests, read their answers.

    A context manager; leaving it stops the workers (at once after an error).

    Parameters
    ----------
    mode : str
        "nocache", "tcp", "tcp_cache" or "cxlrt". For "cxlrt" the region behind ``plan.spec``
        must already hold the cache and the channels (:func:`cxlrt.demo.rack`).
    plan : Plan
        Worker counts, model, block geometry, region.
    """

    def __init__(self, mode: str, plan: Plan) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.plan = mode, plan
        self.infos: dict[int, dict[str, Any]] = {}  # rid -> the prefill side's facts
        self.stats: dict[str, dict] = {}            # worker -> its exit stats
        self._w = _Workers()
        self._closed = False
        servers: list[socket.socket] = []
        try:
            if mode == "nocache":
                self.targets = plan.prefill + plan.decode
                # Shared, as the prefill workers' queue below: a free worker takes the
                # next request, so no mode is dealt a worse dispatch than another.
                self._inboxes = [_CTX.Queue()]
                for i in range(self.targets):
                    self._w.add(f"worker {i}", workers.colocated, plan, self._inboxes[0])
                self._stoppers = self._inboxes * self.targets
            else:
                self.targets = plan.decode
                self._inboxes = [_CTX.Queue()]  # shared: a free prefill worker takes the next
                self._stoppers = self._inboxes * plan.prefill
                if mode in ("tcp", "tcp_cache"):
                    local = plan.cache_blocks if mode == "tcp_cache" else 0
                    if mode == "tcp_cache" and local < 1:
                        raise ValueError("tcp_cache mode needs plan.cache_blocks >= 1 (the "
                                         "per-worker prefix cache's capacity)")
                    servers = [socket.create_server(("127.0.0.1", 0), backlog=plan.prefill)
                               for _ in range(plan.decode)]
                    ports = [s.getsockname()[1] for s in servers]
                    for d in range(plan.decode):
                        self._w.add(f"decode {d}", workers.decode_tcp, plan, servers[d])
                    for p in range(plan.prefill):
                        self._w.add(f"prefill {p}", workers.prefill_tcp, plan, self._inboxes[0],
                                    ports, local)
                else:
                    for d in range(plan.decode):
                        self._w.add(f"decode {d}", workers.decode_cxlrt, plan, d)
                    for p in range(plan.prefill):
                        self._w.add(f"prefill {p}", workers.prefill_cxlrt, plan,
                                    self._inboxes[0], p)
            self._w.start()
            for s in servers:  # the decode workers hold their own copies
                s.close()
            self._w.wait_ready()
        except BaseException:
            for s in servers:
                s.close()
            self._w.close(graceful=False)
            raise

    def submit(self, req: Request) -> float:
        """Hand ``req`` out (``req.target`` picks the decode worker); returns its issue time."""
        t = time.monotonic()
        self._inboxes[0].put(req)
        return t

    def next_done(self) -> tuple[int, float, list[int], dict[str, Any]]:
        """Wait for the next finished request: (rid, time of its first token, tokens, facts)."""
        while True:
            msg = self._w.get()
            if msg[0] == "prefill":
                self.infos.setdefault(msg[1], {}).update(msg[2])
            elif msg[0] == "done":
                return msg[1], msg[2], msg[3], msg[4]
            else:
                raise RuntimeError(f"unexpected message from a {self.mode} worker: {msg[:2]}")

    def prefill_info(self, rid: int) -> dict[str, Any]:
        """The prefill side's facts about ``rid`` (waits for them; call when nothing else
        is in flight, as every other message is unexpected then)."""
        while rid not in self.infos:
            msg = self._w.get()
            if msg[0] != "prefill":
                raise RuntimeError(f"unexpected message from a {self.mode} worker: {msg[:2]}")
            self.infos.setdefault(msg[1], {}).update(msg[2])
        return self.infos[rid]

    def close(self) -> dict[str, dict]:
        """Stop the workers once every request is done; returns their exit stats."""
        if self._closed:
            return self.stats
        self._closed = True
        try:
            for q in self._stoppers:
                q.put(None)
            while len(self.stats) < len(self._w.procs):  # a worker's last word: its stats
                msg = self._w.get()
                if msg[0] == "prefill":  # may come after its request's "done"
                    self.infos.setdefault(msg[1], {}).update(msg[2])
                elif msg[0] == "stats":
                    self.stats[msg[1]] = msg[2]
                elif msg[0] != "done":  # a request nobody waited for (after a failure)
                    raise RuntimeError(f"unexpected message from a {self.mode} worker: "
                                       f"{msg[:2]}")
        finally:
            self._w.close(graceful=len(self.stats) == len(self._w.procs))
        return self.stats

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._closed = True
            self._w.close(graceful=False)


def serve(mode: str, plan: Plan, wl: Workload,
          progress: Callable[[int], None] = lambda n: None) -> ModeRun:
    """Run the whole workload in ``mode`` as a closed loop per conversation.

    Every conversation's first turn is issued at once; each next turn as soon as
    the previous answer is complete (it is part of the next prompt).
    """
    cfg = wl.cfg
    answers: list[list[list[int]]] = [[] for _ in range(cfg.conversations)]
    issued: dict[int, tuple[Request, float]] = {}
    results: list[RequestResult] = []
    with Cluster(mode, plan) as cluster:

        def issue(conv: int, turn: int) -> None:
            rid = len(issued)
            req = Request(rid, conv, turn, wl.prompt(conv, turn, answers[conv]),
                          cfg.new_tokens, rid % cluster.targets)
            issued[rid] = (req, cluster.submit(req))

        t0 = time.monotonic()
        for conv in range(cfg.conversations):
            issue(conv, 0)
        while len(results) < cfg.requests:
            rid, t_first, tokens, info = cluster.next_done()
            req, t_issue = issued[rid]
            info = dict(info)
            first_logits = info.pop("first_logits")
            results.append(RequestResult(rid, req.conv, req.turn, len(req.tokens),
                                         t_first - t_issue, tokens, info, first_logits, t_issue))
            answers[req.conv].append(tokens)
            if req.turn + 1 < cfg.turns:
                issue(req.conv, req.turn + 1)
            progress(len(results))
        wall = time.monotonic() - t0
        stats = cluster.close()
    for r in results:
        r.info.update(cluster.infos.get(r.rid, {}))
    return ModeRun(mode, sorted(results, key=lambda r: r.rid), stats, wall)
