"""The memory stages of a chat turn, in order; each stage lives in its own module.

    before forwarding   identify (:mod:`.identity`) → place the session (:mod:`.sessions`)
                        → recall (:mod:`.recall`) inside the rewrite (:mod:`.rewrite`: budget,
                        tool-result slots, the assembled prompt)
    when the reply ends archive the turn (:mod:`.archive`), durable before the client's last
                        byte; then, in the background, index it and fold aged turns into the
                        rolling summary

A failure here degrades memory, never the request (the pipeline forwards unchanged).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from proxy.auth import ANONYMOUS, Principal
from proxy.background.feedback import Feedback
from proxy.background.handback import Handback
from proxy.background.indexer import Indexer
from proxy.background.summarizer import Summarizer
from proxy.cache import SizedLRU
from proxy.chat import claims, machinery
from proxy.chat.api import Conversation
from proxy.chat.archive import Archive
from proxy.chat.identity import Identity, identify, is_housekeeping
from proxy.chat.prompt import NO_ROOM, Assembly
from proxy.chat.quota import TurnQuota
from proxy.chat.recall import Recall
from proxy.chat.recent import RecentRequests
from proxy.chat.rewrite import Rewriter
from proxy.chat.sessions import PlacementRequest, place
from proxy.chat.turn import MemoryTurn
from proxy.config import Settings
from proxy.errors import BadRequest
from proxy.limits import Throttle
from proxy.logs import event
from proxy.messages import anchor_length, chain_hashes, last_user_text
from proxy.search.embedder import Embedder
from proxy.search.retrieval import Retriever
from proxy.slots.store import SlotStore
from proxy.store import live
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks
from proxy.tokens import TokenCounter

log = logging.getLogger("engram.memory")

TOO_MANY_MESSAGES = "too-many-messages"
# Requests with more messages than this have their chain hashes computed on a thread.
THREAD_MESSAGES = 500


class MemoryService:
    """Owns the memory stages for the chat pipeline."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        embedder: Embedder | None,
        retriever: Retriever,
        tasks: BackgroundTasks,
        tokens: TokenCounter | None = None,
        context_size: Callable[[str | None], Awaitable[int | None]] | None = None,
        summarizer: Summarizer | None = None,
        handback: Handback | None = None,
        feedback: Feedback | None = None,
        slots: SlotStore | None = None,
        indexer: Indexer | None = None,
        shared: bool = False,
    ) -> None:
        self.settings = settings
        self.store = store
        self.embedder = embedder
        self.tasks = tasks
        self.tokens = tokens or TokenCounter()
        self.summarizer = summarizer
        self.handback = handback
        self.feedback = feedback
        self.slots = slots
        self.indexer = indexer
        self.recall = Recall(settings, store, retriever)
        self.rewriter = Rewriter(
            settings, store, self.tokens, self.recall, context_size, summarizer, slots
        )
        limits = settings.limits
        self.quota = TurnQuota(store, limits.max_turns_per_user)
        # Session positions held by requests in flight (on the database when it is shared).
        self.claims = claims.Claims(store, shared)
        self.archive = Archive(
            store,
            indexer,
            settings.memory.redact_secrets,
            limits.max_message_bytes,
            self.quota,
            self.recall.forget_repeated,
            self.claims,
        )
        # The recent requests as forwarded, for the inspector (in memory only).
        self.recent = RecentRequests(settings.limits.last_prompts_bytes)
        self._throttle = Throttle()
        # Single-shot requests that quoted a live conversation (a client's side request).
        self.client_tasks = 0
        extra = settings.memory.housekeeping_patterns
        self._housekeeping = (
            re.compile("|".join(f"(?:{p})" for p in extra), re.I) if extra else None
        )

    @property
    def archived_turns(self) -> int:
        return self.archive.archived_turns

    @property
    def last_requests(self) -> SizedLRU[str, tuple[float, Assembly]]:
        """Session id -> (when, assembly) of its last forwarded prompt."""
        return self.rewriter.last_requests

    async def before_forward(
        self,
        headers: Mapping[str, str],
        conv: Conversation,
        mode: str,
        principal: Principal = ANONYMOUS,
    ) -> MemoryTurn:
        """Identify, schedule the archive, retrieve and inject. Mutates nothing it is given;
        returns what it decided (``mt.forward_messages``, when set, is the messages to forward).
        ``principal``: who authenticated the request (its key's user wins over any header)."""
        messages = conv.messages
        ident = identify(headers, conv.hints or {}, principal.user)
        if principal.via == "trusted-proxy" and ident.user_source not in ("header", "body"):
            raise BadRequest(
                "A trusted front-end (auth.trusted_proxy_secret) must name the user: send "
                "X-OpenWebUI-User-Id or X-Engram-User.",
                code="user_required",
            )
        cap = self.settings.limits.max_messages
        if cap and len(messages) > cap:  # forwarded as sent, memory left out (limits.max_messages)
            if self._throttle.due("max_messages", ident.user):
                event(
                    log,
                    logging.WARNING,
                    "request over limits.max_messages: forwarded as sent, not archived, "
                    "no memories",
                    user=ident.user,
                    messages=len(messages),
                    cap=cap,
                )
            return MemoryTurn(
                ident, messages, [], skipped=TOO_MANY_MESSAGES, memory_note=TOO_MANY_MESSAGES
            )
        housekeeping = is_housekeeping(messages, self._housekeeping)
        write = mode in ("on", "write-only")
        recall = mode in ("on", "read-only")
        if not housekeeping and machinery.single_shot(messages):
            housekeeping = await self._quotes_live(ident.user, messages)
        # The query's embedding starts now, on the embedder's thread, while the conversation is
        # hashed and placed.
        query = self.recall.query_vector(messages) if recall and not housekeeping else None
        started = time.perf_counter()
        try:
            mt = await self._before_forward(
                ident, messages, conv, housekeeping, write, recall, query
            )
            mt.memory_ms = (time.perf_counter() - started) * 1000
            return mt
        finally:
            if query is not None and not query.done():
                query.cancel()

    async def _before_forward(
        self,
        ident: Identity,
        messages: list[dict[str, Any]],
        conv: Conversation,
        housekeeping: bool,
        write: bool,
        recall: bool,
        query: asyncio.Task[Any] | None,
    ) -> MemoryTurn:
        chains = (
            await asyncio.to_thread(chain_hashes, messages)
            if len(messages) > THREAD_MESSAGES
            else chain_hashes(messages)
        )
        mt = MemoryTurn(ident, messages, chains, query_vector=query)
        mt.model = conv.model
        mt.api = conv.api
        if housekeeping:
            mt.skipped = "housekeeping"
            return mt
        now = time.time()
        if write:
            self.quota.prefetch(ident.user)
        anchor = anchor_length(messages)
        req = PlacementRequest(
            ident.user,
            ident.explicit_session,
            mt.chains,
            anchor,
            ident.parent,
            ident.agent,
            self.settings.sessions.max_depth,
            messages,
        )
        # Placement only reads: a new session is created by the commit, once the upstream has
        # accepted the request (a rejected one leaves nothing behind).
        placement = await self.store.read(lambda c: place(c, req, now))
        if write:  # its position in the session, held until the commit (or a fork, planned now)
            placement, mt.claim = await self.claims.take(placement, now)
        mt.placement = placement if write or not placement.created else None
        try:
            await self.rewriter.compose(
                mt,
                conv.reply_tokens,
                recall=recall,
                context_size=conv.context_size,
                rendered=conv.rendered,
            )
            if mt.memory_note == NO_ROOM:
                self._no_room(mt)
        finally:
            # The archive rows are made while the upstream answers; the commit writes them.
            if write and mt.placement is not None:
                mt.request_rows = self.tasks.spawn(
                    self.archive.request_rows(mt, now), name="archive-rows"
                )
        a = mt.assembly
        if write and a is not None and a.rewritten and mt.placement is not None:
            mt.summary_upto = a.window_start
        return mt

    def _no_room(self, mt: MemoryTurn) -> None:
        """Say once per conversation (every 10 minutes) that memories were left out for room."""
        where = mt.placement.session.id if mt.placement is not None else mt.identity.user
        if not self._throttle.due("no_room", where):
            return
        a = mt.assembly
        event(
            log,
            logging.WARNING,
            "memories found but left out: the request leaves no room for them in the "
            "upstream's context (tools and messages fill it; see the inspector's request page)",
            user=mt.identity.user,
            session=where,
            budget=mt.budget,
            prompt_tokens=a.tokens if a is not None else None,
            model=mt.model,
        )

    async def _quotes_live(self, user: str, messages: list[dict[str, Any]]) -> bool:
        """Whether a single-shot request quotes a live conversation of this user: a client's
        side request about it (:mod:`proxy.chat.machinery`), counted and logged."""
        text = machinery.request_text(messages)
        if len(text) < machinery.MIN_REPLY_CHARS:
            return False
        since = time.time() - machinery.LIVE_S
        conversations = await self.store.read(
            lambda c: live.latest_turns(
                c, user, since, machinery.MAX_SESSIONS, machinery.RECENT_TURNS
            )
        )
        if not machinery.quotes_any(text, conversations):
            return False
        self.client_tasks += 1
        log.debug("a request quoting a live conversation of %s: forwarded as sent", user)
        return True

    async def release(self, mt: MemoryTurn) -> None:
        """Give back the position the request held, if its commit did not (the request ends
        unarchived, or its commit failed)."""
        if mt.claim is not None:
            await self.claims.release(mt.claim)

    def record_request(self, request_id: str, mt: MemoryTurn) -> None:
        """Note the request's id, so that feedback can name it once the upstream accepted it
        (:meth:`settle`); a rejected request is not recorded. The inspector's view of it is
        kept now (:mod:`proxy.chat.recent`)."""
        mt.request_id = request_id
        self.recent.add(request_id, mt)

    def settle(self, mt: MemoryTurn, status: int | None, expansions: int = 0) -> None:
        """The reply is over: record the request for feedback (in the background) if the
        upstream accepted it and the commit has not already done so."""
        if mt.request_id is not None:
            self.recent.settle(mt.request_id, status, expansions)
        if status == 200:
            self._record(mt)

    def _record(self, mt: MemoryTurn) -> None:
        if self.feedback is None or mt.skipped is not None or mt.request_id is None:
            return
        if mt.recorded:
            return
        mt.recorded = True
        self.feedback.record(
            mt.request_id,
            mt.identity.user,
            mt.placement.session.id if mt.placement is not None else None,
            last_user_text(mt.messages),
            mt.injected,
            mt.model,
        )

    async def commit(
        self, mt: MemoryTurn, reply_message: dict[str, Any] | None, complete: bool
    ) -> None:
        """Archive the turn (see :meth:`proxy.chat.archive.Archive.commit`; called only for a
        reply the upstream accepted), record the request (before the client's last byte, so
        feedback can name it at once), then fold what aged out of the window into the summary,
        in the background."""
        await self.archive.commit(mt, reply_message, complete)
        self._record(mt)
        if mt.summary_upto is not None:
            upto, placement = mt.summary_upto, mt.placement
            if placement is not None and placement.by_words:  # its positions are not indexes
                upto = max(0, upto + placement.next_position - placement.matched)
            self._schedule_summary(mt, upto)

    def _schedule_summary(self, mt: MemoryTurn, upto: int) -> None:
        """Fold what aged out of the window into the session's summary, after the archive."""
        summarizer, placement = self.summarizer, mt.placement
        if summarizer is None or placement is None:
            return
        if not summarizer.wanted(placement.session.id, upto):
            return

        async def run() -> None:
            await summarizer.update(placement.session.id, upto, mt.model)

        self.tasks.spawn(run(), name="summary")
