"""Scaffolding, stored once per user (migration 12): what :mod:`proxy.scaffold` cuts out of the
turns' text, by hash.

A turn's ``content`` holds its words; ``turns.scaffold`` lists the pieces cut out of it as
``[at, hash, lead, trail]`` (the offset in the words, the piece's hash, the white space around
it), and ``scaffolds`` holds each piece's text once per user. :func:`record` writes both when a
turn is inserted, with the sessions that used each piece (``scaffold_sessions``) and the long
paragraphs each session sent (``paragraph_sightings``, hashes only: a paragraph sent again in
another session is scaffolding, :func:`known_paragraphs`). :func:`forget_sessions` deletes what
only forgotten sessions used; :func:`full_contents` puts the text back together (export).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

from proxy.store.dialect import ids_in, texts_in
from proxy.store.models import NewTurn, Scaffold, Turn
from proxy.store.sqlite.db import Connection


def refs_json(pieces: Sequence[Scaffold]) -> str | None:
    """``turns.scaffold`` for these pieces (None for none)."""
    if not pieces:
        return None
    rows = [[p.at, p.hash, p.lead, p.trail] for p in pieces]
    return json.dumps(rows, ensure_ascii=False, separators=(",", ":"))


def join_at(words: str, pieces: Iterable[tuple[int, str]]) -> str:
    """``words`` with each ``(at, text)`` put back at its offset (in order)."""
    out: list[str] = []
    pos = 0
    for at, text in pieces:
        out += (words[pos:at], text)
        pos = at
    out.append(words[pos:])
    return "".join(out)


def record(
    conn: Connection, user_id: str, session_id: str, turns: Sequence[NewTurn], now: float
) -> None:
    """Store the pieces of ``turns`` (inserted into ``session_id``) once for the user, with
    the session's use of them and its sightings of long paragraphs."""
    pieces = {p.hash: p for t in turns for p in t.scaffold}
    if pieces:
        conn.executemany(
            "INSERT INTO scaffolds(user_id, hash, kind, content, created_at, last_seen)"
            " VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(user_id, hash) DO UPDATE SET last_seen = excluded.last_seen",
            [(user_id, h, p.kind, p.content, now, now) for h, p in pieces.items()],
        )
        conn.executemany(
            "INSERT INTO scaffold_sessions(user_id, hash, session_id) VALUES (?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(user_id, h, session_id) for h in pieces],
        )
    seen = {h for t in turns for h in t.sightings}
    if seen:
        conn.executemany(
            "INSERT INTO paragraph_sightings(user_id, hash, session_id) VALUES (?, ?, ?)"
            " ON CONFLICT DO NOTHING",
            [(user_id, h, session_id) for h in seen],
        )


def known_paragraphs(
    conn: Connection, user_id: str, hashes: Sequence[str], session_id: str | None
) -> set[str]:
    """Which of ``hashes`` (of long paragraphs) are scaffolding for the user: stored as such
    already, or sent by another of the user's sessions than ``session_id``."""
    if not hashes:
        return set()
    wanted = json.dumps(sorted(set(hashes)))
    rows = conn.execute(
        f"SELECT hash FROM scaffolds WHERE user_id = ? AND hash IN {texts_in(conn)}"
        " UNION SELECT hash FROM paragraph_sightings WHERE user_id = ?"
        f" AND hash IN {texts_in(conn)} AND session_id IS DISTINCT FROM ?",
        (user_id, wanted, user_id, wanted, session_id),
    )
    return {str(r[0]) for r in rows}


def repeated_hashes(conn: Connection, user_id: str) -> frozenset[str]:
    """Hashes of the paragraphs that became scaffolding by repetition (recall leaves them out
    of turns stored before they did)."""
    rows = conn.execute(
        "SELECT hash FROM scaffolds WHERE user_id = ? AND kind = 'repeated'", (user_id,)
    )
    return frozenset(str(r[0]) for r in rows)


def forget_sessions(conn: Connection, user_id: str, sessions: Sequence[str]) -> int:
    """Delete the sessions' uses and sightings, and the pieces no other session of the user
    uses; how many pieces went. Call inside the forgetting transaction."""
    marks = json.dumps(list(sessions))
    conn.execute(
        f"DELETE FROM paragraph_sightings WHERE user_id = ? AND session_id IN {texts_in(conn)}",
        (user_id, marks),
    )
    hashes = [
        str(r[0])
        for r in conn.execute(
            "DELETE FROM scaffold_sessions WHERE user_id = ?"
            f" AND session_id IN {texts_in(conn)} RETURNING hash",
            (user_id, marks),
        )
    ]
    if not hashes:
        return 0
    return conn.execute(
        f"DELETE FROM scaffolds WHERE user_id = ? AND hash IN {texts_in(conn)}"
        " AND NOT EXISTS (SELECT 1 FROM scaffold_sessions u"
        " WHERE u.user_id = scaffolds.user_id AND u.hash = scaffolds.hash)",
        (user_id, json.dumps(sorted(set(hashes)))),
    ).rowcount


def full_contents(conn: Connection, user_id: str, turn_ids: Sequence[int]) -> dict[int, str]:
    """The text as sent (words with their scaffolding put back) of those of ``turn_ids`` that
    had scaffolding cut out, by id."""
    if not turn_ids:
        return {}
    rows = conn.execute(
        f"SELECT id, content, scaffold FROM turns WHERE id IN {ids_in(conn)}"
        " AND scaffold IS NOT NULL",
        (json.dumps(list(turn_ids)),),
    ).fetchall()
    if not rows:
        return {}
    refs = {int(r[0]): (str(r[1]), json.loads(r[2])) for r in rows}
    wanted = sorted({ref[1] for _, pieces in refs.values() for ref in pieces})
    texts = dict(
        conn.execute(
            f"SELECT hash, content FROM scaffolds WHERE user_id = ? AND hash IN {texts_in(conn)}",
            (user_id, json.dumps(wanted)),
        ).fetchall()
    )
    return {
        turn_id: join_at(
            words, ((at, lead + str(texts.get(h, "")) + trail) for at, h, lead, trail in pieces)
        )
        for turn_id, (words, pieces) in refs.items()
    }


def as_sent(conn: Connection, turns: Sequence[Turn]) -> list[Turn]:
    """``turns`` with their text as sent (:func:`full_contents`) in ``content``."""
    if not turns:
        return []
    by_user: dict[str, list[int]] = {}
    for t in turns:
        by_user.setdefault(t.user_id, []).append(t.id)
    whole: dict[int, str] = {}
    for user, ids in by_user.items():
        whole.update(full_contents(conn, user, ids))
    return [dataclasses.replace(t, content=whole[t.id]) if t.id in whole else t for t in turns]
