"""Pruning PostgreSQL's ``changes`` log, by one replica at a time.

SQLite's log prunes itself (a trigger keeps the newest ``CHANGES_KEEP`` rows, migration 15).
PostgreSQL's is pruned by age (:func:`proxy.store.postgres.follow.prune`), by the code: each
replica's consolidation pass calls :meth:`ChangesPruner.run`, and the replica that holds the
lease :data:`LEASE` prunes. It keeps the lease from pass to pass (claimed for :data:`PASSES`
intervals, renewed at each), so the others are refused while it lives; once it dies, its lease
runs out and the next replica to claim it prunes from then on. Claim and prune are one
transaction: two replicas claiming at once wait on the lease's row, and one of them wins.
"""

from __future__ import annotations

import logging
import time

from proxy.logs import event
from proxy.store import leases
from proxy.store.postgres import follow
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store

log = logging.getLogger("engram.changes")

LEASE = "prune:changes"
PASSES = 3.0
"""Intervals the pruning replica's lease lasts: a pass or two late is not taken for dead."""


class ChangesPruner:
    """Prunes the log past ``keep`` seconds when this process holds :data:`LEASE`."""

    def __init__(
        self, store: Store, holder: str, interval: float, keep: float = follow.KEEP_SECONDS
    ) -> None:
        self.store = store
        self.holder = holder  # this process's lease holder name (background.leases)
        self.ttl = PASSES * max(interval, 1.0)
        self.keep = keep
        self.pruned = 0  # rows this process deleted

    async def run(self) -> int | None:
        """One pass: rows deleted, or None when another replica prunes (or on SQLite)."""
        if not self.store.pg:
            return None
        now, holder, ttl, keep = time.time(), self.holder, self.ttl, self.keep

        def job(c: Connection) -> int | None:
            if not leases.claim(c, LEASE, holder, now, ttl):
                return None
            return follow.prune(c, now, keep)

        gone = await self.store.write(job)
        if gone:
            self.pruned += gone
            event(log, logging.INFO, "changes log pruned", rows=gone, older_than_s=keep)
        return gone
