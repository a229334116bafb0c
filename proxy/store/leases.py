"""Leases: one process at a time runs a background job on an item, however many share the
database (``engram serve --workers N``, ``engram import`` beside a server).

A lease is a row of ``leases`` (migration 16): the item's name (``summary:<session>``,
``handback:<session>``, ``consolidate:<request>``), who holds it and until when. :func:`claim`
takes it when it is free, expired, or already the caller's (a renewal), in one statement under
SQLite's write lock, so two processes claiming at once cannot both win. The holder renews it
while the job runs (:class:`proxy.background.leases.Leases`) and releases it after; a holder
that dies (SIGKILL included) stops renewing, and another process may take the item once the
lease has expired. This is SQLite's counterpart of PostgreSQL's ``FOR UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

from proxy.store.sqlite.db import Connection

PRUNE_AFTER_S = 3600.0
"""Expired leases older than this are deleted when a lease is claimed."""


def claim(conn: Connection, name: str, holder: str, now: float, ttl: float) -> bool:
    """Take (or renew) the lease ``name`` for ``holder`` until ``now + ttl``; False when
    another holder has it and it has not expired."""
    cur = conn.execute(
        "INSERT INTO leases(name, holder, expires_at) VALUES (?, ?, ?)"
        " ON CONFLICT(name) DO UPDATE SET holder = excluded.holder,"
        " expires_at = excluded.expires_at"
        " WHERE leases.expires_at <= ? OR leases.holder = excluded.holder",
        (name, holder, now + ttl, now),
    )
    taken = cur.rowcount == 1
    if taken:
        conn.execute("DELETE FROM leases WHERE expires_at < ?", (now - PRUNE_AFTER_S,))
    return taken


def release(conn: Connection, name: str, holder: str) -> None:
    """Give the lease back (only if ``holder`` still has it)."""
    conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))


def holder_of(conn: Connection, name: str, now: float) -> str | None:
    """Who holds ``name`` now (None: nobody, or expired)."""
    row = conn.execute(
        "SELECT holder FROM leases WHERE name = ? AND expires_at > ?", (name, now)
    ).fetchone()
    return str(row[0]) if row else None


def expires_at(conn: Connection, name: str) -> float | None:
    """When ``name``'s lease runs out unless renewed (None: there is none)."""
    row = conn.execute("SELECT expires_at FROM leases WHERE name = ?", (name,)).fetchone()
    return float(row[0]) if row else None
