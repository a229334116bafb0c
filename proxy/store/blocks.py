"""The ``prompt_blocks`` table (migration 17): which memories Engram laid before which user
message of a conversation, so that every later request lays the same block in the same place
and the forwarded prompt keeps extending the one before it (DESIGN.md, invariant 4).

A record names its message by the message's chain hash (:func:`proxy.messages.chain_hashes`: the
message and every message before it) and the session that laid it (the block's tag is made from
it, and forgetting that session takes the record with it, by cascade), and holds the memories'
turn ids, best first: never their text. Which records a request uses is
:mod:`proxy.chat.laying`'s choice (its own session's; a forked conversation's, for the messages
it shares after the first reply). The block is rendered again from the turns each time (the
fence secret is shared by every process on the database), so a turn forgotten, muted or edited
since leaves the block as it would be made now."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.store.sqlite.db import Connection

MAX_IDS = 100
"""Most memory ids one record keeps (``retrieval.top_k``'s ceiling)."""


@dataclass(frozen=True, slots=True)
class Record:
    """What was laid before one user message: by which session, which memories, and when (the
    block shows the days of that year without it: :func:`proxy.chat.fence.day`)."""

    session_id: str
    ids: list[int]
    created_at: float = 0.0


def blocks_of(conn: Connection, user_id: str, chains: Sequence[str]) -> dict[str, list[Record]]:
    """The user's records for the messages of ``chains`` that have any: chain -> records, the
    oldest first."""
    out: dict[str, list[Record]] = {}
    wanted = list(dict.fromkeys(chains))
    for i in range(0, len(wanted), 500):  # within any backend's parameter limit
        part = wanted[i : i + 500]
        marks = ",".join("?" * len(part))
        for chain, session_id, ids, created_at in conn.execute(
            f"SELECT chain, session_id, turn_ids, created_at FROM prompt_blocks"
            f" WHERE user_id = ? AND chain IN ({marks}) ORDER BY created_at, session_id",
            (user_id, *part),
        ):
            at = float(created_at) if isinstance(created_at, int | float) else 0.0
            out.setdefault(str(chain), []).append(Record(str(session_id), _ids(ids), at))
    return out


def put_block(
    conn: Connection, user_id: str, chain: str, session_id: str, ids: Sequence[int], now: float
) -> None:
    """Record the memories the session laid before the message ``chain`` at ``now`` (when the
    block was made: its year is the block's, :func:`proxy.chat.fence.day`; the first record
    stays: a message's block never changes once forwarded). A session that is gone records
    nothing."""
    conn.execute(
        "INSERT INTO prompt_blocks(user_id, chain, session_id, turn_ids, created_at)"
        " SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?)"
        " ON CONFLICT(user_id, chain, session_id) DO NOTHING",
        (user_id, chain, session_id, json.dumps([int(i) for i in ids[:MAX_IDS]]), now, session_id),
    )


def _ids(text: object) -> list[int]:
    """A record's ids, read defensively (anything but a list of integers reads as none)."""
    try:
        value = json.loads(str(text))
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
