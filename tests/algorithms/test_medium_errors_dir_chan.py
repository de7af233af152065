"""A medium that fails one access, in the directory and the channel: every step, in turn.

The companion of test_medium_errors.py (the KV pins and the allocator). `emu:` fails one
chosen access of the calling thread (`EmuBackend.fail_access`), before it takes effect
("undone") or after it (a write that landed but whose answer was lost, "done"). Each
test runs one operation once per access it makes, failing that one, and checks after
every case what must always hold:

- directory (put of a new name, overwrite, delete, lookups): the call raised
  MediumError or worked; what put reported done reads back from the other node; a name
  never resolves to another name's object; the failed call, repeated, works and leaves
  nothing mid-change; the meta lock is free (the other node takes it and writes);
  `cxlrt check` finds nothing but leaks.
- channel (send, recv, the first send/recv that claims a role, creation): no message
  arrives twice, corrupted, out of order or from nobody; every send that returned is
  received exactly once; one that raised at most once; the channel keeps working and
  keeps its owners; the consumer never serves another message's bytes.
"""

from __future__ import annotations

import hashlib
import os
from functools import partial

import pytest

import cxlrt
from cxlrt import check as cxcheck
from cxlrt import cleanup, heapscan
from cxlrt.channel import HEADER_BYTES, PREFIX, Channel, ChannelBusyError

MOST = 4000  # accesses of one operation: far more than any makes
KINDS = ("load", "store", "flush", "fence")
CHAN_KINDS = KINDS + ("dma",)  # a channel moves its payload by DMA
SLOTS = 2
MSG_BYTES = 200


def _fail_one_access(r, k, effect, act, kinds, times=1):
    """Run act() with the k-th access of `kinds` by this thread failing (k from 0), and the
    times - 1 after it. Returns (whether the first failure fired, the MediumError act
    raised or None, its result)."""
    injected = r.backend.stats()["injected_failures"]
    r.backend.fail_access(after=k, kinds=kinds, effect=effect, times=times)
    err = out = None
    try:
        out = act()
    except cxlrt.MediumError as e:
        err = e
    finally:
        fired = r.backend.stats()["injected_failures"] > injected
        r.backend.fail_access(kinds=())
    return fired, err, out


def _value(r, name):
    try:
        return r.get(name)
    except KeyError:
        return None


def _publish_retried(ch, k, errors):
    """The end of a send or recv sweep: every failure surfaced but the counter's publish
    (its store, and its persist's flush and fence), which is said again, after which the
    call went through; and `check` finds nothing but leaks."""
    assert k >= 6 and k - errors == 3, (k, errors)
    _only_leaks(ch.spec)


def _only_leaks(spec):
    problems = cxcheck.check(spec)["problems"]
    assert all(p.startswith("leak") for p in problems), problems


# --- directory -----------------------------------------------------------------------------

DIR_OPS = ["put-new", "put-overwrite", "delete"]


@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
@pytest.mark.parametrize("op", DIR_OPS)
def test_a_failed_access_anywhere_in_a_directory_change_loses_and_mixes_up_no_name(
        backend, emu_only, op, effect, keep):
    """put of a new name (into a free entry whose name line still holds another name),
    put over an existing name, and delete, each with one access failed in turn. The
    call works or raises MediumError; a change that returned reads back from node 1,
    one that raised shows its old value or its new one; no other name moves and the
    freed name ("ghost") never resolves; the meta lock is free (node 1 takes it); the
    call, repeated, works and leaves no entry mid-change; node 1 can then write."""
    r = keep(backend.create(nodes=2, size="4M"))
    other = keep(backend.open(1))
    offs = {n: r.alloc(64) for n in ("before", "victim", "after", "new", "ghost", "probe")}
    for n in ("before", "victim", "after"):
        r.put(n, offs[n])
    stable = {"before": offs["before"], "after": offs["after"]}
    old = None if op == "put-new" else offs["victim"]
    new = None if op == "delete" else offs["new"]
    lock = other.locks.builtin(0)  # the directory's (meta) lock, as node 1 takes it

    def reset():
        if op == "put-new":
            if _value(r, "victim") is not None:
                r.delete("victim")
            r.put("ghost", offs["ghost"])  # into the victim's old entry (the first free one)
            r.delete("ghost")  # free again, its name line says "ghost"
        else:
            r.put("victim", old)

    def act():
        if op == "delete":
            r.delete("victim")
        else:
            r.put("victim", new)

    errors = decided = 0
    for k in range(MOST):
        reset()
        fired, err, _ = _fail_one_access(r, k, effect, act, KINDS)
        where = f"{op}, access {k} failed ({'done' if effect else 'undone'})"
        seen = _value(other, "victim")
        if err is None:
            assert seen == new, f"{where}: the call returned, but node 1 reads {seen}"
        else:
            errors += 1
            assert seen in (old, new), f"{where}: node 1 reads {seen}, neither {old} nor {new}"
            decided += seen != old
        want = dict(stable, **({"victim": seen} if seen is not None else {}))
        assert dict(other.directory.items()) == want, f"{where}: names moved"
        assert _value(other, "ghost") is None, f"{where}: a freed name resolves"
        assert lock.acquire(timeout=5), f"{where}: the meta lock stayed held"
        lock.release()
        if err is not None:  # the caller repeats what it was told failed
            try:
                act()
            except KeyError:
                assert op == "delete", f"{where}: the repeated put raised KeyError"
        for who in (r, other):
            assert _value(who, "victim") == new, f"{where}, then repeated: wrong value"
        assert other.directory.scan(patience_s=0)[1] == [], f"{where}: left mid-change"
        other.put("probe", offs["probe"])  # node 1 writes the directory too
        assert r.get("probe") == offs["probe"]
        other.delete("probe")
        if not fired:
            break  # the call made fewer than k + 1 accesses: every one was failed
    else:
        pytest.fail(f"a {op} that never runs out of accesses")
    # Every failure but a few the lock retries made the call fail, and some failed
    # after the change was decided (its generation odd: readers see the new value).
    assert k >= 20 and errors >= k - 8 and decided >= 1, (k, errors, decided)
    _only_leaks(backend.spec())


@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_failed_access_in_a_directory_lookup_is_an_error_or_the_right_offset(
        backend, emu_only, effect, keep):
    """get of a name behind a freed entry, get of the freed name, and the listing, on
    node 1, each load or flush failed in turn: MediumError or the right answer, and the
    next lookup works (a reader holds nothing another could wait on)."""
    r = keep(backend.create(nodes=2, size="4M"))
    other = keep(backend.open(1))
    offs = {f"n{i}": r.alloc(64) for i in range(4)}
    for n, off in offs.items():
        r.put(n, off)
    r.delete("n1")
    want = {n: off for n, off in offs.items() if n != "n1"}

    def lookups():
        return other.get("n3"), _value(other, "n1"), dict(other.directory.items())

    errors = 0
    for k in range(MOST):
        fired, err, got = _fail_one_access(other, k, effect, lookups, ("load", "flush"))
        if err is None:
            assert got == (offs["n3"], None, want), f"lookup, access {k} failed: {got}"
        errors += err is not None
        assert lookups() == (offs["n3"], None, want), f"lookup, access {k} failed, then again"
        if not fired:
            break
    else:
        pytest.fail("a lookup that never runs out of accesses")
    assert k >= 128 and errors == k, (k, errors)  # every entry read, every failure told
    assert dict(r.directory.items()) == want
    _only_leaks(backend.spec())


# --- channel: helpers ----------------------------------------------------------------------

def _msg(i: int) -> bytes:
    """Message i: its number, a digest of it, then filler; 60..199 bytes, so most of it
    lies past the slot's first line (a second DMA on receipt)."""
    n = 60 + (i * 37) % (MSG_BYTES - 60)
    num = i.to_bytes(8, "little")
    head = num + hashlib.blake2b(num, digest_size=8).digest()
    return head + bytes((i * 7 + j) & 0xFF for j in range(n - len(head)))


def _number(m: bytes, where: str) -> int:
    i = int.from_bytes(m[:8], "little")
    assert m == _msg(i), f"{where}: a corrupt message ({len(m)} bytes: {m[:24].hex()}...)"
    return i


def _take_all(c, where):
    """Everything the consumer can take now (every send here published before)."""
    got = []
    while True:
        try:
            m = c.try_recv()
        except cxlrt.RegionError as e:  # a wedged consumer: every later recv says the same
            raise AssertionError(f"{where}: the consumer cannot receive: {e}") from e
        if m is None:
            return got
        got.append(m)
        assert len(got) <= 4 * SLOTS, f"{where}: the consumer receives without end"


def _check_stream(got, sent, maybe, where):
    """`got` (the application's messages, in order): intact, in order, none twice,
    each of `sent` exactly once, each of `maybe` at most once, nothing else."""
    ids = [_number(m, where) for m in got]
    assert len(set(ids)) == len(ids), f"{where}: delivered twice: {ids}"
    assert ids == sorted(ids), f"{where}: out of order: {ids}"
    assert set(ids) <= set(sent) | set(maybe), f"{where}: unknown messages: {ids}"
    assert set(sent) <= set(ids), f"{where}: lost {sorted(set(sent) - set(ids))} (got {ids})"


class _Channels:
    """A region of two nodes in this process and, per case, a fresh channel between them
    (the producer on node 0, the consumer on node 1), retired after it."""

    def __init__(self, backend, keep, lease=None):
        self.spec = backend.spec()
        self.r = keep(backend.create(nodes=2, size="8M", lease=lease))
        self.other = keep(backend.open(1))

    def pair(self, name):
        return (Channel(self.r, name, slots=SLOTS, msg_bytes=MSG_BYTES),
                Channel(self.other, name, slots=SLOTS, msg_bytes=MSG_BYTES))

    def warm(self, name):
        """A pair whose roles are taken and that has carried a full ring of messages
        (so the next send observes the consumer's head)."""
        p, c = self.pair(name)
        for i in range(SLOTS):
            p.send(_msg(100 + i), timeout=5)
        got = [_number(m, "warm-up") for m in _take_all(c, "warm-up")]
        assert got == list(range(100, 100 + SLOTS)), got
        return p, c

    def retire(self, name, *chans):
        for ch in chans:
            ch.close()
        off = self.r.get(PREFIX + name)
        self.r.delete(PREFIX + name)
        self.r.free(off)


def _owned(p, c, before, where):
    """Neither role was taken over (same owners, same epochs)."""
    for ch, role, node in ((p, "producer", 0), (c, "consumer", 1)):
        o = ch.owner(role)
        assert o is not None and (o["node"], o["pid"]) == (node, os.getpid()), \
            f"{where}: the {role} role is {o}"
        if before is not None:
            assert o["epoch"] == before[role], f"{where}: the {role} role was taken over"


def _epochs(p):
    return {role: p.owner(role)["epoch"] for role in ("producer", "consumer")}


# --- channel: send and recv ----------------------------------------------------------------

@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_send_that_raised_and_is_repeated_arrives_once(backend, emu_only, effect, keep):
    """One access of a send failed in turn (the ring observed full first, so its head
    observe is swept too); the producer repeats the same message, as a caller told
    "the medium failed" does, then sends one more. The consumer gets both, once each,
    intact and in order, and the roles stay with their owners."""
    ch = _Channels(backend, keep)
    errors = 0
    for k in range(MOST):
        name = f"s{k}"
        p, c = ch.warm(name)
        before = _epochs(p)
        where = f"send, access {k} failed ({'done' if effect else 'undone'})"
        fired, err, _ = _fail_one_access(ch.r, k, effect, partial(p.send, _msg(1), timeout=5),
                                         CHAN_KINDS)
        if err is not None:
            errors += 1
            p.send(_msg(1), timeout=5)
        p.send(_msg(2), timeout=5)
        _check_stream(_take_all(c, where), [1, 2], [], where)
        assert len(c) == 0, f"{where}: messages left over"
        _owned(p, c, before, where)
        ch.retire(name, p, c)
        if not fired:
            break
    else:
        pytest.fail("a send that never runs out of accesses")
    _publish_retried(ch, k, errors)


@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_recv_that_raised_and_is_repeated_gets_the_message_once(
        backend, emu_only, effect, keep):
    """One access of a recv failed in turn; the consumer repeats the recv at once. It
    gets the message (the call that raised returned nothing), then the next ones, each
    once, intact and in order; the roles stay with their owners."""
    ch = _Channels(backend, keep)
    errors = 0
    for k in range(MOST):
        name = f"r{k}"
        p, c = ch.warm(name)
        before = _epochs(p)
        where = f"recv, access {k} failed ({'done' if effect else 'undone'})"
        p.send(_msg(1), timeout=5)
        fired, err, first = _fail_one_access(ch.other, k, effect, partial(c.recv, timeout=5),
                                             CHAN_KINDS)
        if err is not None:
            errors += 1
            first = c.recv(timeout=5)
        got = [first]
        p.send(_msg(2), timeout=5)
        p.send(_msg(3), timeout=5)  # into the slot message 1 had
        got += _take_all(c, where)
        _check_stream(got, [1, 2, 3], [], where)
        _owned(p, c, before, where)
        ch.retire(name, p, c)
        if not fired:
            break
    else:
        pytest.fail("a recv that never runs out of accesses")
    _publish_retried(ch, k, errors)


@pytest.mark.parametrize("times", [1, 4], ids=["once", "4x"])
@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_send_that_returned_after_one_that_raised_arrives(
        backend, emu_only, effect, times, keep):
    """One access of a send failed in turn (4x: and the three after it, more than the
    counter's publish says again); the consumer looks right away (it may get the
    message: the send may have happened); the producer moves on to the next messages
    instead of repeating it. Every send that returned arrives exactly once."""
    ch = _Channels(backend, keep)
    for k in range(MOST):
        name = f"m{k}"
        p, c = ch.warm(name)
        where = (f"send, access {k} failed ({'done' if effect else 'undone'}, {times}x), "
                 "then others")
        fired, err, _ = _fail_one_access(ch.r, k, effect, partial(p.send, _msg(1), timeout=5),
                                         CHAN_KINDS, times)
        got = _take_all(c, where)
        late = []
        for i in (2, 3):
            try:
                p.send(_msg(i), timeout=0.05)
            except TimeoutError:  # the ring is full: the failed send's message holds a
                late.append(i)    # slot until a later publish shows it (4x)
        got += _take_all(c, where)
        for i in late:
            p.send(_msg(i), timeout=5)
        got += _take_all(c, where)
        _check_stream(got, [2, 3] if err else [1, 2, 3], [1], where)
        ch.retire(name, p, c)
        if not fired:
            break
    else:
        pytest.fail("a send that never runs out of accesses")
    _only_leaks(ch.spec)


@pytest.mark.parametrize("times", [1, 4], ids=["once", "4x"])
@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_the_consumer_keeps_receiving_after_a_recv_that_raised(
        backend, emu_only, effect, times, keep):
    """One access of a recv failed in turn (4x: and the three after it); meanwhile the
    producer fills what it sees free of the ring before the consumer comes back. The
    consumer then receives every sent message once, in order (the one the failed recv
    was taking at most once)."""
    ch = _Channels(backend, keep)
    for k in range(MOST):
        name = f"w{k}"
        p, c = ch.warm(name)
        where = (f"recv, access {k} failed ({'done' if effect else 'undone'}, {times}x), "
                 "then a full ring")
        p.send(_msg(1), timeout=5)
        fired, err, first = _fail_one_access(ch.other, k, effect, partial(c.recv, timeout=5),
                                             CHAN_KINDS, times)
        got = [] if first is None else [first]
        late = []
        for i in (2, 3):
            try:
                p.send(_msg(i), timeout=0.05)
            except TimeoutError:  # the ring is full: the failed recv freed no slot
                late.append(i)
        got += _take_all(c, where)
        for i in late:
            p.send(_msg(i), timeout=5)
        got += _take_all(c, where)
        _check_stream(got, [2, 3] if err else [1, 2, 3], [1], where)
        ch.retire(name, p, c)
        if not fired:
            break
    else:
        pytest.fail("a recv that never runs out of accesses")
    _only_leaks(ch.spec)


# --- channel: the first send/recv claims its role ------------------------------------------

@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_first_send_or_recv_that_raised_can_be_repeated(
        backend, emu_only, role, effect, keep):
    """The first send (or recv) of a fresh channel end claims its role; one access of
    it, claim included, failed in turn. Repeating the call works (the role is not
    left taken), and the consumer gets each message once, intact and in order."""
    ch = _Channels(backend, keep, lease=1.0)  # a takeover's quarantine lasts one lease
    for k in range(MOST):
        name = f"{role[0]}{k}"
        p, c = ch.pair(name)
        where = f"first {role} call, access {k} failed ({'done' if effect else 'undone'})"
        try:
            if role == "producer":
                fired, err, _ = _fail_one_access(ch.r, k, effect,
                                                 partial(p.send, _msg(1), timeout=5), CHAN_KINDS)
                if err is not None:
                    p.send(_msg(1), timeout=5)
                got = _take_all(c, where)  # room for the next: a takeover's hole takes a slot
            else:
                p.send(_msg(1), timeout=5)
                fired, err, first = _fail_one_access(ch.other, k, effect,
                                                     partial(c.recv, timeout=5), CHAN_KINDS)
                got = [c.recv(timeout=5) if err is not None else first]
            p.send(_msg(2), timeout=5)  # a takeover's quarantined slot: up to a lease
        except ChannelBusyError as e:
            raise AssertionError(f"{where}, then repeated: the role stays taken: {e}") from e
        got += _take_all(c, where)
        _check_stream(got, [1, 2], [], where)
        _owned(p, c, None, where)
        ch.retire(name, p, c)
        if not fired:
            break
    else:
        pytest.fail(f"a first {role} call that never runs out of accesses")
    _only_leaks(ch.spec)


# --- channel: creation ---------------------------------------------------------------------

@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_failed_channel_creation_leaves_no_name_on_memory_that_is_not_the_channels(
        backend, emu_only, effect, keep):
    """Channel() of a new name, one store, fence or DMA failed in turn (its lookups,
    loads and flushes only, are the directory's sweep above). Repeated, it works; the
    channel it names lies in live memory that no later alloc hands out, and it carries
    a message from one node to the other."""
    ch = _Channels(backend, keep)
    obs = keep(cxlrt.open(ch.spec, node=0, observer=True))
    for k in range(MOST):
        name = f"n{k}"
        where = f"creation, access {k} failed ({'done' if effect else 'undone'})"
        fired, err, p = _fail_one_access(
            ch.r, k, effect, partial(Channel, ch.r, name, slots=SLOTS, msg_bytes=MSG_BYTES),
            ("store", "fence", "dma"))
        if err is not None:
            p = Channel(ch.r, name, slots=SLOTS, msg_bytes=MSG_BYTES)
        c = Channel(ch.other, name, slots=SLOTS, msg_bytes=MSG_BYTES)
        assert ch.other.get(PREFIX + name) == p.offset
        end = p.ring_offset + SLOTS * p.slot_bytes
        s = heapscan.scan(obs)
        fresh = [ch.r.alloc(end - p.offset, 64) for _ in range(4)]
        for off in fresh:
            ch.r.free(off)
        p.send(_msg(1), timeout=5)
        got = _take_all(c, where)
        try:
            ch.retire(name, p, c)
        except cxlrt.InvalidFreeError:
            pass  # the failed creation freed it already (asserted below)
        assert heapscan.in_live_chunk(s, p.offset), f"{where}: the channel is in free heap"
        assert all(not p.offset <= off < end for off in fresh), \
            f"{where}: the channel at {p.offset:#x} was allocated again: {fresh}"
        _check_stream(got, [1], [], where)
        if not fired:
            break
    else:
        pytest.fail("a creation that never runs out of accesses")
    _only_leaks(ch.spec)


@pytest.mark.parametrize("times", [1, 4], ids=["once", "4x"])
@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
def test_a_name_on_an_object_allocated_after_a_failed_carve_leads_into_live_heap(
        backend, emu_only, effect, times):
    """A fresh region's first object of a size class (a channel's, 1728 bytes) carves a
    chunk; one access of that alloc failed in turn, the alloc repeated, and the object
    named, as Channel() does. The name must lead into live heap (`cxlrt check`: nothing
    but leaks), else repair of the node would give the object's chunk to others."""
    size = HEADER_BYTES + SLOTS * 256
    query = f"?{backend.params}" if backend.params else ""
    errors = 0
    for k in range(MOST):
        spec = f"{backend.scheme}:{os.path.join(backend.root, f'carve{k}')}{query}"
        r = cxlrt.open(spec, node=0, create=True, size="4M", nodes=2)
        try:
            fired, err, off = _fail_one_access(r, k, effect, partial(r.alloc, size, 64), KINDS,
                                               times)
            errors += err is not None
            if err is not None:
                off = r.alloc(size, 64)
            r.put("obj", off)
            with cxlrt.open(spec, node=0, observer=True) as obs:
                live = heapscan.in_live_chunk(heapscan.scan(obs), off)
        finally:
            r.close()
        if live:
            cleanup.delete(spec)
        assert live, (f"alloc, access {k} failed ({'done' if effect else 'undone'}, {times}x): the "
                      f"object named at {off:#x} lies in free heap: "
                      f"{cxcheck.check(spec)['problems']}")
        if not fired:
            break
    else:
        pytest.fail("an alloc that never runs out of accesses")
    if times > 1:
        # Past _format's retries the chunk stays unformatted: the alloc raises, and the
        # next one must not take a slot of it (_scan_own skips a chunk without its magic).
        assert errors >= 1, (k, errors)
        return
    # Every failure surfaced but those a step absorbs by writing again what it wrote:
    # the allocator lock's release (4 accesses) and the fresh chunk's header and bitmap
    # (_carve's _format, 9: the chunk is ours and no slot of it is out yet).
    assert k >= 20 and k - errors == 4 + 9, (k, errors)
