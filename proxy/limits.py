"""Small helpers of the ``[limits]`` caps (pure, no I/O): a log throttle, so a cap that keeps
being hit is said once per user per interval rather than on every request, and cutting a text
to a number of UTF-8 bytes with a note saying how much was left out."""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.cache import LRU

LOG_EVERY = 600.0
"""Seconds between two log lines about the same cap and user."""
THROTTLE_KEYS = 10_000


class Throttle:
    """Says whether something keyed (a cap and a user) is due to be logged again."""

    def __init__(
        self, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every = every
        self.clock = clock
        self._last: LRU[tuple[str, str], float] = LRU(THROTTLE_KEYS)

    def due(self, what: str, key: str) -> bool:
        """True the first time, then again once ``every`` seconds have passed (for this key)."""
        now = self.clock()
        last = self._last.get((what, key))
        if last is not None and now - last < self.every:
            return False
        self._last[(what, key)] = now
        return True


CUT_MARGIN = 4096
"""Characters past the cut that ``clean`` reads too (a secret straddling the cut is still
recognised by redaction, and not stored half raw)."""


def cut_note(total: int, kept: int) -> str:
    """What follows a text cut to the archive's bound."""
    return (
        f"\n[… cut by Engram: the message had {total} bytes, the first {kept} are archived "
        "(limits.max_message_bytes)]"
    )


def cut_text(text: str, max_bytes: int, clean: Callable[[str], str] | None = None) -> str:
    """``clean(text)`` when ``text`` has at most ``max_bytes`` UTF-8 bytes (or ``max_bytes``
    is 0); else ``clean`` of its beginning cut to ``max_bytes`` bytes on a character boundary,
    then :func:`cut_note`. ``clean`` (e.g. redaction) never reads more than the cut and
    :data:`CUT_MARGIN` characters."""
    clean = clean or (lambda t: t)
    if not max_bytes or len(text) * 4 <= max_bytes:  # cannot be over: skip the encoding
        return clean(text)
    total = len(text.encode("utf-8", "surrogatepass"))
    if total <= max_bytes:
        return clean(text)
    head = clean(text[: max_bytes + CUT_MARGIN]).encode("utf-8", "surrogatepass")[:max_bytes]
    kept = head.decode("utf-8", "ignore")
    return kept + cut_note(total, len(kept.encode("utf-8", "surrogatepass")))
