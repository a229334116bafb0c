"""Consolidation: flagged requests distilled into facts by the upstream model, in the background.

For each request waiting in ``consolidation_queue`` (oldest first) the user's archive is searched
more widely than the hot path can afford (``consolidation.candidates`` per path, ``top_k`` hits,
each with ``neighbours`` turns on either side from its session), and the upstream model is asked
what was missing, as short facts (:mod:`proxy.background.facts`). Each new fact is stored as a
memory item
(role ``fact``, speaker = its subject) that the normal hybrid search finds from then on: in the
user's facts session ``facts~<user>`` (indexed, so every top-level conversation recalls it), or,
for a sub-agent's request, in the sub-agent's own session (what it read never reaches its parent
this way). A fact identical to one already there is not stored again.

Budget: consolidation has its own token counter and never starts a call whose estimated cost
(prompt + ``max_tokens``) would take it past ``consolidation.budget_share`` of the tokens proxied
(the summariser's figure); over budget, requests stay queued and the pass ends. What the upstream
reports in ``usage`` is what is counted. A failed call or a reply with no parseable fact stores
nothing, and the request is tried again on a later pass, up to ``max_attempts``, then marked
failed with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.background.changes import ChangesPruner
from proxy.background.facts import (
    Fact,
    consolidation_messages,
    normal,
    parse_facts,
    render_excerpts,
)
from proxy.background.feedback import Feedback
from proxy.background.items import add_item
from proxy.background.summarizer import Summarizer, budgeted_call
from proxy.config import Settings
from proxy.logs import event
from proxy.redact import redact
from proxy.search.embedder import Embedder
from proxy.search.fts_query import tokens as word_tokens
from proxy.search.retrieval import Retriever
from proxy.store import queries
from proxy.store.feedback import (
    RecordedRequest,
    feedback_notes,
    get_request,
    is_pending,
    mark_done,
    mark_failed_try,
    pending_requests,
    queue_counts,
)
from proxy.store.items import fact_texts
from proxy.store.models import RECALLED_ROLES, Turn
from proxy.store.naming import create_named, facts_session_name
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store

log = logging.getLogger("engram.consolidation")

FACTS_AGENT = "facts"


@dataclass
class PassReport:
    """What one pass over the queue did."""

    processed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    waiting: int = 0  # left queued: over budget
    facts: int = 0


# --- SQL -----------------------------------------------------------------------------------------


def neighbourhoods(conn: Connection, hits: Sequence[Turn], n: int) -> list[Turn]:
    """Each hit with the ``n`` conversation turns on either side of it (same session, system
    prompts left out), hit by hit, each group in conversation order, no turn twice."""
    out: list[Turn] = []
    seen: set[int] = set()
    for hit in hits:
        group = [hit]
        if n > 0 and hit.position >= 0:
            group = [
                t
                for t in queries.session_turns(
                    conn, hit.session_id, max(0, hit.position - n), 2 * n + 1
                )
                if t.position <= hit.position + n and (t.role != "system" or t.id == hit.id)
            ] or [hit]
        for t in group:
            if t.id not in seen and t.user_id == hit.user_id:
                seen.add(t.id)
                out.append(t)
    return out


def facts_session(conn: Connection, user_id: str, now: float) -> str:
    """The id of the user's facts session (indexed; named ``facts~<user>``, a name no client can
    take: :mod:`proxy.store.naming`), created when first needed."""
    return create_named(
        conn,
        user_id,
        facts_session_name(user_id),
        parent_id=None,
        agent=FACTS_AGENT,
        fingerprint=None,
        indexed=True,
        now=now,
    ).id


def best_source(fact: Fact, turns: Sequence[Turn]) -> Turn | None:
    """The excerpt a fact came from: the first it names, else the one sharing most words."""
    by_id = {t.id: t for t in turns}
    for turn_id in fact.source_turns:
        if turn_id in by_id:
            return by_id[turn_id]
    words = {w.lower() for w in word_tokens(f"{fact.subject} {fact.fact}")}
    best, score = None, 0
    for t in turns:
        shared = len(words & {w.lower() for w in word_tokens(t.content)})
        if shared > score:
            best, score = t, shared
    return best


# --- the job -------------------------------------------------------------------------------------


class Consolidator:
    """Runs passes over the consolidation queue, within its own token budget."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        embedder: Embedder | None,
        summarizer: Summarizer,
        feedback: Feedback,
    ) -> None:
        self.settings = settings
        self.store = store
        self.embedder = embedder
        self.summarizer = summarizer
        self.feedback = feedback
        cfg = settings.consolidation
        # PostgreSQL's changes log, pruned at each pass by the replica holding its lease
        self.changes = ChangesPruner(store, summarizer.leases.holder, cfg.interval)
        # Wider than the hot path: more candidates, and every word of the question searched
        # (the hot path leaves out the commonest ones to stay fast).
        wide = dataclasses.replace(
            settings.retrieval, candidates=cfg.candidates, mmr=False, fts_common_share=1.0
        )
        self.retriever = Retriever(store, embedder, wide)
        self.tokens_spent = 0
        self.calls = 0
        self.call_failures = 0
        self.junk = 0
        self.waited = 0
        self.facts_stored = 0
        self._lock = asyncio.Lock()

    # -- budget ---------------------------------------------------------------------------
    @property
    def tokens_proxied(self) -> int:
        return self.summarizer.tokens_proxied

    def allowance(self) -> float:
        return self.settings.consolidation.budget_share * self.tokens_proxied

    async def _ask(
        self, messages: list[dict[str, str]], model: str | None
    ) -> tuple[str, str | None]:
        """("ok", reply) | ("budget", None) | ("failed", why): one budgeted upstream call."""
        cfg = self.settings.consolidation
        tokens = self.summarizer.tokens
        prompt = "\n".join(m["content"] for m in messages)
        result = await budgeted_call(
            self.summarizer.upstream,
            messages,
            model,
            max_tokens=cfg.max_tokens,
            temperature=0.1,
            timeout=cfg.timeout,
            cost=max(tokens.raw(prompt), tokens.count(prompt, model)) + 8 + cfg.max_tokens,
            room=self.allowance() - self.tokens_spent,
            activity=self.summarizer.activity,
            what="consolidation",
        )
        self.tokens_spent += result.spent
        if result.status == "budget":
            self.waited += 1
            return "budget", None
        self.calls += 1
        if result.status == "failed":
            self.call_failures += 1
            return "failed", f"upstream call failed: {result.error}"[:300]
        return "ok", result.reply or ""

    # -- passes ---------------------------------------------------------------------------
    async def run_pass(self, user_id: str | None = None) -> PassReport:
        """Consolidate up to ``consolidation.batch`` queued requests (of one user, or all);
        stops at the first that does not fit the budget."""
        report = PassReport()
        async with self._lock:
            batch = self.settings.consolidation.batch
            for request_id, owner in await self.store.read(
                lambda c: pending_requests(c, user_id, batch)
            ):
                async with self.summarizer.leases.hold(f"consolidate:{request_id}") as mine:
                    pending = functools.partial(is_pending, request_id=request_id)
                    if not mine or not await self.store.read(pending):
                        continue  # another process has it, or had it meanwhile
                    outcome, facts = await self._one(request_id, owner)
                if outcome == "waiting":
                    report.waiting = (await self.store.read(lambda c: queue_counts(c, user_id)))[
                        "pending"
                    ]
                    break
                report.processed += 1
                report.facts += facts
                setattr(report, outcome, getattr(report, outcome) + 1)
        return report

    async def _one(self, request_id: str, user_id: str) -> tuple[str, int]:
        """Consolidate one request: (outcome, new facts); outcome is done, retried, failed or
        waiting. Nothing is written to memory unless facts came back."""
        cfg = self.settings.consolidation
        try:
            req = await self.store.read(lambda c: get_request(c, request_id))
            if req is None or req.user_id != user_id:
                return await self._fail(request_id, "the request is gone", final=True)
            session = await self.store.get_session(req.session_id) if req.session_id else None
            subagent = session is not None and session.parent_id is not None
            scope = [session.id] if session is not None and subagent else None
            notes = await self.store.read(lambda c: feedback_notes(c, request_id))
            excerpts = await self._search(req, scope, notes)
            if not excerpts:
                await self.store.write(lambda c: mark_done(c, request_id, 0, "nothing found"))
                return "done", 0
            ctx = await self.summarizer.upstream.context_size(req.model) or 2048
            text = render_excerpts(excerpts, max(1000, (ctx - cfg.max_tokens - 400) * 3))
            shown = excerpts[: len(text.splitlines())]
            served = await self.store.get_turns(req.memory_ids, user_id=user_id)
            recalled = [t.content for t in served]
            query = req.query + "".join(f"\n(user's note: {n})" for n in notes)
            messages = consolidation_messages(query, text, recalled, cfg.max_facts)
            outcome, reply = await self._ask(messages, req.model)
            if outcome == "budget":
                return "waiting", 0
            if outcome == "failed":
                return await self._fail(request_id, reply or "upstream call failed")
            facts = parse_facts(
                reply or "",
                {t.id for t in shown},
                source=messages[-1]["content"],
                max_facts=cfg.max_facts,
                prompt=messages[0]["content"],
            )
            if not facts:
                self.junk += 1
                return await self._fail(request_id, "the reply held no parseable fact")
            target = session.id if session is not None and subagent else None
            stored = await self._store(user_id, target, facts, shown)
        except Exception as exc:
            log.exception("consolidating request %s failed", request_id)
            return await self._fail(request_id, f"error: {exc}"[:300])
        await self.store.write(lambda c: mark_done(c, request_id, stored))
        event(log, logging.INFO, "request consolidated", request=request_id, facts=stored)
        return "done", stored

    async def _fail(self, request_id: str, why: str, final: bool = False) -> tuple[str, int]:
        tries = 1 if final else self.settings.consolidation.max_attempts
        status = await self.store.write(lambda c: mark_failed_try(c, request_id, why, tries))
        event(log, logging.WARNING, "consolidation try failed", request=request_id, error=why)
        return ("failed" if status == "failed" else "retried"), 0

    async def _search(
        self, req: RecordedRequest, scope: list[str] | None, notes: Sequence[str]
    ) -> list[Turn]:
        """The wider search: hits for the query (and the user's notes) with their neighbours."""
        cfg = self.settings.consolidation
        query = " ".join([req.query, *notes])

        def keep(t: Turn) -> bool:
            return t.role in RECALLED_ROLES and bool(t.content.strip())

        hits = await self.retriever.search(
            req.user_id, query, cfg.top_k, session_ids=scope, keep=keep
        )
        found = [h.turn for h in hits]
        n = cfg.neighbours
        return [
            t
            for t in await self.store.read(lambda c: neighbourhoods(c, found, n))
            if t.content.strip()
        ]

    async def _store(
        self, user_id: str, target: str | None, facts: Sequence[Fact], shown: Sequence[Turn]
    ) -> int:
        """Store the facts not already there; returns how many were new."""
        now = time.time()
        sid = (
            target
            if target is not None
            else await self.store.write(lambda c: facts_session(c, user_id, now))
        )
        texts = await self.store.read(lambda c: fact_texts(c, sid))
        known = {(normal(speaker), normal(content)) for speaker, content in texts}
        stored = 0
        hide = redact if self.settings.memory.redact_secrets else str
        for fact in facts:
            key = (normal(hide(fact.subject)), normal(hide(fact.content())))  # as stored
            if key in known:
                continue
            source = best_source(fact, shown)
            await add_item(
                self.store,
                self.embedder,
                sid,
                user_id,
                "fact",
                fact.subject,
                fact.content(),
                source_session=source.session_id if source is not None else None,
                redact_secrets=self.settings.memory.redact_secrets,
                source_turn=source.id if source is not None else None,
            )
            known.add(key)
            stored += 1
        self.facts_stored += stored
        return stored

    async def scheduled_pass(self) -> None:
        """One background pass (every ``consolidation.interval`` seconds, through
        :func:`proxy.tasks.every`), pruning of the request record, and of PostgreSQL's
        changes log (one replica at a time: :mod:`proxy.background.changes`)."""
        report = await self.run_pass()
        if report.processed:
            event(log, logging.INFO, "consolidation pass", **dataclasses.asdict(report))
        await self.feedback.prune()
        await self.changes.run()
