"""Users' full-text index held in memory: FTS5's BM25 ranking, computed in numpy.

FTS5 scores every row a query matches, and a question's words match many: on the benchmark
archive of 10,000 LoCoMo turns a question took 5.5 ms, of 100,000 turns 26-40 ms, nearly all of
it ``bm25()`` row by row. :class:`TermCache` keeps, per user, each term's rows with its counts
and answers the same query in about 0.3 ms at 10,000 turns.

What it ranks by is ``bm25(turns_fts, w_body, w_ctx, w_date)`` as FTS5 computes it
(``fts5_aux.c``): for each query term ``f = sum over columns of weight x count``, ``idf =
ln((N - n + 0.5) / (n + 0.5))`` (1e-6 when not positive, ``n`` the rows holding the term),
``score = -sum idf * f * (k1 + 1) / (f + k1 * (1 - b + b * D / avgdl))`` with ``k1 = 1.2``,
``b = 0.75``, ``D`` the row's tokens in all columns; best (lowest) first, ties by turn id. Two
things differ, both on purpose:

- the statistics (``N``, ``n``, ``avgdl``) are the user's own rows', not the whole table's:
  another user's archive no longer reorders this user's matches, which closes (while the user is
  held) the word-presence oracle described in :mod:`proxy.store.sqlite.search_sql`;
- ``N`` and ``avgdl`` are the rows' true count and length. The contentless-delete
  ``turns_fts`` keeps deleted rows in its statistics, and every new turn deletes and re-inserts
  its neighbours' rows: on the benchmark archive of 10,000 turns it counts 28,500 rows averaging
  127.5 tokens, against 10,000 of 156.7.

How the index is kept and ranked: :mod:`proxy.store.caches.term_index`.

Coherence, in the writer thread (as :mod:`proxy.store.caches.vec_cache`): temporary triggers on the
writer connection (:func:`install_triggers`) note the turns that enter the full-text index
(inserted with ``fts_pending = 0``, or set to 0 by the indexer); after the commit they are read
and appended to the users held. Anything else that changes a held user's rows (a turn's text,
session, position, role, speaker or time updated, a turn deleted, a session's ``indexed``
flipped) drops the user, loaded again in the background by a later search, which meanwhile
asks FTS5. A turn still ``fts_pending`` is in no neighbour's ``ctx`` here until it is indexed
(FTS5 may hold it there already): the two agree once the indexer has caught up. What other
processes on the same database change arrives through the ``changes`` log
(:mod:`proxy.store.changes`): appended (:meth:`TermCache.append`) or dropped alike.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proxy.store.caches.scope import claim_load, in_scope
from proxy.store.caches.term_index import LoadStopped, TermIndex, turns_of_ids_sql, turns_sql
from proxy.store.rows import json_list
from proxy.store.sqlite.db import Connection

log = logging.getLogger("engram.store")

MAX_BYTES = 128 * 1024 * 1024
"""Memory the cache may hold (a user of 100,000 LoCoMo-like turns takes about 58 MB)."""
BYTES_PER_TURN = 600
"""What a turn is expected to take, to decide whether a user would fit before loading."""
LOAD_NOW_ROWS = 2_000
"""A user of up to this many turns is loaded by the search that finds it not held (about 0.2 s
at most, once), so its ranking does not change when the load completes; a larger one in the
background, FTS5 answering meanwhile."""

T = TypeVar("T")


# -- the journal (writer thread) -----------------------------------------------------------
@dataclass
class _Changes:
    added: list[tuple[int, str]] = field(default_factory=list)  # (turn id, user)
    users: set[str] = field(default_factory=set)  # dropped


_journal = threading.local()


def _note(added: tuple[int, str] | None = None, user: str | None = None) -> None:
    changes: _Changes | None = getattr(_journal, "changes", None)
    if changes is None:
        return
    if added is not None:
        changes.added.append(added)
    if user is not None:
        changes.users.add(user)


def install_triggers(conn: Connection) -> None:
    """Temporary triggers (this connection only) that note turns entering the full-text index
    and the changes that drop a user."""
    conn.create_function("engram_terms_added", 2, lambda i, u: _note(added=(int(i), str(u))))
    conn.create_function("engram_terms_changed", 1, lambda u: _note(user=str(u)))
    conn.executescript(
        """
        CREATE TEMP TRIGGER IF NOT EXISTS engram_terms_insert AFTER INSERT ON main.turns
        WHEN new.fts_pending = 0 BEGIN SELECT engram_terms_added(new.id, new.user_id); END;
        CREATE TEMP TRIGGER IF NOT EXISTS engram_terms_indexed
        AFTER UPDATE OF fts_pending ON main.turns WHEN old.fts_pending = 1 AND new.fts_pending = 0
        BEGIN SELECT engram_terms_added(new.id, new.user_id); END;
        CREATE TEMP TRIGGER IF NOT EXISTS engram_terms_update
        AFTER UPDATE OF user_id, session_id, position, role, speaker, content, timestamp
        ON main.turns BEGIN
            SELECT engram_terms_changed(old.user_id); SELECT engram_terms_changed(new.user_id);
        END;
        CREATE TEMP TRIGGER IF NOT EXISTS engram_terms_delete AFTER DELETE ON main.turns
        BEGIN SELECT engram_terms_changed(old.user_id); END;
        CREATE TEMP TRIGGER IF NOT EXISTS engram_terms_session
        AFTER UPDATE OF indexed ON main.sessions WHEN old.indexed IS NOT new.indexed
        BEGIN SELECT engram_terms_changed(new.user_id); END;
        """
    )


# -- the cache -----------------------------------------------------------------------------
class TermCache:
    """Per-user full-text indexes in memory (see the module docstring). Thread-safe."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._users: OrderedDict[str, TermIndex] = OrderedDict()
        self._loading: dict[str, list[int]] = {}
        self._scheduled: set[str] = set()
        self._lock = threading.Lock()
        self.loads = 0
        self.closing = False  # set when the store closes: a load in flight stops

    # -- writer thread --------------------------------------------------------------------
    def run_write(self, conn: Connection, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)`` (a write, committed or rolled back by itself); then what it did to the
        full-text index is applied here."""
        _journal.changes = _Changes()
        ok = False
        try:
            result = fn(conn)
            ok = True
            return result
        finally:
            self._commit(conn, ok)

    def _commit(self, conn: Connection, ok: bool) -> None:
        changes: _Changes | None = getattr(_journal, "changes", None)
        _journal.changes = None
        if changes is None or not (changes.added or changes.users):
            return
        if not ok:  # rolled back (or failed half way): drop whoever it touched
            changes.users.update(user for _, user in changes.added)
            changes.added = []
        for user in changes.users:
            self.drop(user)
        self.append(conn, changes.added)

    def append(self, conn: Connection, turns: Sequence[tuple[int, str]]) -> None:
        """Add (turn id, user) just indexed to the users held or loading (the writer after its
        commit; a reader for another process's, :mod:`proxy.store.changes`)."""
        with self._lock:
            wanted = set(self._users) | set(self._loading)
        added = [i for i, user in turns if user in wanted]
        if not added:
            return
        owner = dict(turns)
        by_user: dict[str, list[tuple[Any, ...]]] = {}
        for row in conn.execute(
            turns_of_ids_sql(conn) + " ORDER BY t.id",
            (json_list(added),),
        ):
            by_user.setdefault(owner[int(row[0])], []).append(tuple(row))
        for user, turns in by_user.items():
            with self._lock:
                if user in self._loading:
                    self._loading[user].extend(int(t[0]) for t in turns)
                    continue
                index = self._users.get(user)
            if index is not None:
                with index.lock:
                    index.add(turns)

    # -- readers --------------------------------------------------------------------------
    def search(
        self,
        conn: Connection,
        user_id: str,
        terms: Sequence[str] | None,
        limit: int,
        in_background: Callable[[Callable[[Connection], object]], None],
        expected_rows: int,
        weights: Sequence[float],
        *,
        session_ids: Sequence[str] | None,
        exclude_ids: Sequence[int],
        exclude_sessions: Sequence[str],
        exclude_roles: Sequence[str],
    ) -> list[tuple[int, float]] | None:
        """The user's rows ranked as ``bm25()`` ranks them for a query of ``terms`` (joined by
        OR); None when the user is not held or ``terms`` is None (a query this cache cannot
        answer). A user not held who would fit is loaded: now on ``conn`` when of up to
        ``LOAD_NOW_ROWS`` turns (``expected_rows``), else with ``in_background``."""
        with self._lock:
            index = self._users.get(user_id)
            if index is not None:
                self._users.move_to_end(user_id)
        if index is None:
            if not (self._fits(expected_rows) and self._wants_load(user_id)):
                return None
            if expected_rows > LOAD_NOW_ROWS:
                in_background(lambda c: self.load(c, user_id))
                return None
            self.load(conn, user_id)  # small: loaded now, so its ranking never changes
            with self._lock:
                index = self._users.get(user_id)
            if index is None:
                return None
        if terms is None:
            return None
        with index.lock:
            keep = in_scope(
                index, index.n, session_ids, exclude_ids, exclude_sessions, exclude_roles
            )
            return index.rank(terms, weights, keep, limit)

    def preload(
        self,
        user_id: str,
        rows: int,
        in_background: Callable[[Callable[[Connection], object]], None],
    ) -> None:
        """Load a user of ``rows`` turns with ``in_background`` if it fits and is not held."""
        if self._fits(rows) and self._wants_load(user_id):
            in_background(lambda c: self.load(c, user_id))

    def _fits(self, rows: int) -> bool:
        return self.max_bytes > 0 and rows * BYTES_PER_TURN <= self.max_bytes

    def _wants_load(self, user_id: str) -> bool:
        return claim_load(self._lock, self._users, self._scheduled, user_id)

    def load(self, conn: Connection, user_id: str) -> None:
        """Read and tokenize the user's indexed turns (a reader thread); turns indexed while it
        reads are added after."""
        with self._lock:
            self._loading[user_id] = []
        done, t0 = False, time.perf_counter()
        try:
            built = TermIndex()
            sql = turns_sql(conn) + " WHERE t.user_id = ? AND t.fts_pending = 0 ORDER BY t.id"
            built.add([tuple(r) for r in conn.execute(sql, (user_id,))], lambda: self.closing)
            while True:  # then what was indexed while it read, until nothing more came
                with self._lock:
                    pending = self._loading.get(user_id)
                    if pending is None:  # dropped meanwhile: thrown away
                        return
                    if not pending:
                        del self._loading[user_id]
                        self._users[user_id] = built
                        self.loads += 1
                        self._evict()
                        done = True
                        took = time.perf_counter() - t0
                        log.info("terms in memory: %d turns in %.1f s (%.1f MB)", built.n, took,
                                 built.nbytes / 1e6)  # fmt: skip
                        return
                    self._loading[user_id] = []
                more = conn.execute(
                    turns_of_ids_sql(conn) + " AND t.fts_pending = 0 ORDER BY t.id",
                    (json_list(pending),),
                )
                built.add([tuple(r) for r in more])
        except LoadStopped:
            return
        finally:
            with self._lock:
                self._scheduled.discard(user_id)
                if not done:
                    self._loading.pop(user_id, None)

    def held(self, user_id: str) -> bool:
        with self._lock:
            return user_id in self._users

    # -- both -----------------------------------------------------------------------------
    def drop(self, user_id: str) -> None:
        with self._lock:
            self._users.pop(user_id, None)
            self._loading.pop(user_id, None)  # the load in flight is thrown away

    def clear(self) -> None:
        with self._lock:
            self._users.clear()
            self._loading.clear()

    def _evict(self) -> None:
        total = sum(ix.nbytes for ix in self._users.values())
        while total > self.max_bytes and self._users:
            _, gone = self._users.popitem(last=False)
            total -= gone.nbytes
