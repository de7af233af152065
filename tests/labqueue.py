"""The virtual CXL lab's guest runs, started in the background as the session begins.

A TCG guest spends most of its minutes on one core, booting and running its suite, and
the rest of the suite has little to do with it: on two cores the guests' 15-20 minutes
ran end to end after the rest of the suite. So tests/conftest.py moves the lab's tests
to the end of the session and hands their runs to this queue when collection is done.
The queue runs them one at a time (each guest wants a core of its own), in the order
the tests will ask for them, and a lab test waits for its own run's result. Run on its
own (no queue started), a lab test runs its guest itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time


class Job:
    """One guest run: the command, its environment and its bound (seconds from its
    start). `result()` waits for it, and returns its exit code and its output. A
    callable `cmd` is given a scratch folder that lives as long as the run."""

    def __init__(self, cmd, timeout, env=None):
        self.cmd, self.timeout, self.env = cmd, timeout, env
        self.done = threading.Event()
        self.rc = self.out = None
        self.proc = None
        self.started = self.ended = None

    def run(self):
        # Its own session, so that a bound or the end of the pytest session stops the
        # guest (run.sh's qemu) along with the script; output to a file, not a pipe, so
        # nobody has to drain it while the session runs other tests.
        self.started = time.monotonic()
        with tempfile.TemporaryFile("w+") as log, \
                tempfile.TemporaryDirectory(prefix="cxlrt-lab-") as scratch:
            try:
                cmd = self.cmd(scratch) if callable(self.cmd) else self.cmd
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             text=True, env=self.env, start_new_session=True)
                if _STOPPED.is_set() and id(self) in _QUEUE:
                    self.kill()  # stop() ran between the worker's check and the start
                try:
                    self.rc = self.proc.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    self.kill()
                    self.proc.wait()
                    self.rc = f"cut off after {self.timeout} s"
            except BaseException as e:  # a failed start must reach the test, not a thread
                self.rc = f"{type(e).__name__}: {e}"
            finally:
                log.seek(0)
                self.out = log.read()
                self.ended = time.monotonic()
                self.done.set()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def result(self):
        if not self.done.is_set() and _QUEUE.get(id(self)) is None:
            self.run()  # not queued: this test runs its guest itself
        self.done.wait()
        return self.rc, self.out


_QUEUE: dict[int, Job] = {}  # id(job) -> job, for every job handed to the queue
_LOCK = threading.Lock()
_STOPPED = threading.Event()


def start(jobs):
    """Run `jobs` one after another in a daemon thread, in this order."""
    jobs = [j for j in jobs if not j.done.is_set() and id(j) not in _QUEUE]
    if not jobs:
        return
    with _LOCK:
        for j in jobs:
            _QUEUE[id(j)] = j

    def worker():
        for j in jobs:
            if _STOPPED.is_set():
                j.rc, j.out = "the session ended before this guest ran", ""
                j.done.set()
            else:
                j.run()

    threading.Thread(target=worker, name="cxlrt-lab-queue", daemon=True).start()


def stop():
    """The session ends: stop whatever guest is still running (a test that failed
    early, ^C, -x), and start no other."""
    _STOPPED.set()
    for j in list(_QUEUE.values()):
        j.kill()
