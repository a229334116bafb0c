"""Indexing archived turns after the fact, and catching up at start.

A chat turn's messages and reply are archived (their rows alone) in the one write transaction
that ends the reply, before its last byte reaches the client: that is what makes an answered turn
survive a crash, and what the next request's session placement reads. Indexing is the slow part,
so it happens here, afterwards, in tracked background tasks: the full-text row (with the
neighbours' ``ctx`` rewrite, :func:`proxy.store.indexing.index_deferred`), then the vector. The
turns table is the journal: a turn with ``fts_pending = 1`` or ``embed_hash IS NULL`` still waits,
and :meth:`Indexer.replay` finishes every such turn when Engram starts (after a crash, or turns
stored while the embedder was down), oldest first, in batches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.logs import event
from proxy.search.embedder import Embedder
from proxy.store import indexing
from proxy.store.models import NewTurn, embed_text, text_hash
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks

log = logging.getLogger("engram.indexer")

REPLAY_BATCH = 64


class Indexer:
    """Indexes archived turns in the background (full text always, vectors with an embedder)."""

    def __init__(self, store: Store, embedder: Embedder | None, tasks: BackgroundTasks) -> None:
        self.store = store
        self.embedder = embedder
        self.tasks = tasks
        self.indexed = 0  # turns given their full-text row
        self.embedded = 0  # turns given a vector
        self.failures = 0  # batches the embedder failed on (their turns wait for the replay)

    def submit(self, rows: Sequence[tuple[int, NewTurn]]) -> None:
        """Index these just-archived turns (id, row) in the background."""
        if rows:
            self.tasks.spawn(self._index(rows), name="index-turns")

    async def _index(self, rows: Sequence[tuple[int, NewTurn]]) -> None:
        ids = [turn_id for turn_id, _ in rows]
        await self.store.scrubber.fts_writable()  # not while a forget's scrub merges the index
        self.indexed += await self.store.write(lambda c: indexing.index_deferred(c, ids))
        items = [
            (turn_id, embed_text(r.role, r.speaker, r.content))
            for turn_id, r in rows
            if r.content.strip()
        ]
        if items and self.embedder is not None:
            await self._embed(items)

    async def _embed(self, items: Sequence[tuple[int, str]]) -> bool:
        """Embed and store ``(turn id, text)`` pairs; False when the embedder failed."""
        assert self.embedder is not None
        try:
            vectors = await self.embedder.embed_passages([text for _, text in items])
        except Exception:  # the text stays archived and searchable; the replay retries
            self.failures += 1
            log.exception("embedding failed; the turns keep their text and wait for a vector")
            return False
        done = await self.store.set_vectors(
            [
                (turn_id, vector, text_hash(text))
                for (turn_id, text), vector in zip(items, vectors, strict=True)
            ]
        )
        self.embedded += done
        return True

    async def replay(self, batch: int = REPLAY_BATCH) -> int:
        """Index every archived turn still waiting: full text, then vectors; returns how many
        turns got either."""
        indexed = 0
        while ids := await self.store.read(lambda c: indexing.pending_index_ids(c, batch * 8)):
            await self.store.scrubber.fts_writable()
            done = await self.store.write(lambda c: indexing.index_deferred(c, ids))
            if not done:
                break  # nothing moved: never loop on the same ids
            indexed += done
        self.indexed += indexed
        if indexed:
            event(
                log,
                logging.INFO,
                "full-text indexed turns archived before the last stop",
                turns=indexed,
            )
        return indexed + await self._replay_vectors(batch)

    async def _replay_vectors(self, batch: int) -> int:
        if self.embedder is None:
            return 0
        before, after = self.embedded, 0
        while True:
            turns = await self.store.turns_without_vectors(None, batch, after_id=after)
            if not turns:
                break
            after = turns[-1].id
            items = [(t.id, embed_text(t.role, t.speaker, t.content)) for t in turns]
            if not await self._embed(items):
                break  # the embedder is down: the next start tries again
        done = self.embedded - before
        if done:
            event(log, logging.INFO, "embedded turns archived before the last stop", turns=done)
        return done
