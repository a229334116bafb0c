"""The schema, as numbered migrations recorded in ``schema_migrations``.

:func:`migrate` applies every migration newer than the database, each in its own
``BEGIN IMMEDIATE`` transaction, and records ``(version, applied_at)``. A migration, once
released, never changes: a schema change is a new function appended to :data:`MIGRATIONS`.

Conventions the schema fixes (migration 1):

- Times (``created_at``, ``last_seen``, ``turns.timestamp``, ``applied_at``) are REAL Unix
  seconds (UTC), so they sort, subtract and compare without parsing.
- ``turns`` is the archive: one row per message, ``UNIQUE(session_id, position)``. JSON columns
  (``tool_calls``) hold JSON text.
- ``turns_fts`` is an external-content FTS5 index over ``turns(content, speaker)``, kept in sync
  by the ``turns_ai`` / ``turns_au`` / ``turns_ad`` triggers. Its tokenizer is
  :data:`FTS_TOKENIZE`. Changing the constant changes only databases created afterwards; an
  existing database needs a new migration that recreates ``turns_fts`` and runs
  ``INSERT INTO turns_fts(turns_fts) VALUES('rebuild')``.
- ``turn_vec`` is a sqlite-vec ``vec0`` table keyed by ``turn_id`` (= ``turns.id``), partitioned
  by ``user_id`` so a KNN scans one namespace's vectors only, with ``session_id`` and
  ``indexed`` metadata columns for filtering inside the KNN. ``embedding_bits`` is the sign-bit
  quantisation of ``embedding`` (``vec_quantize_binary``, 48 bytes): large namespaces are searched
  by Hamming distance first and the candidates re-scored by exact cosine. ``turns_ad`` deletes a
  turn's vector with it (a virtual table cannot be the child of a foreign key).
  ``turn_vec.indexed`` copies ``sessions.indexed``; no trigger can keep it in step (sqlite-vec
  0.1.9 refuses an UPDATE that is not a point lookup by ``turn_id``), so the store updates both.
- ``turns.embed_hash`` is the hash of the exact text a turn's vector was computed from; a new
  turn whose text was embedded before reuses that vector instead of embedding it again.
- ``meta`` holds key/value facts about the database (e.g. the embedding model of ``turn_vec``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.store.db import Connection, driver

FTS_TOKENIZE = "porter unicode61 remove_diacritics 2"
"""FTS5 tokenizer of ``turns_fts`` in new databases."""

EMBED_DIM = 384
"""Vector length of ``turn_vec.embedding``."""


def _execute_script(conn: Connection, script: str) -> None:
    """Run ``script`` statement by statement inside the caller's transaction.

    ``executescript`` would COMMIT the open transaction first, breaking one-migration-one-
    transaction; trigger bodies hold semicolons, so split on complete statements.
    """
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if driver().module.complete_statement(pending):
            conn.execute(pending)
            pending = ""
    leftover = [ln for ln in pending.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    if leftover:
        raise ValueError(f"incomplete SQL statement in migration: {pending.strip()[:80]!r}")


def _m001_initial(conn: Connection) -> None:
    _execute_script(
        conn,
        f"""
        CREATE TABLE meta (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );

        CREATE TABLE users (
            id         TEXT PRIMARY KEY,         -- the user namespace
            created_at REAL NOT NULL
        );

        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            user_id     TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            parent_id   TEXT REFERENCES sessions(id) ON DELETE CASCADE,
            level       INTEGER NOT NULL DEFAULT 0 CHECK (level >= 0),
            agent       TEXT,
            created_at  REAL NOT NULL,
            last_seen   REAL NOT NULL,
            fingerprint TEXT,
            -- 1: the session's turns are found by searches over all of the user's memory;
            -- 0: only by searches naming the session (e.g. a sub-agent's raw history).
            indexed     INTEGER NOT NULL DEFAULT 1 CHECK (indexed IN (0, 1))
        );
        CREATE INDEX sessions_user ON sessions(user_id, last_seen);
        CREATE INDEX sessions_parent ON sessions(parent_id);
        CREATE INDEX sessions_fingerprint ON sessions(user_id, fingerprint);

        CREATE TABLE turns (
            id           INTEGER PRIMARY KEY,
            session_id   TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            user_id      TEXT NOT NULL REFERENCES users(id) ON DELETE CASCADE,
            position     INTEGER NOT NULL CHECK (position >= 0),
            role         TEXT NOT NULL,
            speaker      TEXT,                   -- the message's "name", or a display name
            content      TEXT NOT NULL DEFAULT '',
            tool_calls   TEXT,                   -- JSON array, as the message carried it
            tool_call_id TEXT,
            timestamp    REAL NOT NULL,          -- Unix seconds
            token_count  INTEGER,
            content_hash TEXT NOT NULL,          -- identity of the message (see store.models)
            embed_hash   TEXT,                   -- hash of the text its vector came from
            incomplete   INTEGER NOT NULL DEFAULT 0 CHECK (incomplete IN (0, 1)),
            UNIQUE (session_id, position)
        );
        CREATE INDEX turns_user ON turns(user_id, id);
        CREATE INDEX turns_user_hash ON turns(user_id, content_hash);
        CREATE INDEX turns_embed_hash ON turns(embed_hash) WHERE embed_hash IS NOT NULL;

        CREATE VIRTUAL TABLE turns_fts USING fts5(
            content, speaker,
            content = 'turns', content_rowid = 'id',
            tokenize = '{FTS_TOKENIZE}'
        );

        CREATE VIRTUAL TABLE turn_vec USING vec0(
            turn_id   INTEGER PRIMARY KEY,
            user_id   TEXT PARTITION KEY,
            embedding FLOAT[{EMBED_DIM}] DISTANCE_METRIC=cosine,
            embedding_bits BIT[{EMBED_DIM}],
            session_id TEXT,
            indexed   INTEGER
        );

        CREATE TRIGGER turns_ai AFTER INSERT ON turns BEGIN
            INSERT INTO turns_fts(rowid, content, speaker)
            VALUES (new.id, new.content, new.speaker);
        END;

        CREATE TRIGGER turns_au AFTER UPDATE OF content, speaker ON turns BEGIN
            INSERT INTO turns_fts(turns_fts, rowid, content, speaker)
            VALUES ('delete', old.id, old.content, old.speaker);
            INSERT INTO turns_fts(rowid, content, speaker)
            VALUES (new.id, new.content, new.speaker);
        END;

        CREATE TRIGGER turns_ad AFTER DELETE ON turns BEGIN
            INSERT INTO turns_fts(turns_fts, rowid, content, speaker)
            VALUES ('delete', old.id, old.content, old.speaker);
            DELETE FROM turn_vec WHERE turn_id = old.id;
        END;
        """,
    )


Migration = Callable[[Connection], None]

MIGRATIONS: tuple[tuple[int, Migration], ...] = ((1, _m001_initial),)
"""(version, function), ascending. Append only."""


def _ensure_table(conn: Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
    )


def applied_versions(conn: Connection) -> list[int]:
    """Versions recorded in ``schema_migrations``, ascending (empty for a blank database)."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    ).fetchone()
    if exists is None:
        return []
    return [row[0] for row in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]


def latest_version() -> int:
    return MIGRATIONS[-1][0]


def migrate(conn: Connection) -> list[int]:
    """Apply pending migrations, one transaction each; returns the versions applied.

    ``conn`` must be in autocommit mode (as :func:`proxy.store.db.connect` opens it).
    A database newer than this code raises ``RuntimeError`` rather than being touched.
    """
    _ensure_table(conn)
    done = set(applied_versions(conn))
    if done and max(done) > latest_version():
        raise RuntimeError(
            f"database schema version {max(done)} is newer than this Engram "
            f"(knows up to {latest_version()}); upgrade Engram"
        )
    applied: list[int] = []
    for version, fn in MIGRATIONS:
        if version in done:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated while we waited for the write lock.
            if conn.execute(
                "SELECT 1 FROM schema_migrations WHERE version = ?", (version,)
            ).fetchone():
                conn.execute("COMMIT")
                continue
            fn(conn)
            conn.execute(
                "INSERT INTO schema_migrations(version, applied_at) VALUES (?, ?)",
                (version, time.time()),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(version)
    return applied
