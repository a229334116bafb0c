"""A small progress display for long commands: a redrawn bar on a terminal, else a line now and
then (logs and pipes stay readable). Given a ``unit``, it adds the rate since the start and the
time left at that rate (``120 turns/s, ETA 0:42``)."""

from __future__ import annotations

import time
from typing import TextIO


def clock(seconds: float) -> str:
    """``h:mm:ss`` or ``m:ss``."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """``update(done, note)`` as work advances, ``close()`` at the end."""

    def __init__(
        self,
        total: int,
        stream: TextIO,
        *,
        every_s: float = 5.0,
        width: int = 30,
        unit: str | None = None,
    ) -> None:
        self.total = max(total, 0)
        self.stream = stream
        self.every_s = every_s
        self.width = width
        self.unit = unit
        self.tty = stream.isatty()
        self._start = self._last = time.monotonic()
        self._drawn = False

    def restart(self, total: int) -> None:
        """Count from now, towards ``total``."""
        self.total = max(total, 0)
        self._start = self._last = time.monotonic()

    def rate(self, done: int) -> str:
        """``"<rate> <unit>/s, ETA m:ss"`` (empty without a unit or before any work)."""
        elapsed = time.monotonic() - self._start
        if self.unit is None or done <= 0 or elapsed <= 0:
            return ""
        per_s = done / elapsed
        eta = clock((self.total - done) / per_s) if self.total > done else "0:00"
        return f"{per_s:.0f} {self.unit}/s, ETA {eta}"

    def update(self, done: int, note: str = "") -> None:
        share = min(done / self.total, 1.0) if self.total else 1.0
        notes = "  ".join(n for n in (self.rate(done), note) if n)
        text = f"{done}/{self.total} ({share:.0%}){'  ' + notes if notes else ''}"
        if self.tty:
            filled = round(share * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r[{bar}] {text}\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
