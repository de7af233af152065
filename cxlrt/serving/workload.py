"""A deterministic multi-turn chat workload that shares one system prompt.

Every conversation starts from the same system prompt; turn ``t`` of a
conversation sends the system prompt, every earlier user message and every
earlier generated answer, and a new user message. So successive turns share
ever longer prefixes (within a conversation) and every request shares the
system prompt (across conversations): the two kinds of reuse a rack-wide
prefix cache is for. The answers are what the model generates, so turn ``t``
can only be built once turn ``t - 1`` is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the workload; every field must be >= 1.

    Parameters
    ----------
    conversations : int
        Conversations served at once (C).
    turns : int
        Turns per conversation (T).
    system_tokens : int
        Length of the shared system prompt, tokens.
    user_tokens : int
        Length of each new user message, tokens.
    new_tokens : int
        Tokens generated per turn (the answer).
    vocab : int
        Token ids are drawn from ``[0, vocab)``.
    seed : int
        Seed of the token draws.
    """

    conversations: int = 4
    turns: int = 5
    system_tokens: int = 1024
    user_tokens: int = 64
    new_tokens: int = 32
    vocab: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_tokens", "user_tokens", "new_tokens",
                     "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def prompt_tokens(self, turn: int) -> int:
        """Length of a turn's prompt (0-based turn)."""
        return (self.system_tokens + (turn + 1) * self.user_tokens
                + turn * self.new_tokens)

    @property
    def max_prompt_tokens(self) -> int:
        return self.prompt_tokens(self.turns - 1)

    @property
    def requests(self) -> int:
        return self.conversations * self.turns


@dataclass
class Workload:
    """The token ids of a workload: the system prompt and every user message.

    Build it with :func:`make_workload`; then ``prompt(c, t, answers)`` gives the
    prompt of turn ``t`` of conversation ``c`` from that conversation's earlier
    answers.
    """

    cfg: WorkloadConfig
    system: list[int]
    users: list[list[list[int]]] = field(repr=False)  # [conversation][turn] -> tokens

    def prompt(self, conv: int, turn: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """Prompt of ``turn`` of ``conv``: system + (user, answer) * turn + user.

        Parameters
        ----------
        answers : sequence of token lists
            The conversation's answers to turns ``0 .. turn-1`` (more are ignored).
        """
        if not 0 <= conv < self.cfg.conversations or not 0 <= turn < self.cfg.turns:
            raise IndexError(f"no turn {turn} of conversation {conv} in a "
                             f"{self.cfg.conversations} x {self.cfg.turns} workload")
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the answers to {turn} earlier turns, "
                             f"got {len(answers)}")
        out = list(self.system)
        for t in range(turn):
            out += self.users[conv][t]
            out += answers[t]
        out += self.users[conv][turn]
        return out


def make_workload(cfg: WorkloadConfig) -> Workload:
    """Draw the system prompt and the user messages from ``cfg.seed``."""
    rng = np.random.default_rng(cfg.seed)
    system = rng.integers(0, cfg.vocab, cfg.system_tokens).tolist()
    users = [[rng.integers(0, cfg.vocab, cfg.user_tokens).tolist() for _ in range(cfg.turns)]
             for _ in range(cfg.conversations)]
    return Workload(cfg, system, users)
