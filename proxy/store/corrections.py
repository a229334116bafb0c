"""What a person corrects in their memory, as SQL: forgetting one turn (with what was made from
it), pinning and muting turns (``turns.recall``, migration 13), notes, and facts replaced.

- :func:`forget_turn` deletes one of the user's turns. Its full-text row and vector go by
  trigger (:mod:`proxy.store.sqlite.fts_sql`); what was made from it goes too, since none of it can
  be
  shown not to hold its words: facts distilled from it (``source_turn``), its session's rolling
  summary when that covers it, the hand-backs its (sub-agent) session gave its parent, and the
  request records whose query was its text. Making the bytes leave the file is
  :mod:`proxy.store.sqlite.scrub`'s job, afterwards, as for a session.
- :func:`set_recall`: 1 pins a turn (recalled into every chat of its user: :func:`pinned`),
  -1 mutes it (never recalled), 0 leaves it to search.
- Notes live in the user's ``notes~<user>`` session (a name no client can take), as the user's
  own turns: stored, indexed and recalled like any turn (:func:`notes_session`).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.store.dialect import ids_in, instr
from proxy.store.items import insert_item
from proxy.store.models import NewTurn, Turn
from proxy.store.naming import NOTES_PREFIX, create_named
from proxy.store.rows import TURN_COLS, json_list, turn_of
from proxy.store.sqlite.db import Connection
from proxy.vectors import Vector

RECALL_MODES = {"pinned": 1, "normal": 0, "muted": -1}
"""The names of ``turns.recall``'s values, as the admin API, the CLI and the page say them."""
RECALL_NAMES = {v: k for k, v in RECALL_MODES.items()}
NOTES_AGENT = "engram-notes"


@dataclass(frozen=True)
class TurnForgotten:
    """What :func:`forget_turn` deleted: the turn, and what had been made from it."""

    user_id: str
    turn_id: int
    session_id: str
    role: str
    facts: int
    summaries: int
    handbacks: int
    requests: int


def user_turn(conn: Connection, user_id: str, turn_id: int) -> Turn | None:
    """The user's turn of this id, or None (another user's never answers)."""
    row = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE id = ? AND user_id = ?", (turn_id, user_id)
    ).fetchone()
    return turn_of(row) if row is not None else None


def forget_turn(conn: Connection, user_id: str, turn_id: int) -> TurnForgotten | None:
    """Delete the user's turn and what was made from it (see the module docstring); None when
    the user has no such turn. Call inside a write transaction."""
    turn = user_turn(conn, user_id, turn_id)
    if turn is None:
        return None
    conn.execute("DELETE FROM turns WHERE id = ?", (turn_id,))
    facts = conn.execute(
        "DELETE FROM turns WHERE user_id = ? AND source_turn = ?", (user_id, turn_id)
    ).rowcount
    summaries = handbacks = 0
    if turn.position >= 0:
        summaries = conn.execute(
            "DELETE FROM summaries WHERE session_id = ? AND upto > ?",
            (turn.session_id, turn.position),
        ).rowcount
        handbacks = conn.execute(
            "DELETE FROM turns WHERE user_id = ? AND role = 'summary' AND source_session = ?",
            (user_id, turn.session_id),
        ).rowcount
    text = turn.content.strip()
    requests = 0
    if text:
        requests = conn.execute(
            "DELETE FROM requests WHERE user_id = ? AND session_id = ? AND query != ''"
            f" AND (query = ? OR {instr(conn)}(?, query) > 0 OR {instr(conn)}(query, ?) > 0)",
            (user_id, turn.session_id, text, text, text),
        ).rowcount
    return TurnForgotten(
        user_id, turn_id, turn.session_id, turn.role, facts, summaries, handbacks, requests
    )


def set_recall(conn: Connection, user_id: str, turn_id: int, value: int) -> Turn | None:
    """Pin (1), mute (-1) or release (0) the user's turn; the turn as it is now, or None."""
    if value not in RECALL_NAMES:
        raise ValueError(f"recall is one of {sorted(RECALL_NAMES)}, not {value!r}")
    conn.execute(
        "UPDATE turns SET recall = ? WHERE id = ? AND user_id = ?", (value, turn_id, user_id)
    )
    return user_turn(conn, user_id, turn_id)


def pinned(conn: Connection, user_id: str, limit: int) -> list[Turn]:
    """The user's pinned turns, the newest first (at most ``limit``)."""
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE user_id = ? AND recall = 1 ORDER BY id DESC LIMIT ?",
        (user_id, limit),
    )
    return [turn_of(r) for r in rows]


def notes_session(conn: Connection, user_id: str, now: float) -> str:
    """The id of the user's notes session (``notes~<user>``, indexed), made when first needed."""
    return create_named(
        conn,
        user_id,
        f"{NOTES_PREFIX}{user_id}",
        parent_id=None,
        agent=NOTES_AGENT,
        fingerprint=None,
        indexed=True,
        now=now,
    ).id


def replace_fact(
    conn: Connection, user_id: str, fact_id: int, new: NewTurn, vector: Vector | None
) -> Turn | None:
    """Put ``new`` in place of the user's fact ``fact_id`` (its session, source session, source
    turn and pin or mute kept; a new row, whose id is the old one's again when that was the
    newest), the old row deleted with its index entry and vector; None when the user has no such
    fact. Call inside a write transaction."""
    old = user_turn(conn, user_id, fact_id)
    if old is None or old.role != "fact":
        return None
    source_session, source_turn = fact_sources(conn, [fact_id]).get(fact_id, (None, None))
    conn.execute("DELETE FROM turns WHERE id = ?", (fact_id,))
    new_id = insert_item(conn, old.session_id, user_id, new, vector, None)
    conn.execute(
        "UPDATE turns SET source_session = ?, source_turn = ?, recall = ? WHERE id = ?",
        (source_session, source_turn, old.recall, new_id),
    )
    return user_turn(conn, user_id, new_id)


def fact_sources(conn: Connection, ids: list[int]) -> dict[int, tuple[str | None, int | None]]:
    """(source session, source turn) of each of these items."""
    rows = conn.execute(
        f"SELECT id, source_session, source_turn FROM turns WHERE id IN {ids_in(conn)}",
        (json_list(ids),),
    )
    return {int(r[0]): (r[1], r[2]) for r in rows}
