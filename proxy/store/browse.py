"""Paged reads for the inspector's pages: one user's sessions (filtered), a session's turns, its
sub-sessions, the user's facts and notes. Every query is bounded by a page (``LIMIT``) and walks
an index, so a page costs the same at 100,000 turns as at 100 (``bench.inspector``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.store.dialect import binary_order, char, cross_join, instr, texts_in
from proxy.store.models import Session, Turn
from proxy.store.rows import (
    SESSION_COLS,
    TURN_COLS,
    TURN_COLS_T,
    json_list,
    session_of,
    turn_of,
)
from proxy.store.sqlite.db import Connection

FIRST_LINE_CHARS = 160


@dataclass(frozen=True)
class SessionRow:
    """A session as the sessions page lists it."""

    session: Session
    turns: int
    first_line: str  # the start of its first user message ("" when it has none)
    apis: tuple[str, ...]  # the chat APIs its turns came through


def session_page(
    conn: Connection,
    user_id: str,
    *,
    limit: int,
    offset: int = 0,
    name: str | None = None,
    among: Sequence[str] | None = None,
    api: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> tuple[list[SessionRow], int]:
    """A page of the user's sessions, most recently seen first, and how many match. ``name``:
    its name contains this, or (``among``) it is one of these session ids; ``api``: one of its
    turns came through this chat API; ``since`` / ``until``: seen at or after, started before."""
    where: list[str] = ["user_id = ?"]
    args: list[Any] = [user_id]
    if name is not None or among is not None:
        alts = []
        if name is not None:
            alts.append(f"{instr(conn)}(lower(name), lower(?)) > 0")
            args.append(name)
        if among is not None:
            alts.append(f"id IN {texts_in(conn)}")
            args.append(json_list(among))
        where.append("(" + " OR ".join(alts) + ")")
    if api is not None:
        where.append(
            "EXISTS (SELECT 1 FROM turns t WHERE t.session_id = sessions.id AND t.api = ?)"
        )
        args.append(api)
    if since is not None:
        where.append("last_seen >= ?")
        args.append(since)
    if until is not None:
        where.append("created_at < ?")
        args.append(until)
    cond = " AND ".join(where)
    page_sql = (
        f"SELECT {SESSION_COLS}{{}} FROM sessions WHERE {cond}"
        f" ORDER BY last_seen DESC, id{binary_order(conn)} LIMIT ? OFFSET ?"
    )
    if api is None:  # the count walks an index; the page stops after its rows
        (total,) = conn.execute(f"SELECT count(*) FROM sessions WHERE {cond}", args).fetchone()
        rows = conn.execute(page_sql.format(""), [*args, limit, offset]).fetchall()
        return [_row(conn, session_of(r)) for r in rows], int(total)
    # The API's test is an index probe per session (``turns_session_api``, migration 14), made
    # once: the count comes in the same pass as the page (a count, then a page, tested a rare
    # API's sessions twice: 36 + 30 ms at 100k turns before the index, one pass 39 ms).
    counted = conn.execute(page_sql.format(", count(*) OVER ()"), [*args, limit, offset]).fetchall()
    if counted:
        total = counted[0][-1]
    else:  # a page past the end: no row carries the count
        (total,) = conn.execute(f"SELECT count(*) FROM sessions WHERE {cond}", args).fetchone()
    return [_row(conn, session_of(r[:-1])) for r in counted], int(total)


def _row(conn: Connection, s: Session) -> SessionRow:
    (turns,) = conn.execute(
        "SELECT count(*) FROM turns WHERE session_id = ? AND position >= 0", (s.id,)
    ).fetchone()
    first = conn.execute(
        "SELECT substr(content, 1, ?) FROM turns WHERE session_id = ? AND position >= 0"
        " AND role = 'user' AND trim(content) != '' ORDER BY position LIMIT 1",
        (FIRST_LINE_CHARS, s.id),
    ).fetchone()
    apis = conn.execute(
        "SELECT DISTINCT api FROM turns WHERE session_id = ? AND api IS NOT NULL LIMIT 5",
        (s.id,),
    ).fetchall()
    return SessionRow(s, int(turns), str(first[0]) if first else "", tuple(a[0] for a in apis))


def session_apis(conn: Connection, user_id: str, limit: int = 20) -> list[str]:
    """The chat APIs the user's recent turns came through (the sessions page's filter)."""
    rows = conn.execute(
        "SELECT DISTINCT api FROM (SELECT api FROM turns WHERE user_id = ? AND api IS NOT NULL"
        " ORDER BY id DESC LIMIT 5000) AS recent LIMIT ?",
        (user_id, limit),
    )
    return sorted(str(r[0]) for r in rows)


def turn_page(conn: Connection, session_id: str, *, limit: int, offset: int = 0) -> list[Turn]:
    """A page of a session's messages (positions 0, 1, …), in order."""
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE session_id = ? AND position >= 0"
        " ORDER BY position LIMIT ? OFFSET ?",
        (session_id, limit, offset),
    )
    return [turn_of(r) for r in rows]


def sub_sessions(conn: Connection, session_id: str, limit: int = 500) -> list[tuple[Session, int]]:
    """The sessions under this one (sub-agents, theirs…), each with its depth below it, in tree
    order (a parent before its children)."""
    rows = conn.execute(
        "WITH RECURSIVE tree(id, depth, path) AS ("
        " SELECT id, 0, id FROM sessions WHERE id = ?"
        f" UNION ALL SELECT s.id, t.depth + 1, t.path || {char(conn, 31)} || s.created_at || s.id"
        " FROM sessions s JOIN tree t ON s.parent_id = t.id WHERE t.depth < 64)"
        f" SELECT {', '.join('s.' + c.strip() for c in SESSION_COLS.split(','))}, tree.depth"
        " FROM tree JOIN sessions s ON s.id = tree.id WHERE tree.depth > 0"
        f" ORDER BY tree.path{binary_order(conn)} LIMIT ?",
        (session_id, limit),
    )
    return [(session_of(r[:-1]), int(r[-1])) for r in rows]


def _items(conn: Connection) -> str:
    """The FROM and WHERE of the user's items (negative positions) of a role: found session by
    session in the ``(session_id, position)`` index, not among all of the user's turns
    (``turns_user`` holds no position: the user's 100,000 turns read, 40 ms, for 600 facts; this
    way 3 ms). A session's turns are its user's (:func:`proxy.store.queries.insert_turns`), so no
    ``t.user_id`` test. SQLite's ``CROSS JOIN`` keeps that join order; PostgreSQL's planner
    chooses its own."""
    return (
        f"FROM sessions s {cross_join(conn)} turns t ON t.session_id = s.id AND t.position < 0"
        " WHERE s.user_id = ? AND t.role = ?"
    )


def user_items(
    conn: Connection, user_id: str, role: str, *, limit: int, offset: int = 0
) -> tuple[list[Turn], int]:
    """A page of the user's items of a role (facts), the newest first, and how many."""
    (total,) = conn.execute(f"SELECT count(*) {_items(conn)}", (user_id, role)).fetchone()
    rows = conn.execute(
        f"SELECT {TURN_COLS_T} {_items(conn)} ORDER BY t.id DESC LIMIT ? OFFSET ?",
        (user_id, role, limit, offset),
    )
    return [turn_of(r) for r in rows], int(total)


def user_totals(conn: Connection, user_id: str) -> tuple[int, int]:
    """(turns, sessions holding a turn) of the user, as the overview shows them: the first
    counted in ``turns_user`` alone, the second one index probe per session (not
    :func:`proxy.store.queries.session_turn_counts`, which reads and groups every turn: 80 ms
    at 100,000 turns, this 12 ms)."""
    (turns,) = conn.execute("SELECT count(*) FROM turns WHERE user_id = ?", (user_id,)).fetchone()
    (sessions,) = conn.execute(
        "SELECT count(*) FROM sessions s WHERE s.user_id = ?"
        " AND EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.id)",
        (user_id,),
    ).fetchone()
    return int(turns), int(sessions)


def session_turns_newest(
    conn: Connection, session_id: str, *, limit: int, offset: int = 0
) -> tuple[list[Turn], int]:
    """A page of a session's messages, the newest first, and how many (the notes)."""
    (total,) = conn.execute(
        "SELECT count(*) FROM turns WHERE session_id = ? AND position >= 0", (session_id,)
    ).fetchone()
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE session_id = ? AND position >= 0"
        " ORDER BY position DESC LIMIT ? OFFSET ?",
        (session_id, limit, offset),
    )
    return [turn_of(r) for r in rows], int(total)


def marked(conn: Connection, user_id: str, limit: int) -> list[Turn]:
    """The user's pinned and muted turns, the newest first (the page's list)."""
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE user_id = ? AND recall != 0 ORDER BY id DESC LIMIT ?",
        (user_id, limit),
    )
    return [turn_of(r) for r in rows]


def facts_of(conn: Connection, user_id: str, session_id: str, limit: int) -> list[Turn]:
    """Facts distilled from the user's session, the newest first."""
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE user_id = ? AND role = 'fact'"
        " AND source_session = ? ORDER BY id DESC LIMIT ?",
        (user_id, session_id, limit),
    )
    return [turn_of(r) for r in rows]
