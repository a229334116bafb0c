"""How rows of ``sessions`` and ``turns`` are read, shared by the modules that query them.

- :data:`SESSION_COLS`, :data:`TURN_COLS` (and :data:`TURN_COLS_T`, prefixed ``t.``): the
  columns every query selects, in the order :func:`session_of` and :func:`turn_of` read them.
- :func:`json_list`: a list passed as one parameter, unpacked in SQL by ``json_each(?)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from proxy.store.models import Session, Turn

SESSION_COLS = (
    "id, user_id, parent_id, level, agent, created_at, last_seen, fingerprint, indexed, name"
)
TURN_COLS = (
    "id, session_id, user_id, position, role, speaker, content, tool_calls, tool_call_id, "
    "timestamp, token_count, content_hash, incomplete, api, recall"
)
CONTENT_COLUMN = 6  # of TURN_COLS
TURN_COLS_T = ", ".join(f"t.{c.strip()}" for c in TURN_COLS.split(","))


def session_of(row: Sequence[Any]) -> Session:
    """The :class:`Session` of a row selected with :data:`SESSION_COLS`."""
    return Session(
        id=row[0],
        user_id=row[1],
        parent_id=row[2],
        level=row[3],
        agent=row[4],
        created_at=row[5],
        last_seen=row[6],
        fingerprint=row[7],
        indexed=bool(row[8]),
        name=row[9] if row[9] is not None else row[0],
    )


def turn_of(row: Sequence[Any]) -> Turn:
    """The :class:`Turn` of a row selected with :data:`TURN_COLS` (or :data:`TURN_COLS_T`)."""
    return Turn(
        id=row[0],
        session_id=row[1],
        user_id=row[2],
        position=row[3],
        role=row[4],
        speaker=row[5],
        content=row[6],
        tool_calls=json.loads(row[7]) if row[7] is not None else None,
        tool_call_id=row[8],
        timestamp=row[9],
        token_count=row[10],
        content_hash=row[11],
        incomplete=bool(row[12]),
        api=row[13],
        recall=row[14],
    )


def json_list(values: Iterable[Any]) -> str:
    """``values`` as a JSON array: one SQL parameter, read back with ``json_each(?)``."""
    return json.dumps(list(values))
