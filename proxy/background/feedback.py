"""Feedback on chat requests: a record of recent requests, flags, the consolidation queue.

Every chat request that went through the memory stages leaves a small ``requests`` row (its id
from ``X-Engram-Request-Id``, user, session, the last user message redacted, the ids of the
memories injected, the model), written in the background, never on the request path. The record
is bounded: ``feedback.keep_requests`` per user and ``feedback.keep_days``, pruned in the
background; a request still waiting for consolidation is kept.

``POST /engram/api/feedback`` names a request of the caller's user: ``helpful: false`` flags it
and queues it for consolidation (:mod:`proxy.background.consolidation`); ``helpful: true`` is
recorded and
queues nothing. Engram flags requests itself through :meth:`Feedback.flag` (e.g. when the model
expands a tool-result slot that has expired).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.config import Settings
from proxy.errors import NotFound
from proxy.logs import event
from proxy.redact import redact
from proxy.store import queries
from proxy.store.db import Connection
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks

log = logging.getLogger("engram.feedback")

MAX_QUERY_CHARS = 4000
MAX_NOTE_CHARS = 4000
PRUNE_EVERY = 500  # requests recorded between two prunes
STATUSES = ("pending", "done", "failed")


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


@dataclass(frozen=True)
class FeedbackResult:
    request_id: str
    helpful: bool
    queued: bool  # whether the request is (now) waiting for consolidation


# --- SQL -----------------------------------------------------------------------------------------


def insert_request(conn: Connection, r: RecordedRequest) -> None:
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
    gone += conn.execute(
        "DELETE FROM requests WHERE rowid IN (SELECT rowid FROM (SELECT rowid, row_number()"
        " OVER (PARTITION BY user_id ORDER BY created_at DESC, rowid DESC) AS n FROM requests)"
        f" WHERE n > ?) AND id NOT IN ({waiting})",
        (keep_per_user,),
    ).rowcount
    return int(gone)


def queue_counts(conn: Connection, user_id: str | None = None) -> dict[str, int]:
    sql = "SELECT status, count(*) FROM consolidation_queue"
    args: tuple[Any, ...] = ()
    if user_id is not None:
        sql, args = sql + " WHERE user_id = ?", (user_id,)
    counts = dict.fromkeys(STATUSES, 0)
    for status, n in conn.execute(sql + " GROUP BY status", args):
        counts[str(status)] = int(n)
    return counts


# --- the service ---------------------------------------------------------------------------------


class Feedback:
    """Records chat requests and the feedback on them."""

    def __init__(self, settings: Settings, store: Store, tasks: BackgroundTasks) -> None:
        self.settings = settings
        self.store = store
        self.tasks = tasks
        self._pending: dict[str, asyncio.Task[Any]] = {}
        self._since_prune = 0
        self.recorded = 0
        self.record_failures = 0

    def record(
        self,
        request_id: str,
        user_id: str,
        session_id: str | None,
        query: str,
        memory_ids: Sequence[int],
        model: str | None,
    ) -> None:
        """Remember a chat request, in the background."""
        row = RecordedRequest(
            request_id,
            user_id,
            session_id,
            model,
            query[:MAX_QUERY_CHARS],
            [i for i in memory_ids if i > 0],
            time.time(),
        )
        task = self.tasks.spawn(self._record(row), name=f"record-request:{request_id}")
        self._pending[request_id] = task
        task.add_done_callback(lambda _t: self._pending.pop(request_id, None))

    async def _record(self, row: RecordedRequest) -> None:
        if self.settings.memory.redact_secrets:
            row = dataclasses.replace(row, query=redact(row.query))
        try:
            await self.store.write(lambda c: insert_request(c, row))
        except Exception:
            self.record_failures += 1
            log.exception("recording request %s failed; feedback cannot name it", row.id)
            return
        self.recorded += 1
        self._since_prune += 1
        if self._since_prune >= PRUNE_EVERY:
            self._since_prune = 0
            await self.prune()

    async def prune(self) -> int:
        cfg = self.settings.feedback
        older_than = time.time() - cfg.keep_days * 86400
        gone = await self.store.write(lambda c: prune_requests(c, cfg.keep_requests, older_than))
        if gone:
            event(log, logging.DEBUG, "old requests pruned", requests=gone)
        return gone

    async def _find(self, user_id: str, request_id: str) -> RecordedRequest | None:
        pending = self._pending.get(request_id)
        if pending is not None:  # named before its record was written: wait for it
            await asyncio.wait([pending])
        found = await self.store.read(lambda c: get_request(c, request_id))
        return found if found is not None and found.user_id == user_id else None

    async def submit(
        self,
        user_id: str,
        request_id: str,
        helpful: bool,
        note: str | None = None,
        source: str = "api",
    ) -> FeedbackResult:
        """Record feedback on one of the user's requests; a 404 when it has no such request
        (another user's looks exactly like a missing one)."""
        found = await self._find(user_id, request_id)
        if found is None:
            raise NotFound(
                f"No request {request_id!r} for user {user_id!r} (requests are kept "
                f"{self.settings.feedback.keep_days:g} days).",
                code="request_not_found",
            )
        if note is not None and self.settings.memory.redact_secrets:
            note = redact(note)
        now = time.time()
        queued = await self.store.write(
            lambda c: add_feedback(c, found, helpful, source, note, now)
        )
        event(
            log,
            logging.INFO,
            "feedback",
            request=request_id,
            helpful=helpful,
            source=source,
            queued=queued,
        )
        return FeedbackResult(request_id, helpful, queued)

    async def flag(self, user_id: str, request_id: str, reason: str) -> bool:
        """Flag a request as badly served by memory (Engram's own finding, e.g.
        ``"expired_slot"``); False when the user has no such request."""
        try:
            result = await self.submit(user_id, request_id, False, source=reason)
        except NotFound:
            return False
        return result.queued
