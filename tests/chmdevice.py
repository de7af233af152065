"""Test-only access to a chm: device's shared state, as a process inside its controller
would leave it."""

from __future__ import annotations

import ctypes
import os
import signal

import numpy as np

from cxlrt.emulation import chmside
from cxlrt.mapping import Mapping


def die_inside(side_path: str, geo: dict, scribble) -> None:
    """Fork a process that takes the device lock, calls scribble(m, ftab, pmap) on the
    mapped sidecar, and is SIGKILLed holding the lock; assert that it died so."""
    pid = os.fork()
    if pid == 0:
        try:
            m = Mapping(side_path, geo["total"])
            buf = (ctypes.c_char * m.size).from_buffer(m)
            libc = ctypes.CDLL(None)
            if libc.pthread_mutex_lock(ctypes.byref(buf, chmside.LOCK_OFFSET)) == 0:
                ftab = np.frombuffer(m, np.uint64, geo["frames"], geo["ftab"])
                pmap = np.frombuffer(m, np.uint32, geo["pages"], geo["pmap"])
                scribble(m, ftab, pmap)
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), status  # died holding the lock, as planned
