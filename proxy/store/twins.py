"""Concurrent commits of one conversation (:func:`proxy.chat.sessions.commit_turns`), one at a
time on every backend.

A commit reads what the session holds, then writes: which rows are new, which positions a
concurrent request took (a fork), whether a named session exists yet. SQLite runs one write
transaction at a time, so that is atomic already. On PostgreSQL (read committed) two replicas'
commits would both read before either wrote: both create the session of one name (a unique
violation: one request's turns lost), both take one position (``ON CONFLICT DO NOTHING`` drops
one reply instead of forking).
:func:`lock_conversation` takes a transaction-level advisory lock keyed by the conversation
first, so the second commit waits for the first and its next statement sees what it wrote.

New conversations are not joined here: each planned session is created under the id its reply
named, and requests continuing one session at once are told apart before forwarding
(:mod:`proxy.chat.claims`).
"""

from __future__ import annotations

from proxy.store.dialect import is_pg
from proxy.store.sqlite.db import Connection


def lock_conversation(conn: Connection, *key: str) -> None:
    """Hold, until this transaction ends, the lock of the conversation ``key`` names (PostgreSQL;
    SQLite's write lock is held already). Keys that collide in the 64-bit hash only wait."""
    if is_pg(conn):
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(?, 0))",
            ("\x1f".join(("engram:conversation", *key)),),
        )
