"""A small progress display for long commands: a redrawn bar on a terminal, else a line now and
then (logs and pipes stay readable)."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """``update(done, note)`` as work advances, ``close()`` at the end."""

    def __init__(
        self, total: int, stream: TextIO, *, every_s: float = 5.0, width: int = 30
    ) -> None:
        self.total = max(total, 0)
        self.stream = stream
        self.every_s = every_s
        self.width = width
        self.tty = stream.isatty()
        self._last = time.monotonic()
        self._drawn = False

    def update(self, done: int, note: str = "") -> None:
        share = min(done / self.total, 1.0) if self.total else 1.0
        text = f"{done}/{self.total} ({share:.0%}){'  ' + note if note else ''}"
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
