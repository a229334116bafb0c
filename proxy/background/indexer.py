"""Indexing archived turns after the fact: a bounded queue, taken in small chunks, and catching up.

A chat turn's messages and reply are archived (their rows alone) in the one write transaction
that ends the reply, before its last byte reaches the client: that is what makes an answered turn
survive a crash, and what the next request's session placement reads. Indexing is the slow part,
so it happens here, afterwards: the full-text row (with the neighbours' ``ctx`` rewrite,
:func:`proxy.store.indexing.index_deferred`), then the vector. The turns table is the journal: a
turn with ``fts_pending = 1`` or ``embed_hash IS NULL`` still waits.

Backpressure. :meth:`Indexer.submit` queues a commit's turns as one *job*; one worker task (alive
only while there is work, so :class:`~proxy.tasks.BackgroundTasks` drains it) takes
:data:`CHUNK` turns of the first job (one short write transaction, one embedding call), then
puts the job's rest at the back: a small turn of one user is indexed within a chunk or two
even while another user's 4,000-message request is being indexed, and the writer is never held
for long. At most ``limits.index_queue_turns`` turns wait in memory; the turns of a commit
beyond that bound are *deferred*: they stay in the journal (already durable and readable, just
not searchable yet) and the worker catches them up from the database, one chunk at a time,
whenever the queue is empty. :meth:`Indexer.replay` finishes every waiting turn when Engram
starts (after a crash, or turns stored while the embedder was down), oldest first, in batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from proxy.logs import event
from proxy.search.embedder import Embedder
from proxy.store import indexing
from proxy.store.gate import StoreUnavailable
from proxy.store.models import NewTurn, embed_text, text_hash
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks

log = logging.getLogger("engram.indexer")

REPLAY_BATCH = 64
CHUNK = 64
"""Turns indexed in one step: one write transaction (about 35 ms of the writer for full text)
and one embedding call; between steps other jobs take their turn."""
DEFAULT_QUEUE_TURNS = 4096

# One queued turn: its id and the text its vector comes from ("" when it has none).
Item = tuple[int, str]


class Indexer:
    """Indexes archived turns in the background (full text always, vectors with an embedder)."""

    def __init__(
        self,
        store: Store,
        embedder: Embedder | None,
        tasks: BackgroundTasks,
        queue_turns: int = DEFAULT_QUEUE_TURNS,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.tasks = tasks
        self.queue_turns = queue_turns
        self.indexed = 0  # turns given their full-text row
        self.embedded = 0  # turns given a vector
        self.failures = 0  # batches the embedder failed on (their turns wait for the replay)
        self.deferred = 0  # turns left to the catch-up because the queue was full
        self._jobs: deque[list[Item]] = deque()
        self._queued = 0  # turns in the jobs
        self._catch_up_to = 0  # deferred turns have ids up to this one
        self._worker: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        """Turns waiting in memory to be indexed."""
        return self._queued

    def submit(self, rows: Sequence[tuple[int, NewTurn]]) -> None:
        """Index these just-archived turns (id, row) in the background; those beyond the
        queue's bound are deferred to the catch-up."""
        if not rows:
            return
        room = max(0, self.queue_turns - self._queued)
        take, rest = rows[:room], rows[room:]
        if take:
            job = [
                (turn_id, embed_text(r.role, r.speaker, r.content) if r.content.strip() else "")
                for turn_id, r in take
            ]
            self._jobs.append(job)
            self._queued += len(job)
        if rest:
            if not self.deferred or self._catch_up_to == 0:
                event(
                    log,
                    logging.WARNING,
                    "indexing queue full; turns deferred (archived, searchable once caught up)",
                    turns=len(rest),
                    queue=self._queued,
                )
            self.deferred += len(rest)
            self._catch_up_to = max(self._catch_up_to, max(turn_id for turn_id, _ in rest))
        self._wake()

    def _wake(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = self.tasks.spawn(self._work(), name="index-turns")

    async def _work(self) -> None:
        """Round-robin over the jobs, a chunk at a time; the catch-up when they are done."""
        while True:
            if self._jobs:
                job = self._jobs.popleft()
                chunk, rest = job[:CHUNK], job[CHUNK:]
                if rest:
                    self._jobs.append(rest)
                try:
                    await self._index(chunk)
                except StoreUnavailable:  # the database is down (its gate said so once)
                    self._wait_for_database(chunk)
                    return
                except Exception:  # the turns stay in the journal: the next start's replay
                    log.exception("indexing archived turns failed; they wait for the next start")
                finally:
                    self._queued -= len(chunk)
            elif self._catch_up_to:
                try:
                    more = await self._catch_up_chunk(self._catch_up_to)
                except StoreUnavailable:
                    return  # the next commit, once the database is back, wakes the catch-up
                if not more:
                    self._catch_up_to = 0
            else:
                return

    def _wait_for_database(self, chunk: Sequence[Item]) -> None:
        """The database went away: this chunk and every queued turn stay in the journal, and
        the catch-up indexes them from there once a commit wakes the worker."""
        queued = [item for each in self._jobs for item in each]
        self._jobs.clear()
        self._queued -= len(queued)  # the chunk's own share is taken off by the caller
        self._catch_up_to = max(self._catch_up_to, *(turn_id for turn_id, _ in [*chunk, *queued]))

    async def _index(self, chunk: Sequence[Item]) -> None:
        ids = [turn_id for turn_id, _ in chunk]
        await self.store.scrubber.fts_writable()  # not while a forget's scrub merges the index
        self.indexed += await self.store.write(lambda c: indexing.index_deferred(c, ids))
        items = [(turn_id, text) for turn_id, text in chunk if text]
        if items and self.embedder is not None:
            await self._embed(items)

    async def _catch_up_chunk(self, upto: int) -> bool:
        """Index one chunk of the deferred turns (ids up to ``upto``); False when none is left
        (or the embedder failed: the next start's replay tries again)."""
        ids = [
            i
            for i in await self.store.read(lambda c: indexing.pending_index_ids(c, CHUNK))
            if i <= upto
        ]
        if ids:
            await self.store.scrubber.fts_writable()
            self.indexed += await self.store.write(lambda c: indexing.index_deferred(c, ids))
        if self.embedder is None:
            return bool(ids)
        turns = [t for t in await self.store.turns_without_vectors(None, CHUNK) if t.id <= upto]
        if turns:
            items = [(t.id, embed_text(t.role, t.speaker, t.content)) for t in turns]
            if not await self._embed(items):
                return False
        return bool(ids or turns)

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
