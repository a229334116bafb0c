"""One user's full-text index in memory: postings, lengths and neighbours, and BM25 over them.

The data structure behind :mod:`proxy.store.caches.term_cache` (read its docstring for what is
ranked and
why). A turn's row is ``body`` + ``ctx`` + ``date`` (:mod:`proxy.store.sqlite.fts_sql`), and
``ctx`` is
the first ``CTX_CHARS`` characters of the bodies of its ``CTX_TURNS`` neighbours on each side.
So each turn is tokenized once, by FTS5's own tokenizer in a private in-memory table (the same
terms by construction), into its body's terms, its cut body's and its date's; a row's ``ctx`` is
derived at query time from the neighbour table (a term of turn x's cut body is in the ``ctx`` of
each of x's neighbours: being neighbours is symmetric). A new turn appends its postings and
rewires at most ``2 * CTX_TURNS`` neighbours; no row is rewritten. The tokenizer is
``FTS_TOKENIZE``, the one every database's ``turns_fts`` was made with (changing it takes a
migration that rebuilds ``turns_fts``: see :mod:`proxy.store.sqlite.migrations`).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from proxy.store.caches.scope import Codes
from proxy.store.dialect import ids_in, is_pg
from proxy.store.postgres.schema import _body as pg_body
from proxy.store.postgres.schema import _date as pg_date
from proxy.store.sqlite.db import Connection, driver
from proxy.store.sqlite.fts_sql import CTX_CHARS, CTX_TURNS, body_sql, date_sql
from proxy.store.sqlite.migrations import FTS_TOKENIZE

K1 = 1.2
B = 0.75
LOAD_CHUNK = 10_000
"""Turns tokenized per statement while a user is loaded."""
_SIDE = CTX_TURNS
_WIDTH = 2 * CTX_TURNS

F64 = npt.NDArray[np.float64]

TURNS_SQL = (
    f"SELECT t.id, t.session_id, t.position, t.role, s.indexed, {body_sql('t')}, {date_sql('t')}"
    " FROM turns t JOIN sessions s ON s.id = t.session_id"
)
"""The columns :meth:`TermIndex.add` takes, for a ``WHERE`` to follow."""
PG_TURNS_SQL = (
    f"SELECT t.id, t.session_id, t.position, t.role, s.indexed, {pg_body('t')}, {pg_date('t')}"
    " FROM turns t JOIN sessions s ON s.id = t.session_id"
)
"""The same on PostgreSQL: the body and date words as its ``turns_fts`` triggers write them."""


def turns_sql(conn: Connection) -> str:
    """:data:`TURNS_SQL` for ``conn``'s backend."""
    return PG_TURNS_SQL if is_pg(conn) else TURNS_SQL


def turns_of_ids_sql(conn: Connection) -> str:
    """:func:`turns_sql` of the turns whose ids one JSON-array parameter holds, by id; ``AND``
    may follow."""
    if is_pg(conn):
        return PG_TURNS_SQL + f" WHERE t.id IN {ids_in(conn)}"
    return TURNS_SQL + ", (SELECT value FROM json_each(?)) a WHERE t.id = a.value"


class LoadStopped(Exception):
    """A load was asked to stop (the store is closing)."""


def terms_of(match: str) -> list[str] | None:
    """The terms of a query made by :func:`proxy.search.fts_query.match_of` (quoted words joined
    by ``OR``), as the tokenizer makes them; None for any other expression, or a word the
    tokenizer splits in several terms (FTS5 reads it as a phrase)."""
    words: list[str] = []
    for part in match.split(" OR "):
        inner = part[1:-1]
        if len(part) < 2 or part[0] != '"' or part[-1] != '"' or '"' in inner.replace('""', ""):
            return None
        words.append(inner.replace('""', '"'))
    missing = [w for w in dict.fromkeys(words) if w not in _WORD_TERMS]
    if missing:
        if len(_WORD_TERMS) + len(missing) > _WORD_MEMO:
            _WORD_TERMS.clear()
        _WORD_TERMS.update(zip(missing, map(tuple, _stems(missing)), strict=True))
    terms: list[str] = []
    for word in words:
        stems = _WORD_TERMS.get(word)
        if stems is None:  # cleared by another thread meanwhile
            stems = tuple(_stems([word])[0])
        if len(stems) > 1:
            return None
        terms.extend(stems)
    return terms


_WORD_MEMO = 8192
_WORD_TERMS: dict[str, tuple[str, ...]] = {}
"""Query words' terms, so a search seldom asks the tokenizer (0.15 ms a query); at most
``_WORD_MEMO`` words, forgotten all at once when full."""


_tok = threading.local()


_GROUPED = (
    "SELECT col, term, group_concat(doc), group_concat(n) FROM ("
    "SELECT col, term, doc, count(*) AS n FROM tok_terms GROUP BY col, term, doc"
    ") GROUP BY col, term"
)

Grouped = dict[str, dict[str, tuple[npt.NDArray[np.int64], F64]]]


def _tokens(texts: Sequence[tuple[int, str, str]]) -> Grouped:
    """``{column: {term: (rows ascending, counts)}}`` for each ``(row, body, date)``; columns
    ``body``, ``cut`` (the body's first ``CTX_CHARS`` characters, only for a longer body) and
    ``date``. FTS5's own tokenizer (``FTS_TOKENIZE``) in a private in-memory table."""
    tok = getattr(_tok, "conn", None)
    if tok is None:
        tok = driver().module.connect(":memory:", isolation_level=None, check_same_thread=False)
        tok.execute(
            "CREATE VIRTUAL TABLE tok USING fts5(body, cut, date, content = '',"
            f" tokenize = '{FTS_TOKENIZE}')"
        )
        tok.execute("CREATE VIRTUAL TABLE tok_terms USING fts5vocab(tok, instance)")
        _tok.conn = tok
    tok.executemany(
        "INSERT INTO tok(rowid, body, cut, date) VALUES (?, ?, ?, ?)",
        [(r, b, b[:CTX_CHARS] if len(b) > CTX_CHARS else None, d) for r, b, d in texts],
    )
    out: Grouped = {"body": {}, "cut": {}, "date": {}}
    try:
        for col, term, docs, counts in tok.execute(_GROUPED):
            rows = np.array(str(docs).split(","), np.int64)
            n = np.array(str(counts).split(","), np.float64)
            if rows.size > 1 and bool(np.any(rows[1:] < rows[:-1])):
                order = np.argsort(rows)
                rows, n = rows[order], n[order]
            out[str(col)][str(term)] = (rows, n)
    finally:
        tok.execute("INSERT INTO tok(tok) VALUES ('delete-all')")
    return out


class _Postings:
    """One term's rows (ascending) with its count in the body and in the cut body."""

    __slots__ = ("body", "cut", "n", "rows")

    def __init__(self) -> None:
        self.rows = np.zeros(0, np.int32)
        self.body = np.zeros(0, np.float32)
        self.cut = np.zeros(0, np.float32)
        self.n = 0

    def extend(self, rows: npt.NDArray[np.int64], body: F64, cut: F64) -> None:
        need = self.n + len(rows)
        if need > len(self.rows):
            cap = max(4, need + need // 4)
            for name in ("rows", "body", "cut"):
                old = getattr(self, name)
                new = np.zeros(cap, old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        self.rows[self.n : need] = rows
        self.body[self.n : need] = body
        self.cut[self.n : need] = cut
        self.n = need

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.body.nbytes + self.cut.nbytes) + 120


class TermIndex:
    """One user's rows: per-row arrays (capacity >= n), postings, the sessions' order."""

    def __init__(self) -> None:
        self.n = 0
        self.ids = np.zeros(0, np.int64)
        self.session = np.zeros(0, np.int32)
        self.indexed = np.zeros(0, np.bool_)
        self.role = np.zeros(0, np.int32)
        self.blen = np.zeros(0, np.float64)  # tokens of the body
        self.clen = np.zeros(0, np.float64)  # of the cut body (what neighbours' ctx holds)
        self.dlen = np.zeros(0, np.float64)  # of the date
        self.size = np.zeros(0, np.float64)  # D: the whole row's
        self.nb = np.zeros((0, _WIDTH), np.int32)  # neighbour rows, -1 for none
        self.total = 0.0  # sum of D
        self.sessions = Codes()
        self.roles = Codes()
        self.held: dict[int, int] = {}
        self.terms: dict[str, _Postings] = {}
        self.dates: dict[str, _Postings] = {}
        self.order: dict[int, list[tuple[int, int]]] = {}  # session -> (position, row)
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        per_row = sum(a.nbytes for a in (self.ids, self.session, self.indexed, self.role))
        per_row += sum(a.nbytes for a in (self.blen, self.clen, self.dlen, self.size, self.nb))
        postings = sum(p.nbytes for p in self.terms.values())
        return int(per_row + postings + sum(p.nbytes for p in self.dates.values()))

    def _grow(self, need: int) -> None:
        if need <= len(self.ids):
            return
        cap = max(1024, need + need // 8)
        for name in ("ids", "session", "indexed", "role", "blen", "clen", "dlen", "size", "nb"):
            old = getattr(self, name)
            new = np.full((cap, *old.shape[1:]), -1 if name == "nb" else 0, old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def add(
        self, turns: Sequence[tuple[Any, ...]], stop: Callable[[], bool] = lambda: False
    ) -> None:
        """Append turns (id, session, position, role, indexed, body, date) not held yet.
        ``stop`` is asked between chunks of ``LOAD_CHUNK`` turns: True raises
        :class:`LoadStopped` (the index is then half built: throw it away)."""
        turns = list({int(t[0]): t for t in turns if int(t[0]) not in self.held}.values())
        if not turns:
            return
        first = self.n
        self._grow(first + len(turns))
        rows = range(first, first + len(turns))
        for row, (turn_id, session_id, _, role, indexed, _, _) in zip(rows, turns, strict=True):
            self.ids[row] = int(turn_id)
            self.session[row] = self.sessions.code(str(session_id))
            self.indexed[row] = bool(indexed)
            self.role[row] = self.roles.code(str(role))
            self.held[int(turn_id)] = row
        for start in range(0, len(turns), LOAD_CHUNK):
            if stop():
                raise LoadStopped
            part = rows[start : start + LOAD_CHUNK]
            texts = [
                (row, str(t[5]), str(t[6])) for row, t in zip(part, turns[start:], strict=False)
            ]
            self._postings(_tokens(texts), part)
        self.n = first + len(turns)
        touched: set[int] = set(rows)
        for row, (_, _, position, role, _, _, _) in zip(rows, turns, strict=True):
            if role != "system" and int(position) >= 0:
                touched.update(self._place(row, int(position)))
        for row in touched:
            self._resize(row)

    def _postings(self, grouped: Grouped, rows: range) -> None:
        """Fold the :func:`_tokens` of new ``rows`` into the postings and lengths."""
        body, cut, date = grouped["body"], grouped["cut"], grouped["date"]
        for column, lengths in ((body, self.blen), (cut, self.clen), (date, self.dlen)):
            if column:
                at = np.concatenate([r for r, _ in column.values()])
                np.add.at(lengths, at, np.concatenate([n for _, n in column.values()]))
        long = np.zeros(len(self.ids), np.bool_)
        for r, _ in cut.values():
            long[r] = True
        short = np.array([r for r in rows if not long[r]], np.int64)
        self.clen[short] = self.blen[short]
        for term, (at, n) in body.items():
            c = np.where(long[at], 0.0, n)
            extra = cut.get(term)
            if extra is not None:  # a long body's cut holds it: its own count there
                merged = np.union1d(at, extra[0])
                b2, c2 = np.zeros(merged.size), np.zeros(merged.size)
                b2[np.searchsorted(merged, at)] = n
                c2[np.searchsorted(merged, at)] = c
                c2[np.searchsorted(merged, extra[0])] = extra[1]
                at, n, c = merged, b2, c2
            self.terms.setdefault(term, _Postings()).extend(at, n, c)
        for term, (at, n) in cut.items():
            if term not in body:  # a word cut in two at CTX_CHARS
                self.terms.setdefault(term, _Postings()).extend(at, np.zeros(at.size), n)
        for term, (at, n) in date.items():
            self.dates.setdefault(term, _Postings()).extend(at, n, np.zeros(at.size))

    def _place(self, row: int, position: int) -> list[int]:
        """Put a turn in its session's order; the rows whose neighbours changed."""
        order = self.order.setdefault(int(self.session[row]), [])
        i = bisect.bisect_left(order, (position, row))
        order.insert(i, (position, row))
        lo, hi = max(0, i - _SIDE), min(len(order), i + _SIDE + 1)
        for j in range(lo, hi):
            window = [order[x][1] for x in range(max(0, j - _SIDE), min(len(order), j + _SIDE + 1))]
            at = window.pop(j - max(0, j - _SIDE))
            self.nb[at] = -1
            self.nb[at, : len(window)] = window
        return [order[j][1] for j in range(lo, hi)]

    def _resize(self, row: int) -> None:
        near = self.nb[row]
        size = self.blen[row] + self.dlen[row] + float(self.clen[near[near >= 0]].sum())
        self.total += size - self.size[row]
        self.size[row] = size

    # -- ranking ----------------------------------------------------------------------------
    def rank(
        self,
        terms: Sequence[str],
        weights: Sequence[float],
        keep: npt.NDArray[np.bool_],
        limit: int,
    ) -> list[tuple[int, float]]:
        """(turn id, bm25) best first among the rows ``keep`` allows (see the module)."""
        n = self.n
        if n == 0 or limit <= 0:
            return []
        wb, wc, wd = (float(w) for w in weights)
        norm = K1 * (1.0 - B + B * self.size[:n] / (self.total / n))
        score = np.zeros(n, np.float64)
        matched = np.zeros(n, np.bool_)
        for term in dict.fromkeys(terms):
            f, hit = self._freq(term, n, wb, wc, wd)
            hits = int(np.count_nonzero(hit))
            if hits == 0:
                continue
            idf = math.log((n - hits + 0.5) / (hits + 0.5))
            at = np.flatnonzero(hit)
            score[at] += (idf if idf > 0 else 1e-6) * f[at] * (K1 + 1) / (f[at] + norm[at])
            matched |= hit
        live = np.flatnonzero(matched & keep[:n])
        if live.size == 0:
            return []
        if live.size > limit:
            cut = np.partition(-score[live], limit - 1)[limit - 1]
            live = live[-score[live] <= cut]
        order = np.lexsort((self.ids[live], -score[live]))[:limit]
        return [(int(self.ids[live[i]]), -float(score[live[i]])) for i in order]

    def _freq(
        self, term: str, n: int, wb: float, wc: float, wd: float
    ) -> tuple[F64, npt.NDArray[np.bool_]]:
        """The term's weighted count in each row (body, neighbours' cut bodies, date) and
        which rows hold it at all."""
        f = np.zeros(n, np.float64)
        hit = np.zeros(n, np.bool_)
        p = self.terms.get(term)
        if p is not None and p.n:
            rows, body, cut = p.rows[: p.n], p.body[: p.n], p.cut[: p.n]
            f[rows] += wb * body
            hit[rows[body > 0]] = True
            around = self.nb[rows]  # (k, width): the rows whose ctx holds each row's cut body
            counts = np.repeat(cut, _WIDTH)
            flat = around.ravel()
            ok = (flat >= 0) & (counts > 0)
            if ok.any():
                f += wc * np.bincount(flat[ok], weights=counts[ok], minlength=n)[:n]
                hit[flat[ok]] = True
        d = self.dates.get(term)
        if d is not None and d.n:
            f[d.rows[: d.n]] += wd * d.body[: d.n]
            hit[d.rows[: d.n]] = True
        return f, hit


def _stems(words: Sequence[str]) -> list[list[str]]:
    """The terms the tokenizer makes of each word."""
    found: list[list[str]] = [[] for _ in words]
    for term, (rows, _) in _tokens([(i, w, "") for i, w in enumerate(words)])["body"].items():
        for row in rows:
            found[int(row)].append(term)
    return found
