"""Vectors for archived turns, computed after the fact, and caught up at start.

A chat turn's messages and reply are archived (text and full-text index) in the one write
transaction that ends the reply, before its last byte reaches the client: that is what makes an
answered turn survive a crash. Embedding is the slow part, so it happens here, afterwards, in
tracked background tasks. A turn archived but not yet embedded (``embed_hash IS NULL``) is the
journal: :meth:`Indexer.replay` embeds every such turn when Engram starts (after a crash, or
turns stored while the embedder was down), oldest first, in batches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.embedder import Embedder
from proxy.logs import event
from proxy.store.models import NewTurn, embed_text, text_hash
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks

log = logging.getLogger("engram.indexer")

REPLAY_BATCH = 64


class Indexer:
    """Embeds archived turns in the background; ``embedder=None`` makes it do nothing."""

    def __init__(self, store: Store, embedder: Embedder | None, tasks: BackgroundTasks) -> None:
        self.store = store
        self.embedder = embedder
        self.tasks = tasks
        self.embedded = 0  # turns given a vector
        self.failures = 0  # batches the embedder failed on (their turns wait for the replay)

    def submit(self, rows: Sequence[tuple[int, NewTurn]]) -> None:
        """Embed these just-archived turns (id, row) in the background."""
        items = [
            (turn_id, embed_text(r.role, r.speaker, r.content))
            for turn_id, r in rows
            if r.content.strip()
        ]
        if items and self.embedder is not None:
            self.tasks.spawn(self._embed(items), name="index-turns")

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
        """Embed every archived turn that has no vector yet; returns how many got one."""
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
