"""tests/labqueue.py, which runs the lab's guests in the background: with shell
commands in place of guests, so that it runs everywhere."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from . import labqueue
from .labqueue import Job


@pytest.fixture
def queue(monkeypatch):
    # A queue of this test's own: the session's may hold real guest runs.
    monkeypatch.setattr(labqueue, "_QUEUE", {})
    monkeypatch.setattr(labqueue, "_STOPPED", labqueue.threading.Event())
    yield labqueue
    labqueue.stop()


def _sh(script, timeout=30):
    return Job(["sh", "-c", script], timeout)


def test_runs_one_at_a_time_in_order_and_each_test_gets_its_own_output(queue, tmp_path):
    log = tmp_path / "log"
    jobs = [_sh(f"echo start {n} >> {log}; sleep 0.2; echo end {n} >> {log}; echo out {n}; "
                f"exit {n}") for n in range(3)]
    queue.start(jobs)
    assert [j.result() for j in reversed(jobs)] == [(2, "out 2\n"), (1, "out 1\n"), (0, "out 0\n")]
    assert log.read_text().split("\n")[:-1] == [
        f"{w} {n}" for n in range(3) for w in ("start", "end")]
    assert all(a.ended <= b.started for a, b in zip(jobs, jobs[1:], strict=False))


def test_a_job_past_its_bound_is_killed_with_its_children(queue, tmp_path):
    pid = tmp_path / "pid"
    # The child stands for run.sh's qemu: it must not outlive the cut-off.
    job = _sh(f"sleep 60 & echo $! > {pid}; wait", timeout=0.5)
    queue.start([job])
    rc, _ = job.result()
    assert rc == "cut off after 0.5 s"
    child = int(pid.read_text())
    for _ in range(100):  # the kernel reaps it once init waits for it
        try:
            if pathlib.Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the job's child {child} outlived the cut-off")


def test_stop_kills_the_running_guest_and_starts_no_other(queue):
    first, second = _sh("sleep 60"), _sh("echo ran")
    queue.start([first, second])
    while first.proc is None:
        time.sleep(0.01)
    t0 = time.monotonic()
    queue.stop()
    assert first.result()[0] == -9 and time.monotonic() - t0 < 10
    assert second.result() == ("the session ended before this guest ran", "")


def test_a_job_nobody_queued_runs_in_the_test_and_a_scratch_folder_lives_with_it(queue):
    job = Job(lambda d: ["sh", "-c", f"test -d {d} && echo {d}"], 10)
    rc, out = job.result()
    assert rc == 0 and out.startswith("/") and not os.path.exists(out.strip())


def test_a_command_that_cannot_start_reaches_the_test(queue):
    job = Job(["/nonexistent/run.sh"], 10)
    queue.start([job])
    rc, out = job.result()
    assert rc.startswith("FileNotFoundError") and out == ""
