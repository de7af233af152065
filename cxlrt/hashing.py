"""Chained block keys for the prefix KV cache.

Key i names the KV of block i *and everything before it*:
``h_i = H(h_{i-1} || salt_digest || tokens_i)``, with H a collision-resistant hash
cut to 128 bits. Two prompts share key i exactly when they share blocks 0..i
and the salt, so a lookup of a prompt's keys finds its longest cached prefix.
The salt names what makes KV differ beyond tokens (model, dtype, layout,
adapter, tenant); tokens are hashed as little-endian int64 so the same ids give
the same keys on every host, whatever container they came in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

KEY_BYTES = 16
ALGORITHMS = {"blake2b": 1, "sha256": 2}
ALGORITHM_NAMES = {v: k for k, v in ALGORITHMS.items()}


def _hasher(algorithm: str):
    if algorithm == "blake2b":
        return lambda data: hashlib.blake2b(data, digest_size=KEY_BYTES).digest()
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()[:KEY_BYTES]
    raise ValueError(f"hash algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")


def salt_digest(salt: bytes | str, algorithm: str = "blake2b") -> bytes:
    """The 16-byte digest of a salt that keys and the cache index record."""
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        raise TypeError(f"salt must be bytes or str, not {type(salt).__name__}")
    return _hasher(algorithm)(b"cxlrt-kv-salt\0" + bytes(salt))


def _token_array(tokens: Any) -> np.ndarray:
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integer ids that fit in int64, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError("token ids must fit in int64")
    return arr.astype("<i8", copy=False)


def block_hashes(tokens: Sequence[int] | Any, block_tokens: int, *, salt: bytes | str = b"",
                 parent: bytes | None = None, algorithm: str = "blake2b") -> list[bytes]:
    """Chained 16-byte keys, one per full block of `block_tokens` tokens.

    A trailing partial block gets no key. `parent` continues a chain: pass the
    last key of the blocks that precede `tokens`.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    h = _hasher(algorithm)
    salt_d = salt_digest(salt, algorithm)
    if parent is None:
        prev = bytes(KEY_BYTES)
    elif isinstance(parent, (bytes, bytearray)) and len(parent) == KEY_BYTES:
        prev = bytes(parent)
    else:
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {parent!r:.40}")
    raw = _token_array(tokens).tobytes()
    step = block_tokens * 8
    out = []
    for i in range(len(raw) // step):
        prev = h(prev + salt_d + raw[i * step:(i + 1) * step])
        out.append(prev)
    return out
