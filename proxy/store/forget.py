"""Deleting a session and everything that came from it, and the session-to-slot links that make
its tool-result slots deletable (``slot_sessions``, migration 9).

:func:`forget_session` runs in one write transaction: the session and its sub-sessions go, and by
cascade and trigger their turns (with FTS rows and vectors), summaries, request records (and the
feedback and consolidation-queue rows hanging off them), the memory items derived from any of them
(a sub-agent's hand-back in its parent, facts: ``source_session``), and the slots that only these
sessions referenced, and the scaffolding (:mod:`proxy.store.scaffolds`) no other session of the
user used. It answers the ids of those slots, so the caller can delete their copies in
Redis too. Making the bytes leave the file is :mod:`proxy.store.sqlite.scrub`'s job, afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.store import scaffolds
from proxy.store.dialect import greatest
from proxy.store.sqlite.db import Connection


@dataclass(frozen=True)
class Forgotten:
    """What :func:`forget_session` deleted: the sessions (the one named first, then its
    sub-sessions), their user, their turns, and the slot ids no remaining session uses."""

    user_id: str
    sessions: tuple[str, ...]
    turns: int
    slot_ids: tuple[str, ...]


def session_tree(conn: Connection, session_id: str) -> list[str]:
    """The session and every session under it, the named one first."""
    rows = conn.execute(
        "WITH RECURSIVE tree(id, depth) AS (SELECT id, 0 FROM sessions WHERE id = ?"
        " UNION SELECT s.id, t.depth + 1 FROM sessions s JOIN tree t ON s.parent_id = t.id)"
        " SELECT id, depth FROM tree",
        (session_id,),
    )  # ordered here: by code point on both backends, whatever PostgreSQL's collation
    return [str(r[0]) for r in sorted(rows, key=lambda r: (int(r[1]), str(r[0])))]


def forget_session(conn: Connection, session_id: str, user_id: str | None) -> Forgotten | None:
    """Delete the session (of ``user_id``, when given) with all it produced; None if no session
    matched. Call inside a write transaction."""
    row = conn.execute("SELECT user_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
    if row is None or (user_id is not None and row[0] != user_id):
        return None
    owner = str(row[0])
    tree = session_tree(conn, session_id)
    marks = ",".join("?" * len(tree))
    (turns,) = conn.execute(
        f"SELECT count(*) FROM turns WHERE session_id IN ({marks})", tree
    ).fetchone()
    slot_ids = sorted(
        str(r[0])
        for r in conn.execute(
            f"SELECT DISTINCT l.slot_id FROM slot_sessions l WHERE l.session_id IN ({marks})"
            " AND NOT EXISTS (SELECT 1 FROM slot_sessions o WHERE o.user_id = l.user_id"
            f" AND o.slot_id = l.slot_id AND o.session_id NOT IN ({marks}))",
            [*tree, *tree],
        )
    )  # by code point, as SQLite's ORDER BY sorted them
    conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,))  # the rest by cascade
    conn.execute(f"DELETE FROM slot_sessions WHERE session_id IN ({marks})", tree)
    scaffolds.forget_sessions(conn, owner, tree)
    conn.executemany(
        "DELETE FROM slots WHERE user_id = ? AND id = ?", [(owner, sid) for sid in slot_ids]
    )
    return Forgotten(owner, tuple(tree), int(turns), tuple(slot_ids))


def link_slots(
    conn: Connection, user_id: str, session_id: str, slot_ids: Sequence[str], until: float
) -> None:
    """Record that ``session_id`` referenced ``slot_ids``, kept until ``until``."""
    conn.executemany(
        "INSERT INTO slot_sessions(session_id, slot_id, user_id, expires_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(session_id, slot_id) DO UPDATE SET"
        f" expires_at = {greatest(conn)}(slot_sessions.expires_at, excluded.expires_at)",
        [(session_id, sid, user_id, until) for sid in slot_ids],
    )


def purge_links(conn: Connection, now: float) -> int:
    """Delete the links kept past their time; how many."""
    return conn.execute("DELETE FROM slot_sessions WHERE expires_at <= ?", (now,)).rowcount
