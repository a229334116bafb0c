"""What a user is talking about now: the latest turns of their most recently active
conversations, which a client's side request may quote (:mod:`proxy.chat.machinery`)."""

from __future__ import annotations

from proxy.store.sqlite.db import Connection


def latest_turns(
    conn: Connection, user_id: str, since: float, sessions: int, turns: int
) -> list[list[tuple[str, str]]]:
    """The latest ``turns`` user and assistant turns, (role, content) newest first, of each of
    the user's ``sessions`` most recently active since ``since`` (what a client's side request
    may quote: :mod:`proxy.chat.machinery`)."""
    ids = conn.execute(
        "SELECT id FROM sessions WHERE user_id = ? AND last_seen >= ?"
        " ORDER BY last_seen DESC LIMIT ?",
        (user_id, since, sessions),
    ).fetchall()
    found: list[list[tuple[str, str]]] = []
    for (sid,) in ids:
        rows = conn.execute(
            "SELECT role, content FROM turns WHERE session_id = ?"
            " AND role IN ('user', 'assistant') ORDER BY position DESC LIMIT ?",
            (sid, turns),
        ).fetchall()
        found.append([(str(role), str(content)) for role, content in rows])
    return found
