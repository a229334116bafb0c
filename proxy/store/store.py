"""The async face of the memory database: one writer thread, a pool of reader threads.

Every SQLite call runs off the event loop. Writes go, in order, through one writer thread owning
the one read-write connection; each write method is one transaction, and once submitted runs to
completion even if the caller is cancelled (a client that goes away never loses half an archive
step). Reads run on ``readers`` threads, each with its own ``query_only`` connection (WAL lets
them read while the writer writes); cache loads on a loader thread of their own (store.warm).

Public surface (all ``async`` except the constructor)::

    Store(path, *, readers=2, vec_mode="auto", quantized_above=QUANTIZED_ABOVE, fts_weights=
          FTS_WEIGHTS, fts_memory=, vec_memory=)  bm25 (body, ctx, date); RAM for terms, vectors
    read(fn) / write(fn, transaction=True)   run fn(conn) on a reader / in a write transaction
                                (fns from proxy.store's table modules: feedback, slots, items…)
    ensure_user(user_id);  get_or_create_session(user_id, session_id, *, parent_id=None,
                          agent=None, fingerprint=None, indexed=None) -> Session
    get_session(session_id);  set_session_indexed(session_id, indexed);  list_users()
    resolve_session(user_id, chain_hashes, *, min_length=1) -> (Session, matched) | None
    list_sessions(user_id) -> list[Session]  most recently seen first
    delete_session(session_id, *, user_id=None) / delete_user(user_id) -> bool  with all they
        produced (store.forget);  scrubber.scrub()   after deletes (store.scrub)
    add_turns(session_id, user_id, turns, vectors=None) -> ids inserted (stored positions
        skipped);  set_vectors([(turn_id, vector, embed_hash)]);  turns_without_vectors(...)
    count_turns(session_id);  session_turn_hashes(session_id);  session_turn_counts(user_id);
    next_position(session_id);  session_turns(session_id, from_position=0, limit=None)
    get_turns(ids, *, user_id=None) -> list[Turn]  in the order of ids;  turn_vectors(user_id, ids)
    fts_search(user_id, match, limit, *, session_ids=None, exclude_ids=(),
               exclude_sessions=(), exclude_roles=()) -> [(id, bm25)]
    fts_word_shares(user_id, words, *, min_turns=0, above=0) -> {word: share of the user's turns}
    vec_search(user_id, vector, limit, *, session_ids=None, exclude_ids=(),
               exclude_sessions=(), mode=None, exclude_roles=()) -> [(id, cosine distance)]
    fts_candidates(user_id, words, choose, limit, ...) / vec_candidates(user_id, vector, limit,
               *, known=(), ...) -> (ranking, rows)  each path in one reader job (store.search)
    export(user_id) -> AsyncIterator[dict]  sessions then turns;  stats();  preload()  warm start
    follow()   apply what other processes on the file changed (store.changes; each search
               does it first);  follower.on_deleted   told of turns they deleted
    ensure_embedding_model(name, dim=None) -> bool   False when turn_vec holds another model's
                                vectors (store.vectable); vec_dim: turn_vec's dimension

Search scope: ``session_ids=None``: the user's sessions flagged ``indexed`` (sub-agent ones
are not); a list: exactly those. ``exclude_sessions`` (the conversation being answered) and
``exclude_roles`` (tool outputs) take no candidate places. Always confined to ``user_id``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from proxy.store import (
    backend,
    changes,
    indexing,
    queries,
    vectable,
)
from proxy.store.caches import term_cache, vec_cache, warm, word_counts
from proxy.store.export import export_items
from proxy.store.forget import forget_session
from proxy.store.gate import Gate
from proxy.store.held import Connections
from proxy.store.models import NewTurn, Session, StoreStats, Turn
from proxy.store.postgres.follow import PgFollower
from proxy.store.search import Searching
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.scrub import Scrubber
from proxy.store.sqlite.search_sql import FTS_WEIGHTS, QUANTIZED_ABOVE, VecMode
from proxy.vectors import Vector

T = TypeVar("T")


class Store(Searching):
    """The memory database. Create, ``await open()``, use, ``await close()``. Its search
    methods are :class:`~proxy.store.search.Searching`'s."""

    def __init__(
        self,
        path: str | Path,
        *,
        readers: int = 2,
        vec_mode: VecMode = "auto",
        quantized_above: int = QUANTIZED_ABOVE,
        fts_weights: Sequence[float] = FTS_WEIGHTS,
        fts_memory: int = term_cache.MAX_BYTES,
        vec_memory: int = vec_cache.MAX_BYTES,
    ) -> None:
        if str(path) == ":memory:":
            raise ValueError("the store needs a file: readers and writer use separate connections")
        self.pg = backend.is_url(path)
        self.target: str | Path = str(path) if self.pg else Path(path)
        self.path = Path(path) if not self.pg else None  # the SQLite file
        self.backend = backend.name(path)
        self.display = backend.display(path)  # a URL without its password
        self.readers = self._readers = max(1, readers)
        self._vec_mode: VecMode = vec_mode
        self._quantized_above = quantized_above
        if len(fts_weights) != len(FTS_WEIGHTS):
            raise ValueError(f"fts_weights needs {len(FTS_WEIGHTS)} values (body, ctx, date)")
        self._fts_weights = tuple(float(w) for w in fts_weights)
        self._writer: ThreadPoolExecutor | None = None
        self._reader_pool: ThreadPoolExecutor | None = None
        # PostgreSQL named without its password; down: memory off, retried (store.gate)
        self.gate = Gate(f"PostgreSQL at {self.display}" if self.pg else str(self.display))
        self.connections = Connections(self.target, self.gate)  # one per thread (store.held)
        self.reads_in_flight = 0
        self.writes_in_flight = 0
        self._user_counts: dict[str, tuple[float, int]] = {}
        self.vec_dim: int | None = None  # turn_vec's, read at open
        self._words = word_counts.UserWordCounts()
        self.vectors = vec_cache.VectorCache(vec_memory)  # the exact KNN in numpy
        self.terms = term_cache.TermCache(fts_memory)  # BM25 in numpy
        follower = PgFollower if self.pg else changes.Follower
        self.follower = follower(self.terms, self.vectors)  # other processes' writes
        self.loader = warm.Loader(self.connections)  # loads those caches beside the readers
        self._words.again = lambda: self.loader.submit(self._words.run)  # words queued meanwhile
        self.scrubber = Scrubber(self)  # after deletes: FTS merge, vacuum, checkpoint

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self) -> None:
        """Open the writer connection, apply migrations, start the threads."""
        if self._writer is not None:
            return
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-db-write")
        self._reader_pool = ThreadPoolExecutor(  # their connections open at first use
            max_workers=self._readers, thread_name_prefix="engram-db-read"
        )
        self.loader.start()

        def _open_writer() -> None:
            # a SQLite file is created 0600, its folder 0700 if missing
            conn = backend.open_connection(self.target)
            try:
                backend.migrate(conn)
                if not self.pg:  # on PostgreSQL the writer catches up after each commit
                    vec_cache.install_triggers(conn)
                    term_cache.install_triggers(conn)
                self.follower.install(conn)
                self.vec_dim = vectable.table_dim(conn)
            except BaseException:
                conn.close()
                raise
            self.connections.adopt(conn)

        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, _open_writer)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Finish queued writes, close every connection, stop the threads."""
        writer, self._writer = self._writer, None
        pool, self._reader_pool = self._reader_pool, None
        loop = asyncio.get_running_loop()
        self.terms.closing = True  # a load in flight stops at its next chunk
        await loop.run_in_executor(None, self.loader.close)
        if pool is not None:
            await loop.run_in_executor(None, pool.shutdown, True)
        if writer is not None:  # closed behind every write already submitted
            writer.submit(self.connections.close_mine)
            await loop.run_in_executor(None, writer.shutdown, True)
        self.connections.close_all()

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- running work ---------------------------------------------------------------------
    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` on a reader thread with a read-only connection."""
        pool = self._reader_pool
        if pool is None:
            raise RuntimeError("store is not open")
        self.gate.check()  # down: StoreUnavailable now, no thread hop (store.gate)

        def job() -> T:
            return self.connections.run(fn, readonly=True)

        self.reads_in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, job)
        finally:
            self.reads_in_flight -= 1

    async def write(self, fn: Callable[[Connection], T], *, transaction: bool = True) -> T:
        """Run ``fn(conn)`` on the writer thread inside one ``BEGIN IMMEDIATE`` transaction
        (``transaction=False``: outside any, e.g. a checkpoint). Once submitted it runs to
        completion even if the caller is cancelled."""
        writer = self._writer
        if writer is None:
            raise RuntimeError("store is not open")
        self.gate.check()
        follower = self.follower

        def guarded(c: Connection) -> T:
            try:
                return fn(c)
            except BaseException:
                follower.write_ended(False)  # before the rollback hands its numbers out again
                raise

        def run(conn: Connection) -> T:
            # one transaction (or none); what it did to vectors and terms is then applied
            ok = False
            try:
                result = self.terms.run_write(
                    conn, lambda c: self.vectors.run_write(c, guarded, transaction)
                )
                ok = True
                if self.pg:  # this write's changes reach the caches as others' do
                    follower.catch_up(conn)
                return result
            finally:
                follower.write_ended(ok)

        def job() -> T:
            return self.connections.run(run, readonly=False)

        self.writes_in_flight += 1
        try:
            future = asyncio.wrap_future(writer.submit(job))
            return await asyncio.shield(future)
        finally:
            self.writes_in_flight -= 1

    # -- users and sessions ---------------------------------------------------------------
    async def ensure_user(self, user_id: str) -> None:
        now = time.time()
        await self.write(lambda c: queries.ensure_user(c, user_id, now))

    async def get_or_create_session(
        self,
        user_id: str,
        session_id: str,
        *,
        parent_id: str | None = None,
        agent: str | None = None,
        fingerprint: str | None = None,
        indexed: bool | None = None,
    ) -> Session:
        """The session, created if new (``last_seen`` bumped if not).

        A sub-session (``parent_id``) gets ``level = parent.level + 1`` and, unless ``indexed``
        says otherwise, stays out of searches over the user's whole memory. Raises
        :class:`SessionConflict` when the id (or the parent) belongs to another user,
        :class:`SessionNotFound` for a missing parent.
        """
        now = time.time()
        return await self.write(lambda c: queries.get_or_create_session(c, user_id, session_id,
            parent_id=parent_id, agent=agent, fingerprint=fingerprint, indexed=indexed,
            now=now))  # fmt: skip

    async def get_session(self, session_id: str) -> Session | None:
        return await self.read(lambda c: queries.get_session(c, session_id))

    async def resolve_session(
        self, user_id: str, hashes: Sequence[str], *, min_length: int = 1
    ) -> tuple[Session, int] | None:
        """The user's session sharing the longest prefix of chain ``hashes`` (see queries)."""
        hashes = list(hashes)
        return await self.read(lambda c: queries.resolve_session(c, user_id, hashes, min_length))

    async def set_session_indexed(self, session_id: str, indexed: bool) -> None:
        await self.write(lambda c: queries.set_session_indexed(c, session_id, indexed))

    async def list_sessions(self, user_id: str) -> list[Session]:
        return await self.read(lambda c: queries.list_sessions(c, user_id))

    async def delete_session(self, session_id: str, *, user_id: str | None = None) -> bool:
        """Delete the session, sub-sessions, turns, derived items, its slots (store.forget);
        False if none matched. ``await store.scrubber.scrub()`` then clears the files."""
        return await self.write(lambda c: forget_session(c, session_id, user_id)) is not None

    async def delete_user(self, user_id: str) -> bool:
        self._user_counts.pop(user_id, None)
        return await self.write(lambda c: queries.delete_user(c, user_id))

    # -- turns ----------------------------------------------------------------------------
    async def add_turns(
        self,
        session_id: str,
        user_id: str,
        turns: Sequence[NewTurn],
        vectors: Sequence[Vector | None] | None = None,
    ) -> list[int]:
        """Archive ``turns`` (with a vector each, or None) in one transaction. Positions the
        session already holds are skipped; returns the ids inserted."""
        now = time.time()
        turns = list(turns)
        vecs = list(vectors) if vectors is not None else None
        for vec in vecs or ():
            if vec is not None:
                indexing.check_vector(vec, self.vec_dim)
        return await self.write(
            lambda c: queries.add_turns(c, session_id, user_id, turns, vecs, now)
        )

    async def set_vectors(self, items: Sequence[tuple[int, Vector, str]]) -> int:
        items = [(i, indexing.check_vector(v, self.vec_dim), h) for i, v, h in items]
        return await self.write(lambda c: indexing.set_vectors(c, items))

    async def turns_without_vectors(
        self, user_id: str | None, limit: int = 256, after_id: int = 0
    ) -> list[Turn]:
        return await self.read(
            lambda c: indexing.turns_without_vectors(c, user_id, limit, after_id)
        )

    async def count_turns(self, session_id: str) -> int:
        return await self.read(lambda c: queries.count_turns(c, session_id))

    async def session_turn_counts(self, user_id: str) -> dict[str, int]:
        return await self.read(lambda c: queries.session_turn_counts(c, user_id))

    async def next_position(self, session_id: str) -> int:
        return await self.read(lambda c: queries.next_position(c, session_id))

    async def session_turn_hashes(self, session_id: str) -> list[str]:
        return await self.read(lambda c: queries.session_turn_hashes(c, session_id))

    async def session_turns(
        self, session_id: str, from_position: int = 0, limit: int | None = None
    ) -> list[Turn]:
        return await self.read(lambda c: queries.session_turns(c, session_id, from_position, limit))

    async def get_turns(self, ids: Sequence[int], *, user_id: str | None = None) -> list[Turn]:
        ids = list(ids)
        return await self.read(lambda c: queries.get_turns(c, ids, user_id)) if ids else []

    async def follow(self) -> int:
        """Apply what other processes on the database changed (store.changes); how many rows."""
        return await self.read(self.follower.catch_up)

    async def preload(self) -> list[str]:
        """Start loading the caches of the users seen last (a warm start, store.warm)."""
        return await warm.warm_start(self.read, self.terms, self.vectors, self.loader, self.vec_dim)

    # -- export, stats, meta --------------------------------------------------------------
    def export(self, user_id: str, *, page_size: int = 500) -> AsyncIterator[dict[str, Any]]:
        """Everything one user namespace holds, as JSON-ready dicts: sessions, then turns."""
        return export_items(self.read, user_id, page_size)

    async def list_users(self) -> list[str]:
        return await self.read(queries.list_users)

    async def stats(self) -> StoreStats:
        return await self.read(lambda c: queries.stats(c, self.path))

    async def ensure_embedding_model(self, name: str, dim: int | None = None) -> bool:
        """Record ``name`` (of ``dim`` dimensions) as the model of ``turn_vec`` if that loses no
        vector; False if the table holds another model's (:func:`vectable.claim_model`)."""

        def job(c: Connection) -> tuple[bool, int]:
            return vectable.claim_model(c, name, dim), vectable.table_dim(c)

        ok, self.vec_dim = await self.write(job)
        return ok
