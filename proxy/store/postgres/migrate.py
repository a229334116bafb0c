"""The PostgreSQL schema's migrations, applied at start under an advisory lock.

Replicas starting together race to migrate: each takes the session advisory lock
:data:`LOCK_KEY` first, so one applies what is missing and the others, once they hold it, find
it applied. The schema itself is :mod:`proxy.store.postgres.schema`, versions 16 to 18 (SQLite's
numbering).
"""

from __future__ import annotations

import time
from typing import Any

from proxy.store.postgres import schema
from proxy.store.postgres.connection import ensure_vector_types

LOCK_KEY = 0x656E6772616D  # "engram"


def prompt_blocks_sql(dim: int = 384) -> list[str]:
    """Migration 17: ``prompt_blocks`` (:mod:`proxy.store.blocks`); ``dim`` is not used."""
    del dim
    return [
        schema.binary_collation(
            """CREATE TABLE prompt_blocks (
            user_id    text NOT NULL,
            chain      text NOT NULL,
            session_id text NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            turn_ids   text NOT NULL,
            created_at double precision NOT NULL,
            PRIMARY KEY (user_id, chain, session_id)
        )"""
        ),
        "CREATE INDEX prompt_blocks_session ON prompt_blocks(session_id)",
    ]


def said_sql(dim: int = 384) -> list[str]:
    """Migration 18: ``turns.said_hash`` (:mod:`proxy.said`); ``dim`` is not used."""
    del dim
    return [
        'ALTER TABLE turns ADD COLUMN said_hash text COLLATE "C"',
        "CREATE INDEX turns_said ON turns(user_id, said_hash) WHERE said_hash IS NOT NULL",
    ]


MIGRATIONS: list[tuple[int, Any]] = [
    (16, schema.schema_sql),
    (17, prompt_blocks_sql),
    (18, said_sql),
]
"""(version, function of the vector dimension answering the statements), ascending. The
numbering is SQLite's: PostgreSQL starts at the schema SQLite's migrations 1-16 leave, and a
later change to the schema takes the same number on both."""


def applied_versions(conn: Any) -> list[int]:
    exists = conn.execute("SELECT to_regclass('schema_migrations') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return []
    return [int(r[0]) for r in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]


def latest_version() -> int:
    return MIGRATIONS[-1][0]


def migrate(conn: Any, dim: int = 384) -> list[int]:
    """Apply the missing migrations (each one transaction) under the advisory lock; the
    versions applied. A schema newer than this code raises RuntimeError, untouched."""
    conn.execute("SELECT pg_advisory_lock(?)", (LOCK_KEY,))
    try:
        done = set(applied_versions(conn))
        if done and max(done) > latest_version():
            raise RuntimeError(
                f"database schema version {max(done)} is newer than this Engram "
                f"(knows up to {latest_version()}); upgrade Engram"
            )
        applied: list[int] = []
        for version, statements in MIGRATIONS:
            if version in done:
                continue
            conn.execute("BEGIN")
            try:
                for sql in statements(dim):
                    conn.executescript(sql)  # as written: no placeholders in DDL
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations ("
                    " version bigint PRIMARY KEY, applied_at double precision NOT NULL)"
                )
                conn.execute(
                    "INSERT INTO schema_migrations(version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            applied.append(version)
        ensure_vector_types(conn)
        return applied
    finally:
        conn.execute("SELECT pg_advisory_unlock(?)", (LOCK_KEY,))
