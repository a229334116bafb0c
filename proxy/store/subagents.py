"""When sub-agent sessions are completed (``sessions.completed_at``): the state of
:class:`proxy.background.handback.Handback`, which hands a finished sub-agent back to its
parent once."""

from __future__ import annotations

from proxy.store.sqlite.db import Connection


def set_completed(conn: Connection, session_id: str, when: float) -> None:
    """Mark the session completed at ``when``."""
    conn.execute("UPDATE sessions SET completed_at = ? WHERE id = ?", (when, session_id))


def is_completed(conn: Connection, session_id: str) -> bool:
    """Whether the session exists and is completed."""
    row = conn.execute("SELECT completed_at FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return row is not None and row[0] is not None


def idle_subagents(conn: Connection, older_than: float) -> list[str]:
    """Ids of the uncompleted sub-agent sessions last seen before ``older_than``."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT id FROM sessions WHERE parent_id IS NOT NULL AND completed_at IS NULL"
            " AND last_seen < ?",
            (older_than,),
        )
    ]
