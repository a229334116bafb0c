"""The search's SQL on PostgreSQL: full-text candidates from ``turns_fts.tsv``, the rows holding
a word (the common-word cut-off), and the exact cosine KNN over ``turn_vec``.

What SQLite's FTS5 and vec0 answer (:mod:`proxy.store.sqlite.search_sql`,
:mod:`proxy.store.caches.word_counts`),
where the users' in-memory caches do not (:mod:`proxy.store.caches.term_cache` ranks by the same
BM25 on
both backends; :mod:`proxy.store.caches.vec_cache` by the same cosine):

- full text: an FTS5 query of quoted words joined by ``OR`` (:func:`words_of`) becomes each word
  through ``plainto_tsquery('english', ?)`` (a parameter: no user text is parsed as tsquery
  syntax; a stop word adds nothing), the words joined by ``||``. The candidates are the rows whose
  ``tsv`` matches, ranked by ``ts_rank_cd`` with the columns' weights (body A, ctx B, date C),
  best first, ties by turn id; returned negated, so that lower is better as bm25's is. It has no
  IDF: a common word weighs as much as a rare one (the common-word cut-off drops the most common);
- word counts: the rows whose ``tsv`` matches the word's ``plainto_tsquery`` (a word of several
  lexemes: all of them);
- vectors: ``embedding <=> ?`` (pgvector's cosine distance, as sqlite-vec's) ordered, ties by turn
  id, every filter inside the one query. There is no bit-quantised copy: the quantised plan is
  the exact one here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from proxy.store.rows import json_list

_WORD = re.compile(r"[^\W_]+")
_TSQ = "plainto_tsquery('english', ?)"
_EMPTY_TSQ = "''::tsquery"


def words_of(match: str) -> list[str]:
    """The words of an FTS5 query made by :func:`proxy.search.fts_query.match_of` (quoted words
    joined by ``OR``); for any other text, its word tokens (letters and digits)."""
    words: list[str] = []
    for part in match.split(" OR "):
        inner = part[1:-1]
        if len(part) < 2 or part[0] != '"' or part[-1] != '"' or '"' in inner.replace('""', ""):
            return list(dict.fromkeys(_WORD.findall(match)))
        words.append(inner.replace('""', '"'))
    return list(dict.fromkeys(words))


def tsquery(words: Sequence[str]) -> tuple[str, list[str]]:
    """SQL of a tsquery matching any of ``words``, and its parameters (one per word)."""
    if not words:
        return _EMPTY_TSQ, []
    return " || ".join([_TSQ] * len(words)), list(words)


def rank_weights(weights: Sequence[float]) -> list[float]:
    """``ts_rank_cd``'s weights ``{D, C, B, A}`` for the columns' (body, ctx, date): scaled so
    the largest is 1 (it refuses weights above 1; the order is the same at any scale)."""
    body, ctx, date = (max(0.0, float(w)) for w in weights)
    top = max(body, ctx, date) or 1.0
    return [0.0, date / top, ctx / top, body / top]


def fts_search(
    conn: Any,
    match: str,
    limit: int,
    weights: Sequence[float],
    joins: str,
    where: str,
    scope_args: Sequence[Any],
    excluded: set[int],
) -> list[tuple[int, float]]:
    """(turn id, -ts_rank_cd) best first over the rows of turns ``t`` that ``joins`` and
    ``where`` (from :func:`proxy.store.sqlite.search_sql._fts_scope`) confine to the scope."""
    q, q_args = tsquery(words_of(match))
    sql = (
        "SELECT f.turn_id, -ts_rank_cd(?::float4[], f.tsv, q.q) AS score"
        f" FROM (SELECT {q} AS q) q CROSS JOIN turns_fts f JOIN turns t ON t.id = f.turn_id{joins}"
        " WHERE f.tsv @@ q.q" + where
    )
    args: list[Any] = [rank_weights(weights), *q_args, *scope_args]
    if excluded:
        sql += " AND f.turn_id NOT IN (SELECT value::bigint FROM json_array_elements_text(?::json))"
        args.append(json_list(excluded))
    sql += " ORDER BY score, f.turn_id LIMIT ?"
    args.append(limit)
    return [(int(r[0]), float(r[1])) for r in conn.execute(sql, args)]


def term_rows(conn: Any, words: Sequence[str], user_id: str | None = None) -> dict[str, int]:
    """How many rows of ``turns_fts`` (``user_id``'s, or everyone's) each word's query
    matches."""
    words = list(dict.fromkeys(words))
    if not words:
        return {}
    mine = " JOIN turns t ON t.id = f.turn_id AND t.user_id = ?" if user_id is not None else ""
    sql = (
        "SELECT w.value, CASE WHEN numnode(q.q) = 0 THEN 0 ELSE"
        f" (SELECT count(*) FROM turns_fts f{mine} WHERE f.tsv @@ q.q) END"
        " FROM json_array_elements_text(?::json) w"
        " CROSS JOIN LATERAL (SELECT plainto_tsquery('english', w.value) AS q) q"
    )
    args: list[Any] = [user_id] if user_id is not None else []
    rows = conn.execute(sql, [*args, json_list(words)])
    return {str(w): int(n) for w, n in rows}


def vec_search(
    conn: Any,
    user_id: str,
    query: bytes,
    limit: int,
    session_ids: Sequence[str] | None,
    excluded: set[int],
    exclude_sessions: Sequence[str],
    exclude_roles: Sequence[str],
) -> list[tuple[int, float]]:
    """(turn id, cosine distance) nearest first among the user's vectors in scope (``query``:
    float32 bytes, as :func:`proxy.vectors.to_blob` makes them)."""
    texts = "(SELECT value FROM json_array_elements_text(?::json))"
    joins = " JOIN turns t ON t.id = v.turn_id" if exclude_roles else ""
    where = " WHERE v.user_id = ?"
    args: list[Any] = [query, user_id]
    if session_ids is None:
        where += " AND v.indexed = 1"
    else:
        where += f" AND v.session_id IN {texts}"
        args.append(json_list(session_ids))
    if exclude_sessions:
        where += f" AND v.session_id NOT IN {texts}"
        args.append(json_list(exclude_sessions))
    if excluded:
        where += (
            " AND v.turn_id NOT IN (SELECT value::bigint FROM json_array_elements_text(?::json))"
        )
        args.append(json_list(excluded))
    if exclude_roles:
        where += f" AND t.role NOT IN {texts}"
        args.append(json_list(exclude_roles))
    rows = conn.execute(
        f"SELECT v.turn_id, v.embedding <=> ? AS distance FROM turn_vec v{joins}{where}"
        " ORDER BY distance, v.turn_id LIMIT ?",
        [*args, limit],
    )
    return [(int(r[0]), float(r[1])) for r in rows]
