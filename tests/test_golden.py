"""Golden region images (tests/golden/) pin the on-media format.

Each image of the current layout version is opened (a copy, as node 0 of a file:
spec) and its known contents are read back through the public API. A field that
moves without a version bump reads the image wrong and fails here; a version
bump makes the older images be refused with a clear error, which is checked too.
The images' uuid and wall-clock words are random per build and never read.
Their node-local state (robust mutexes, pin tables) was thrown away with the
process that made them: every node is detached, so it is rebuilt at open.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

import numpy as np
import pytest

import cxlrt
from cxlrt import superblock as sb
from cxlrt.check import check
from cxlrt.errors import LayoutVersionError
from tests.golden import make_golden as golden

with open(golden.MANIFEST) as _f:
    MANIFEST = json.load(_f)
CURRENT = [e for e in MANIFEST if e["layout_version"] == sb.VERSION]
OLDER = [e for e in MANIFEST if e["layout_version"] < sb.VERSION]


def _unpack(entry, folder) -> str:
    """A writable copy of the image in `folder`, as a file: spec."""
    path = os.path.join(folder, "region")
    with gzip.open(os.path.join(golden.HERE, entry["image"]), "rb") as src, \
            open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return "file:" + path


@pytest.fixture(params=CURRENT, ids=[e["image"] for e in CURRENT])
def image(request, region_dir):
    return request.param, _unpack(request.param, region_dir)


def test_the_current_layout_version_has_images():
    assert CURRENT, (f"no golden image of layout version {sb.VERSION}: a deliberate format "
                     "change adds them with `python tests/golden/make_golden.py`")


def test_superblock_and_info(image):
    entry, spec = image
    info = cxlrt.inspect(spec)
    assert info["version"] == entry["layout_version"] == sb.VERSION
    assert (info["size"], info["nodes"]) == (entry["size"], entry["nodes"])
    assert info["sections"] == sb.layout(entry["size"], entry["nodes"])
    assert info["lease_ms"] == int(golden.LEASE_S * 1000)
    assert [a["state"] for a in info["node_areas"]] == ["detached"] + \
        ["never attached"] * (entry["nodes"] - 1)
    assert info["node_areas"][0]["attaches"] == 1
    (kv,) = info["kv_caches"]
    blocks = len(golden.kv_blocks())
    assert {k: kv[k] for k in ("name", "capacity_blocks", "block_bytes", "block_tokens",
                               "occupancy", "stores", "pins")} == {
        "name": golden.KV_NAME, "capacity_blocks": golden.KV_ARGS["capacity_blocks"],
        "block_bytes": golden.KV_ARGS["block_bytes"],
        "block_tokens": golden.KV_ARGS["block_tokens"], "occupancy": blocks,
        "stores": blocks, "pins": 0}


def _names():
    return sorted([golden.SMALL[0], golden.LARGE[0], "kv/" + golden.KV_NAME,
                   "chan/" + golden.CHAN_NAME])


def test_check_is_clean(image):
    entry, spec = image
    report = check(spec)
    assert report["problems"] == []
    assert report["dead_nodes"] == []
    assert sorted(report["directory"]) == _names()
    names = {lk["name"]: lk["mode"] for lk in report["locks"]}
    assert {n: names.get(n) for n in golden.LOCKS} == golden.LOCKS
    usage = report["usage"]
    assert (usage["large_objects"], usage["large_bytes"]) == (1, 2 * sb.CHUNK)
    # the small object, the KV cache object, its payloads, the channel
    assert usage["small_objects"] == 3 + len(golden.kv_blocks())


def test_directory_and_objects(image):
    _, spec = image
    with cxlrt.open(spec, node=0) as r:
        assert sorted(r.names()) == _names()
        for name, nbytes, seed in (golden.SMALL, golden.LARGE):
            assert r.dma_read(r.get(name), nbytes) == golden.pattern(nbytes, seed), name


def test_kv_lookup_and_load(image):
    _, spec = image
    with cxlrt.open(spec, node=0) as r:
        kv = cxlrt.KVCache(r, golden.KV_NAME, salt=golden.KV_ARGS["salt"],
                           block_tokens=golden.KV_ARGS["block_tokens"], create=False)
        try:
            with kv.lookup(golden.kv_keys()) as hit:
                assert len(hit) == len(golden.kv_blocks())
                got = kv.load(hit)
            want = np.frombuffer(b"".join(golden.kv_blocks()), np.uint8)
            assert np.array_equal(got.reshape(-1), want)
        finally:
            kv.close()


def test_channel_recv(image):
    _, spec = image
    with cxlrt.open(spec, node=0) as r:
        ch = cxlrt.Channel(r, golden.CHAN_NAME, slots=None, msg_bytes=None)
        try:
            assert [ch.recv(timeout=1.0) for _ in golden.MESSAGES] == list(golden.MESSAGES)
            assert ch.try_recv() is None
        finally:
            ch.close()


@pytest.mark.skipif(not OLDER, reason="no image of an older layout version yet")
@pytest.mark.parametrize("entry", OLDER, ids=[e["image"] for e in OLDER])
def test_older_versions_are_refused_clearly(entry, region_dir):
    spec = _unpack(entry, region_dir)
    with pytest.raises(LayoutVersionError, match=str(entry["layout_version"])):
        cxlrt.open(spec, node=0)
