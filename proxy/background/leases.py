"""Background jobs that run once per item across the processes sharing a database.

:meth:`Leases.hold` claims an item's lease (:mod:`proxy.store.leases`) for this process, renews
it every third of :data:`TTL_S` while the job runs, and releases it after. A process that
dies mid-job stops renewing: another one takes the item once the lease has expired (the job
is then done again from its start: a summary or a hand-back is written in one transaction at
the end, so a half-done job leaves nothing behind). A job that nothing schedules again (a
summary is asked for by a request, not by a loop) claims with ``wait``: refused, it claims
once more when the holder's lease would run out, so a dead holder's job is taken over then,
not at the next request (a live holder has renewed it: the job is its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator

from proxy.store import leases
from proxy.store.store import Store

log = logging.getLogger("engram.leases")

TTL_S = 30.0
"""How long a lease lasts unless renewed (``memory.job_lease``): how soon another process takes
over a dead one's job."""

SLACK_S = 0.05
"""Past a lease's end, before a waiting claim tries again."""


class Leases:
    """This process's leases on the items of background jobs."""

    def __init__(self, store: Store, ttl: float = TTL_S) -> None:
        self.store = store
        self.ttl = ttl
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.refused = 0  # claims another process held

    @contextlib.asynccontextmanager
    async def hold(self, name: str, wait: bool = False) -> AsyncIterator[bool]:
        """``async with leases.hold("summary:<id>") as mine:`` run the job only if ``mine``.
        ``wait``: refused, claim again when the holder's lease would run out."""
        holder = self.holder
        if not await self._claim(name, wait):
            self.refused += 1
            yield False
            return
        renewing = asyncio.create_task(self._renew(name))
        try:
            yield True
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            await self.store.write(lambda c: leases.release(c, name, holder))

    async def _claim(self, name: str, wait: bool) -> bool:
        """Claim ``name``; refused and ``wait``, once more when the lease would run out (a live
        holder has renewed it by then, a dead one has not)."""
        holder, ttl = self.holder, self.ttl
        now = time.time()
        if await self.store.write(lambda c: leases.claim(c, name, holder, now, ttl)):
            return True
        if not wait:
            return False
        until = await self.store.read(lambda c: leases.expires_at(c, name))
        await asyncio.sleep(min(max(0.0, (until or now) - time.time()), ttl) + SLACK_S)
        now = time.time()
        return bool(await self.store.write(lambda c: leases.claim(c, name, holder, now, ttl)))

    async def _renew(self, name: str) -> None:
        holder, ttl = self.holder, self.ttl
        while True:
            await asyncio.sleep(ttl / 3)
            if not await self.store.write(
                lambda c: leases.claim(c, name, holder, time.time(), ttl)
            ):
                log.warning("lease %s was taken by another process (this one stalled)", name)
                return
