"""Configuration of the serving demo that needs no torch (the CLI reads it for --help)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("nocache", "tcp", "tcp_cache", "cxlrt")
"""The demo's modes: (a) no cache, (b) KV over TCP, (b') KV over TCP from a per-worker
prefix cache in local memory, (c) KV through cxlrt."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of a :class:`TinyLM`.

    The defaults make a prefill of 1-2k tokens take about 0.1-0.3 s on one core.
    """

    vocab: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    seed: int = 0
    logit_scale: float = 8.0  # std of the logits: keeps greedy picks clear of float32 rounding

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads "
                             f"({self.n_heads})")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of every layer for one token (float32)."""
        return self.n_layers * 2 * self.d_model * 4

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one KV block of ``block_tokens`` tokens."""
        return block_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Plan:
    """Everything a worker needs to know, fixed for one run.

    Node ids in the region: 0 is the scheduler (it formats the region and creates
    the cache and the channels), prefill worker ``p`` is node ``1 + p``, decode
    worker ``d`` is node ``1 + prefill + d``.
    """

    model: ModelConfig
    block_tokens: int
    prefill: int
    decode: int
    spec: str = ""
    cache_name: str = "demo.kv"
    cache_blocks: int = 0
    msg_bytes: int = 4096
    channel_slots: int = 16

    @property
    def block_bytes(self) -> int:
        return self.model.block_bytes(self.block_tokens)

    @property
    def salt(self) -> bytes:
        """What makes this run's KV differ beyond tokens: model, weights, dtype, layout.

        A cache salted with it never serves KV of another model or layout.
        """
        m = self.model
        return (f"cxlrt-demo/TinyLM-numpy/v{m.vocab}-d{m.d_model}-l{m.n_layers}-h{m.n_heads}"
                f"-f{m.d_ff}/seed{m.seed}/float32/kv[tok,layer,2,d]").encode()

    def full_blocks(self, n_tokens: int) -> int:
        """Blocks the prefill side makes ready: every full block but the last token's."""
        return (n_tokens - 1) // self.block_tokens

    def channel_name(self, p: int, d: int) -> str:
        return f"demo.p{p}.d{d}"

    def prefill_node(self, p: int) -> int:
        return 1 + p

    def decode_node(self, d: int) -> int:
        return 1 + self.prefill + d
