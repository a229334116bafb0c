"""Finding a conversation by what was said (:mod:`proxy.said`): the stored turns whose
``said_hash`` a request's said chain holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.store.dialect import texts_in
from proxy.store.rows import json_list
from proxy.store.sqlite.db import Connection

MAX_ALIKE = 8
"""Most sessions holding the longest prefix that are looked at (the most recently seen)."""


@dataclass(frozen=True, slots=True)
class SaidMatch:
    """A stored session holding a prefix of what a request says: through the request's message
    ``index``, whose turn is at ``position``; ``free`` when nothing said is stored after it."""

    session_id: str
    index: int
    position: int
    free: bool


def _wanted(said: Sequence[str | None]) -> dict[str, int]:
    return {h: i for i, h in enumerate(said) if h is not None}


def _last_said(conn: Connection, session_id: str) -> int:
    (last,) = conn.execute(
        "SELECT max(position) FROM turns WHERE session_id = ? AND said_hash IS NOT NULL",
        (session_id,),
    ).fetchone()
    return -1 if last is None else int(last)


def longest_said(
    conn: Connection,
    user_id: str,
    said: Sequence[str | None],
    min_index: int,
    parent_id: str | None = None,
) -> SaidMatch | None:
    """The user's session (among those under ``parent_id``) holding the longest prefix of what
    ``said`` says, reaching at least message ``min_index``: of those holding it, the most
    recently seen (of the first :data:`MAX_ALIKE`) with nothing said after it, else the most
    recently seen."""
    wanted = _wanted(said)
    if not wanted:
        return None
    rows = conn.execute(
        "SELECT t.session_id, t.position, t.said_hash, s.last_seen FROM turns t"
        " JOIN sessions s ON s.id = t.session_id"
        f" WHERE t.user_id = ? AND t.said_hash IN {texts_in(conn)}"
        " AND s.parent_id IS NOT DISTINCT FROM ?",
        (user_id, json_list(wanted), parent_id),
    ).fetchall()
    found = sorted(
        (
            (wanted[str(h)], float(seen), str(sid), int(pos))
            for sid, pos, h, seen in rows
            if wanted[str(h)] >= min_index
        ),
        reverse=True,
    )
    if not found:
        return None
    best = found[0][0]
    matches = [
        SaidMatch(sid, index, pos, _last_said(conn, sid) == pos)
        for index, _, sid, pos in found[:MAX_ALIKE]
        if index == best
    ]
    return next((m for m in matches if m.free), matches[0])


def said_in(conn: Connection, session_id: str, said: Sequence[str | None]) -> int | None:
    """The index of the last message of ``said`` whose hash the session holds (None: none)."""
    wanted = _wanted(said)
    if not wanted:
        return None
    rows = conn.execute(
        f"SELECT said_hash FROM turns WHERE session_id = ? AND said_hash IN {texts_in(conn)}",
        (session_id, json_list(wanted)),
    ).fetchall()
    held = [wanted[str(r[0])] for r in rows]
    return max(held) if held else None
