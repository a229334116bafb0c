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
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.cache import LRU
from proxy.chat.fence import Recalled
from proxy.chat.turn import MemoryTurn
from proxy.config import Settings
from proxy.messages import content_text, last_user_text
from proxy.redact import redact
from proxy.search.retrieval import Hit, RecallTimeout, Retriever
from proxy.store import queries
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
        # text hash as sent -> (hash as sent, hash as archived, i.e. redacted)
        self._hashes: LRU[str, tuple[str, str]] = LRU(TEXT_CACHE)

    def query_vector(self, messages: Sequence[Mapping[str, Any]]) -> asyncio.Task[Any] | None:
        s = self.settings.retrieval
        if s.top_k <= 0 or s.budget_tokens <= 0:
            return None
        task = self.retriever.embed_query(last_user_text(messages))
        if task is not None:  # an unused or failed embedding is dropped quietly
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def recall(self, mt: MemoryTurn, window_start: int) -> list[Recalled]:
        """The best memories for the new user message that the forwarded window lacks."""
        s = self.settings.retrieval
        query = last_user_text(mt.messages)
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
            return text_hash(content[:EMBED_CHARS]) not in present

        def keep(turn: Turn) -> bool:
            return wanted(turn.role, turn.content)

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
            )
        except RecallTimeout:  # past limits.recall_deadline: the request goes without
            mt.memory_note = "recall-timeout"
            return extra
        except Exception:  # memory degrades, the request goes on
            log.exception("retrieval failed; forwarding without memories")
            return extra
        if degraded:
            mt.memory_note = degraded[0]  # "fts-only": the query vector came too late
        near: dict[int, list[Recalled]] = {}
        if s.neighbours > 0 and hits:
            try:
                near = await self.neighbours(mt.identity.user, hits, s.neighbours, wanted)
            except Exception:  # the hits alone still help
                log.exception("reading neighbour turns failed; recalling the hits alone")
        out = list(extra)
        seen = {m.id for m in extra}
        for h in hits:
            hit = Recalled(
                h.turn.id,
                h.turn.role,
                h.turn.speaker,
                h.turn.content,
                h.turn.timestamp,
                h.turn.session_id,
                h.score,
            )
            for m in (hit, *near.get(h.turn.id, ())):
                if m.id not in seen:
                    seen.add(m.id)
                    out.append(m)
        return out

    async def neighbours(
        self,
        user: str,
        hits: Sequence[Hit],
        n: int,
        wanted: Callable[[str, str], bool],
    ) -> dict[int, list[Recalled]]:
        """Each hit's same-session neighbours (positions ±1..n) that ``wanted`` keeps, by hit id:
        nearest first, the next turn before the previous one; each scores slightly below its hit.
        One store read for all hits. Memory items (negative positions) have no neighbours."""
        offsets = [d for i in range(1, n + 1) for d in (i, -i)]
        places = sorted(
            {
                (h.turn.session_id, h.turn.position + d)
                for h in hits
                if h.turn.position >= 0
                for d in offsets
                if h.turn.position + d >= 0
            }
        )
        found = await self.store.read(lambda c: queries.turns_at(c, user, places))
        out: dict[int, list[Recalled]] = {}
        for h in hits:
            if h.turn.position < 0:
                continue
            for d in offsets:
                t = found.get((h.turn.session_id, h.turn.position + d))
                if t is not None and wanted(t.role, t.content):
                    score = h.score * (1 - 0.01 * abs(d))
                    out.setdefault(h.turn.id, []).append(recalled(t, score))
        return out

    def texts(self, messages: Sequence[Mapping[str, Any]]) -> set[str]:
        """Hashes of the messages' texts as archived (redacted) and as sent (their first
        EMBED_CHARS characters), remembered by the hash as sent: clients resend the history."""
        out: set[str] = set()
        for m in messages:
            text = content_text(m.get("content"))
            plain = text_hash(text[:EMBED_CHARS])
            found = self._hashes.get(plain)
            if found is None:
                redacted = text_hash(redact(text[: EMBED_CHARS + REDACT_MARGIN])[:EMBED_CHARS])
                found = (plain, redacted)
                self._hashes[plain] = found
            out.update(found)
        return out

    def not_in(
        self, memories: list[Recalled], messages: Sequence[Mapping[str, Any]]
    ) -> list[Recalled]:
        """``memories`` less those whose text ``messages`` already hold."""
        present = self.texts(messages)
        return [m for m in memories if text_hash(m.content[:EMBED_CHARS]) not in present]
