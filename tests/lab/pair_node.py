"""One node of the two-guest lab test: each guest is a host of its own.

Usage: pair_node.py NODE ITERS. Node 0 formats dax:/dev/dax0.0; both nodes then
increment a counter under the cross-node lock, store KV-like blocks by DMA and
verify the other node's blocks byte for byte. Exit code 0 means all held.
"""

import hashlib
import sys
import time

import cxlrt
from cxlrt.backends.dax import medium_size

SPEC = "dax:/dev/dax0.0"
NODES = 2


def block(node, i, n=4096):
    seed = hashlib.sha256(f"{node}/{i}".encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


def main(node, iters):
    if node == 0:
        cxlrt.format(SPEC, size=medium_size("/dev/dax0.0"), nodes=NODES, force=True, lease=60)
    deadline = time.time() + 120
    while True:  # node 1 waits for node 0's format (its magic is published last)
        try:
            r = cxlrt.open(SPEC, node=node)
            break
        except cxlrt.NotARegionError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    lock = r.lock("pair")
    if node == 0:
        counter = r.alloc(64)
        r.dma_write(counter, bytes(64))
        r.put("counter", counter)
    while True:
        try:
            counter = r.get("counter")
            break
        except KeyError:
            time.sleep(0.1)
    for _ in range(iters):
        with lock:
            r.flush(counter, 8)
            v = r.load64(counter)
            r.store64(counter, v + 1)
            r.persist(counter, 8)
    blocks = []
    for i in range(8):
        off = r.alloc(4096)
        r.dma_write(off, block(node, i))
        blocks.append(off)
    table = r.alloc(64)
    r.dma_write(table, b"".join(o.to_bytes(8, "little") for o in blocks))
    r.put(f"blocks{node}", table)
    other = 1 - node
    while True:
        try:
            theirs = r.get(f"blocks{other}")
            break
        except KeyError:
            time.sleep(0.1)
    offs = [int.from_bytes(r.dma_read(theirs + 8 * i, 8), "little") for i in range(8)]
    for i, off in enumerate(offs):
        assert r.dma_read(off, 4096) == block(other, i), f"node {node}: block {i} differs"
    r.put(f"done{node}", 1)
    while True:
        try:
            r.get(f"done{other}")
            break
        except KeyError:
            time.sleep(0.1)
    r.flush(counter, 8)
    total = r.load64(counter)
    print(f"node {node}: counter {total} (expected {NODES * iters}), acquisitions "
          f"{lock.acquisitions()}, other node's 8 blocks verified", flush=True)
    assert total == NODES * iters, total
    time.sleep(1)  # let the other guest read our done flag before we detach
    r.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
