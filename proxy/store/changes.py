"""What other processes changed, applied to this process's search caches: the ``changes`` log.

Several processes may share one database: ``engram import`` beside ``engram serve``, the
processes of ``engram serve --workers N``. Each holds users' terms and vectors in memory
(:mod:`proxy.store.caches.term_cache`, :mod:`proxy.store.caches.vec_cache`) and applies its *own*
writes to
them from its writer thread, after each commit. What another process writes reaches them
through ``changes`` (migration 15): in the transaction of every change those caches care
about, a trigger (or :func:`proxy.store.indexing.insert_vector`) logs a row of ids, never text:

- ``indexed``: a turn entered the full-text index: appended to the user's terms, if held;
- ``vector``: a turn's vector was stored: appended to the user's vectors, if held (a vector
  that differs from the one held for that turn drops the user: it was replaced);
- ``changed``: anything else that alters a user's rows (a turn's text, place or time updated,
  a session's ``indexed`` flipped; ``user_id`` NULL: ``turn_vec`` rebuilt, every user): the user
  is dropped from both caches and loaded again by a later search;
- ``deleted``: a turn deleted (forgotten), with its session: dropped alike, and
  :attr:`Follower.on_deleted` is told, so that the server's other in-memory views of it (the
  inspector's recent requests and last prompts) go as they do for a forget in this process.

:meth:`Follower.catch_up` runs on a reader thread before each search (and every second,
:meth:`proxy.store.store.Store.follow`): it reads the rows past
the last it saw (one indexed range read; usually none or a few) and applies the foreign ones,
so a turn another process indexed is searchable here at the next search, without a reload.
This process's own rows are skipped: a temporary trigger on the writer connection notes each
one's sequence number (:meth:`Follower.mine`) before its transaction commits, so no reader can
see one unmarked. A rolled-back write's numbers are unmarked again (:meth:`Follower.rolled_back`):
SQLite hands them out again to the next writer.

Sequence numbers are handed out under SQLite's single write lock and never reused once
committed (``AUTOINCREMENT``), so the committed rows are contiguous: a first row past
``last + 1`` means rows were pruned (the log keeps the newest
:data:`~proxy.store.sqlite.migrations_later.CHANGES_KEEP`) before this process read them; then, or
when more than :data:`BATCH` rows wait, both caches are cleared (users load again on demand).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

from proxy.store.caches.term_cache import TermCache
from proxy.store.caches.vec_cache import VectorCache
from proxy.store.sqlite.db import Connection

BATCH = 4096
"""Rows applied in one catch-up; a process further behind clears its caches instead."""

_SQL = (
    "SELECT seq, user_id, turn_id, kind, session_id FROM changes WHERE seq > ? ORDER BY seq LIMIT ?"
)


class Follower:
    """Applies other processes' changes to ``terms`` and ``vectors``. Thread-safe."""

    def __init__(self, terms: TermCache, vectors: VectorCache) -> None:
        self.terms = terms
        self.vectors = vectors
        self._lock = threading.Lock()  # one catch-up at a time
        self._mine_lock = threading.Lock()
        self._last = 0  # the highest sequence number applied (or skipped)
        self._lo: list[int] = []  # this process's rows: ranges lo..hi, ascending
        self._hi: list[int] = []
        self._write_from: int | None = None  # the first row of the write under way (writer)
        self.applied = 0  # foreign rows applied
        self.cleared = 0  # times the caches were cleared (pruned past, or too far behind)
        # Told (on a reader thread) the turns other processes deleted, None: perhaps any: what
        # the server holds of them beside these caches (views of recent requests) goes too.
        self.on_deleted: Callable[[Deleted | None], None] = lambda _: None

    # -- writer thread --------------------------------------------------------------------
    def install(self, conn: Connection) -> None:
        """Start from the log's end and mark this connection's rows (the writer's, at open)."""
        self._last = int(conn.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0])
        conn.create_function("engram_change_mine", 1, self.mine)
        conn.execute(
            "CREATE TEMP TRIGGER IF NOT EXISTS engram_changes_mine AFTER INSERT ON main.changes"
            " BEGIN SELECT engram_change_mine(new.seq); END"
        )

    def mine(self, seq: int) -> None:
        """This process logged row ``seq`` (the writer, inside the transaction)."""
        seq = int(seq)
        with self._mine_lock:
            if self._write_from is None:
                self._write_from = seq
            if self._hi and self._hi[-1] == seq - 1:
                self._hi[-1] = seq
            else:
                self._lo.append(seq)
                self._hi.append(seq)

    def write_ended(self, ok: bool) -> None:
        """The write under way committed (``ok``) or failed: a failed one's rows are unmarked
        (rolled back, their numbers go to the next writer)."""
        with self._mine_lock:
            first, self._write_from = self._write_from, None
            if ok or first is None:
                return
            while self._lo and self._lo[-1] >= first:
                self._lo.pop()
                self._hi.pop()
            if self._hi and self._hi[-1] >= first:
                self._hi[-1] = first - 1

    def _is_mine(self, seq: int) -> bool:
        i = bisect.bisect_right(self._lo, seq) - 1
        return i >= 0 and seq <= self._hi[i]

    def _forget_mine(self, upto: int) -> None:
        """Drop the marks of rows up to ``upto`` (read past: never asked about again)."""
        cut = bisect.bisect_right(self._hi, upto)
        del self._lo[:cut], self._hi[:cut]

    # -- readers --------------------------------------------------------------------------
    def catch_up(self, conn: Connection) -> int:
        """Apply the rows other processes committed since the last call; returns how many."""
        with self._lock:
            rows: list[Row] = conn.execute(_SQL, (self._last, BATCH + 1)).fetchall()
            if not rows:
                return 0
            if len(rows) > BATCH or int(rows[0][0]) != self._last + 1:
                self._clear(conn, pruned=int(rows[0][0]) != self._last + 1)
                return 0
            with self._mine_lock:
                foreign = [r for r in rows if not self._is_mine(int(r[0]))]
                self._last = int(rows[-1][0])
                self._forget_mine(self._last)
            if foreign:
                self._apply(conn, foreign)
            self.applied += len(foreign)
            return len(foreign)

    def _clear(self, conn: Connection, pruned: bool) -> None:
        """Pruned past, or too far behind: start again from the end with nothing held. The
        turns deleted meanwhile are still told (all of them, when the log no longer has them)."""
        self.terms.clear()
        self.vectors.clear()
        self.cleared += 1
        top = int(conn.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0])
        if pruned:
            self.on_deleted(None)
        else:
            gone = conn.execute(
                "SELECT seq, user_id, turn_id, kind, session_id FROM changes"
                " WHERE seq > ? AND seq <= ? AND kind = 'deleted'",
                (self._last, top),
            ).fetchall()
            if gone:
                self.on_deleted(_deleted(gone))
        with self._mine_lock:
            self._last = max(self._last, top)
            self._forget_mine(self._last)

    def _apply(self, conn: Connection, rows: Sequence[Row]) -> None:
        dropped: set[str] = set()
        for _, user, _, kind, _ in rows:
            if kind in ("changed", "deleted"):
                if user is None:  # turn_vec rebuilt: every user's vectors
                    self.terms.clear()
                    self.vectors.clear()
                    dropped.clear()
                    break
                dropped.add(user)
        else:
            for user in dropped:
                self.terms.drop(user)
                self.vectors.drop(user)
            indexed: list[tuple[int, str]] = []
            vectors: list[tuple[int, str]] = []
            for _, user, turn, kind, _ in rows:
                if user is not None and turn is not None and user not in dropped:
                    if kind == "indexed":
                        indexed.append((int(turn), user))
                    elif kind == "vector":
                        vectors.append((int(turn), user))
            if indexed:
                self.terms.append(conn, indexed)
            if vectors:
                self.vectors.append_stored(conn, vectors)
        if any(r[3] == "deleted" for r in rows):
            self.on_deleted(_deleted(rows))


Row = tuple[int, str | None, int | None, str, str | None]  # seq, user, turn, kind, session
Deleted = dict[str, tuple[set[str], set[int]]]
"""user -> (sessions, turns) of the turns another process deleted."""


def _deleted(rows: Sequence[Row]) -> Deleted:
    out: Deleted = {}
    for _, user, turn, kind, session in rows:
        if kind == "deleted" and user is not None:
            sessions, turns = out.setdefault(user, (set(), set()))
            if session is not None:
                sessions.add(session)
            if turn is not None:
                turns.add(int(turn))
    return out
