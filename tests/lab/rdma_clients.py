"""Several client processes on one served region, in a lab guest (tests/test_lab.py).

Usage: rdma_clients.py SPEC CLIENTS ITERS. Formats the served region for CLIENTS
nodes, then runs CLIENTS processes, node k each: they count to CLIENTS x ITERS under
one cross-node lock, each stores 8 KV blocks under its own prompt, and each loads and
verifies every other client's blocks byte for byte. Exit code 0 means all held.
"""

import hashlib
import multiprocessing as mp
import sys
import time

import numpy as np

import cxlrt
from cxlrt import registry

BLOCK = 16 << 10


def tokens(node):
    return [node * 1000 + i for i in range(8 * 16)]


def payload(node, i):
    seed = hashlib.sha256(f"{node}/{i}".encode()).digest()
    return np.frombuffer((seed * (BLOCK // len(seed)))[:BLOCK], np.uint8)


def client(spec, node, clients, iters, barrier):
    r = cxlrt.open(spec, node=node)
    lock = r.lock("count")
    cache = cxlrt.KVCache(r, "lab", block_bytes=BLOCK, capacity_blocks=64, block_tokens=16)
    if node == 0:
        counter = r.alloc(64)
        r.dma_write(counter, bytes(64))
        r.put("counter", counter)
    barrier.wait(300)
    counter = r.get("counter")
    for _ in range(iters):
        with lock:
            r.flush(counter, 8)
            r.store64(counter, r.load64(counter) + 1)
            r.persist(counter, 8)
    keys = cache.block_hashes(tokens(node))
    cache.store(keys, np.stack([payload(node, i) for i in range(8)]))
    barrier.wait(300)
    for other in range(clients):
        if other == node:
            continue
        theirs = cache.block_hashes(tokens(other))
        out = np.zeros((8, BLOCK), np.uint8)
        with cache.lookup(theirs) as hit:
            assert len(hit) == 8, f"node {node}: {len(hit)} of node {other}'s blocks found"
            cache.load(hit, out)
        for i in range(8):
            assert (out[i] == payload(other, i)).all(), f"node {node}: {other}'s block {i}"
    barrier.wait(300)
    r.flush(counter, 8)
    total = r.load64(counter)
    assert total == clients * iters, total
    print(f"node {node}: counter {total} (expected {clients * iters}), "
          f"{clients - 1} other clients' 8 blocks verified", flush=True)
    r.close()


def main(spec, clients, iters):
    deadline = time.monotonic() + 180  # another guest's server may still be starting
    while True:
        try:
            size = registry.hook("rdma", "medium_size")(spec.partition(":")[2].partition("?")[0])
            break
        except (ConnectionError, TimeoutError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    cxlrt.format(spec, size=size, nodes=clients, force=True)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    procs = [ctx.Process(target=client, args=(spec, k, clients, iters, barrier))
             for k in range(clients)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * clients, f"client exit codes {codes}"
    print(f"rdma clients: {clients} passed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
