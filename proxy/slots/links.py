"""Which sessions referenced which tool-result slots, so that forgetting a session can delete
the slots only it used (in the ``slot_sessions`` table, :mod:`proxy.store.forget`).

A slot belongs to a user, not to a session: its id is a hash of the output, so two sessions that
read the same file share one slot. :class:`SlotLinks` records, in the background (a chat request
never waits for it), that a session's prompt referenced a slot; at most once per ``window``
seconds per (session, slot), with a lifetime of ``LINK_KEEP`` slot TTLs, renewed while the session
keeps sending the prompt. A link written late (a forget raced it) only leaves a slot to its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from proxy.store.forget import link_slots
from proxy.store.store import Store

log = logging.getLogger("engram.slots")

LINK_KEEP = 2
"""A link lives this many slot TTLs after it was last recorded (a slot read refreshes its own TTL
without re-recording its link, so a link outlives its slot's TTL)."""
MAX_LINKED = 100_000
"""Bound on the memory of recent links; stale entries go first, then everything."""


class SlotLinks:
    """Records session-to-slot links through the store's writer, off the request's path."""

    def __init__(self, store: Store, ttl: float, window: Callable[[], float]) -> None:
        self.store = store
        self.ttl = ttl
        self.window = window
        self._recent: dict[tuple[str, str], float] = {}  # (session, slot) -> monotonic time
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed = 0

    def record(self, user: str, session: str, slot_ids: Collection[str]) -> None:
        """Remember (soon) that ``session`` of ``user`` referenced ``slot_ids``."""
        now, window = time.monotonic(), self.window()
        new = sorted(s for s in slot_ids if now - self._recent.get((session, s), -window) >= window)
        if not new:
            return
        for slot_id in new:
            self._recent[(session, slot_id)] = now
        if len(self._recent) > MAX_LINKED:
            self._recent = {k: v for k, v in self._recent.items() if now - v < window}
            if len(self._recent) > MAX_LINKED:
                self._recent.clear()
        task = asyncio.get_running_loop().create_task(
            self._write(user, session, new), name="slot-links"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, user: str, session: str, slot_ids: Sequence[str]) -> None:
        until = time.time() + LINK_KEEP * self.ttl
        try:
            await self.store.write(lambda c: link_slots(c, user, session, slot_ids, until))
        except Exception as exc:
            self.failed += 1
            for slot_id in slot_ids:  # try again on the next request
                self._recent.pop((session, slot_id), None)
            log.warning("recording which session used a tool-result slot failed: %s", exc)

    def forget(self, sessions: Collection[str]) -> None:
        """Drop what is remembered of ``sessions`` (they were deleted)."""
        gone = set(sessions)
        self._recent = {k: v for k, v in self._recent.items() if k[0] not in gone}

    async def drain(self) -> None:
        """Wait for the links being written (before the store closes)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
