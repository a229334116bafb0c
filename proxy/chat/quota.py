"""The per-user turn cap (``limits.max_turns_per_user``): a cached count, cheap per request.

Counting a user's turns is an indexed scan of their entries (about 5 ms per 100k turns), so it
is not run per request: :class:`TurnQuota` counts a user once (started beside the request's
other memory stages, :meth:`TurnQuota.prefetch`), adds what this server archives for them, and
counts again after :data:`RECOUNT_EVERY` seconds, or after :data:`RECOUNT_OVER` while the user is
over the cap, so that forgetting sessions (or another server on the same file) is seen soon.
Over the cap a turn is not archived, and that is logged once per user per
:data:`proxy.limits.LOG_EVERY` seconds; the request itself is untouched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from proxy.cache import LRU
from proxy.limits import Throttle
from proxy.logs import event
from proxy.store.quota import user_turn_count
from proxy.store.store import Store

log = logging.getLogger("engram.limits")

RECOUNT_EVERY = 600.0
RECOUNT_OVER = 30.0
USERS = 100_000  # users whose counts are remembered


class TurnQuota:
    """Whether a user may archive more turns; ``cap`` 0 means no cap."""

    def __init__(self, store: Store, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.cap = cap
        self.clock = clock
        self.refused = 0  # turns not archived because their user was over the cap
        self._counts: LRU[str, tuple[int, float]] = LRU(USERS)  # user -> (turns, counted at)
        self._counting: dict[str, asyncio.Task[int]] = {}
        self._throttle = Throttle()

    def _stale(self, user: str) -> bool:
        found = self._counts.get(user)
        if found is None:
            return True
        turns, at = found
        age = self.clock() - at
        return age > (RECOUNT_OVER if turns >= self.cap else RECOUNT_EVERY)

    def prefetch(self, user: str) -> None:
        """Start counting ``user``'s turns now if the count is missing or old."""
        if self.cap and self._stale(user) and user not in self._counting:
            task = asyncio.get_running_loop().create_task(self._count(user), name="count-turns")
            self._counting[user] = task
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _count(self, user: str) -> int:
        try:
            turns = await self.store.read(lambda c: user_turn_count(c, user))
            self._counts[user] = (turns, self.clock())
            return turns
        finally:
            self._counting.pop(user, None)

    async def allows(self, user: str, turns: int) -> bool:
        """Whether ``turns`` new turns of ``user`` are archived (False: over the cap, logged
        once per user per interval). A request under the cap is archived whole, so a user
        ends at most one request's turns past it."""
        if not self.cap or not turns:
            return True
        self.prefetch(user)
        task = self._counting.get(user)
        try:
            held = await asyncio.shield(task) if task is not None else self._counts[user][0]
        except Exception:  # a count that failed never costs a turn: archive it
            log.exception("counting a user's turns failed; archiving without the cap")
            return True
        if held < self.cap:
            return True
        self.refused += turns
        if self._throttle.due("max_turns_per_user", user):
            event(
                log,
                logging.WARNING,
                "user over limits.max_turns_per_user: new turns are not archived "
                "(replies still go)",
                user=user,
                turns=held,
                cap=self.cap,
            )
        return False

    def add(self, user: str, turns: int) -> None:
        """``turns`` more were archived for ``user``."""
        found = self._counts.get(user)
        if found is not None and turns:
            self._counts[user] = (found[0] + turns, found[1])
