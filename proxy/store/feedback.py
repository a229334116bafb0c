"""The record of chat requests, the feedback on them, and the consolidation queue.

Tables ``requests`` (one row per chat request that went through the memory stages), ``feedback``
(helpful or not, per request) and ``consolidation_queue`` (flagged requests waiting to be
distilled into facts). Written by :class:`proxy.background.feedback.Feedback`, worked through by
:class:`proxy.background.consolidation.Consolidator`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from proxy.store import queries
from proxy.store.dialect import is_pg
from proxy.store.sqlite.db import Connection

STATUSES = ("pending", "done", "failed")
"""The states of a queued request."""


@dataclass(frozen=True)
class RecordedRequest:
    """One row of ``requests``."""

    id: str
    user_id: str
    session_id: str | None
    model: str | None
    query: str
    memory_ids: list[int]
    created_at: float


# -- requests and feedback ------------------------------------------------------------------


def insert_request(conn: Connection, r: RecordedRequest) -> None:
    """Record a request (once: an id already recorded is left as it is). A session deleted in
    the meantime leaves the record without its link."""
    queries.ensure_user(conn, r.user_id, r.created_at)
    session = r.session_id
    if session is not None and queries.get_session(conn, session) is None:
        session = None  # deleted in the meantime: keep the record, lose the link
    conn.execute(
        "INSERT INTO requests(id, user_id, session_id, model, query, memory_ids, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING",
        (r.id, r.user_id, session, r.model, r.query, json.dumps(r.memory_ids), r.created_at),
    )


def get_request(conn: Connection, request_id: str) -> RecordedRequest | None:
    """The recorded request with this id (of any user), or None."""
    row = conn.execute(
        "SELECT id, user_id, session_id, model, query, memory_ids, created_at FROM requests"
        " WHERE id = ?",
        (request_id,),
    ).fetchone()
    if row is None:
        return None
    ids = json.loads(row[5])
    return RecordedRequest(
        str(row[0]),
        str(row[1]),
        row[2],
        row[3],
        str(row[4]),
        [int(i) for i in ids if isinstance(i, int)],
        float(row[6]),
    )


def add_feedback(
    conn: Connection,
    request: RecordedRequest,
    helpful: bool,
    source: str,
    note: str | None,
    now: float,
) -> bool:
    """Record the feedback; a flag queues the request (again, if it was done or failed).
    Returns whether the request is waiting for consolidation now."""
    conn.execute(
        "INSERT INTO feedback(request_id, user_id, helpful, source, note, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (request.id, request.user_id, int(helpful), source, note, now),
    )
    if helpful:
        row = conn.execute(
            "SELECT status FROM consolidation_queue WHERE request_id = ?", (request.id,)
        ).fetchone()
        return row is not None and row[0] == "pending"
    conn.execute(
        "INSERT INTO consolidation_queue(request_id, user_id, status, attempts, created_at,"
        " updated_at) VALUES (?, ?, 'pending', 0, ?, ?) ON CONFLICT(request_id) DO UPDATE SET"
        " status = 'pending', attempts = 0, error = NULL, updated_at = excluded.updated_at"
        " WHERE consolidation_queue.status != 'pending'",
        (request.id, request.user_id, now, now),
    )
    return True


def prune_requests(conn: Connection, keep_per_user: int, older_than: float) -> int:
    """Drop requests past the retention bounds (feedback and queue rows go with them), except
    those still waiting for consolidation. Returns how many went."""
    waiting = "SELECT request_id FROM consolidation_queue WHERE status = 'pending'"
    gone = conn.execute(
        f"DELETE FROM requests WHERE created_at < ? AND id NOT IN ({waiting})", (older_than,)
    ).rowcount
    later = "id" if is_pg(conn) else "rowid"  # of two at one time, the one kept (no rowid)
    gone += conn.execute(
        "DELETE FROM requests WHERE id IN (SELECT id FROM (SELECT id, row_number() OVER"
        f" (PARTITION BY user_id ORDER BY created_at DESC, {later} DESC) AS n FROM requests)"
        f" AS ranked WHERE n > ?) AND id NOT IN ({waiting})",
        (keep_per_user,),
    ).rowcount
    return int(gone)


def feedback_notes(conn: Connection, request_id: str) -> list[str]:
    """The notes that came with the flags of a request, oldest first."""
    rows = conn.execute(
        "SELECT note FROM feedback WHERE request_id = ? AND helpful = 0 AND note IS NOT NULL"
        " AND note != '' ORDER BY id",
        (request_id,),
    )
    return [str(r[0]) for r in rows]


# -- the consolidation queue ----------------------------------------------------------------


def queue_counts(conn: Connection, user_id: str | None = None) -> dict[str, int]:
    """Queued requests per status (one user's, or all), every status of :data:`STATUSES`."""
    sql = "SELECT status, count(*) FROM consolidation_queue"
    args: tuple[Any, ...] = ()
    if user_id is not None:
        sql, args = sql + " WHERE user_id = ?", (user_id,)
    counts = dict.fromkeys(STATUSES, 0)
    for status, n in conn.execute(sql + " GROUP BY status", args):
        counts[str(status)] = int(n)
    return counts


def pending_requests(conn: Connection, user_id: str | None, limit: int) -> list[tuple[str, str]]:
    """(request id, user) of queued requests, oldest first."""
    sql = "SELECT request_id, user_id FROM consolidation_queue WHERE status = 'pending'"
    args: list[object] = []
    if user_id is not None:
        sql += " AND user_id = ?"
        args.append(user_id)
    rows = conn.execute(sql + " ORDER BY updated_at, request_id LIMIT ?", [*args, limit])
    return [(str(r[0]), str(r[1])) for r in rows]


def is_pending(conn: Connection, request_id: str) -> bool:
    """Whether the request still waits (another process may have taken it meanwhile)."""
    row = conn.execute(
        "SELECT 1 FROM consolidation_queue WHERE request_id = ? AND status = 'pending'",
        (request_id,),
    ).fetchone()
    return row is not None


def mark_done(conn: Connection, request_id: str, facts: int, note: str | None = None) -> None:
    """A queued request is consolidated: ``facts`` new facts, ``note`` why none if so."""
    conn.execute(
        "UPDATE consolidation_queue SET status = 'done', facts = ?, error = ?,"
        " attempts = attempts + 1, updated_at = ? WHERE request_id = ?",
        (facts, note, time.time(), request_id),
    )


def mark_failed_try(conn: Connection, request_id: str, error: str, max_attempts: int) -> str:
    """Count a failed try; the request fails for good after ``max_attempts``. Returns the
    status it is left in."""
    conn.execute(
        "UPDATE consolidation_queue SET attempts = attempts + 1, error = ?, updated_at = ?,"
        " status = CASE WHEN attempts + 1 >= ? THEN 'failed' ELSE 'pending' END"
        " WHERE request_id = ?",
        (error[:500], time.time(), max_attempts, request_id),
    )
    row = conn.execute(
        "SELECT status FROM consolidation_queue WHERE request_id = ?", (request_id,)
    ).fetchone()
    return str(row[0]) if row else "failed"
