"""A medium that fails one access of a cross-node lock's acquire or release, in turn (or
four in a row: more than the retries in front of them).

What must hold after every case: the call raised MediumError or did its work; while
node 0 holds the lock node 1 cannot take it; once node 0 has let go (or its acquire
failed) node 1 takes it at once, and node 0 can take it again: a failed access never
leaves a ticket, a request or the node-local mutex behind to wedge the lock.
"""

from __future__ import annotations

import pytest

from tests.algorithms.test_medium_errors import MOST, _fail_one_access

KINDS = ("load", "store", "flush", "fence")
SOON = 5.0  # s: far longer than a free lock takes; a wedged one never answers


def _takes(r, mode):
    lk = r.lock("sweep", mode=mode)
    got = lk.acquire(timeout=SOON)
    if got:
        lk.release()
    return got


@pytest.mark.parametrize("times", [1, 4], ids=["once", "4x"])
@pytest.mark.parametrize("effect", [False, True], ids=["undone", "done"])
@pytest.mark.parametrize("op", ["acquire", "release"])
@pytest.mark.parametrize("mode", ["bakery", "manager"])
def test_a_failed_access_in_a_lock_step_never_wedges_or_doubles_the_lock(
        backend, emu_only, mode, op, effect, times, keep):
    """Before, in manager mode, a failed publish of the request (its store landed in
    our view) and a failed release each left a request on our line that the manager
    granted to nobody: node 1 waited for as long as node 0 lived. And a failure that
    outlasted the release's retries (4x) did so in both modes, until node 0 took the
    lock again."""
    r = keep(backend.create(nodes=2, size="32M", lock_manager=mode == "manager"))
    other = keep(backend.open(1))
    lk = r.lock("sweep", mode=mode)
    errors = 0
    for k in range(MOST):
        what = f"{mode} {op}, access {k} failed ({'done' if effect else 'undone'}, {times}x)"
        if op == "release":
            assert lk.acquire(timeout=SOON), what
        fired, err = _fail_one_access(r, k, effect, lk.acquire if op == "acquire" else lk.release,
                                      KINDS, times)
        errors += err is not None
        if lk.held_by_me():
            assert op == "acquire" and err is None, f"{what}: held after {err!r}"
            o = other.lock("sweep", mode=mode)
            assert not o.acquire(timeout=0.05), f"{what}: node 1 took a lock node 0 holds"
            lk.release()
        assert _takes(other, mode), f"{what}: node 1 cannot take the lock (wedged)"
        assert _takes(r, mode), f"{what}: node 0 cannot take the lock again (wedged)"
        if not fired:
            break
    else:
        pytest.fail(f"{op} never ran out of accesses")
    assert k >= 2, k
    if times > 1:
        # A failure that outlasts the retries is told; the sweep says the leave again
        # once the medium answers, which is why node 1 took the lock above.
        assert errors >= 1, (k, errors)
    elif op == "release":
        assert errors == 0, (k, errors)  # its stores are said again: one failure is absorbed
    elif mode == "bakery":
        # Every failed access surfaces but one: the count of acquisitions on our own
        # line, a statistic. (A manager-mode waiter's accesses also include its
        # best-effort look at the manager's heartbeat, as many as its wait is long.)
        assert k - errors == 1, (k, errors)
    else:
        assert errors >= 1, (k, errors)
