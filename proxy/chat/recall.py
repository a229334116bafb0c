"""Recall: the memories a new user message needs that the forwarded window does not hold.

The query (the last user message) is embedded as soon as the request is parsed
(:meth:`Recall.query_vector`), beside hashing and placement. The search is hybrid (FTS5 and
vectors fused by RRF, :mod:`proxy.search.retrieval`) over the user's memory; a sub-agent searches
its own session only (plus, optionally, its parent's summary), a conversation gets what its
sub-agents handed back first. Turns whose text the prompt already holds are never recalled;
``retrieval.neighbours`` brings each hit's neighbours in its conversation. Tool outputs are left
out, inside the search so they take no places, unless ``retrieval.recall_tool_outputs``.
Recall keeps to ``limits.recall_deadline``: a query vector not ready by then leaves the memories
to FTS5 alone, and a full-text search not done by then leaves them out; ``mt.memory_note`` says
which. What is recalled is rendered for the model by :mod:`proxy.chat.fence`, which marks
hand-backs, summaries and facts as derived.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from proxy import scaffold
from proxy.cache import LRU
from proxy.chat.beside import Words, new_words, places_near
from proxy.chat.fence import Recalled
from proxy.chat.turn import MemoryTurn, Why
from proxy.config import Settings
from proxy.messages import content_text, last_user_text
from proxy.redact import redact
from proxy.search.phrasing import asked_words
from proxy.search.relevance import (
    GateSettings,
    HitFeatures,
    admit,
    query_content,
    says_something,
)
from proxy.search.retrieval import Hit, RecallTimeout, Retriever
from proxy.store import corrections, queries, scaffolds
from proxy.store.items import session_items
from proxy.store.models import EMBED_CHARS, RECALLED_ROLES, Turn, text_hash
from proxy.store.store import Store
from proxy.store.summaries import get_summary

log = logging.getLogger("engram.recall")

# Characters past EMBED_CHARS that redaction reads too, so that a secret straddling the cut is
# still recognised (redacting the whole of a 30 kB tool output on every request cost 35 ms).
REDACT_MARGIN = 4096
TEXT_CACHE = 50_000  # message texts whose hashes are remembered (clients resend the history)
TOOL_OUTPUT_ROLES = ("tool", "function")
REPEATED_USERS = 1024  # users whose repeated paragraphs are kept in memory
REPEATED_TTL = 30.0  # seconds a user's repeated paragraphs are kept before being read again
READ_AHEAD = 4  # a question's hits whose neighbours are read before the gate, per one it keeps
# (the gate drops many: its best three were among the search's best twelve in ~91 % of the
# questions of bench.memory_load; the rest are read after it)
PINNED_MAX = 10  # pinned turns recalled into a chat, the newest first
PINNED_TTL = 5.0  # seconds a user's pinned turns are kept before being read again (other
# processes, such as `engram pin`, pin without telling this one)


def query_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """What recall searches for: the words of the last user message (its scaffolding, such as a
    ``<system-reminder>`` block, left out; "" for a message the client made up)."""
    return scaffold.words_of("user", last_user_text(messages)).strip()


def words_recalled(role: str, content: str, repeated: frozenset[str]) -> str:
    """A recalled turn's text as the model is shown it: without scaffolding a turn stored
    before it was cut out still holds (by shape, or a paragraph since repeated elsewhere)."""
    words = scaffold.words_of(role, content)
    if repeated and len(words) >= scaffold.REPEAT_MIN:
        words = "".join(
            p
            for p in scaffold.paragraphs(words)
            if len(core := scaffold.core_of(p)) < scaffold.REPEAT_MIN
            or scaffold.digest(core) not in repeated
        )
    return words


def recalled(turn: Turn, score: float) -> Recalled:
    """A stored turn as a memory to show the model."""
    return Recalled(
        turn.id, turn.role, turn.speaker, turn.content, turn.timestamp, turn.session_id, score
    )


class Recall:
    """The recall stage: one per server (it keeps a cache of message text hashes)."""

    def __init__(self, settings: Settings, store: Store, retriever: Retriever) -> None:
        self.settings = settings
        self.store = store
        self.retriever = retriever
        self.gate = GateSettings.of(settings.retrieval)
        # text hash as sent -> (hash as sent, redacted, as archived: redacted words)
        self._hashes: LRU[str, tuple[str, str, str]] = LRU(TEXT_CACHE)
        # user -> (when read, paragraphs that became scaffolding by repetition)
        self._repeated: LRU[str, tuple[float, frozenset[str]]] = LRU(REPEATED_USERS)
        # user -> (when read, pinned turns)
        self._pinned: LRU[str, tuple[float, list[Turn]]] = LRU(REPEATED_USERS)

    def query_vector(self, messages: Sequence[Mapping[str, Any]]) -> asyncio.Task[Any] | None:
        s = self.settings.retrieval
        if s.top_k <= 0 or s.budget_tokens <= 0:
            return None
        query = query_text(messages)
        if not query:
            return None
        task = self.retriever.embed_query(query)
        if task is not None:  # an unused or failed embedding is dropped quietly
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def recall(
        self, mt: MemoryTurn, window_start: int, shown: Collection[int] = ()
    ) -> list[Recalled]:
        """The memories that bear on the new user message (:mod:`proxy.search.relevance`) and that
        the forwarded window lacks: neither its messages' text nor the memories ``shown`` by
        blocks laid earlier in it (once per conversation)."""
        s = self.settings.retrieval
        query = query_text(mt.messages)
        if not query or s.top_k <= 0 or s.budget_tokens <= 0:
            return []
        limit = self.settings.limits.recall_deadline
        deadline = asyncio.get_running_loop().time() + limit if limit else None
        head = (
            mt.messages[:1]
            if mt.messages and mt.messages[0].get("role") in ("system", "developer")
            else []
        )
        present = self.texts([*head, *mt.messages[window_start:]])
        skip_roles = () if s.recall_tool_outputs else TOOL_OUTPUT_ROLES

        def wanted(role: str, content: str) -> bool:
            if role not in RECALLED_ROLES or role in skip_roles or not content.strip():
                return False
            if text_hash(content[:EMBED_CHARS]) in present:
                return False
            # A turn stored before scaffolding was cut out reads as its words.
            return bool(scaffold.words_of(role, content).strip())

        def keep(turn: Turn) -> bool:  # muted: never; shown in this conversation: not again
            return turn.recall >= 0 and turn.id not in shown and wanted(turn.role, turn.content)

        session = mt.placement.session if mt.placement else None
        if session is None and mt.identity.parent is not None:
            return []  # a sub-agent with nothing stored yet (read-only) has nothing of its own
        # A sub-agent recalls from its own session only: never a sibling's or its parent's turns.
        scope = [session.id] if session is not None and session.parent_id else None
        extra: list[Recalled] = []
        if (
            scope
            and session is not None
            and session.parent_id
            and self.settings.sessions.subagent_sees_parent_summary
        ):
            parent_id = session.parent_id
            found = await self.store.read(lambda c: get_summary(c, parent_id))
            if found is not None:
                extra.append(
                    Recalled(
                        0,
                        "summary",
                        "parent conversation",
                        found.content,
                        found.updated_at,
                        parent_id,
                        1.0,
                    )
                )
        if session is not None and not scope:
            # What this conversation's sub-agents handed back comes first, searched or not.
            sid = session.id
            for item in await self.store.read(lambda c: session_items(c, sid, "summary", 3)):
                if keep(item):
                    mt.why[item.id] = Why("hand-back", 1.0, {})
                    extra.append(
                        Recalled(
                            item.id,
                            item.role,
                            item.speaker,
                            item.content,
                            item.timestamp,
                            item.session_id,
                            1.0,
                        )
                    )
        if not scope:  # what the user pinned comes into every chat (not a sub-agent's)
            for item in await self.pinned(mt.identity.user):
                if item.id in shown or item.id in mt.why:
                    continue
                if wanted(item.role, item.content):
                    mt.why[item.id] = Why("pinned", 1.0, {})
                    extra.append(recalled(item, 1.0))
        degraded: list[str] = []
        try:
            hits = await self.retriever.search(
                mt.identity.user,
                query,
                s.top_k,
                keep=keep,
                session_ids=scope,
                exclude_roles=skip_roles,
                query_vector=mt.query_vector,
                deadline=deadline,
                degraded=degraded,
                distinct=True,
            )
        except RecallTimeout:  # past limits.recall_deadline: the request goes without
            mt.memory_note = "recall-timeout"
            return extra
        except Exception:  # memory degrades, the request goes on
            log.exception("retrieval failed; forwarding without memories")
            return extra
        if degraded:
            mt.memory_note = degraded[0]  # "fts-only": the query vector came too late
        asks = query_content(query)
        read = Words()
        # A question's best memories bring the turns beside them (not one about the user's own
        # life or words: the user's turns say it, and beside them in a chat sit the model's
        # replies, which are no evidence of it). Those of its best few hits are read now, on a
        # reader thread, while the gate reads the hits.
        beside = s.neighbours <= 0 and asks.question and not asks.own and s.question_neighbours > 0
        early = None
        if beside and hits:
            pre = [h.turn for h in hits[: READ_AHEAD * s.question_neighbours]]
            early = asyncio.ensure_future(
                self.turns_at(mt.identity.user, places_near(pre, (1, -1)))
            )
            early.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.sleep(0)  # the read starts
        if self.gate.enabled and hits:
            base = await self._baselines(hits, mt.query_vector)
            features = [
                HitFeatures(
                    h.score, h.cosine, h.ranks.get("fts"), h.ranks.get("vec"), h.turn.role,
                    h.turn.content, base[i] if base else None,
                )
                for i, h in enumerate(hits)
            ]  # fmt: skip
            hits = [hits[i] for i in admit(asks, features, self.gate, read)]
        near: dict[int, list[Recalled]] = {}
        try:
            if s.neighbours > 0 and hits:
                near = await self.neighbours(mt.identity.user, hits, s.neighbours, wanted)
            elif beside and early is not None and hits:

                def says(role: str, content: str) -> bool:
                    return wanted(role, content) and says_something(
                        role, content, self.gate, read(content)
                    )

                # A hit that holds every word the question asks about is its answer, as far
                # as the store can tell: neighbours would add only what was said beside it.
                asked = asked_words(query)
                if not asked or not any(asked <= read.set(h.turn.content) for h in hits):
                    top = hits[: s.question_neighbours]
                    user = mt.identity.user
                    rows = await early
                    near = await self.neighbours(user, top, 1, says, shown, rows)
                    near = new_words(hits, near, asks.terms, read)
        except Exception:  # the hits alone still help
            log.exception("reading neighbour turns failed; recalling the hits alone")
        out = list(extra)
        seen = {m.id for m in extra}
        repeated = await self.repeated(mt.identity.user, [h.turn for h in hits])
        for h in hits:
            hit = recalled(h.turn, h.score)
            for m in (hit, *near.get(h.turn.id, ())):
                if m.id in seen:
                    continue
                seen.add(m.id)
                mt.why[m.id] = (
                    Why("search", h.score, dict(h.ranks))
                    if m is hit
                    else Why("neighbour", m.score, {}, h.turn.id)
                )
                words = words_recalled(m.role, m.content, repeated)
                if words.strip():
                    out.append(dataclasses.replace(m, content=words) if words != m.content else m)
        return out

    async def _baselines(
        self, hits: Sequence[Hit], vector: asyncio.Task[Any] | None
    ) -> list[float | None]:
        """The hits' baselines for the gate (:meth:`Retriever.baselines`); none when the query's
        vector is not there (recall went on without it) or they cannot be had."""
        if vector is None or not vector.done() or vector.cancelled() or vector.exception():
            return []
        try:
            return await self.retriever.baselines(hits, vector.result())
        except Exception:  # the gate goes on without them
            log.exception("the gate's baselines failed; gating without them")
            return []

    async def pinned(self, user: str) -> list[Turn]:
        """The user's pinned turns (the newest :data:`PINNED_MAX`), kept :data:`PINNED_TTL`."""
        now = time.monotonic()
        found = self._pinned.get(user)
        if found is not None and now - found[0] < PINNED_TTL:
            return found[1]
        turns = await self.store.read(lambda c: corrections.pinned(c, user, PINNED_MAX))
        self._pinned[user] = (now, turns)
        return turns

    def forget_pinned(self, user: str) -> None:
        """The user's pins changed in this process: read them again at the next request."""
        self._pinned.pop(user)

    def forget_repeated(self, user: str) -> None:
        """The user's repeated paragraphs changed (the archive made one scaffolding)."""
        self._repeated.pop(user)

    async def repeated(self, user: str, turns: Sequence[Turn]) -> frozenset[str]:
        """The user's paragraphs that became scaffolding by repetition, read (and kept a
        while) only when a recalled turn is long enough to hold one."""
        if all(len(t.content) < scaffold.REPEAT_MIN for t in turns):
            return frozenset()
        now = time.monotonic()
        found = self._repeated.get(user)
        if found is not None and now - found[0] < REPEATED_TTL:
            return found[1]
        hashes = await self.store.read(lambda c: scaffolds.repeated_hashes(c, user))
        self._repeated[user] = (now, hashes)
        return hashes

    async def neighbours(
        self,
        user: str,
        hits: Sequence[Hit],
        n: int,
        wanted: Callable[[str, str], bool],
        shown: Collection[int] = (),
        found: Mapping[tuple[str, int], Turn | None] | None = None,
    ) -> dict[int, list[Recalled]]:
        """Each hit's same-session neighbours (positions ±1..n) that ``wanted`` keeps and that are
        not ``shown``, by hit id: nearest first, the next turn before the previous one; each
        scores slightly below its hit. One store read for the places ``found`` (read earlier,
        :meth:`turns_at`) lacks. Memory items (negative positions) have no neighbours."""
        offsets = [d for i in range(1, n + 1) for d in (i, -i)]
        places = places_near([h.turn for h in hits], offsets)
        known = dict(found or {})
        missing = [p for p in places if p not in known]
        if missing:
            known.update(await self.turns_at(user, missing))
        out: dict[int, list[Recalled]] = {}
        for h in hits:
            if h.turn.position < 0:
                continue
            for d in offsets:
                t = known.get((h.turn.session_id, h.turn.position + d))
                if (
                    t is not None
                    and t.recall >= 0
                    and t.id not in shown
                    and wanted(t.role, t.content)
                ):
                    score = h.score * (1 - 0.01 * abs(d))
                    out.setdefault(h.turn.id, []).append(recalled(t, score))
        return out

    async def turns_at(
        self, user: str, places: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], Turn | None]:
        """The user's turns at these (session, position) places (None: no turn there)."""
        found = await self.store.read(lambda c: queries.turns_at(c, user, places))
        return {p: found.get(p) for p in places}

    def texts(self, messages: Sequence[Mapping[str, Any]]) -> set[str]:
        """Hashes of the messages' texts as archived (redacted) and as sent (their first
        EMBED_CHARS characters), remembered by the hash as sent: clients resend the history."""
        out: set[str] = set()
        for m in messages:
            text = content_text(m.get("content"))
            plain = text_hash(text[:EMBED_CHARS])
            found = self._hashes.get(plain)
            if found is None:
                redacted = redact(text[: EMBED_CHARS + REDACT_MARGIN])
                words = scaffold.words_of(str(m.get("role")), redacted)
                found = (
                    plain,
                    text_hash(redacted[:EMBED_CHARS]),
                    text_hash(words[:EMBED_CHARS]),  # as archived: scaffolding cut out
                )
                self._hashes[plain] = found
            out.update(found)
        return out

    def not_in(
        self, memories: list[Recalled], messages: Sequence[Mapping[str, Any]]
    ) -> list[Recalled]:
        """``memories`` less those whose text ``messages`` already hold."""
        present = self.texts(messages)
        return [m for m in memories if text_hash(m.content[:EMBED_CHARS]) not in present]
