"""A tiny decoder-only transformer with fixed random weights, and its KV layout.

The demo needs a model whose prefill costs real compute (so that recomputing a
prefix visibly costs time) and whose KV cache is explicit tensors (so that it
can be cut into blocks, stored in cxlrt, sent over TCP and loaded back). The
weights come from a seed: nothing is downloaded, and every process that builds
``TinyLM(cfg)`` holds the same model bit for bit.

KV layout
---------
One tensor of shape ``(tokens, n_layers, 2, d_model)`` (``2`` = K, V), token
major. The KV of tokens ``[a, b)`` is then one contiguous slice ``kv[a:b]``, so
a block of ``block_tokens`` tokens is ``block_bytes`` contiguous bytes holding
every layer's K and V for those tokens: what one cxlrt cache entry, one TCP
payload or one ``cache.load`` destination holds, with no packing copy.

Exactness
---------
The disaggregated paths compute a prompt's KV in pieces (a cached prefix, then
the missing blocks, then the tail) while the monolithic run computes it in one
call. Float32 matmuls of different shapes round differently, so the KV bits
may differ in the last place; greedy tokens stay equal because the output
projection is scaled so that the top two logits are far apart compared with
that rounding (``logit_scale``). ``tests/test_demo.py`` checks chunked against
full prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cxlrt.serving.config import ModelConfig

__all__ = ["ModelConfig", "TinyLM"]

Tokens = Sequence[int] | np.ndarray | torch.Tensor


class TinyLM:
    """Pre-norm decoder-only transformer: embedding + sinusoidal positions,
    ``n_layers`` x (causal multi-head attention, GELU MLP), RMS norms without
    weights, an output projection of its own.

    Parameters
    ----------
    cfg : ModelConfig, optional
        Shape and seed (default ``ModelConfig()``); equal configs give equal weights.
    """

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        self.cfg = cfg = cfg or ModelConfig()
        g = torch.Generator().manual_seed(cfg.seed)
        d, f = cfg.d_model, cfg.d_ff

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

        self.embed = torch.randn(cfg.vocab, d, generator=g)
        self.layers = [
            {"qkv": w(d, 3 * d, fan_in=d), "o": w(d, d, fan_in=d),
             "up": w(d, f, fan_in=d), "down": w(f, d, fan_in=f)}
            for _ in range(cfg.n_layers)
        ]
        self.unembed = w(d, cfg.vocab, fan_in=d) * cfg.logit_scale

    # --- KV ------------------------------------------------------------------------

    def new_kv(self, capacity: int) -> torch.Tensor:
        """An uninitialised KV buffer for ``capacity`` tokens, shape (T, L, 2, d)."""
        return torch.empty(capacity, self.cfg.n_layers, 2, self.cfg.d_model)

    # --- compute -------------------------------------------------------------------

    def _positions(self, start: int, n: int) -> torch.Tensor:
        # Sinusoidal, computed from the absolute position: a token gets the same
        # encoding whichever chunk it is prefilled in.
        d = self.cfg.d_model
        pos = torch.arange(start, start + n, dtype=torch.float64)[:, None]
        freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(1e4) / d))
        out = torch.empty(n, d, dtype=torch.float64)
        out[:, 0::2] = torch.sin(pos * freq)
        out[:, 1::2] = torch.cos(pos * freq)
        return out.float()

    @torch.inference_mode()
    def prefill(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Compute the KV of ``tokens`` at positions ``start...`` given the KV before them.

        Parameters
        ----------
        tokens : sequence of int, or a 1-D integer array or tensor
            The new tokens (at least one).
        kv : torch.Tensor
            KV buffer of shape (capacity, L, 2, d), ``capacity >= start + len(tokens)``.
            ``kv[:start]`` must hold the KV of the tokens before; ``kv[start:start+n]``
            is written.
        start : int
            Position of the first new token (tokens already in ``kv``).

        Returns
        -------
        torch.Tensor
            Logits of the last new token, shape (vocab,).
        """
        ids = torch.as_tensor(tokens, dtype=torch.long)
        n = ids.numel()
        if ids.dim() != 1 or n < 1:
            raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape "
                             f"{tuple(ids.shape)}")
        if start < 0 or start + n > kv.shape[0]:
            raise ValueError(f"KV buffer holds {kv.shape[0]} tokens; cannot write "
                             f"[{start}, {start + n})")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab})")
        cfg = self.cfg
        h, dh, end = cfg.n_heads, cfg.d_model // cfg.n_heads, start + n
        x = self.embed[ids] + self._positions(start, n)
        # Causal over absolute positions: new token i sees keys 0 .. start+i.
        mask = None
        if n > 1:
            mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None])
        for li, p in enumerate(self.layers):
            q, k, v = (_rms(x) @ p["qkv"]).split(cfg.d_model, dim=1)
            kv[start:end, li, 0] = k
            kv[start:end, li, 1] = v
            keys = kv[:end, li, 0].view(end, h, dh).transpose(0, 1)
            vals = kv[:end, li, 1].view(end, h, dh).transpose(0, 1)
            att = F.scaled_dot_product_attention(q.view(n, h, dh).transpose(0, 1), keys, vals,
                                                 attn_mask=mask)
            x = x + att.transpose(0, 1).reshape(n, cfg.d_model) @ p["o"]
            x = x + F.gelu(_rms(x) @ p["up"]) @ p["down"]
        return _rms(x[-1]) @ self.unembed

    def decode(self, logits: torch.Tensor, kv: torch.Tensor, length: int,
               n_new: int) -> list[int]:
        """Greedily generate ``n_new`` tokens after a prompt of ``length`` tokens.

        Parameters
        ----------
        logits : torch.Tensor
            Logits of the prompt's last token (what :meth:`prefill` returned).
        kv : torch.Tensor
            KV buffer with the prompt's KV in ``kv[:length]`` and room for
            ``n_new - 1`` more tokens.
        length, n_new : int
            Prompt length; tokens to generate.
        """
        out = [int(torch.argmax(logits))]
        for i in range(n_new - 1):
            logits = self.prefill([out[-1]], kv, length + i)
            out.append(int(torch.argmax(logits)))
        return out

    def generate(self, prompt: Tokens, n_new: int) -> list[int]:
        """The monolithic run: prefill the whole prompt in one call, then decode."""
        n = len(prompt)
        kv = self.new_kv(n + n_new)
        return self.decode(self.prefill(prompt, kv, 0), kv, n, n_new)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
