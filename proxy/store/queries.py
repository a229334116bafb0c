"""The SQL of users, sessions and turns, as plain synchronous functions of a connection.

:class:`proxy.store.store.Store` runs these on its writer thread (functions that write, each
inside one transaction the caller opened) or its reader threads. Keeping them free of threads and
asyncio keeps them easy to read and to test on a bare connection. The other tables' SQL lives
beside this module, one module per owner (see :mod:`proxy.store`); the turns' vectors and deferred
full-text rows are in :mod:`proxy.store.indexing`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.store import scaffolds
from proxy.store.dialect import greatest, ids_in, is_pg, no_limit, texts_in
from proxy.store.indexing import insert_vector
from proxy.store.models import (
    NewTurn,
    Session,
    SessionConflict,
    SessionNotFound,
    StoreStats,
    Turn,
    text_hash,
)
from proxy.store.rows import SESSION_COLS, TURN_COLS, TURN_COLS_T, json_list, session_of, turn_of
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.migrations import applied_versions
from proxy.store.vectable import stamp_model_id, vector_count
from proxy.vectors import Vector

# -- users and sessions ---------------------------------------------------------------------


def ensure_user(conn: Connection, user_id: str, now: float) -> None:
    conn.execute(
        "INSERT INTO users(id, created_at) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
        (user_id, now),
    )


def get_session(conn: Connection, session_id: str) -> Session | None:
    row = conn.execute(
        f"SELECT {SESSION_COLS} FROM sessions WHERE id = ?", (session_id,)
    ).fetchone()
    return session_of(row) if row is not None else None


def get_or_create_session(
    conn: Connection,
    user_id: str,
    session_id: str,
    *,
    parent_id: str | None,
    agent: str | None,
    fingerprint: str | None,
    indexed: bool | None,
    now: float,
    name: str | None = None,
) -> Session:
    """The session with this id, created if new (``name`` defaults to the id). The id is the
    global key: a client's id goes through :mod:`proxy.store.naming` instead."""
    ensure_user(conn, user_id, now)
    found = get_session(conn, session_id)
    if found is not None:
        if found.user_id != user_id:
            raise SessionConflict(f"session {session_id!r} belongs to another user namespace")
        conn.execute("UPDATE sessions SET last_seen = ? WHERE id = ?", (now, session_id))
        return get_session(conn, session_id) or found
    level = 0
    if parent_id is not None:
        parent = get_session(conn, parent_id)
        if parent is None:
            raise SessionNotFound(f"parent session {parent_id!r} does not exist")
        if parent.user_id != user_id:
            raise SessionConflict(f"parent session {parent_id!r} belongs to another user namespace")
        level = parent.level + 1
    if indexed is None:
        indexed = parent_id is None  # a sub-agent's raw history stays out of general search
    name = session_id if name is None else name
    if conn.execute(
        "SELECT 1 FROM sessions WHERE user_id = ? AND name = ?", (user_id, name)
    ).fetchone():
        raise SessionConflict(f"user {user_id!r} already has a session named {name!r}")
    conn.execute(
        f"INSERT INTO sessions({SESSION_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            session_id,
            user_id,
            parent_id,
            level,
            agent,
            now,
            now,
            fingerprint,
            int(indexed),
            name,
        ),
    )
    created = get_session(conn, session_id)
    assert created is not None
    return created


def resolve_session(
    conn: Connection,
    user_id: str,
    hashes: Sequence[str],
    min_length: int = 1,
    parent_id: str | None = None,
) -> tuple[Session, int] | None:
    """The user's session holding the longest prefix of ``hashes``, and that prefix's length.

    ``hashes[i]`` is the expected ``content_hash`` at position ``i``. They must be chain hashes
    (each covering every earlier message, as :func:`proxy.messages.chain_hashes` makes them), so
    a match at position ``i`` implies positions ``0..i`` match. Prefixes shorter than
    ``min_length`` do not count. Ties go to the most recently seen session. Only sessions whose
    parent is ``parent_id`` count (None: top-level sessions), so a sub-agent's conversation never
    continues a sibling's, nor a parent's.
    """
    found = longest_prefixes(conn, user_id, hashes, min_length, parent_id)
    if not found:
        return None
    session = get_session(conn, found[0])
    return (session, found[1]) if session is not None else None


def longest_prefixes(
    conn: Connection,
    user_id: str,
    hashes: Sequence[str],
    min_length: int = 1,
    parent_id: str | None = None,
) -> tuple[str, int, list[str]] | None:
    """What :func:`resolve_session` finds, as ids: the session holding the longest prefix, its
    length, and every session holding a prefix that long (the first included, most recently
    seen first: conversations that started alike, each a place to continue)."""
    if not hashes:
        return None
    wanted = {h: i for i, h in enumerate(hashes)}
    rows = conn.execute(
        "SELECT t.session_id, t.position, t.content_hash, s.last_seen FROM turns t"
        " JOIN sessions s ON s.id = t.session_id"
        f" WHERE t.user_id = ? AND t.content_hash IN {texts_in(conn)}"
        " AND s.parent_id IS NOT DISTINCT FROM ?",
        (user_id, json_list(wanted), parent_id),
    ).fetchall()
    keys = sorted(
        (
            (position + 1, float(last_seen), str(session_id))
            for session_id, position, content_hash, last_seen in rows
            if wanted.get(content_hash) == position and position + 1 >= min_length
        ),
        reverse=True,
    )
    if not keys:
        return None
    length = keys[0][0]
    return keys[0][2], length, [k[2] for k in keys if k[0] == length]


def set_session_indexed(conn: Connection, session_id: str, indexed: bool) -> None:
    conn.execute("UPDATE sessions SET indexed = ? WHERE id = ?", (int(indexed), session_id))
    # sqlite-vec updates metadata only through point lookups by primary key.
    ids = [r[0] for r in conn.execute("SELECT id FROM turns WHERE session_id = ?", (session_id,))]
    conn.executemany(
        "UPDATE turn_vec SET indexed = ? WHERE turn_id = ?", [(int(indexed), i) for i in ids]
    )


def list_sessions(conn: Connection, user_id: str) -> list[Session]:
    rows = conn.execute(
        f"SELECT {SESSION_COLS} FROM sessions WHERE user_id = ? ORDER BY last_seen DESC, id",
        (user_id,),
    )
    return [session_of(r) for r in rows]


def delete_user(conn: Connection, user_id: str) -> bool:
    """Delete a user namespace and everything it owns."""
    return conn.execute("DELETE FROM users WHERE id = ?", (user_id,)).rowcount > 0


# -- turns ----------------------------------------------------------------------------------


def add_turns(
    conn: Connection,
    session_id: str,
    user_id: str,
    turns: Sequence[NewTurn],
    vectors: Sequence[Vector | None] | None,
    now: float,
) -> list[int]:
    """Insert ``turns`` (and their vectors); positions the session already has are skipped.

    Returns the ids of the turns inserted, in input order.
    """
    return [i for i, _ in insert_turns(conn, session_id, user_id, turns, vectors, now)]


def insert_turns(
    conn: Connection,
    session_id: str,
    user_id: str,
    turns: Sequence[NewTurn],
    vectors: Sequence[Vector | None] | None,
    now: float,
    *,
    fts_pending: bool = False,
) -> list[tuple[int, NewTurn]]:
    """:func:`add_turns`, answering (id, turn) for each turn inserted. With ``fts_pending`` the
    turns get no full-text row yet: :func:`index_deferred` makes it later."""
    if vectors is None:
        vectors = [None] * len(turns)
    if len(vectors) != len(turns):
        raise ValueError("vectors must be None or one (or None) per turn")
    session = get_session(conn, session_id)
    if session is None:
        raise SessionNotFound(f"session {session_id!r} does not exist")
    if session.user_id != user_id:
        raise SessionConflict(f"session {session_id!r} belongs to another user namespace")
    ids: list[tuple[int, NewTurn]] = []
    model = stamp_model_id(conn) if any(v is not None for v in vectors) else None
    for turn, vec in zip(turns, vectors, strict=True):
        embed_hash = None
        if vec is not None:
            embed_hash = turn.embed_hash or text_hash(turn.content)
        row = conn.execute(
            "INSERT INTO turns(session_id, user_id, position, role, speaker, content, tool_calls,"
            " tool_call_id, timestamp, token_count, content_hash, embed_hash, incomplete,"
            " fts_pending, api, embed_model, scaffold, said_hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(session_id, position) DO NOTHING RETURNING id",
            (
                session_id,
                user_id,
                turn.position,
                turn.role,
                turn.speaker,
                turn.content,
                json.dumps(turn.tool_calls, ensure_ascii=False, separators=(",", ":"))
                if turn.tool_calls is not None
                else None,
                turn.tool_call_id,
                turn.timestamp if turn.timestamp is not None else now,
                turn.token_count,
                turn.identity(),
                embed_hash,
                int(turn.incomplete),
                int(fts_pending),
                turn.api,
                model if vec is not None else None,
                scaffolds.refs_json(turn.scaffold),
                turn.said_hash,
            ),
        ).fetchone()
        if row is None:  # the session holds that position already
            continue
        turn_id = int(row[0])
        if vec is not None:
            insert_vector(conn, turn_id, user_id, session_id, session.indexed, vec)
        ids.append((turn_id, turn))
    if any(t.scaffold or t.sightings for _, t in ids):
        scaffolds.record(conn, user_id, session_id, [t for _, t in ids], now)
    conn.execute(
        f"UPDATE sessions SET last_seen = {greatest(conn)}(last_seen, ?) WHERE id = ?",
        (now, session_id),
    )
    return ids


def count_turns(conn: Connection, session_id: str) -> int:
    (n,) = conn.execute("SELECT count(*) FROM turns WHERE session_id = ?", (session_id,)).fetchone()
    return int(n)


def count_user_turns(conn: Connection, user_id: str) -> int:
    (n,) = conn.execute("SELECT count(*) FROM turns WHERE user_id = ?", (user_id,)).fetchone()
    return int(n)


def session_turn_counts(conn: Connection, user_id: str) -> dict[str, int]:
    """Turns per session of one user namespace (sessions without turns are left out)."""
    rows = conn.execute(
        "SELECT session_id, count(*) FROM turns WHERE user_id = ? GROUP BY session_id", (user_id,)
    )
    return {r[0]: int(r[1]) for r in rows}


def next_position(conn: Connection, session_id: str) -> int:
    """The position after the session's last turn (0 for an empty session)."""
    (last,) = conn.execute(
        "SELECT max(position) FROM turns WHERE session_id = ?", (session_id,)
    ).fetchone()
    return 0 if last is None else int(last) + 1


def session_owner(conn: Connection, session_id: str) -> str | None:
    """The user namespace a session belongs to (None: no such session)."""
    row = conn.execute("SELECT user_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return None if row is None else str(row[0])


def hashes_from(conn: Connection, session_id: str, position: int) -> dict[int, str]:
    """The chain hash a session holds at each position from ``position`` on."""
    rows = conn.execute(
        "SELECT position, content_hash FROM turns WHERE session_id = ? AND position >= ?",
        (session_id, position),
    )
    return {int(r[0]): str(r[1]) for r in rows}


def turns_at(
    conn: Connection, user_id: str, places: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], Turn]:
    """The user's turns at these (session id, position) places, by place: one query, each place
    an exact lookup in the (session_id, position) index (CROSS JOIN keeps SQLite from walking the
    user's whole turns_user index instead)."""
    if not places:
        return {}
    if is_pg(conn):
        rows = conn.execute(
            f"SELECT {TURN_COLS_T} FROM json_array_elements(?::json) AS p"
            " JOIN turns AS t ON t.session_id = p.value->>0"
            " AND t.position = (p.value->>1)::bigint WHERE t.user_id = ?",
            (json.dumps(list(places)), user_id),
        )
    else:
        rows = conn.execute(
            f"SELECT {TURN_COLS_T} FROM json_each(?) AS p CROSS JOIN turns AS t"
            " ON t.session_id = json_extract(p.value, '$[0]')"
            " AND t.position = json_extract(p.value, '$[1]')"
            " WHERE t.user_id = ?",
            (json.dumps(list(places)), user_id),
        )
    out = [turn_of(r) for r in rows]
    return {(t.session_id, t.position): t for t in out}


def session_turn_hashes(conn: Connection, session_id: str) -> list[str]:
    rows = conn.execute(
        "SELECT content_hash FROM turns WHERE session_id = ? ORDER BY position", (session_id,)
    )
    return [r[0] for r in rows]


def session_turns(
    conn: Connection,
    session_id: str,
    from_position: int = 0,
    limit: int | None = None,
    as_sent: bool = False,
) -> list[Turn]:
    """The session's turns by position: their words, or with ``as_sent`` their text as the
    client sent it (the scaffolding put back, :mod:`proxy.store.scaffolds`)."""
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE session_id = ? AND position >= ?"
        " ORDER BY position LIMIT ?",
        (session_id, from_position, no_limit(conn) if limit is None else limit),
    )
    turns = [turn_of(r) for r in rows]
    return scaffolds.as_sent(conn, turns) if as_sent else turns


def get_turns(conn: Connection, ids: Sequence[int], user_id: str | None) -> list[Turn]:
    """The turns with these ids, in the order given; unknown (or other users') ids are left out."""
    sql = f"SELECT {TURN_COLS} FROM turns WHERE id IN {ids_in(conn)}"
    args: list[Any] = [json_list(ids)]
    if user_id is not None:
        sql += " AND user_id = ?"
        args.append(user_id)
    by_id = {row[0]: turn_of(row) for row in conn.execute(sql, args)}
    return [by_id[i] for i in ids if i in by_id]


# -- export and stats -----------------------------------------------------------------------


def session_rows(conn: Connection, user_id: str) -> list[Session]:
    rows = conn.execute(
        f"SELECT {SESSION_COLS} FROM sessions WHERE user_id = ? ORDER BY created_at, id",
        (user_id,),
    )
    return [session_of(r) for r in rows]


def user_turns_page(conn: Connection, user_id: str, after_id: int, limit: int) -> list[Turn]:
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE user_id = ? AND id > ? ORDER BY id LIMIT ?",
        (user_id, after_id, limit),
    )
    return [turn_of(r) for r in rows]


def list_users(conn: Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT id FROM users ORDER BY id")]


def stats(conn: Connection, path: Path | None) -> StoreStats:
    def count(sql: str) -> int:
        return int(conn.execute(sql).fetchone()[0])

    per_user = {
        r[0]: int(r[1])
        for r in conn.execute("SELECT user_id, count(*) FROM turns GROUP BY user_id ORDER BY 1")
    }
    versions = applied_versions(conn)
    db_bytes = wal_bytes = 0
    if is_pg(conn):
        db_bytes = int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])
    elif path is not None:
        db_bytes = path.stat().st_size if path.exists() else 0
        wal = path.with_name(path.name + "-wal")
        wal_bytes = wal.stat().st_size if wal.exists() else 0
    return StoreStats(
        schema_version=max(versions, default=0),
        users=count("SELECT count(*) FROM users"),
        sessions=count("SELECT count(*) FROM sessions"),
        turns=count("SELECT count(*) FROM turns"),
        vectors=vector_count(conn),
        db_bytes=db_bytes,
        wal_bytes=wal_bytes,
        per_user=per_user,
    )


def now() -> float:
    return time.time()


def shared_value(conn: Connection, key: str, value: str) -> str:
    """The ``meta`` value under ``key``, ``value`` stored there first if none is: the first
    process that asks decides it for every process on the database (a write)."""
    conn.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING", (key, value)
    )
    (found,) = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return str(found)


def shared_secret(conn: Connection, key: str, size: int = 32) -> bytes:
    """A random secret kept in ``meta`` under ``key``, made by the first process that asks:
    every process on the database (``--workers``, a restart, replicas) gets the same one."""
    return bytes.fromhex(shared_value(conn, key, secrets.token_hex(size)))
