"""The SPSC message channel, written once, on every backend."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

import cxlrt
from cxlrt import channel as channel_mod
from cxlrt.channel import Channel, ChannelBusyError
from tests.nodes import _CTX, raise_failures, run_procs


def _pair(backend, name="ch", nodes=2, **kw):
    """Regions of node 0 and node 1 in this process, and a channel end on each."""
    a = backend.create(nodes=nodes)
    b = backend.open(1)
    return a, b, Channel(a, name, **kw), Channel(b, name, **kw)


# Layout version 2: the counters live on the role's run lines (run 0 first).
PROD_RUN0 = 192
CONS_RUN0 = 192 + 64 * channel_mod.RUNS


def _close(*objs):
    for o in objs:
        o.close()


def _message(i: int, max_len: int) -> bytes:
    """Message i: a deterministic length in 0..max_len and bytes that name i."""
    n = (i * 7919) % (max_len + 1)
    seed = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
    return (seed * (n // 32 + 1))[:n]


# --- basics ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 47, 48, 49, 1024, 1025, 4096, 5000])
def test_round_trip(backend, size):
    a, b, p, c = _pair(backend, slots=4, msg_bytes=5000)
    msg = bytes((i * 31 + size) & 0xFF for i in range(size))
    assert c.try_recv() is None
    p.send(msg)
    p.send(bytearray(msg[::-1]))
    p.send(memoryview(msg))
    assert len(c) == p.pending() == 3
    assert c.recv(timeout=5) == msg
    assert c.recv(timeout=5) == msg[::-1]
    assert c.try_recv() == msg
    assert c.try_recv() is None
    assert len(p) == 0
    assert a.names() == ["chan/ch"]
    assert p.owner("producer")["node"] == 0 and p.owner("consumer")["node"] == 1
    assert p.owner("producer")["pid"] == os.getpid()
    _close(p, c, a, b)


def test_multibyte_buffers_are_sent_as_bytes(backend):
    import array
    a, b, p, c = _pair(backend, slots=2, msg_bytes=64)
    arr = array.array("I", [1, 2, 3])
    p.send(arr)
    assert c.recv(timeout=5) == arr.tobytes()
    with pytest.raises(TypeError):
        p.send(memoryview(b"abcdef")[::2])  # not contiguous
    with pytest.raises(TypeError):
        p.send("text")
    _close(p, c, a, b)


def test_try_recv_on_empty_returns_none(backend):
    a, b, p, c = _pair(backend, slots=2, msg_bytes=64)
    assert c.try_recv() is None
    p.send(b"one")
    assert c.try_recv() == b"one"
    assert c.try_recv() is None  # drained again
    assert len(c) == 0
    _close(p, c, a, b)


@pytest.mark.parametrize("timeout", [0, 0.05])
def test_blocking_recv_times_out(backend, timeout):
    a, b, p, c = _pair(backend, slots=2, msg_bytes=64)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no message within"):
        c.recv(timeout=timeout)
    took = time.monotonic() - t0
    assert timeout <= took < timeout + 2.0
    p.send(b"late")  # the channel still works after a timeout
    assert c.recv(timeout=5) == b"late"
    _close(p, c, a, b)


def test_send_blocks_when_full_and_times_out(backend):
    a, b, p, c = _pair(backend, slots=4, msg_bytes=64)
    for i in range(4):
        p.send(bytes([i]) * 10)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="ring full"):
        p.send(b"no room", timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < 2.05
    assert len(p) == 4

    # A blocked sender waits without the GIL and resumes once a slot frees.
    errors = []

    def late_send():
        try:
            p.send(b"late", timeout=10)
        except BaseException as e:  # report it to the test thread
            errors.append(e)

    th = threading.Thread(target=late_send)
    th.start()
    time.sleep(0.2)
    assert th.is_alive(), "send() returned although the ring was full"
    with pytest.raises(RuntimeError, match="already running in another thread"):
        p.send(b"x", timeout=0)  # one sending thread per channel
    assert c.recv(timeout=5) == bytes([0]) * 10
    th.join(10)
    assert not th.is_alive() and not errors, errors
    got = [c.recv(timeout=5) for _ in range(4)]
    assert got == [bytes([1]) * 10, bytes([2]) * 10, bytes([3]) * 10, b"late"]
    _close(p, c, a, b)


def test_oversized_message_is_a_value_error(backend):
    a, b, p, c = _pair(backend, slots=2, msg_bytes=100)
    with pytest.raises(ValueError, match="101-byte message is larger than msg_bytes=100"):
        p.send(bytes(101))
    assert len(p) == 0  # nothing was sent
    p.send(bytes(range(100)))  # exactly msg_bytes is fine
    assert c.recv(timeout=5) == bytes(range(100))
    _close(p, c, a, b)


@pytest.mark.parametrize("slots,msg_bytes,match", [
    (16, 128, r"slots=8 \(asked for 16\)$"),
    (8, 64, r"msg_bytes=128 \(asked for 64\)$"),
    (4, 4096, r"slots=8 \(asked for 4\), msg_bytes=128 \(asked for 4096\)"),
])
def test_attach_with_other_geometry_names_the_difference(backend, slots, msg_bytes, match):
    a = backend.create(nodes=2)
    b = backend.open(1)
    first = Channel(a, "geo", slots=8, msg_bytes=128)
    with pytest.raises(ValueError, match=match):
        Channel(b, "geo", slots=slots, msg_bytes=msg_bytes)
    same = Channel(b, "geo", slots=None, msg_bytes=None)  # None: whatever it has
    assert (same.slots, same.msg_bytes, same.offset) == (8, 128, first.offset)
    assert same.slot_bytes == 192  # 16 + 128 rounded up to lines
    _close(first, same, a, b)


def test_attach_only(backend):
    a = backend.create(nodes=2)
    with pytest.raises(KeyError, match="no channel 'missing'"):
        Channel(a, "missing", create=False)
    assert a.names() == []
    made = Channel(a, "there", slots=2, msg_bytes=8)
    again = Channel(a, "there", slots=2, msg_bytes=8, create=False)
    assert again.offset == made.offset
    _close(made, again, a)


@pytest.mark.parametrize("kw,err", [
    ({"name": ""}, ValueError), ({"name": "x" * 60}, ValueError), ({"name": b"x"}, TypeError),
    ({"slots": 0}, ValueError), ({"slots": 1 << 25}, ValueError), ({"slots": 2.0}, TypeError),
    ({"slots": True}, TypeError), ({"msg_bytes": 0}, ValueError), ({"msg_bytes": -1}, ValueError),
])
def test_bad_arguments(backend, kw, err):
    a = backend.create(nodes=1)
    args = {"name": "ok", "slots": 4, "msg_bytes": 64} | kw
    with pytest.raises(err):
        Channel(a, args.pop("name"), **args)
    assert a.names() == []
    a.close()


def test_bad_timeouts_and_closed_channel(backend):
    a, b, p, c = _pair(backend, slots=2, msg_bytes=8)
    with pytest.raises(ValueError, match="non-negative"):
        p.send(b"x", timeout=-1)
    with pytest.raises(ValueError, match="non-negative"):
        c.recv(timeout=float("nan"))
    p.close()
    p.close()  # idempotent
    assert p.closed
    with pytest.raises(ValueError, match="closed"):
        p.send(b"x")
    with pytest.raises(ValueError, match="closed"):
        p.pending()
    _close(c, a, b)


# --- across processes ---------------------------------------------------------------------

N_FIFO = 5000
FIFO_MSG = 200


def _fifo_worker(role, spec, node, name, count):
    return (_fifo_producer if role == "producer" else _fifo_consumer)(spec, node, name, count)


def _fifo_producer(spec, node, name, count):
    with cxlrt.open(spec, node=node) as r:
        ch = Channel(r, name, slots=8, msg_bytes=FIFO_MSG, create=False)
        for i in range(count):
            ch.send(_message(i, FIFO_MSG), timeout=30)
        ch.close()
        return r.stats()


def _fifo_consumer(spec, node, name, count):
    with cxlrt.open(spec, node=node) as r:
        ch = Channel(r, name, slots=8, msg_bytes=FIFO_MSG, create=False)
        bad = []
        for i in range(count):
            got = ch.recv(timeout=30)
            if got != _message(i, FIFO_MSG):
                bad.append((i, len(got)))
        extra = ch.try_recv()
        ch.close()
        return bad, extra, r.stats()


def test_fifo_across_processes_with_wraparound(backend):
    r0 = backend.create(nodes=2)
    ch = Channel(r0, "fifo", slots=8, msg_bytes=FIFO_MSG)
    spec = backend.spec()
    args = [("producer", spec, 0, "fifo", N_FIFO), ("consumer", spec, 1, "fifo", N_FIFO)]
    prod, (bad, extra, cstats) = raise_failures(run_procs(_fifo_worker, args, timeout=120))
    assert bad == [], f"{len(bad)} messages differ, first {bad[:5]}"
    assert extra is None
    assert ch.pending() == 0
    # Both counters reached N on the medium itself (5000 / 8 slots: 625 laps).
    assert backend.medium_word(ch.offset + PROD_RUN0) == N_FIFO
    assert backend.medium_word(ch.offset + CONS_RUN0) == N_FIFO
    assert ch.owner("producer") is None and ch.owner("consumer") is None  # both closed
    if backend.faulty:
        assert prod["evictions"] + cstats["evictions"] > 0  # faults were really injected
    _close(ch, r0)


def _racing_creator(spec, node, barrier):
    with cxlrt.open(spec, node=node) as r:
        barrier.wait()
        ch = Channel(r, "race", slots=8, msg_bytes=64)
        off = ch.offset
        ch.close()
        return off


def test_racing_creators_end_with_one_channel(backend):
    r0 = backend.create(nodes=3)
    barrier = _CTX.Barrier(3)
    offs = raise_failures(run_procs(_racing_creator,
                                    [(backend.spec(), n, barrier) for n in range(3)]))
    assert len(set(offs)) == 1, offs
    assert r0.names() == ["chan/race"]
    assert r0.get("chan/race") == offs[0]
    r0.close()


def _first_producer(spec, claimed, done):
    with cxlrt.open(spec, node=0) as r:
        ch = Channel(r, "solo", slots=4, msg_bytes=32)
        ch.send(b"first")
        claimed.set()
        assert done.wait(30), "the second producer never finished"
        ch.close()
        return os.getpid()


def _producer_pair(which, spec, claimed, done):
    return (_first_producer if which == 1 else _second_producer)(spec, claimed, done)


def _second_producer(spec, claimed, done):
    try:
        with cxlrt.open(spec, node=1) as r:
            assert claimed.wait(30), "the first producer never sent"
            ch = Channel(r, "solo", slots=4, msg_bytes=32)
            try:
                ch.send(b"second")
            except ChannelBusyError as e:
                got = str(e)
            else:
                got = None
            first = ch.recv(timeout=5)  # the consumer role is still free
            ch.close()
            return got, first
    finally:
        done.set()


def test_second_producer_process_is_rejected(backend):
    r0 = backend.create(nodes=3)
    ch = Channel(r0, "solo", slots=4, msg_bytes=32)
    claimed, done = _CTX.Event(), _CTX.Event()
    pid1, (err, first) = raise_failures(run_procs(
        _producer_pair, [(1, backend.spec(), claimed, done), (2, backend.spec(), claimed, done)]))
    assert err is not None, "a second live producer was allowed to send"
    assert f"node 0 pid {pid1}" in err and "alive" in err
    assert first == b"first"
    # The first producer closed: the role is free and this process takes it.
    ch.send(b"third")
    owner = ch.owner("producer")
    assert (owner["node"], owner["pid"]) == (0, os.getpid())
    assert ch.pending() == 1
    _close(ch, r0)


_KEEP = []  # keeps a child's Channel alive until the child exits (no close, no __dealloc__)


def _send_and_vanish(spec):
    r = cxlrt.open(spec, node=0)
    ch = Channel(r, "orphan", slots=4, msg_bytes=32)
    ch.send(b"from the dead")
    _KEEP.append((r, ch))
    return os.getpid()  # the process exits without close(): the claim stays on the line


def test_producer_role_of_an_exited_process_is_taken_over(backend):
    r0 = backend.create(nodes=2)
    r1 = backend.open(1)
    ch = Channel(r1, "orphan", slots=4, msg_bytes=32)
    (pid,) = raise_failures(run_procs(_send_and_vanish, [(backend.spec(),)]))
    assert ch.owner("producer")["pid"] == pid  # still recorded, but that process is gone
    ch.send(b"from the living")  # node 1 takes over and continues the count
    assert ch.owner("producer")["node"] == 1
    assert [ch.recv(timeout=5), ch.recv(timeout=5)] == [b"from the dead", b"from the living"]
    _close(ch, r0, r1)


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_second_role_holder_in_one_process_is_rejected(backend, role):
    a, b, p, c = _pair(backend, slots=4, msg_bytes=32)
    p.send(b"x")
    assert c.recv(timeout=5) == b"x"
    holder = p if role == "producer" else c

    def use(ch):
        return ch.send(b"y") if role == "producer" else ch.try_recv()

    other = Channel(b if role == "producer" else a, "ch", slots=4, msg_bytes=32)
    with pytest.raises(ChannelBusyError, match=f"another Channel object of this process is "
                                               f"already its {role}"):
        use(other)
    holder.close()
    use(other)  # released by close(): now it may
    assert other.owner(role) is not None
    assert other.owner(role)["node"] == (1 if role == "producer" else 0)
    _close(p, c, other, a, b)


# --- corruption -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [101, 1 << 40, (1 << 64) - 1])
def test_corrupt_length_word_is_a_region_error(backend, bad):
    a, b, p, c = _pair(backend, slots=4, msg_bytes=100)
    p.send(b"good")
    a.dma_write(p.ring_offset, bad.to_bytes(8, "little"))  # slot 0's length word
    with pytest.raises(cxlrt.RegionError, match=f"slot 0 holds a message length of {bad}"):
        c.recv(timeout=5)
    assert len(c) == 1  # nothing was consumed
    a.dma_write(p.ring_offset, (4).to_bytes(8, "little"))  # repaired: delivered as written
    assert c.recv(timeout=5) == b"good"
    _close(p, c, a, b)


@pytest.mark.parametrize("word,value", [("tail", 1000), ("tail", (1 << 64) - 1),
                                        ("head", 1000)])
def test_corrupt_counter_is_a_region_error(backend, word, value):
    a, b, p, c = _pair(backend, slots=4, msg_bytes=100)
    for _ in range(4):
        p.send(b"m")
    c.recv(timeout=5)
    at = p.offset + (PROD_RUN0 if word == "tail" else CONS_RUN0)
    a.dma_write(at, value.to_bytes(8, "little"))
    with pytest.raises(cxlrt.RegionError, match="corrupt"):
        if word == "tail":
            c.recv(timeout=5)
            c.recv(timeout=5)
            c.recv(timeout=5)
            c.recv(timeout=5)  # the 4th needs a fresh look at tail
        else:
            p.send(b"m")
            p.send(b"m", timeout=5)  # full: the producer looks at head
    with pytest.raises(cxlrt.RegionError, match="corrupt"):
        p.pending()
    _close(p, c, a, b)


def test_corrupt_header_and_foreign_object(backend):
    a = backend.create(nodes=1)
    ch = Channel(a, "hdr", slots=2, msg_bytes=8)
    a.dma_write(ch.offset + 16, (1 << 40).to_bytes(8, "little"))  # slots
    with pytest.raises(cxlrt.RegionError, match="header is corrupt"):
        Channel(a, "hdr", slots=None, msg_bytes=None)
    junk = a.alloc(256)
    a.dma_write(junk, bytes(256))
    a.put("chan/junk", junk)
    with pytest.raises(cxlrt.RegionError, match="does not hold a channel"):
        Channel(a, "junk")
    a.put("chan/far", a.size - 64)
    with pytest.raises(cxlrt.RegionError, match="inside the region"):
        Channel(a, "far")
    _close(ch, a)


def test_layout_version_1_channel_is_refused_clearly(backend):
    a = backend.create(nodes=1)
    ch = Channel(a, "old", slots=2, msg_bytes=8)
    a.dma_write(ch.offset, b"CXLCHAN1")  # the magic of the layout before issue 9
    with pytest.raises(cxlrt.RegionError, match="layout-version 1 channel"):
        Channel(a, "old", slots=None, msg_bytes=None)
    _close(ch, a)


def test_slot_with_another_message_number_is_a_region_error(backend):
    """What a producer that lost its role would leave if it wrote after its quarantine."""
    a, b, p, c = _pair(backend, slots=4, msg_bytes=100)
    p.send(b"good")
    a.dma_write(p.ring_offset + 8, (4).to_bytes(8, "little"))  # slot 0 claims message 4
    with pytest.raises(cxlrt.RegionError, match="slot 0 holds message number 4 where "
                                                "message 0 was published"):
        c.recv(timeout=5)
    assert len(c) == 1  # nothing was consumed
    a.dma_write(p.ring_offset + 8, (0).to_bytes(8, "little"))
    assert c.recv(timeout=5) == b"good"
    _close(p, c, a, b)


# --- negative control -------------------------------------------------------------------------

@pytest.mark.debug_build
def test_skipping_the_observe_flush_breaks_delivery(backend, emu_only):
    """Without the flush before the tail load, the consumer reads its stale copy."""
    a, b, p, c = _pair(backend, slots=4, msg_bytes=32)
    assert c.try_recv() is None  # node 1 now holds the producer line, tail 0
    channel_mod._test_skip_observe(True)
    try:
        p.send(b"published")
        with pytest.raises((cxlrt.CoherenceError, TimeoutError)):
            c.recv(timeout=0.2)
    finally:
        channel_mod._test_skip_observe(False)
    assert c.recv(timeout=5) == b"published"  # with the flush it arrives
    _close(p, c, a, b)


def test_close_leaves_a_role_someone_else_took_over_alone(backend):
    """A producer judged dead and replaced must not clear its successor's claim."""
    r0 = backend.create(nodes=2)
    ch = Channel(r0, "taken", slots=4, msg_bytes=32)
    ch.send(b"mine")
    r1 = backend.open(1)
    claim = ch.offset + 64  # the producer claim line, as node 1 writes it when it takes over
    r1.flush(claim, 64)
    r1.store64(claim + 24, 2 | 424242 << 32)  # owner: node 1, pid 424242
    r1.store64(claim, 1)  # epoch 1
    r1.persist(claim, 64)
    ch.close()
    owner = Channel(r0, "taken", slots=4, msg_bytes=32).owner("producer")
    assert (owner["node"], owner["pid"], owner["epoch"]) == (1, 424242, 1)
    r1.close()
    r0.close()


def test_close_waits_for_a_recv_blocked_in_another_thread(backend):
    r0 = backend.create(nodes=1)
    ch = Channel(r0, "waiting", slots=4, msg_bytes=32)
    ch.send(b"x")
    assert ch.recv(timeout=5) == b"x"  # this object is now also the consumer
    out = {}

    def blocked():
        try:
            out["msg"] = ch.recv()
        except Exception as e:  # what a closed channel says to a waiting recv
            out["err"] = e

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.1)
    ch.close()
    t.join(5)
    assert not t.is_alive() and "err" in out and "closed" in str(out["err"])
    assert Channel(r0, "waiting", slots=4, msg_bytes=32).owner("consumer") is None  # given up
    r0.close()
