"""Memory items in ``turns``: what Engram itself adds to a session (a sub-agent's hand-back
summary, a consolidated fact), at negative positions, with the session they came from in
``source_session``. :mod:`proxy.background.items` decides what an item is; this is its SQL."""

from __future__ import annotations

import dataclasses
import time

from proxy.store import queries
from proxy.store.models import NewTurn, SessionNotFound, Turn
from proxy.store.sqlite.db import Connection
from proxy.vectors import Vector


def next_item_position(conn: Connection, session_id: str) -> int:
    """The position the session's next item takes: one below its lowest, and below 0."""
    row = conn.execute(
        "SELECT min(position) FROM turns WHERE session_id = ?", (session_id,)
    ).fetchone()
    lowest = row[0] if row and row[0] is not None else 0
    return min(int(lowest), 0) - 1


def insert_item(
    conn: Connection,
    session_id: str,
    user_id: str,
    turn: NewTurn,
    vector: Vector | None,
    source: str | None,
    source_turn: int | None = None,
) -> int:
    """Store ``turn`` (and its vector) at the session's next item position, with ``source``
    as its ``source_session`` (and ``source_turn``, the turn it was made from, when known);
    returns its turn id. Raises :class:`SessionNotFound` when
    ``source`` was deleted meanwhile (forgotten: nothing made from it may be stored)."""
    if source is not None and queries.get_session(conn, source) is None:
        raise SessionNotFound(f"session {source!r}, the item's source, no longer exists")
    if (
        source_turn is not None
        and not conn.execute("SELECT 1 FROM turns WHERE id = ?", (source_turn,)).fetchone()
    ):
        raise SessionNotFound(f"turn {source_turn}, the item's source, no longer exists")
    positioned = dataclasses.replace(turn, position=next_item_position(conn, session_id))
    (turn_id,) = queries.add_turns(
        conn,
        session_id,
        user_id,
        [positioned],
        [vector] if vector is not None else None,
        time.time(),
    )
    if source is not None or source_turn is not None:
        conn.execute(
            "UPDATE turns SET source_session = ?, source_turn = ? WHERE id = ?",
            (source, source_turn, turn_id),
        )
    return turn_id


def session_items(conn: Connection, session_id: str, role: str, limit: int) -> list[Turn]:
    """The newest ``limit`` items of a role in a session, newest first."""
    ids = [
        r[0]
        for r in conn.execute(
            "SELECT id FROM turns WHERE session_id = ? AND role = ? AND position < 0"
            " ORDER BY position ASC LIMIT ?",
            (session_id, role, limit),
        )
    ]
    return queries.get_turns(conn, ids, None)


def fact_texts(conn: Connection, session_id: str) -> list[tuple[str, str]]:
    """(speaker, content) of every fact of a session; speaker "" where it has none."""
    rows = conn.execute(
        "SELECT speaker, content FROM turns WHERE session_id = ? AND role = 'fact'", (session_id,)
    )
    return [(str(r[0] or ""), str(r[1])) for r in rows]
