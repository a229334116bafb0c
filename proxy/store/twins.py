"""Concurrent commits of one conversation (:func:`proxy.chat.sessions.commit_turns`), one at a
time on every backend; and twin requests, the same new conversation sent twice at once (a client
that hedges or retries through a load balancer, so each copy may reach another replica),
archived as one session.

A commit reads what the session holds, then writes: which rows are new, which positions a
concurrent request took (a fork), whether a named session exists yet. SQLite runs one write
transaction at a time, so that is atomic already. On PostgreSQL (read committed) two replicas'
commits would both read before either wrote: both create the session of one name (a unique
violation: one request's turns lost), both take one position (``ON CONFLICT DO NOTHING`` drops
one reply instead of forking), both create a session for one new conversation.
:func:`lock_conversation` takes a transaction-level advisory lock keyed by the conversation
first, so the second commit waits for the first and its next statement sees what it wrote.

A request that no stored session continues plans a new one (:func:`proxy.chat.sessions.place`),
which its commit creates. Two copies of one first request, placed before either committed, would
each create their own. The commit instead joins a session that a twin created *after this
request was placed* holding the same first row, chain hash and position alike
(:func:`created_since`): the chain hash covers every earlier message, so that session holds
this very conversation. A session created before this request was placed is another
conversation that started alike (a user asking the same question twice): it is not joined, as
:func:`~proxy.chat.sessions.place` did not continue it either.
"""

from __future__ import annotations

from proxy.store import queries
from proxy.store.db import Connection
from proxy.store.dialect import is_pg
from proxy.store.models import Session


def lock_conversation(conn: Connection, *key: str) -> None:
    """Hold, until this transaction ends, the lock of the conversation ``key`` names (PostgreSQL;
    SQLite's write lock is held already). Keys that collide in the 64-bit hash only wait."""
    if is_pg(conn):
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(?, 0))",
            ("\x1f".join(("engram:conversation", *key)),),
        )


def created_since(
    conn: Connection,
    user_id: str,
    parent_id: str | None,
    position: int,
    content_hash: str,
    since: float,
) -> Session | None:
    """The earliest session of ``user_id`` under ``parent_id`` created after ``since`` (when this
    request was placed) that holds ``content_hash`` at ``position``: a twin's, created while
    this request ran. Replicas on other hosts need clocks closer than a request lasts."""
    row = conn.execute(
        "SELECT s.id FROM turns t JOIN sessions s ON s.id = t.session_id"
        " WHERE t.user_id = ? AND t.content_hash = ? AND t.position = ?"
        " AND s.parent_id IS NOT DISTINCT FROM ? AND s.created_at > ?"
        " ORDER BY s.created_at, s.id LIMIT 1",
        (user_id, content_hash, position, parent_id, since),
    ).fetchone()
    return queries.get_session(conn, str(row[0])) if row is not None else None
