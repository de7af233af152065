"""Chained block keys: same prefix, same keys; any earlier change changes every later key."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from cxlrt import block_hashes


def test_same_prefix_same_keys_and_divergence_propagates():
    a = list(range(64))
    b = a[:32] + [7] + a[33:]  # differs in block 2 of 4 (16 tokens a block)
    ka, kb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ka) == 4 and all(len(k) == 16 for k in ka)
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2] and ka[3] != kb[3]
    assert len(set(ka)) == 4


def test_a_change_in_block_zero_changes_every_key():
    a = list(range(48))
    b = [1] + a[1:]
    assert all(x != y for x, y in zip(block_hashes(a, 16), block_hashes(b, 16), strict=True))


def test_same_block_at_another_position_gets_another_key():
    blk = list(range(16))
    k = block_hashes(blk * 3, 16)
    assert len(set(k)) == 3  # chained: position is part of the key


def test_containers_agree():
    toks = list(range(1000, 1100))
    want = block_hashes(toks, 10)
    assert block_hashes(np.array(toks, dtype=np.int32), 10) == want
    assert block_hashes(np.array(toks, dtype=np.uint16), 10) == want
    assert block_hashes(torch.tensor(toks), 10) == want
    assert block_hashes(tuple(toks), 10) == want


def test_partial_block_gets_no_key_and_parent_continues_the_chain():
    toks = list(range(50))
    keys = block_hashes(toks, 16)
    assert len(keys) == 3
    assert block_hashes(toks[:15], 16) == []
    assert block_hashes(toks[16:48], 16, parent=keys[0]) == keys[1:3]


def test_salt_and_algorithm_separate_key_spaces():
    toks = list(range(32))
    plain = block_hashes(toks, 16)
    assert block_hashes(toks, 16, salt=b"model-a") != plain
    assert block_hashes(toks, 16, salt=b"model-a") != block_hashes(toks, 16, salt=b"model-b")
    assert block_hashes(toks, 16, salt="model-a") == block_hashes(toks, 16, salt=b"model-a")
    sha = block_hashes(toks, 16, algorithm="sha256")
    assert sha != plain and all(len(k) == 16 for k in sha)


def test_keys_are_the_documented_chain():
    """h_i = H(h_{i-1} || H(salt) || tokens_i as int64 LE), cut to 128 bits."""
    toks = np.arange(32, dtype="<i8")
    salt_d = hashlib.blake2b(b"cxlrt-kv-salt\0s", digest_size=16).digest()
    h0 = hashlib.blake2b(bytes(16) + salt_d + toks[:16].tobytes(), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + salt_d + toks[16:].tobytes(), digest_size=16).digest()
    assert block_hashes(toks, 16, salt=b"s") == [h0, h1]


@pytest.mark.parametrize("kw,err", [
    ({"block_tokens": 0}, ValueError), ({"block_tokens": True}, ValueError),
    ({"block_tokens": 16, "algorithm": "md5"}, ValueError),
    ({"block_tokens": 16, "parent": b"short"}, ValueError),
    ({"block_tokens": 16, "salt": 5}, TypeError),
])
def test_bad_arguments(kw, err):
    bt = kw.pop("block_tokens")
    with pytest.raises(err):
        block_hashes(list(range(32)), bt, **kw)


@pytest.mark.parametrize("tokens,err", [
    (np.zeros((2, 16), dtype=np.int64), ValueError),
    (np.zeros(32, dtype=np.float32), TypeError),
    (["a"] * 32, TypeError),
])
def test_bad_tokens(tokens, err):
    with pytest.raises(err):
        block_hashes(tokens, 16)
