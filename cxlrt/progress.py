"""A small progress bar for the terminal (no dependency, silent when not a tty)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Draw ``label [#####.....] done/total`` on one line of a terminal.

    Parameters
    ----------
    total : int
        Units of work.
    label : str
        Text before the bar.
    stream : file, optional
        Defaults to stderr; nothing is drawn unless it is a terminal or
        ``force`` is set, so logs and ``--json`` output stay clean.
    """

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None,
                 force: bool = False, width: int = 30) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()
        self.width = width
        self._last = 0.0
        self.t0 = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < self.total):
            return
        self._last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r  {self.label} [{bar:<{self.width}}] {done}/{self.total} "
                          f"{now - self.t0:5.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()
