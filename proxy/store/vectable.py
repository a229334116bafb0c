"""Which model made the vectors, the dimension of ``turn_vec``, and re-embedding (SQL).

- ``embed_models`` lists every embedding model the database has known (name, dimension); the
  ``meta`` row ``embedding_model`` names the model of ``turn_vec`` (the *table's model*), and
  ``turns.embed_model`` records, with ``turns.embed_hash``, the model of each turn's vector
  (meaningful only where ``embed_hash`` is set: a turn without one has no vector). Both are
  written in the same statement wherever a vector is (:func:`stamp_model_id`), so every vector
  carries its model.
- The dimension of ``turn_vec`` follows its model: :func:`table_dim` reads it from the table's
  schema (``Store`` does once at open); :func:`claim_model` records the first model of a database
  and rebuilds an empty ``turn_vec`` for that model's dimension.
- ``engram reindex`` (:mod:`proxy.cli.reindex`) re-embeds with another model in a *build
  table*, ``turn_vec_build`` (turn id, text hash, float32 blob; a plain table, resumable: a
  turn is done once its row exists), named by the ``meta`` row ``reindex_model``; the live
  ``turn_vec`` keeps serving its own model until :func:`finish_build` swaps in one transaction:
  ``turn_vec`` is recreated with the new dimension and filled from the build table, the turns'
  ``embed_hash``/``embed_model`` rewritten, the build table dropped and ``meta`` names the new
  model. With the table's own model, missing vectors are filled in place
  (:func:`fill_ids`, :func:`proxy.store.indexing.set_vectors`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.store.caches import vec_cache
from proxy.store.dialect import ids_in, is_pg, texts_in
from proxy.store.rows import json_list
from proxy.store.sqlite.db import Connection
from proxy.vectors import Vector, from_blob, to_blob

MODEL_KEY = "embedding_model"
"""``meta`` key: the model of ``turn_vec``."""
BUILD_KEY = "reindex_model"
"""``meta`` key: the model ``turn_vec_build`` is being filled with (a reindex under way)."""
BUILD_TABLE = "turn_vec_build"

_DIM_RE = re.compile(r"\bembedding\s+float\s*\[\s*(\d+)\s*\]", re.IGNORECASE)
# Turns that should have a vector: every turn with some text.
_HAS_TEXT = "trim(t.content) != ''"


def vec_table_sql(dim: int, name: str = "turn_vec") -> str:
    """``CREATE VIRTUAL TABLE`` of ``turn_vec`` with ``dim`` dimensions (the layout of migration 1,
    see :mod:`proxy.store.sqlite.migrations`)."""
    if dim < 1:
        raise ValueError("a vector table needs at least one dimension")
    return (
        f"CREATE VIRTUAL TABLE {name} USING vec0("
        " turn_id INTEGER PRIMARY KEY,"
        " user_id TEXT PARTITION KEY,"
        f" embedding FLOAT[{dim}] DISTANCE_METRIC=cosine,"
        f" embedding_bits BIT[{dim}],"
        " session_id TEXT,"
        " indexed INTEGER)"
    )


def pg_vec_table_sql(dim: int, name: str = "turn_vec") -> list[str]:
    """``turn_vec`` on PostgreSQL: a plain table of pgvector values, exact search per user."""
    if dim < 1:
        raise ValueError("a vector table needs at least one dimension")
    return [
        f"CREATE TABLE {name} (turn_id bigint PRIMARY KEY REFERENCES turns(id)"
        ' ON DELETE CASCADE, user_id text COLLATE "C" NOT NULL, session_id text COLLATE "C",'
        f" indexed bigint, embedding vector({dim}) NOT NULL)",
        f"CREATE INDEX {name}_user ON {name}(user_id)",
    ]


def table_dim(conn: Connection) -> int:
    """The dimension of ``turn_vec``, read from its schema."""
    if is_pg(conn):
        found = conn.execute(
            "SELECT atttypmod FROM pg_attribute"
            " WHERE attrelid = to_regclass('turn_vec') AND attname = 'embedding'"
        ).fetchone()
        if found is None or int(found[0]) < 1:
            raise RuntimeError("the database has no turn_vec table of vectors")
        return int(found[0])
    row = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'turn_vec'").fetchone()
    match = _DIM_RE.search(str(row[0])) if row is not None else None
    if match is None:
        raise RuntimeError("the database has no turn_vec table of float vectors")
    return int(match.group(1))


def _meta(conn: Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return str(row[0]) if row is not None else None


def _set_meta(conn: Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?)"
        " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def model_id(conn: Connection, name: str, dim: int) -> int:
    """The ``embed_models`` id of ``name`` (added if new; its dimension kept up to date)."""
    conn.execute(
        "INSERT INTO embed_models(name, dim) VALUES (?, ?)"
        " ON CONFLICT(name) DO UPDATE SET dim = excluded.dim",
        (name, dim),
    )
    (found,) = conn.execute("SELECT id FROM embed_models WHERE name = ?", (name,)).fetchone()
    return int(found)


def stamp_model_id(conn: Connection) -> int | None:
    """The id of the table's model, to record with a vector written now (None while the
    database has recorded no model yet: :func:`claim_model` stamps those vectors later)."""
    row = conn.execute(
        "SELECT e.id FROM meta m JOIN embed_models e ON e.name = m.value WHERE m.key = ?",
        (MODEL_KEY,),
    ).fetchone()
    return int(row[0]) if row is not None else None


def vector_count(conn: Connection) -> int:
    """Rows of ``turn_vec`` (on SQLite its rowid shadow table: no scan of the vectors)."""
    table = "turn_vec" if is_pg(conn) else "turn_vec_rowids"
    return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def _recreate(conn: Connection, dim: int) -> None:
    conn.execute("DROP TABLE turn_vec")
    for sql in pg_vec_table_sql(dim) if is_pg(conn) else [vec_table_sql(dim)]:
        conn.execute(sql)
    # every process's vectors go (proxy.store.changes; this one's: vec_cache's journal)
    conn.execute("INSERT INTO changes(user_id, turn_id, kind) VALUES (NULL, NULL, 'changed')")
    vec_cache.changed(None)


def claim_model(conn: Connection, name: str, dim: int | None) -> bool:
    """Make ``name`` the table's model where that loses nothing; False when ``turn_vec`` holds
    vectors of another model (or of another dimension): they need ``engram reindex``.

    A database with no model recorded, or with no vector at all, takes ``name`` (``turn_vec``
    rebuilt empty if ``dim`` differs); vectors written before any model was recorded are
    stamped with it (they were the table's, whatever wrote them). ``dim=None``: the table's.
    """
    current = _meta(conn, MODEL_KEY)
    have = table_dim(conn)
    want = have if dim is None else dim
    if current == name and want == have:
        return True
    vectors = vector_count(conn)
    if vectors and (current is not None or want != have):
        return False
    if want != have:
        _recreate(conn, want)
    new_id = model_id(conn, name, want)
    _set_meta(conn, MODEL_KEY, name)
    if vectors:
        conn.execute(
            "UPDATE turns SET embed_model = ? WHERE embed_hash IS NOT NULL AND embed_model IS NULL",
            (new_id,),
        )
    return True


@dataclass(frozen=True, slots=True)
class VectorState:
    """What ``engram doctor``, ``serve``'s start-up check and ``engram reindex`` need to know."""

    model: str | None
    """The table's model (None: none recorded yet)."""
    dim: int
    """The dimension of ``turn_vec``."""
    vectors: int
    """Rows of ``turn_vec``."""
    turns: int
    """Turns with text (each should have a vector)."""
    build_model: str | None
    """A reindex towards this model was started and has not finished."""
    built: int
    """Turns already re-embedded for it."""


def vector_state(conn: Connection) -> VectorState:
    build = _meta(conn, BUILD_KEY) if _has_build(conn) else None
    built = 0
    if build is not None:
        built = int(
            conn.execute(
                f"SELECT count(*) FROM {BUILD_TABLE} b JOIN turns t ON t.id = b.turn_id"
            ).fetchone()[0]
        )
    (turns,) = conn.execute(f"SELECT count(*) FROM turns t WHERE {_HAS_TEXT}").fetchone()
    return VectorState(
        model=_meta(conn, MODEL_KEY),
        dim=table_dim(conn),
        vectors=vector_count(conn),
        turns=int(turns),
        build_model=build,
        built=built,
    )


# --- re-embedding --------------------------------------------------------------------------------


def _has_build(conn: Connection) -> bool:
    if is_pg(conn):
        found = conn.execute("SELECT to_regclass(?) IS NOT NULL", (BUILD_TABLE,)).fetchone()
        return bool(found and found[0])
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (BUILD_TABLE,)
    ).fetchone()
    return row is not None


def drop_build(conn: Connection) -> None:
    """Forget an unfinished reindex (its build table)."""
    conn.execute(f"DROP TABLE IF EXISTS {BUILD_TABLE}")
    conn.execute("DELETE FROM meta WHERE key = ?", (BUILD_KEY,))


def start_build(conn: Connection, name: str, dim: int) -> bool:
    """Make sure the build table exists for ``name``; False when it had to be started again
    (it was missing, or for another model), True when an earlier run's work is kept."""
    model_id(conn, name, dim)
    if _has_build(conn) and _meta(conn, BUILD_KEY) == name:
        return True
    drop_build(conn)
    pg = is_pg(conn)
    conn.execute(
        f"CREATE TABLE {BUILD_TABLE} ("
        f" turn_id {'bigint' if pg else 'INTEGER'} PRIMARY KEY,"  # turns.id (no FK: a
        " embed_hash TEXT NOT NULL,"  # forgotten turn is skipped at swap); text_hash embedded
        f" embedding {'vector' if pg else 'BLOB'} NOT NULL)"  # SQLite: little-endian float32
    )
    conn.execute(f"CREATE INDEX {BUILD_TABLE}_hash ON {BUILD_TABLE}(embed_hash)")
    _set_meta(conn, BUILD_KEY, name)
    return False


def _by_length(conn: Connection, where: str, args: Sequence[object]) -> list[int]:
    # Shortest first: texts of similar length share a batch, so the model pads them less.
    rows = conn.execute(
        f"SELECT t.id FROM turns t WHERE {_HAS_TEXT} AND {where} ORDER BY length(t.content), t.id",
        list(args),
    )
    return [int(r[0]) for r in rows]


def build_ids(conn: Connection) -> list[int]:
    """Turns with text not in the build table yet, shortest first."""
    return _by_length(
        conn, f"NOT EXISTS (SELECT 1 FROM {BUILD_TABLE} b WHERE b.turn_id = t.id)", ()
    )


def fill_ids(conn: Connection) -> list[int]:
    """Turns with text whose vector is missing or not of the table's model, shortest first."""
    current = stamp_model_id(conn)
    return _by_length(
        conn, "(t.embed_hash IS NULL OR t.embed_model IS DISTINCT FROM ?)", (current,)
    )


def turn_texts(conn: Connection, ids: Sequence[int]) -> list[tuple[int, str, str | None, str]]:
    """(id, role, speaker, content) of the turns of ``ids`` that still exist, in that order."""
    rows = conn.execute(
        f"SELECT id, role, speaker, content FROM turns WHERE id IN {ids_in(conn)}",
        (json_list(ids),),
    ).fetchall()
    found = {int(r[0]): (int(r[0]), str(r[1]), r[2], str(r[3])) for r in rows}
    return [found[i] for i in ids if i in found]


def known_vectors(conn: Connection, hashes: Sequence[str], *, build: bool) -> dict[str, Vector]:
    """Vectors already computed for texts of these hashes with the model being written (the
    build table's, or ``build=False``: the table's model in ``turn_vec``), by hash."""
    wanted = json_list(sorted(set(hashes)))
    out: dict[str, Vector] = {}
    if build:
        one = "DISTINCT ON (embed_hash) " if is_pg(conn) else ""  # any one per text
        group = "" if is_pg(conn) else " GROUP BY embed_hash"
        rows = conn.execute(
            f"SELECT {one}embed_hash, embedding FROM {BUILD_TABLE}"
            f" WHERE embed_hash IN {texts_in(conn)}{group}",
            (wanted,),
        )
        return {str(h): from_blob(blob) for h, blob in rows}
    current = stamp_model_id(conn)
    pairs = conn.execute(
        f"SELECT embed_hash, min(id) FROM turns WHERE embed_hash IN {texts_in(conn)}"
        " AND embed_model IS NOT DISTINCT FROM ? GROUP BY embed_hash",
        (wanted, current),
    ).fetchall()
    for h, turn_id in pairs:
        row = conn.execute(
            "SELECT embedding FROM turn_vec WHERE turn_id = ?", (turn_id,)
        ).fetchone()
        if row is not None:
            out[str(h)] = from_blob(row[0])
    return out


def add_built(conn: Connection, items: Sequence[tuple[int, Vector, str]], dim: int) -> int:
    """Store (turn id, vector, text hash) in the build table; returns how many were stored."""
    rows = []
    for turn_id, vec, embed_hash in items:
        if vec.shape != (dim,):
            raise ValueError(f"vectors must have {dim} dimensions, got {vec.shape[0]}")
        rows.append((turn_id, embed_hash, to_blob(vec)))
    conn.executemany(
        f"INSERT INTO {BUILD_TABLE}(turn_id, embed_hash, embedding) VALUES (?, ?, ?)"
        " ON CONFLICT(turn_id) DO UPDATE SET embed_hash = excluded.embed_hash,"
        " embedding = excluded.embedding",
        rows,
    )
    return len(rows)


def finish_build(conn: Connection) -> bool:
    """Swap the build table in as ``turn_vec`` (inside the caller's transaction); False, with
    nothing changed, while some turn with text is still missing from it (new since)."""
    name = _meta(conn, BUILD_KEY)
    if name is None or not _has_build(conn):
        raise RuntimeError("no reindex under way")
    if build_ids(conn):
        return False
    (dim,) = conn.execute("SELECT dim FROM embed_models WHERE name = ?", (name,)).fetchone()
    new_id = model_id(conn, name, int(dim))
    _recreate(conn, int(dim))
    bits = "" if is_pg(conn) else " embedding_bits,"
    quantized = "" if is_pg(conn) else " vec_quantize_binary(b.embedding),"
    conn.execute(
        f"INSERT INTO turn_vec(turn_id, user_id, embedding,{bits} session_id, indexed)"
        f" SELECT t.id, t.user_id, b.embedding,{quantized} t.session_id,"
        f" s.indexed FROM {BUILD_TABLE} b JOIN turns t ON t.id = b.turn_id"
        " JOIN sessions s ON s.id = t.session_id ORDER BY t.user_id, t.id"
    )
    conn.execute(
        "UPDATE turns SET embed_hash = NULL, embed_model = NULL WHERE embed_hash IS NOT NULL"
        f" AND id NOT IN (SELECT turn_id FROM {BUILD_TABLE})"
    )
    conn.execute(
        "UPDATE turns SET embed_hash = b.embed_hash, embed_model = ?"
        f" FROM {BUILD_TABLE} b WHERE turns.id = b.turn_id",
        (new_id,),
    )
    drop_build(conn)
    _set_meta(conn, MODEL_KEY, name)
    return True
