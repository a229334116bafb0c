"""How many of a user's rows hold a word, for the common-word cut-off
(``retrieval.fts_common_share``): the whole index's count from FTS5's vocabulary
(:func:`term_rows`), a user's own counted in the background (:class:`UserWordCounts`), so that
another user's text never makes a word common for this one and no search waits for a count.
The word-presence oracle this closes is described in :mod:`proxy.store.sqlite.search_sql`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from proxy.store.dialect import is_pg
from proxy.store.postgres import search_sql
from proxy.store.rows import json_list
from proxy.store.sqlite.db import Connection, driver
from proxy.store.sqlite.migrations import FTS_TOKENIZE

log = logging.getLogger("engram.store")

_tokenizer = threading.local()


def _stems(words: Sequence[str]) -> list[list[str]]:
    """The terms FTS5's tokenizer makes of each word (porter stems), through a private
    in-memory FTS5 table of the same tokenizer on this thread."""
    tok = getattr(_tokenizer, "conn", None)
    if tok is None:
        tok = driver().module.connect(":memory:", isolation_level=None, check_same_thread=False)
        tok.execute(
            f"CREATE VIRTUAL TABLE tok USING fts5(x, content = '', tokenize = '{FTS_TOKENIZE}')"
        )
        tok.execute("CREATE VIRTUAL TABLE tok_terms USING fts5vocab(tok, instance)")
        _tokenizer.conn = tok
    tok.executemany("INSERT INTO tok(rowid, x) VALUES (?, ?)", list(enumerate(words, 1)))
    out: list[list[str]] = [[] for _ in words]
    for doc, term in tok.execute("SELECT doc, term FROM tok_terms"):
        out[int(doc) - 1].append(str(term))
    tok.execute("INSERT INTO tok(tok) VALUES ('delete-all')")
    return out


def term_rows(conn: Connection, words: Sequence[str]) -> dict[str, int]:
    """How many rows of ``turns_fts`` (all users) hold each word, as a query for it matches.

    A lookup in the ``turns_fts_terms`` vocabulary per term, far cheaper than the search. On
    PostgreSQL a count of the rows whose ``tsv`` the word's query matches (its GIN index).
    """
    if is_pg(conn):
        return search_sql.term_rows(conn, words)
    stems = _stems(words)
    wanted = sorted({t for ts in stems for t in ts})
    counts = {
        str(term): int(n)
        for term, n in conn.execute(
            "SELECT term, doc FROM turns_fts_terms WHERE term IN (SELECT value FROM json_each(?))",
            (json_list(wanted),),
        )
    }
    # A word of several terms is a phrase: it matches at most as often as its rarest term.
    return {
        w: min((counts.get(t, 0) for t in ts), default=0)
        for w, ts in zip(words, stems, strict=True)
    }


WORD_COUNT_TTL_S = 3600.0
"""How long a user's count of rows holding a word is trusted: it only decides whether the word
is common enough to leave out of that user's queries, and a user's common words change slowly."""
TERM_ROWS_TTL_S = 30.0
"""How long the index's count of rows holding a word (all users) is reused: it only bounds a
user's share; as long as the turn counts are (a deletion is seen within it)."""
WORD_COUNT_CACHE = 50_000
"""(user, word) counts kept at most (forgotten all at once past it)."""
WORD_COUNTS_PER_JOB = 16
"""Words one background job counts at most."""


class UserWordCounts:
    """How many of a user's FTS5 rows hold a word, for the common-word cut-off: known exactly
    when the whole index's count leaves no doubt, else counted in the user's rows in the
    background (:meth:`count`), so that another user's text never makes a word common for
    this one and the search never waits for a count.

    The index's vocabulary gives ``G``, the rows of every user holding the word, at once. The
    user's own count lies between ``G - others`` and ``min(G, mine)`` (``others``: the turns of
    every other user); when those agree (a database of one user, say) it is exact. Otherwise
    the word counts as not common until :meth:`count` has counted it (a join of every row
    holding it to ``turns``: 5-35 ms at 100k turns, hence not on the request path)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], tuple[float, int]] = {}
        self._rows: dict[str, tuple[float, int]] = {}  # word -> (when, rows of all users)
        self._lock = threading.Lock()
        self._queued: list[tuple[str, str]] = []
        self.running = False
        self.again: Callable[[], None] | None = None  # queue :meth:`run` once more

    def shares(
        self,
        conn: Connection | None,
        user_id: str,
        words: Sequence[str],
        mine: int,
        total: int,
        above: float,
    ) -> dict[str, float] | None:
        """Each word's share of the user's ``mine`` turns, as far as known without waiting: the
        exact share, or (not known yet) a share no more than the user's real one. A word that
        could pass ``above`` and is not known is queued for :meth:`count`. The index's count
        per word is reused for :data:`TERM_ROWS_TTL_S` (``conn`` None: None unless all are)."""
        now = time.monotonic()
        rows: dict[str, int] = {}
        for word in words:
            hit = self._rows.get(word)
            if hit is not None and now - hit[0] < TERM_ROWS_TTL_S:
                rows[word] = hit[1]
        missing = [w for w in words if w not in rows]
        if missing:
            if conn is None:
                return None
            if len(self._rows) >= WORD_COUNT_CACHE:
                self._rows.clear()
            for word, g in term_rows(conn, missing).items():
                rows[word] = g
                self._rows[word] = (now, g)
        others = max(0, total - mine)
        out: dict[str, float] = {}
        for word in words:
            g = rows.get(word, 0)
            low, high = max(0, g - others), min(g, mine)
            if low == high or high <= above * mine:
                out[word] = low / mine  # exact, or too rare to pass the bar in any case
                continue
            known = self._known.get((user_id, word))
            if known is not None and now - known[0] < WORD_COUNT_TTL_S:
                out[word] = known[1] / mine
                continue
            out[word] = min(low / mine, above)  # not common until counted
            with self._lock:
                if (user_id, word) not in self._queued:
                    self._queued.append((user_id, word))
        return out

    def remembered(
        self, user_id: str, words: Sequence[str], mine: int | None, total: int | None, above: float
    ) -> dict[str, float] | None:
        """:meth:`shares` from memory alone (no read before the search can start): None unless
        both turn counts and every word's count in the index are remembered."""
        if not mine or total is None:
            return None
        return self.shares(None, user_id, words, mine, total, above)

    def pending(self) -> bool:
        return bool(self._queued) and not self.running

    def run(self, conn: Connection) -> None:
        """The background job (on a reader thread, ``running`` set by whoever started it).
        Words queued while it counted are not left waiting for the next search: it queues
        itself again (:attr:`again`) for them, behind whatever else waits for that thread."""
        more = False
        try:
            self.count(conn)
        except Exception:
            log.exception("counting a user's common words failed")
        finally:
            with self._lock:  # as a search queues its words: it sees running, or we see them
                more = bool(self._queued) and self.again is not None
                self.running = more
        if more and self.again is not None:
            self.again()

    def count(self, conn: Connection) -> int:
        """Count up to ``WORD_COUNTS_PER_JOB`` queued words in their users' rows; returns how
        many."""
        with self._lock:
            batch, self._queued = (
                self._queued[:WORD_COUNTS_PER_JOB],
                self._queued[WORD_COUNTS_PER_JOB:],
            )
        for user_id, word in batch:
            n = user_term_rows(conn, user_id, word)
            if len(self._known) >= WORD_COUNT_CACHE:
                self._known.clear()
            self._known[(user_id, word)] = (time.monotonic(), n)
        return len(batch)


def user_term_rows(conn: Connection, user_id: str, word: str) -> int:
    """How many of the user's rows of ``turns_fts`` hold ``word`` (as a query for it matches)."""
    if is_pg(conn):
        return search_sql.term_rows(conn, [word], user_id).get(word, 0)
    phrase = '"' + word.replace('"', '""') + '"'
    (n,) = conn.execute(
        "SELECT count(*) FROM turns_fts JOIN turns t ON t.id = turns_fts.rowid"
        " WHERE turns_fts MATCH ? AND t.user_id = ?",
        (phrase, user_id),
    ).fetchone()
    return int(n)
