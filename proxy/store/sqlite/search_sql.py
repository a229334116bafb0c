"""Search within one user namespace: FTS5 BM25 and sqlite-vec KNN (synchronous SQL); on
PostgreSQL ``turns_fts.tsv`` ranked by ``ts_rank_cd`` and pgvector's exact cosine, in
:mod:`proxy.store.postgres.search_sql` (same scopes and filters, same result shape; no probe, no bit
vectors: ``quantized`` is the exact plan there, and no statistics span users).

Both return ``(turn id, score)`` best first and are confined to ``user_id``. With
``session_ids=None`` they cover the user's sessions whose ``indexed`` flag is set; with a list,
exactly those sessions. Turns of ``exclude_sessions`` and ``exclude_ids`` never come back, and
take no candidate places: the filters run inside the queries (for the vector KNN up to
``VEC_EXCLUDE_IN_KNN`` sessions inside vec0's KNN, more by asking it for that many more rows).

FTS5 ranks by ``bm25(turns_fts, *FTS_WEIGHTS)`` over the columns ``body`` (the turn), ``ctx``
(its neighbours in the session) and ``date`` (see :mod:`proxy.store.sqlite.migrations`).

Statistics across users (FTS5 itself: it answers until a user's terms are loaded into memory,
:mod:`proxy.store.caches.term_cache`, which computes the same BM25 with the user's own statistics;
and
always with ``fts_memory=0``). The candidates are always the user's own rows, but FTS5 computes
BM25's statistics over the whole table: the row count ``N``, each term's row count ``n(q)`` (its
IDF, ``log((N - n + 0.5) / (n + 0.5))``) and each column's average length. So another user's
text can reorder this user's matches, and what that reveals is bounded to those aggregates:
never a row, a user, a phrase or a co-occurrence, only (through the order of one's own rows; raw
BM25 scores are never shown) how many rows of all the other users together hold a given word
stem, which a user who writes crafted turns and searches them can narrow down with about
``log2(N)`` searches per word: a word-presence oracle over everyone else's memory combined on a
shared server (secrets are redacted before they are indexed), open only while FTS5 answers.
The common-word cut-off weighs each word by the user's own rows
(:class:`proxy.store.caches.word_counts.UserWordCounts`).

Vector search has two plans over the same ``turn_vec`` partition:

- exact: vec0 KNN on the float32 ``embedding`` (cosine); cost grows with the partition
  (measured p50 3.5 ms at 10k vectors, 33 ms at 100k, 2-core machine);
- quantised: vec0 KNN on the sign bits ``embedding_bits`` (Hamming) for
  ``max(QUANTIZED_MIN_K, QUANTIZED_OVERSAMPLE * wanted)`` candidates, re-scored by exact cosine.
  vec0's KNN cost grows with k (about 0.1 ms per unit of k at 100k), so the oversampling is
  small: with 50 wanted from 100k MiniLM vectors of LoCoMo text, k=100 took 12 ms (k=500: 61 ms,
  more than the exact plan's 38) for recall@10 0.92 / recall@50 0.73 against exact, and the
  hybrid top 6 kept 98% of the exact plan's (bench/retrieval.py). Sign bits suit roughly
  centred embeddings such as MiniLM's; vectors that share a strong common direction lose much
  more recall (a probe measured it; BENCHMARKS.md, "Probes that answered their question").

:class:`~proxy.store.store.Store` picks the plan. ``auto``: the exact plan in memory
(:mod:`proxy.store.caches.vec_cache`) whenever the user's vectors are held there, however many (at
100k vectors a numpy product over them beats the quantised KNN, and its results are exact);
while they are not (being loaded, or too many to hold), vec0's quantised plan above
``QUANTIZED_ABOVE`` turns and its exact plan below.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np

from proxy.store.dialect import is_pg, texts_in
from proxy.store.indexing import check_vector
from proxy.store.postgres import search_sql
from proxy.store.rows import json_list
from proxy.store.sqlite.db import Connection
from proxy.vectors import Vector, as_vector, to_blob

VecMode = Literal["auto", "exact", "quantized"]

QUANTIZED_ABOVE = 20_000
"""In ``auto`` mode, users with more turns than this whose vectors are not held in memory
(:mod:`proxy.store.caches.vec_cache`) are searched through the bit vectors."""
QUANTIZED_OVERSAMPLE = 2
QUANTIZED_MIN_K = 100
"""The bit-vector KNN fetches ``QUANTIZED_OVERSAMPLE`` candidates per result wanted, and at
least ``QUANTIZED_MIN_K``, to re-score by exact cosine."""
VEC_MAX_K = 4096  # sqlite-vec's limit on k
VEC_EXCLUDE_IN_KNN = 8
"""Excluded sessions filtered inside vec0's KNN (``session_id != ?`` each); sqlite-vec 0.1.9
plans a KNN with at most 16 constraints."""
VEC_ROLE_GROWTH = 4
"""With roles to leave out, a KNN that found too few others asks for this many times more."""

FTS_PROBE_FACTOR = 4
FTS_PROBE_MIN = 200
""":func:`fts_search` first checks the scope of the best ``max(FTS_PROBE_MIN,
FTS_PROBE_FACTOR * limit)`` rows of the whole index."""
FTS_PROBE_USER_SHARE = 0.5
""":class:`~proxy.store.store.Store` skips that first step for users holding less than this
share of all turns: their rows would seldom be among the index's best."""

FTS_WEIGHTS: tuple[float, float, float] = (1.0, 0.3, 1.0)
"""bm25 weights of ``turns_fts``'s columns ``body``, ``ctx``, ``date``. Measured on LoCoMo
(bench/locomo.py): a neighbour's words count for less than the turn's own."""


def fts_search(
    conn: Connection,
    user_id: str,
    match: str,
    limit: int,
    *,
    session_ids: Sequence[str] | None,
    exclude_ids: Iterable[int],
    exclude_sessions: Sequence[str] = (),
    weights: Sequence[float] = FTS_WEIGHTS,
    probe_first: bool = True,
    exclude_roles: Sequence[str] = (),
) -> list[tuple[int, float]]:
    """(turn id, bm25) best first; bm25 is FTS5's (lower is better, usually negative).

    ``match`` must be a safe FTS5 expression (see :mod:`proxy.search.fts_query`). With
    ``session_ids=None`` the user's indexed sessions are searched, else exactly those sessions;
    turns of ``exclude_sessions``, and turns whose role is in ``exclude_roles``, are left out
    either way. ``weights``: one per column.

    Plan: FTS5 scores every matching row of the whole index (all users) either way; joining
    each of them to ``turns`` and ``sessions`` for the scope costs as much again. So the best
    ``FTS_PROBE_FACTOR * limit`` rows of the index are taken first and only those are checked
    against the scope; when that leaves fewer than ``limit`` (another user's rows, excluded
    sessions), the search runs again with the scope joined to every match. ``probe_first=False``
    goes straight to that (for a user holding a small part of the index).
    """
    if limit <= 0:
        return []
    if len(weights) != len(FTS_WEIGHTS):
        raise ValueError(f"weights needs {len(FTS_WEIGHTS)} values (body, ctx, date)")
    w = [float(x) for x in weights]
    excluded = set(exclude_ids)
    joins, where, scope_args = _fts_scope(
        conn, user_id, session_ids, exclude_sessions, exclude_roles
    )
    if is_pg(conn):  # turns_fts.tsv, ranked by ts_rank_cd (proxy.store.postgres.search_sql)
        return search_sql.fts_search(conn, match, limit, w, joins, where, scope_args, excluded)
    if probe_first:
        probe = max(FTS_PROBE_MIN, FTS_PROBE_FACTOR * (limit + len(excluded)))
        best = conn.execute(
            "SELECT rowid, bm25(turns_fts, ?, ?, ?) AS score FROM turns_fts"
            " WHERE turns_fts MATCH ? ORDER BY score, rowid LIMIT ?",
            [*w, match, probe],
        ).fetchall()
        in_scope = {
            int(r[0])
            for r in conn.execute(
                f"SELECT t.id FROM turns t{joins} WHERE t.id IN (SELECT value FROM json_each(?))"
                + where,
                [json_list(r[0] for r in best), *scope_args],
            )
        }
        hits = [(int(r[0]), float(r[1])) for r in best if r[0] in in_scope and r[0] not in excluded]
        if len(hits) >= limit or len(best) < probe:  # enough, or every match was seen
            return hits[:limit]
    sql = (
        "SELECT turns_fts.rowid, bm25(turns_fts, ?, ?, ?) AS score"
        f" FROM turns_fts JOIN turns t ON t.id = turns_fts.rowid{joins}"
        " WHERE turns_fts MATCH ?" + where
    )
    args: list[Any] = [*w, match, *scope_args]
    if excluded:
        sql += " AND turns_fts.rowid NOT IN (SELECT value FROM json_each(?))"
        args.append(json_list(excluded))
    sql += " ORDER BY score, turns_fts.rowid LIMIT ?"
    args.append(limit)
    return [(int(r[0]), float(r[1])) for r in conn.execute(sql, args)]


def _fts_scope(
    conn: Connection,
    user_id: str,
    session_ids: Sequence[str] | None,
    exclude_sessions: Sequence[str],
    exclude_roles: Sequence[str] = (),
) -> tuple[str, str, list[Any]]:
    """Joins, WHERE conditions (each starting with " AND") and arguments that confine turns
    ``t`` to the search scope."""
    joins = ""
    where = " AND t.user_id = ?"
    args: list[Any] = [user_id]
    if session_ids is None:
        joins = " JOIN sessions s ON s.id = t.session_id"
        where += " AND s.indexed = 1"
    else:
        where += f" AND t.session_id IN {texts_in(conn)}"
        args.append(json_list(session_ids))
    if exclude_sessions:
        where += f" AND t.session_id NOT IN {texts_in(conn)}"
        args.append(json_list(exclude_sessions))
    if exclude_roles:
        where += f" AND t.role NOT IN {texts_in(conn)}"
        args.append(json_list(exclude_roles))
    return joins, where, args


def vec_search(
    conn: Connection,
    user_id: str,
    vec: Vector,
    limit: int,
    *,
    session_ids: Sequence[str] | None,
    exclude_ids: Iterable[int],
    quantized: bool,
    exclude_sessions: Sequence[str] = (),
    exclude_roles: Sequence[str] = (),
    dim: int | None = None,
) -> list[tuple[int, float]]:
    """(turn id, cosine distance) nearest first, within one user's partition. ``dim``: the
    table's dimension (a query of another length is a ValueError).

    ``quantized``: rank by Hamming distance of the sign bits, then re-score
    ``QUANTIZED_OVERSAMPLE`` times as many candidates by exact cosine distance. Turns of
    ``exclude_sessions`` are left out. Turns whose role is in ``exclude_roles`` are left out
    too; ``turn_vec`` holds no role, so the KNN asks for ``VEC_ROLE_GROWTH`` times more rows
    until ``limit`` others are found (or no more rows are).
    """
    if limit <= 0:
        return []
    query = to_blob(check_vector(vec, dim))
    excluded = set(exclude_ids)
    skip_sessions = list(dict.fromkeys(exclude_sessions))
    if is_pg(conn):  # exact, every filter in the query; no bit vectors (quantized: exact)
        return search_sql.vec_search(
            conn, user_id, query, limit, session_ids, excluded, skip_sessions, exclude_roles
        )
    in_knn, after_knn = skip_sessions[:VEC_EXCLUDE_IN_KNN], skip_sessions[VEC_EXCLUDE_IN_KNN:]
    want = limit + len(excluded)
    if after_knn:  # filtered after the KNN: ask for as many more rows as they could take
        want += conn.execute(
            "SELECT count(*) FROM turns WHERE session_id IN (SELECT value FROM json_each(?))",
            (json_list(after_knn),),
        ).fetchone()[0]
    want = min(VEC_MAX_K, want)
    where = " AND user_id = ?"
    extra: list[Any] = [user_id]
    if session_ids is None:
        where += " AND indexed = 1"
    else:
        where += " AND session_id IN (SELECT value FROM json_each(?))"
        extra.append(json_list(session_ids))
    for session_id in in_knn:
        where += " AND session_id != ?"
        extra.append(session_id)
    if after_knn:
        where += " AND session_id NOT IN (SELECT value FROM json_each(?))"
        extra.append(json_list(after_knn))

    def knn(want: int) -> tuple[list[tuple[int, float]], bool]:
        """The nearest rows, and whether the partition may hold more."""
        if not quantized:
            rows = conn.execute(
                "SELECT turn_id, distance FROM turn_vec WHERE embedding MATCH ? AND k = ?"
                + where
                + " ORDER BY distance",
                [query, want, *extra],
            ).fetchall()
            # ties by turn id, as the in-memory plan (store.vec_cache) orders them
            found = sorted(((int(r[0]), float(r[1])) for r in rows), key=lambda r: (r[1], r[0]))
            return found, len(rows) >= want
        k = min(VEC_MAX_K, max(QUANTIZED_MIN_K, want * QUANTIZED_OVERSAMPLE))
        candidates = [
            r[0]
            for r in conn.execute(
                "SELECT turn_id FROM turn_vec"
                " WHERE embedding_bits MATCH vec_quantize_binary(?) AND k = ?" + where,
                [query, k, *extra],
            )
        ]
        return _rescore(conn, vec, candidates), len(candidates) >= k

    while True:
        found, more = knn(want)
        hits = [hit for hit in found if hit[0] not in excluded]
        if exclude_roles:
            allowed = _without_roles(conn, [h[0] for h in hits], exclude_roles)
            hits = [hit for hit in hits if hit[0] in allowed]
        if len(hits) >= limit or not more or not exclude_roles or want >= VEC_MAX_K:
            return hits[:limit]
        want = min(VEC_MAX_K, want * VEC_ROLE_GROWTH)


def _without_roles(conn: Connection, turn_ids: Sequence[int], roles: Sequence[str]) -> set[int]:
    """Those of ``turn_ids`` whose role is not in ``roles``."""
    rows = conn.execute(
        "SELECT id FROM turns WHERE id IN (SELECT value FROM json_each(?))"
        " AND role NOT IN (SELECT value FROM json_each(?))",
        (json_list(turn_ids), json_list(roles)),
    )
    return {int(r[0]) for r in rows}


def _rescore(conn: Connection, vec: Vector, turn_ids: Sequence[int]) -> list[tuple[int, float]]:
    if not turn_ids:
        return []
    blobs = [
        conn.execute("SELECT embedding FROM turn_vec WHERE turn_id = ?", (i,)).fetchone()[0]
        for i in turn_ids
    ]
    matrix = np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(turn_ids), -1)
    q = as_vector(vec)
    norms = np.linalg.norm(matrix, axis=1) * max(float(np.linalg.norm(q)), 1e-12)
    norms[norms == 0.0] = 1e-12
    distances = 1.0 - (matrix @ q) / norms
    order = np.argsort(distances, kind="stable")
    return [(int(turn_ids[i]), float(distances[i])) for i in order]
