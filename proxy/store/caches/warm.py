"""Loading users' in-memory caches beside the readers, and a warm start.

A user's terms (:mod:`proxy.store.caches.term_cache`) take about 1 s to load per 10,000 turns and
their
vectors (:mod:`proxy.store.caches.vec_cache`) about 0.2 s; on one of the store's two reader threads
a
100,000-turn user's load held that thread for 11 s, every search behind it waiting. The
:class:`Loader` runs such background work on a thread of its own, with its own read-only
connection. :func:`recent_users` names the users a warm start loads when ``engram serve``
starts: measured at 100,000 turns, the first 150 requests after a cold start added 86 ms p50
(FTS5 and the quantised KNN answering while the loads competed for the cores) against 21 ms once
loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proxy.store.caches.term_cache import TermCache
from proxy.store.caches.vec_cache import VectorCache
from proxy.store.gate import StoreUnavailable
from proxy.store.held import Connections
from proxy.store.sqlite.db import Connection

log = logging.getLogger("engram.store")

WARM_USERS = 4
"""Users loaded at a warm start: the most recently active ones."""


class Loader:
    """One thread, one read-only connection of ``connections`` (the store's), for work nothing
    waits for."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(1, "engram-db-load")

    def submit(self, fn: Callable[[Connection], object]) -> None:
        """Run ``fn(conn)`` on the loader thread, in order; a failure is logged."""
        if self._pool is not None:
            self._pool.submit(self._run, fn)

    def _run(self, fn: Callable[[Connection], object]) -> None:
        try:
            self.connections.run(fn, readonly=True)
        except StoreUnavailable:  # the gate said so once (store.gate)
            log.debug("a background read waits for the database")
        except Exception:  # nothing awaits it: say so rather than lose it
            log.exception("a background read failed")

    def close(self) -> None:
        """Drop what is queued, wait for what runs (its connection closes with the store's)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def recent_users(conn: Connection, limit: int = WARM_USERS) -> list[tuple[str, int]]:
    """The ``limit`` users whose sessions were seen last, most recent first, with how many turns
    each holds."""
    rows = conn.execute(
        "SELECT u.user_id, (SELECT count(*) FROM turns t WHERE t.user_id = u.user_id)"
        " FROM (SELECT user_id, max(last_seen) AS seen FROM sessions GROUP BY user_id"
        " ORDER BY seen DESC LIMIT ?) u ORDER BY u.seen DESC",
        (limit,),
    )
    return [(str(r[0]), int(r[1])) for r in rows]


async def warm_start(
    read: Callable[[Callable[[Connection], Any]], Awaitable[Any]],
    terms: TermCache,
    vectors: VectorCache,
    loader: Loader,
    dim: int | None,
    limit: int = WARM_USERS,
) -> list[str]:
    """Start loading, on ``loader``, the terms and vectors of the :func:`recent_users` that
    fit; the users asked for."""
    users: list[tuple[str, int]] = await read(lambda c: recent_users(c, limit))
    for user, rows in users:
        terms.preload(user, rows, loader.submit)
        if dim:
            vectors.preload(user, rows, dim, loader.submit)
    return [user for user, _ in users]


def cache_split(mib: int) -> tuple[int, int]:
    """``(fts_memory, vec_memory)`` for ``mib`` MiB of search indexes in RAM (``[memory]
    cache_mb``): a third for users' terms, the rest for their vectors, which take about three
    times the room per turn (384 floats against some 150 postings)."""
    total = max(0, mib) * 1024 * 1024
    return total // 3, total - total // 3
