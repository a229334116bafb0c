"""The ``changes`` log read on PostgreSQL, where transactions commit out of sequence order.

On SQLite one writer at a time hands out the log's sequence numbers, so committed rows are
contiguous and a follower reads "past the last seen" (:mod:`proxy.store.changes`). On
PostgreSQL several replicas write at once: a transaction that took seq 10 may commit after one
that took seq 11, so "past the last seen" would skip 10 forever. Each row therefore carries the
id of the transaction that wrote it (``txid``, an ``xid8``), and a follower reads by
transaction instead:

- it reads, in one statement (one snapshot), every row whose ``txid`` is at or above its
  watermark ``W``, together with that snapshot's ``xmin`` (every transaction below ``xmin`` had
  ended when the snapshot was taken, so all of their rows are in the read);
- it applies the rows it has not applied yet (a set of their seqs) and moves ``W`` up to
  ``xmin``: the rows of transactions still running then are read when they commit.

Own writes are not marked as on SQLite: the writer catches up right after each commit
(:meth:`proxy.store.store.Store.write`), so the writer's changes reach this process's caches
through the same path as everyone else's, before the write returns.

The log is pruned by age (:data:`KEEP_SECONDS`, :func:`prune`; by one replica at a time,
:mod:`proxy.background.changes`); the highest transaction
pruned is kept in ``meta``, and a follower whose watermark is below it has missed rows: it
clears its caches, as on SQLite.
"""

from __future__ import annotations

from typing import Any

from proxy.store.changes import BATCH, Follower, Row

KEEP_SECONDS = 3600.0
"""Rows older than this are pruned: a replica away longer than that starts its caches again."""

_READ = (
    "SELECT s.x::text, c.seq, c.user_id, c.turn_id, c.kind, c.session_id, c.txid::text"
    " FROM (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS x) s"
    " LEFT JOIN changes c ON c.txid >= ?::xid8 ORDER BY c.seq LIMIT ?"
)
_PRUNED_KEY = "changes_pruned_txid"


class PgFollower(Follower):
    """:class:`~proxy.store.changes.Follower` reading by transaction (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watermark = 0  # xid8: every transaction below it is applied
        self._seen: dict[int, int] = {}  # seq -> txid of rows applied at or above the watermark

    def install(self, conn: Any) -> None:
        """Start from now: what committed before is in the tables a load reads."""
        row = conn.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text").fetchone()
        self._watermark = int(row[0])

    def mine(self, seq: int) -> None:  # the writer catches up instead (module docstring)
        return

    def write_ended(self, ok: bool) -> None:
        return

    def catch_up(self, conn: Any) -> int:
        with self._lock:
            rows = conn.execute(_READ, (str(self._watermark), BATCH + 2)).fetchall()
            xmin = int(rows[0][0])
            found = [r for r in rows if r[1] is not None]
            if len(found) > BATCH or self._pruned_past(conn):
                self._start_again(xmin, found)
                return 0
            fresh: list[Row] = []
            for _, seq, user, turn, kind, session, txid in found:
                if int(seq) not in self._seen:
                    self._seen[int(seq)] = int(txid)
                    fresh.append((int(seq), user, turn, kind, session))
            if xmin > self._watermark:
                self._watermark = xmin
                self._seen = {s: t for s, t in self._seen.items() if t >= xmin}
            if fresh:
                self._apply(conn, fresh)
            self.applied += len(fresh)
            return len(fresh)

    def _pruned_past(self, conn: Any) -> bool:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (_PRUNED_KEY,)).fetchone()
        return row is not None and int(row[0]) >= self._watermark

    def _start_again(self, xmin: int, found: list[Any]) -> None:
        """Too far behind, or pruned past: nothing held, and every row read taken as seen
        (what they changed is in the tables a later load reads)."""
        self.terms.clear()
        self.vectors.clear()
        self.cleared += 1
        self.on_deleted(None)
        self._watermark = max(self._watermark, xmin)
        self._seen = {int(r[1]): int(r[6]) for r in found if int(r[6]) >= self._watermark}


def prune(conn: Any, now: float, keep: float = KEEP_SECONDS) -> int:
    """Delete log rows older than ``keep`` seconds (a write); how many. The highest
    transaction pruned goes to ``meta`` for followers to see they missed rows."""
    row = conn.execute(
        "SELECT max(txid)::text, count(*) FROM changes WHERE created_at < ?", (now - keep,)
    ).fetchone()
    if row is None or not row[1]:
        return 0
    conn.execute("DELETE FROM changes WHERE created_at < ?", (now - keep,))
    conn.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE"
        " SET value = excluded.value",
        (_PRUNED_KEY, str(row[0])),
    )
    return int(row[1])
