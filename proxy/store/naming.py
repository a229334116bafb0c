"""Sessions by owner: a client's session id is a name within its user's namespace.

``sessions.name`` is the id the owner's client sends (``X-Engram-Session``, ``X-Engram-Parent``,
the admin API's ``/sessions/{id}``); ``(user_id, name)`` is unique (migration 7). ``sessions.id``
is the global key the other tables refer to, and nothing a client sends is looked up by it: two
users may both have a session ``project``, and no name one user picks can reach a session of
another. A new session's id is its name when no session has that id yet (so ids stay readable),
otherwise ``<name>~<hash of user and name>`` (or a random one should that be taken too).

Names Engram gives its own sessions start with a prefix of :data:`RESERVED_PREFIXES`
(consolidation's ``facts~<user>``, the notes' ``notes~<user>``); a client's name never does
(:mod:`proxy.chat.sessions` maps such a name to another one), so no client can take or write
into them. The other names Engram makes are its conversation sessions' ``s-<random>`` (placed
by their messages' hash chain; the client may send one back, and it is its own) and
``h-<hash>`` for a client id that is not a safe string (:mod:`proxy.chat.identity`).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable

from proxy.store import queries
from proxy.store.dialect import binary_order, texts_in
from proxy.store.models import Session
from proxy.store.rows import SESSION_COLS, json_list, session_of
from proxy.store.sqlite.db import Connection

FACTS_PREFIX = "facts~"
"""``facts~<user>``: the session of the facts consolidation distils for a user."""
NOTES_PREFIX = "notes~"
"""``notes~<user>``: the session of the notes a person adds (the inspector, the admin API, MCP)."""
RESERVED_PREFIXES = (FACTS_PREFIX, NOTES_PREFIX)
"""Names starting so are Engram's own; no client name does."""


def facts_session_name(user_id: str) -> str:
    return f"{FACTS_PREFIX}{user_id}"


def named_session(conn: Connection, user_id: str, name: str) -> Session | None:
    """The user's session of this name, or None (another user's never answers)."""
    row = conn.execute(
        f"SELECT {SESSION_COLS} FROM sessions WHERE user_id = ? AND name = ?", (user_id, name)
    ).fetchone()
    return session_of(row) if row is not None else None


def sessions_named(conn: Connection, name: str) -> list[Session]:
    """Every user's session of this name (for the command line, which may name no user)."""
    rows = conn.execute(
        f"SELECT {SESSION_COLS} FROM sessions WHERE name = ? ORDER BY user_id{binary_order(conn)}",
        (name,),
    )
    return [session_of(r) for r in rows]


def free_session_id(conn: Connection, user_id: str, name: str) -> str:
    """An id no session has, for the user's new session ``name``: the name itself if free."""
    digest = hashlib.sha256(f"{len(user_id)}:{user_id}\0{name}".encode()).hexdigest()[:16]
    for candidate in (name, f"{name}~{digest}"):
        if queries.get_session(conn, candidate) is None:
            return candidate
    while True:
        candidate = "s-" + uuid.uuid4().hex[:20]
        if queries.get_session(conn, candidate) is None:
            return candidate


def create_named(
    conn: Connection,
    user_id: str,
    name: str,
    *,
    parent_id: str | None,
    agent: str | None,
    fingerprint: str | None,
    indexed: bool | None,
    now: float,
    session_id: str | None = None,
) -> Session:
    """The user's session ``name``, created (with ``session_id`` when that id is free, else one
    from :func:`free_session_id`) if the user has none of that name."""
    found = named_session(conn, user_id, name)
    if found is not None:
        return found
    if session_id is None or queries.get_session(conn, session_id) is not None:
        session_id = free_session_id(conn, user_id, name)
    return queries.get_or_create_session(
        conn,
        user_id,
        session_id,
        parent_id=parent_id,
        agent=agent,
        fingerprint=fingerprint,
        indexed=indexed,
        now=now,
        name=name,
    )


def session_names(conn: Connection, ids: Iterable[str]) -> dict[str, str]:
    """The name of each of these sessions (by id); unknown ids are left out."""
    rows = conn.execute(
        f"SELECT id, name FROM sessions WHERE id IN {texts_in(conn)}",
        (json_list(set(ids)),),
    )
    return {str(r[0]): str(r[1]) for r in rows}
