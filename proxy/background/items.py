"""Memory items: what Engram itself adds to a session (a sub-agent's hand-back summary, a
consolidated fact), stored and indexed like turns so the normal hybrid search finds them.

Items take negative positions (-1, -2, …) in their session, so they never collide with the
conversation's messages (0, 1, 2, …) nor change how a conversation is recognised; they carry the
session they came from in ``source_session``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from proxy.search.embedder import Embedder
from proxy.store import queries
from proxy.store.db import Connection
from proxy.store.models import NewTurn, Turn, embed_text, text_hash
from proxy.store.store import Store

ITEM_ROLES = ("summary", "fact")


def next_item_position(conn: Connection, session_id: str) -> int:
    """The position the session's next item takes: one below its lowest, and below 0."""
    row = conn.execute(
        "SELECT min(position) FROM turns WHERE session_id = ?", (session_id,)
    ).fetchone()
    lowest = row[0] if row and row[0] is not None else 0
    return min(int(lowest), 0) - 1


def _insert(
    conn: Connection, session_id: str, user_id: str, turn: NewTurn, vector: Any, source: str | None
) -> int:
    positioned = dataclasses.replace(turn, position=next_item_position(conn, session_id))
    (turn_id,) = queries.add_turns(
        conn,
        session_id,
        user_id,
        [positioned],
        [vector] if vector is not None else None,
        time.time(),
    )
    if source is not None:
        conn.execute("UPDATE turns SET source_session = ? WHERE id = ?", (source, turn_id))
    return turn_id


async def add_item(
    store: Store,
    embedder: Embedder | None,
    session_id: str,
    user_id: str,
    role: str,
    speaker: str,
    content: str,
    source_session: str | None = None,
) -> int:
    """Store ``content`` as a memory item of ``session_id``; returns its turn id."""
    if role not in ITEM_ROLES:
        raise ValueError(f"a memory item's role is one of {ITEM_ROLES}, not {role!r}")
    text = embed_text(role, speaker, content)
    vector = (await embedder.embed_passages([text]))[0] if embedder is not None else None
    turn = NewTurn(
        position=-1,
        role=role,
        content=content,
        speaker=speaker,
        timestamp=time.time(),
        content_hash=text_hash(f"{role}\0{speaker}\0{content}"),
        embed_hash=text_hash(text),
    )
    return await store.write(
        lambda c: _insert(c, session_id, user_id, turn, vector, source_session)
    )


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
