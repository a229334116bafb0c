"""The turns' search index beyond their rows: vectors in ``turn_vec``, deferred full-text rows.

- Vectors: :func:`insert_vector` (used by :func:`proxy.store.queries.insert_turns`),
  :func:`set_vectors` for turns archived without one (:func:`turns_without_vectors`), and point
  lookups for MMR (:func:`turn_vectors`).
- Full text: a turn archived with ``fts_pending`` gets its ``turns_fts`` row (and its
  neighbours' ``ctx`` rewrite) from :func:`index_deferred`, run by
  :class:`proxy.background.indexer.Indexer` on what :func:`pending_index_ids` lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from proxy.store.caches import vec_cache
from proxy.store.dialect import ids_in, is_pg
from proxy.store.models import Turn
from proxy.store.rows import TURN_COLS, json_list, turn_of
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.fts_sql import fts_reindex_sql
from proxy.store.vectable import stamp_model_id
from proxy.vectors import Vector, as_vector, to_blob


def check_vector(vec: Vector, dim: int | None) -> Vector:
    """``vec`` as 1-D float32, or a ValueError when it has not ``dim`` dimensions (the table's,
    :func:`proxy.store.vectable.table_dim`; None: left to sqlite-vec, which refuses another
    length too)."""
    vec = as_vector(vec)
    if dim is not None and vec.shape != (dim,):
        raise ValueError(
            f"vectors must have {dim} dimensions (those of turn_vec's model), got {vec.shape[0]}"
        )
    return vec


def insert_vector(
    conn: Connection, turn_id: int, user_id: str, session_id: str, indexed: bool, vec: Vector
) -> None:
    """Add a turn's vector (and its bit-quantised copy) to ``turn_vec``. The caller records
    its model (``turns.embed_model``, :func:`proxy.store.vectable.stamp_model_id`)."""
    blob = to_blob(check_vector(vec, None))
    if is_pg(conn):  # no bit-quantised copy (exact search in the database)
        conn.execute(
            "INSERT INTO turn_vec(turn_id, user_id, embedding, session_id, indexed)"
            " VALUES (?, ?, ?, ?, ?)",
            (turn_id, user_id, blob, session_id, int(indexed)),
        )
    else:
        conn.execute(
            "INSERT INTO turn_vec(turn_id, user_id, embedding, embedding_bits, session_id,"
            " indexed) VALUES (?, ?, ?, vec_quantize_binary(?), ?, ?)",
            (turn_id, user_id, blob, blob, session_id, int(indexed)),
        )
    conn.execute(  # for the other processes on this database (proxy.store.changes)
        "INSERT INTO changes(user_id, turn_id, kind) VALUES (?, ?, 'vector')", (user_id, turn_id)
    )
    vec_cache.inserted(turn_id, user_id, session_id, indexed, vec)


def index_deferred(conn: Connection, ids: Sequence[int]) -> int:
    """Give turns archived with ``fts_pending`` their full-text rows, oldest first, re-indexing
    their neighbours as the insert trigger does; ids no longer pending (or gone) are skipped.
    Returns how many were indexed."""
    pending = [
        r[0]
        for r in conn.execute(
            f"SELECT id FROM turns WHERE id IN {ids_in(conn)} AND fts_pending = 1 ORDER BY id",
            (json_list(ids),),
        )
    ]
    delete, insert = fts_reindex_sql()
    for turn_id in pending:
        conn.execute("UPDATE turns SET fts_pending = 0 WHERE id = ?", (turn_id,))
        if is_pg(conn):  # the schema's function does both statements
            conn.execute("SELECT engram_fts_reindex(?)", (turn_id,))
            continue
        conn.execute(delete, {"id": turn_id})
        conn.execute(insert, {"id": turn_id})
    return len(pending)


def pending_index_ids(conn: Connection, limit: int) -> list[int]:
    """Turns still waiting for their full-text row, oldest first."""
    rows = conn.execute("SELECT id FROM turns WHERE fts_pending = 1 ORDER BY id LIMIT ?", (limit,))
    return [r[0] for r in rows]


def set_vectors(conn: Connection, items: Sequence[tuple[int, Vector, str]]) -> int:
    """Store (turn id, vector, embed hash) for existing turns, replacing any vector they had;
    each records the table's model.

    Returns how many turns got one (ids that no longer exist are skipped).
    """
    done = 0
    model = stamp_model_id(conn)
    for turn_id, vec, embed_hash in items:
        row = conn.execute(
            "SELECT t.user_id, t.session_id, s.indexed FROM turns t"
            " JOIN sessions s ON s.id = t.session_id WHERE t.id = ?",
            (turn_id,),
        ).fetchone()
        if row is None:
            continue
        conn.execute("DELETE FROM turn_vec WHERE turn_id = ?", (turn_id,))
        insert_vector(conn, turn_id, row[0], row[1], bool(row[2]), vec)
        conn.execute(
            "UPDATE turns SET embed_hash = ?, embed_model = ? WHERE id = ?",
            (embed_hash, model, turn_id),
        )
        done += 1
    return done


def turns_without_vectors(
    conn: Connection, user_id: str | None, limit: int, after_id: int = 0
) -> list[Turn]:
    """Turns with text but no vector yet, oldest first, from ids above ``after_id``: archived
    turns waiting for the indexer (or stored while the embedder was down)."""
    sql = (
        f"SELECT {TURN_COLS} FROM turns WHERE embed_hash IS NULL AND trim(content) != '' AND id > ?"
    )
    args: list[Any] = [after_id]
    if user_id is not None:
        sql += " AND user_id = ?"
        args.append(user_id)
    sql += " ORDER BY id LIMIT ?"
    args.append(limit)
    return [turn_of(r) for r in conn.execute(sql, args)]


def turn_vectors(
    conn: Connection, ids: Sequence[int], user_id: str | None = None
) -> dict[int, Vector]:
    """Stored vectors of some turns (point lookups in ``turn_vec``); with ``user_id``, of that
    user's turns only."""
    out: dict[int, Vector] = {}
    for turn_id in ids:
        row = conn.execute(
            "SELECT embedding, user_id FROM turn_vec WHERE turn_id = ?", (turn_id,)
        ).fetchone()
        if row is not None and (user_id is None or row[1] == user_id):
            out[turn_id] = np.frombuffer(row[0], dtype=np.float32)
    return out
