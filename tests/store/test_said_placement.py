"""Placement by what was said (:mod:`proxy.said`, :mod:`proxy.store.said_match`) on both
backends: a conversation resent otherwise continues its session, only within its user, and
only through its first reply."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from proxy.chat.archive import to_new_turns
from proxy.chat.sessions import PlacementRequest, commit_turns, place
from proxy.messages import anchor_length, chain_hashes
from proxy.said import said_chain
from proxy.store import backend
from proxy.store.sqlite.db import Connection

REMINDER = "<system-reminder>\nToday is Saturday.\n</system-reminder>\n"


def request(user: str, messages: list[dict[str, Any]]) -> PlacementRequest:
    chains = chain_hashes(messages)
    return PlacementRequest(user, None, chains, anchor_length(messages), messages=messages)


def archive(c: Connection, user: str, messages: list[dict[str, Any]], reply: str) -> str:
    """Place and store a request and its reply, as the pipeline does; the session's id."""
    placement = place(c, request(user, messages), time.time())
    whole = [*messages, {"role": "assistant", "content": reply}]
    said, _ = said_chain(whole)
    picked = [
        i
        for i in range(placement.matched, len(whole))
        if not placement.by_words or said[i] is not None
    ]
    rows = to_new_turns(
        [whole[i] for i in picked],
        [chain_hashes(whole)[i] for i in picked],
        placement.next_position,
        False,
        time.time(),
        said=[said[i] for i in picked],
    )
    c.execute("BEGIN IMMEDIATE")  # "BEGIN" on PostgreSQL
    session, _ = commit_turns(c, placement, rows, time.time())
    c.execute("COMMIT")
    return session.id


def contents(c: Connection, sid: str) -> list[str]:
    rows = c.execute(
        "SELECT content FROM turns WHERE session_id = ? ORDER BY position", (sid,)
    ).fetchall()
    return [str(r[0]) for r in rows]


def test_a_conversation_resent_otherwise_continues_only_its_users_session(
    store_target: str | Path,
) -> None:
    c = backend.open_connection(store_target)
    backend.migrate(c)
    try:
        first = [
            {"role": "system", "content": "You are helpful. Today is Friday."},
            {"role": "user", "content": REMINDER + "My cat is called Ziggy."},
        ]
        sid = archive(c, "ann", first, "Lovely name!")
        resent = [
            {"role": "system", "content": "You are helpful. Today is Saturday."},
            {"role": "user", "content": "My cat is called Ziggy.  "},
            {"role": "assistant", "content": "Lovely  name!\n"},
            {"role": "user", "content": "She is three."},
        ]
        placement = place(c, request("ann", resent), time.time())
        assert placement.by_words and not placement.created
        assert placement.session.id == sid and placement.matched == 3
        assert archive(c, "ann", resent, "Noted.") == sid
        assert contents(c, sid) == [
            "",  # the system message: scaffolding
            "My cat is called Ziggy.",
            "Lovely name!",
            "She is three.",
            "Noted.",
        ]
        # Another user saying the same is not in ann's session.
        assert place(c, request("bob", resent), time.time()).created
        # A first reply said otherwise: another conversation.
        other = [*resent[:2], {"role": "assistant", "content": "Cute!"}, resent[3]]
        assert place(c, request("ann", other), time.time()).created
        assert not place(c, request("ann", other), time.time()).by_words
    finally:
        c.close()
