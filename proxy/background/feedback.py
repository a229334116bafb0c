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
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.config import Settings
from proxy.errors import NotFound
from proxy.logs import event
from proxy.redact import redact
from proxy.store.feedback import (
    RecordedRequest,
    add_feedback,
    get_request,
    insert_request,
    prune_requests,
)
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks

log = logging.getLogger("engram.feedback")

MAX_QUERY_CHARS = 4000
MAX_NOTE_CHARS = 4000
PRUNE_EVERY = 500  # requests recorded between two prunes


@dataclass(frozen=True)
class FeedbackResult:
    request_id: str
    helpful: bool
    queued: bool  # whether the request is (now) waiting for consolidation


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
