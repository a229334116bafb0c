"""The store's search face (a mixin of :class:`~proxy.store.store.Store`): BM25, KNN, word shares.

Each path answers from the users' caches in memory when they are held (:mod:`.term_cache`,
:mod:`.vec_cache`; the same ranking on both backends) and from the database when not (FTS5 and
vec0 on SQLite, ``tsvector`` and pgvector on PostgreSQL: :mod:`.pg.search_sql`).
:meth:`Searching.fts_candidates` and :meth:`Searching.vec_candidates` are what a search runs:
each path in *one* reader job, its candidates' rows included (the word shares, the ranking and
the rows were three hops of the event loop to a reader and back; on a 2-core machine each hop
is paid in wall time while the loop's own Python holds the GIL). ``fts_search``, ``vec_search``
and ``fts_word_shares`` are the same work one part at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from proxy.store import (
    changes,
    indexing,
    queries,
)
from proxy.store.caches import term_cache, term_index, vec_cache, warm, word_counts
from proxy.store.caches.scope import turn_rows
from proxy.store.sqlite import search_sql as search
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.search_sql import VecMode
from proxy.vectors import Vector

T = TypeVar("T")

COUNT_TTL_S = 30.0
"""How long a user's turn count (which picks exact or quantised KNN) is trusted."""

Ranked = list[tuple[int, float]]
Rows = dict[int, tuple[Any, ...]]


class Searching:
    """Search methods over the attributes :class:`~proxy.store.store.Store` sets up."""

    terms: term_cache.TermCache
    vectors: vec_cache.VectorCache
    follower: changes.Follower
    loader: warm.Loader
    vec_dim: int | None
    _words: word_counts.UserWordCounts
    _fts_weights: tuple[float, ...]
    _vec_mode: VecMode
    _quantized_above: int
    _user_counts: dict[str, tuple[float, int]]
    _writer: ThreadPoolExecutor | None

    async def read(self, fn: Callable[[Connection], T]) -> T:
        raise NotImplementedError  # the Store's

    # -- one path, one job ----------------------------------------------------------------
    async def fts_candidates(
        self,
        user_id: str,
        words: Sequence[str],
        choose: Callable[[dict[str, float]], str | None],
        limit: int,
        *,
        min_turns: int = 0,
        above: float = 1.0,
        session_ids: Sequence[str] | None = None,
        exclude_sessions: Sequence[str] = (),
        exclude_roles: Sequence[str] = (),
    ) -> tuple[Ranked, Rows]:
        """The full-text path in one reader job: the shares of ``words`` (as
        :meth:`fts_word_shares`; none asked for when ``words`` is empty), the match ``choose``
        makes of them (None: nothing to search), :meth:`fts_search`'s ranking of it, and the
        found turns' rows (:func:`~proxy.store.caches.scope.turn_rows`)."""
        filters = _filters(session_ids, (), exclude_sessions, exclude_roles)
        quick, shares_job = self._shares(user_id, words, min_turns, above)

        def job(c: Connection) -> tuple[Ranked, Rows]:
            match = choose(quick if quick is not None else shares_job(c))
            if match is None:
                return [], {}
            ranked = self._fts_ranked(c, user_id, match, limit, *filters)
            return ranked, turn_rows(c, [i for i, _ in ranked], user_id)

        try:
            return await self.read(job)
        finally:
            self._count_words_later()

    async def vec_candidates(
        self,
        user_id: str,
        vector: Vector,
        limit: int,
        *,
        known: Container[int] = (),
        session_ids: Sequence[str] | None = None,
        exclude_sessions: Sequence[str] = (),
        exclude_roles: Sequence[str] = (),
    ) -> tuple[Ranked, Rows]:
        """The vector path in one reader job: :meth:`vec_search`'s ranking and the rows of the
        turns it found that are not in ``known`` (rows the caller holds already, such as the
        full-text path's; looked up one id at a time, so it may be filled meanwhile)."""
        filters = _filters(session_ids, (), exclude_sessions, exclude_roles)
        mode = self._vec_mode

        def job(c: Connection) -> tuple[Ranked, Rows]:
            ranked = self._vec_ranked(c, user_id, vector, limit, mode, *filters)
            return ranked, turn_rows(c, [i for i, _ in ranked if i not in known], user_id)

        return await self.read(job)

    # -- one part at a time ---------------------------------------------------------------
    async def fts_search(
        self,
        user_id: str,
        match: str,
        limit: int,
        *,
        session_ids: Sequence[str] | None = None,
        exclude_ids: Iterable[int] = (),
        exclude_sessions: Sequence[str] = (),
        exclude_roles: Sequence[str] = (),
    ) -> Ranked:
        """(turn id, bm25) best first. ``match`` must come from :mod:`proxy.search.fts_query`."""
        filters = _filters(session_ids, exclude_ids, exclude_sessions, exclude_roles)
        return await self.read(lambda c: self._fts_ranked(c, user_id, match, limit, *filters))

    async def vec_search(
        self,
        user_id: str,
        vector: Vector,
        limit: int,
        *,
        session_ids: Sequence[str] | None = None,
        exclude_ids: Iterable[int] = (),
        exclude_sessions: Sequence[str] = (),
        mode: VecMode | None = None,
        exclude_roles: Sequence[str] = (),
    ) -> Ranked:
        """(turn id, cosine distance) nearest first, over the user's partition only."""
        filters = _filters(session_ids, exclude_ids, exclude_sessions, exclude_roles)
        plan = mode or self._vec_mode
        return await self.read(
            lambda c: self._vec_ranked(c, user_id, vector, limit, plan, *filters)
        )

    async def turn_vectors(self, user_id: str, ids: Sequence[int]) -> dict[int, Vector]:
        ids = list(ids)
        found = self.vectors.vectors(user_id, ids)
        if found is None:  # not held (store.vec_cache): point lookups
            found = await self.read(lambda c: indexing.turn_vectors(c, ids, user_id))
        return found

    async def fts_word_shares(
        self, user_id: str, words: Sequence[str], *, min_turns: int = 0, above: float = 1.0
    ) -> dict[str, float]:
        """Each query word's share of ``user_id``'s turns, as far as known without waiting
        (word_counts.UserWordCounts); empty below ``min_turns`` turns. No hop when remembered."""
        quick, job = self._shares(user_id, words, min_turns, above)
        try:
            return quick if quick is not None else await self.read(job)
        finally:
            self._count_words_later()

    # -- the jobs (reader threads) ----------------------------------------------------------
    def _fts_ranked(
        self,
        c: Connection,
        user_id: str,
        match: str,
        limit: int,
        sessions: list[str] | None,
        excluded: list[int],
        skip: list[str],
        roles: list[str],
    ) -> Ranked:
        mine = self._user_turn_count(c, user_id)
        self.follower.catch_up(c)  # what other processes on the database changed
        found = self.terms.search(c, user_id, term_index.terms_of(match), limit,
            self._in_background, mine, self._fts_weights, session_ids=sessions,
            exclude_ids=excluded, exclude_sessions=skip, exclude_roles=roles)  # fmt: skip
        if found is not None:  # the user's terms held in memory (store.term_cache)
            return found
        return search.fts_search(
            c,
            user_id,
            match,
            limit,
            session_ids=sessions,
            exclude_ids=excluded,
            exclude_sessions=skip,
            weights=self._fts_weights,
            probe_first=mine >= search.FTS_PROBE_USER_SHARE * self._user_turn_count(c, None),
            exclude_roles=roles,
        )

    def _vec_ranked(
        self,
        c: Connection,
        user_id: str,
        vector: Vector,
        limit: int,
        mode: VecMode,
        sessions: list[str] | None,
        excluded: list[int],
        skip: list[str],
        roles: list[str],
    ) -> Ranked:
        # The exact plan in memory (store.vec_cache) whenever the user's vectors are held
        # there, however many; vec0's plans while they are not (or would not fit).
        count = self._user_turn_count(c, user_id)
        self.follower.catch_up(c)  # what other processes on the database changed
        found = None if mode == "quantized" else self.vectors.search(user_id, vector, limit,
            self._in_background, count, session_ids=sessions, exclude_ids=excluded,
            exclude_sessions=skip, exclude_roles=roles)  # fmt: skip
        if found is not None:
            return found
        quantized = mode == "quantized" or (mode == "auto" and count > self._quantized_above)
        return search.vec_search(c, user_id, vector, limit, session_ids=sessions,
            exclude_ids=excluded, quantized=quantized, exclude_sessions=skip,
            exclude_roles=roles, dim=self.vec_dim)  # fmt: skip

    def _shares(
        self, user_id: str, words: Sequence[str], min_turns: int, above: float
    ) -> tuple[dict[str, float] | None, Callable[[Connection], dict[str, float]]]:
        """The words' shares if known without a read (else None), and the job that reads them."""
        words = list(dict.fromkeys(words))
        floor, mine, total = max(1, min_turns), self._fresh(user_id), self._fresh("\0all")

        def job(c: Connection) -> dict[str, float]:
            mine = self._user_turn_count(c, user_id)
            if mine < floor:
                return {}
            total = self._user_turn_count(c, None)
            return self._words.shares(c, user_id, words, mine, total, above) or {}

        if not words or (mine is not None and mine < floor):  # known to be below: no read
            return {}, job
        return self._words.remembered(user_id, words, mine, total, above), job

    def _count_words_later(self) -> None:
        if self._words.pending() and self._writer is not None:
            self._words.running = True  # counted in the background: nothing waits for it
            self._in_background(self._words.run)

    def _in_background(self, fn: Callable[[Connection], object]) -> None:
        """Run ``fn(conn)`` on the loader thread (store.warm); nothing waits for it."""
        self.loader.submit(fn)

    def _user_turn_count(self, conn: Connection, user_id: str | None) -> int:
        """A recent count of the user's (``None``: all) turns; stale only picks a plan."""
        key = "\0all" if user_id is None else user_id
        if (known := self._fresh(key)) is not None:
            return known
        if user_id is None:
            count = int(conn.execute("SELECT count(*) FROM turns").fetchone()[0])
        else:
            count = queries.count_user_turns(conn, user_id)
        self._user_counts[key] = (time.monotonic(), count)
        return count

    def _fresh(self, key: str) -> int | None:
        """A user's (``"\0all"``: all) turn count counted in the last :data:`COUNT_TTL_S`."""
        cached = self._user_counts.get(key)
        return cached[1] if cached and time.monotonic() - cached[0] < COUNT_TTL_S else None


def _filters(
    session_ids: Sequence[str] | None,
    exclude_ids: Iterable[int],
    exclude_sessions: Sequence[str],
    exclude_roles: Sequence[str],
) -> tuple[list[str] | None, list[int], list[str], list[str]]:
    """The scope filters as lists, copied before the job runs on its thread."""
    sessions = list(session_ids) if session_ids is not None else None
    return sessions, list(exclude_ids), list(exclude_sessions), list(exclude_roles)
