"""Make the golden region images that pin cxlrt's on-media format.

Each image is a whole region file, formatted and filled through the public API
with the fixed contents below, every node detached cleanly, then gzipped.
tests/test_golden.py opens a copy of each and reads the contents back: a change
of the format that was not meant fails there. A deliberate change bumps
CXL_LAYOUT_VERSION (layout.pxd) and adds images made by this script at the new
version; the old ones stay, and the test expects them to be refused clearly.

Only the superblock's uuid and creation time differ between two runs (and the
wall-clock words: heartbeat and creation stamps); the test never reads those.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "manifest.json")

NODE_COUNTS = (1, 3)          # one image per node count: the sections move with it
EXTRA_CHUNKS = 4              # heap chunks beyond the minimum region's
LEASE_S = 0.5
LOCKS = {"golden.bakery": "bakery", "golden.manager": "manager"}
SMALL = ("golden/small", 200, 0x11)    # (directory name, bytes, fill pattern seed)
LARGE = ("golden/large", 70000, 0x5A)  # more than a chunk: a large object
KV_NAME = "golden"
KV_ARGS = {"block_bytes": 256, "capacity_blocks": 4, "block_tokens": 4, "salt": b"golden"}
KV_TOKENS = tuple(range(100, 112))     # three full blocks
CHAN_NAME = "golden"
CHAN_ARGS = {"slots": 4, "msg_bytes": 48}
MESSAGES = (b"hello from the golden image", b"second message")


def pattern(nbytes: int, seed: int) -> bytes:
    """`nbytes` of fixed, position-dependent bytes (a shifted field shows)."""
    return bytes((seed + 7 * i + (i >> 8)) & 0xFF for i in range(nbytes))


def kv_blocks() -> list[bytes]:
    """The KV blocks stored, one per key, in key order."""
    n = len(KV_TOKENS) // KV_ARGS["block_tokens"]
    return [pattern(KV_ARGS["block_bytes"], 0x30 + b) for b in range(n)]


def kv_keys() -> list[bytes]:
    from cxlrt.hashing import block_hashes
    return block_hashes(list(KV_TOKENS), KV_ARGS["block_tokens"], salt=KV_ARGS["salt"])


def image_name(version: int, nodes: int) -> str:
    return f"v{version}-{nodes}node.img.gz"


def _fill(path: str, nodes: int) -> None:
    """Format a region at `path` and store the fixed contents, then close everything."""
    import numpy as np

    import cxlrt
    from cxlrt import superblock as sb
    size = sb.min_size(nodes) + EXTRA_CHUNKS * sb.CHUNK
    spec = "file:" + path
    with cxlrt.open(spec, node=0, create=True, size=size, nodes=nodes, lease=LEASE_S) as r:
        for name, mode in LOCKS.items():
            r.lock(name, mode=mode)
        with r.lock("golden.bakery"):
            pass
        for name, nbytes, seed in (SMALL, LARGE):
            off = r.alloc(nbytes)
            r.dma_write(off, pattern(nbytes, seed))
            r.put(name, off)
        kv = cxlrt.KVCache(r, KV_NAME, **KV_ARGS)
        kv.store(kv_keys(), np.frombuffer(b"".join(kv_blocks()), np.uint8).reshape(
            len(kv_blocks()), KV_ARGS["block_bytes"]))
        kv.close()
        ch = cxlrt.Channel(r, CHAN_NAME, **CHAN_ARGS)
        for m in MESSAGES:
            ch.send(m)
        ch.close()


def make(out_dir: str, nodes: int) -> dict:
    """Write one image into `out_dir`; returns its manifest entry."""
    from cxlrt import superblock as sb
    work = tempfile.mkdtemp(prefix="cxlrt-golden-")
    old_local = os.environ.get("CXLRT_LOCAL_DIR")
    os.environ["CXLRT_LOCAL_DIR"] = work  # node-local files die with the folder
    try:
        raw_path = os.path.join(work, "region")
        _fill(raw_path, nodes)
        name = image_name(sb.VERSION, nodes)
        with open(raw_path, "rb") as src, gzip.GzipFile(os.path.join(out_dir, name), "wb",
                                                        mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        return {"image": name, "layout_version": sb.VERSION, "nodes": nodes,
                "size": os.path.getsize(raw_path)}
    finally:
        if old_local is None:
            os.environ.pop("CXLRT_LOCAL_DIR", None)
        else:
            os.environ["CXLRT_LOCAL_DIR"] = old_local
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=HERE, help="folder for the images (default: this one)")
    p.add_argument("--force", action="store_true",
                   help="overwrite images of the current layout version that already exist "
                        "(only for a deliberate format change that kept the version: rare)")
    args = p.parse_args(argv)
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = []
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    from cxlrt import superblock as sb
    have = {e["image"] for e in manifest}
    for nodes in NODE_COUNTS:
        name = image_name(sb.VERSION, nodes)
        if name in have and not args.force:
            print(f"{name}: exists (layout version {sb.VERSION}); --force to remake it")
            continue
        entry = make(args.out, nodes)
        manifest = [e for e in manifest if e["image"] != name] + [entry]
        print(f"{name}: {entry['size']} bytes, "
              f"{os.path.getsize(os.path.join(args.out, name))} gzipped")
    with open(manifest_path, "w") as f:
        json.dump(sorted(manifest, key=lambda e: e["image"]), f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
