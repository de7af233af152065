"""A tiny decoder-only transformer with fixed random weights, and its KV layout.

The demo needs a model whose prefill costs real compute (so that recomputing a
prefix visibly costs time) and whose KV cache is explicit arrays (so that it
can be cut into blocks, stored in cxlrt, sent over TCP and loaded back). It is
written in numpy (float32 throughout) so that ``cxlrt demo`` needs nothing but
numpy. The weights come from a seed: nothing is downloaded, and every process
that builds ``TinyLM(cfg)`` holds the same model bit for bit (numpy's
``Generator`` streams are reproducible for a given numpy version).

KV layout
---------
One C-contiguous float32 array of shape ``(tokens, n_layers, 2, d_model)``
(``2`` = K, V), token major. The KV of tokens ``[a, b)`` is then one contiguous
slice ``kv[a:b]``, so a block of ``block_tokens`` tokens is ``block_bytes``
contiguous bytes holding every layer's K and V for those tokens: what one cxlrt
cache entry, one TCP payload or one ``cache.load`` destination holds, with no
packing copy.

Exactness
---------
The disaggregated paths compute a prompt's KV in pieces (a cached prefix, then
the missing blocks, then the tail) while the monolithic run computes it in one
call. Float32 matmuls of different shapes round differently, so the KV bits
may differ in the last place; greedy tokens stay equal because the output
projection is scaled so that the top two logits are far apart compared with
that rounding (``logit_scale``). ``tests/test_demo.py`` checks chunked against
full prefill, and that the top-two gap dwarfs the difference.

Cost
----
Prefill is a handful of batched ``np.matmul`` calls per layer on arrays with
unit inner stride (BLAS sgemm), with no Python loop over tokens or heads. Attention
computes the full ``(heads, new, context)`` score matrix and masks it, so a
chunk of ``n`` new tokens after ``start`` costs ``O(n * (start + n))``. The
GELU is the tanh approximation: numpy has a vectorised ``tanh`` but no ``erf``
(``math.erf`` per element would dominate the prefill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cxlrt.serving.config import ModelConfig

__all__ = ["ModelConfig", "TinyLM"]

Tokens = Sequence[int] | np.ndarray

_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
_EPS = np.float32(1e-6)


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
        g = np.random.default_rng(cfg.seed)
        d, f = cfg.d_model, cfg.d_ff

        def w(*shape: int, fan_in: int, scale: float = 1.0) -> np.ndarray:
            # Drawn in float32 directly: the stream (and so the weights) is fixed by the
            # seed, and no float64 -> float32 rounding step can differ between processes.
            a = g.standard_normal(shape, dtype=np.float32)
            a *= np.float32(scale / math.sqrt(fan_in))
            return a

        self.embed = g.standard_normal((cfg.vocab, d), dtype=np.float32)
        self.layers = [
            {"qkv": w(d, 3 * d, fan_in=d), "o": w(d, d, fan_in=d),
             "up": w(d, f, fan_in=d), "down": w(f, d, fan_in=f)}
            for _ in range(cfg.n_layers)
        ]
        self.unembed = w(d, cfg.vocab, fan_in=d, scale=cfg.logit_scale)
        # Inverse frequencies of the sinusoidal positions, float64 so that a position's
        # encoding does not depend on which chunk computes it (it is cast once, at the end).
        self._inv_freq = np.exp(np.arange(0, d, 2, dtype=np.float64) * (-math.log(1e4) / d))

    # --- KV ------------------------------------------------------------------------

    def new_kv(self, capacity: int) -> np.ndarray:
        """An uninitialised KV buffer for ``capacity`` tokens.

        Returns
        -------
        numpy.ndarray
            C-contiguous float32, shape ``(capacity, n_layers, 2, d_model)``.
        """
        return np.empty((capacity, self.cfg.n_layers, 2, self.cfg.d_model), np.float32)

    # --- compute -------------------------------------------------------------------

    def _positions(self, start: int, n: int) -> np.ndarray:
        # Sinusoidal, computed from the absolute position: a token gets the same
        # encoding whichever chunk it is prefilled in.
        ang = np.arange(start, start + n, dtype=np.float64)[:, None] * self._inv_freq
        out = np.empty((n, self.cfg.d_model), np.float32)
        out[:, 0::2] = np.sin(ang)
        out[:, 1::2] = np.cos(ang)
        return out

    def prefill(self, tokens: Tokens, kv: np.ndarray, start: int = 0) -> np.ndarray:
        """Compute the KV of ``tokens`` at positions ``start...`` given the KV before them.

        Parameters
        ----------
        tokens : sequence of int, or a 1-D integer array
            The new tokens (at least one).
        kv : numpy.ndarray
            Float32 KV buffer of shape (capacity, L, 2, d), ``capacity >= start +
            len(tokens)``. ``kv[:start]`` must hold the KV of the tokens before;
            ``kv[start:start+n]`` is written.
        start : int
            Position of the first new token (tokens already in ``kv``).

        Returns
        -------
        numpy.ndarray
            Float32 logits of the last new token, shape (vocab,).
        """
        ids = np.asarray(tokens, dtype=np.int64)
        n = ids.size
        if ids.ndim != 1 or n < 1:
            raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {ids.shape}")
        if start < 0 or start + n > kv.shape[0]:
            raise ValueError(f"KV buffer holds {kv.shape[0]} tokens; cannot write "
                             f"[{start}, {start + n})")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab})")
        cfg = self.cfg
        d, h = cfg.d_model, cfg.n_heads
        dh, end = d // h, start + n
        scale = np.float32(1.0 / math.sqrt(dh))
        x = self.embed[ids]
        x += self._positions(start, n)
        # Causal over absolute positions: new token i sees keys 0 .. start+i. An additive
        # 0 / -inf bias, broadcast over heads; every row keeps key 0, so no row is all
        # -inf and the softmax below never divides by zero. One new token sees everything.
        bias = None
        if n > 1:
            keep = np.arange(end)[None, :] <= np.arange(start, end)[:, None]
            bias = np.where(keep, np.float32(0), np.float32(-np.inf))
        for li, p in enumerate(self.layers):
            qkv = _rms(x) @ p["qkv"]
            kv[start:end, li, 0] = qkv[:, d:2 * d]
            kv[start:end, li, 1] = qkv[:, 2 * d:]
            # (heads, tokens, dh) views. The past K and V stay strided views of the KV
            # buffer: every (tokens, dh) slice has unit inner stride, so np.matmul hands it
            # to sgemm as it is (a contiguous copy was measured slower, most of all when
            # decoding one token against a long context).
            q = qkv[:, :d] * scale
            q = q.reshape(n, h, dh).transpose(1, 0, 2)
            keys = kv[:end, li, 0].reshape(end, h, dh).transpose(1, 0, 2)
            vals = kv[:end, li, 1].reshape(end, h, dh).transpose(1, 0, 2)
            att = np.matmul(q, keys.transpose(0, 2, 1))  # (h, n, end)
            if bias is not None:
                att += bias
            # Stable softmax: subtract each row's max before exp (in place: att is the
            # biggest array here).
            att -= att.max(axis=-1, keepdims=True)
            np.exp(att, out=att)
            att /= att.sum(axis=-1, keepdims=True)
            ctx = np.matmul(att, vals)  # (h, n, dh)
            x += ctx.transpose(1, 0, 2).reshape(n, d) @ p["o"]
            x += _gelu(_rms(x) @ p["up"]) @ p["down"]
        return _rms(x[-1:])[0] @ self.unembed

    def decode(self, logits: np.ndarray, kv: np.ndarray, length: int,
               n_new: int) -> list[int]:
        """Greedily generate ``n_new`` tokens after a prompt of ``length`` tokens.

        Parameters
        ----------
        logits : numpy.ndarray
            Logits of the prompt's last token (what :meth:`prefill` returned).
        kv : numpy.ndarray
            KV buffer with the prompt's KV in ``kv[:length]`` and room for
            ``n_new - 1`` more tokens.
        length, n_new : int
            Prompt length; tokens to generate.

        Returns
        -------
        list of int
            The ``n_new`` generated tokens.
        """
        out = [int(np.argmax(logits))]
        for i in range(n_new - 1):
            logits = self.prefill([out[-1]], kv, length + i)
            out.append(int(np.argmax(logits)))
        return out

    def generate(self, prompt: Tokens, n_new: int) -> list[int]:
        """The monolithic run: prefill the whole prompt in one call, then decode."""
        n = len(prompt)
        kv = self.new_kv(n + n_new)
        return self.decode(self.prefill(prompt, kv, 0), kv, n, n_new)


def _rms(x: np.ndarray) -> np.ndarray:
    """RMS norm over the last axis, no weight (a new array; ``x`` is left alone)."""
    ms = np.einsum("ij,ij->i", x, x)[:, None]
    ms *= np.float32(1.0 / x.shape[-1])
    ms += _EPS
    return x * (1.0 / np.sqrt(ms))


def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation, computed in place in ``x`` (which it returns)."""
    t = x * x
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= _GELU_C
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= np.float32(0.5)
    x *= t
    return x
