"""The ``summaries`` table: one rolling summary per session, written by
:class:`proxy.background.summarizer.Summarizer` and read when a prompt is assembled."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.store.sqlite.db import Connection


@dataclass(frozen=True)
class Summary:
    """A session's rolling summary."""

    session_id: str
    content: str
    upto: int  # covers the session's turns at positions < upto
    tokens: int
    updated_at: float


def get_summary(conn: Connection, session_id: str) -> Summary | None:
    """The session's summary, or None while it has none."""
    row = conn.execute(
        "SELECT session_id, content, upto, tokens, updated_at FROM summaries WHERE session_id = ?",
        (session_id,),
    ).fetchone()
    return (
        None
        if row is None
        else Summary(str(row[0]), str(row[1]), int(row[2]), int(row[3]), float(row[4]))
    )


def put_summary(conn: Connection, s: Summary, model: str | None) -> None:
    """Store ``s`` as its session's summary, replacing the one it had; ``model`` wrote it."""
    conn.execute(
        "INSERT INTO summaries(session_id, content, upto, tokens, model, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(session_id) DO UPDATE SET"
        " content = excluded.content, upto = excluded.upto, tokens = excluded.tokens,"
        " model = excluded.model,"
        " updated_at = excluded.updated_at",
        (s.session_id, s.content, s.upto, s.tokens, model, s.updated_at),
    )
