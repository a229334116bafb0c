"""What a search may return: the scope filters both in-memory searches share (the vectors of
:mod:`proxy.store.caches.vec_cache`, the terms of :mod:`proxy.store.caches.term_cache`), over rows
that carry
each turn's id, session, ``indexed`` flag and role as small integer codes; and the one rule
both caches follow before loading a user (:func:`claim_load`); and the rows of a search's
candidates (:func:`turn_rows`)."""

from __future__ import annotations

import threading
from collections.abc import Container, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from proxy.store.dialect import ids_in
from proxy.store.rows import TURN_COLS, json_list
from proxy.store.sqlite.db import Connection


class Codes:
    """Small integer codes for strings (sessions, roles), so filters compare ints."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}

    def code(self, text: str) -> int:
        found = self.of.get(text)
        if found is None:
            found = self.of[text] = len(self.of)
        return found

    def codes(self, texts: Sequence[str]) -> npt.NDArray[np.int32]:
        return np.array([self.of[t] for t in texts if t in self.of], dtype=np.int32)


class Scoped(Protocol):
    """Rows that carry what a search's scope looks at (:class:`_Rows`, a user's full-text
    index in :mod:`proxy.store.caches.term_cache`)."""

    @property
    def ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def session(self) -> npt.NDArray[np.int32]: ...
    @property
    def indexed(self) -> npt.NDArray[np.bool_]: ...
    @property
    def role(self) -> npt.NDArray[np.int32]: ...
    @property
    def sessions(self) -> Codes: ...
    @property
    def roles(self) -> Codes: ...


def in_scope(
    rows: Scoped,
    n: int,
    session_ids: Sequence[str] | None,
    exclude_ids: Sequence[int],
    exclude_sessions: Sequence[str],
    exclude_roles: Sequence[str],
) -> npt.NDArray[np.bool_]:
    """Which of the first ``n`` rows a search may return: the ``indexed`` ones, or (with
    ``session_ids``) those of exactly these sessions, less the excluded ids, sessions and
    roles."""
    if session_ids is None:
        keep = rows.indexed[:n].copy()
    else:
        keep = np.isin(rows.session[:n], rows.sessions.codes(session_ids))
    if exclude_sessions:
        keep &= ~np.isin(rows.session[:n], rows.sessions.codes(exclude_sessions))
    if exclude_roles:
        keep &= ~np.isin(rows.role[:n], rows.roles.codes(exclude_roles))
    if exclude_ids:
        keep &= ~np.isin(rows.ids[:n], np.asarray(list(exclude_ids), dtype=np.int64))
    return keep


def claim_load(
    lock: threading.Lock, held: Container[str], scheduled: set[str], user_id: str
) -> bool:
    """True, and ``user_id`` marked in ``scheduled``, when the user is neither held nor already
    scheduled to load: one load per user at a time, claimed under the cache's ``lock``."""
    with lock:
        if user_id in held or user_id in scheduled:
            return False
        scheduled.add(user_id)
        return True


def turn_rows(conn: Connection, ids: Sequence[int], user_id: str) -> dict[int, tuple[Any, ...]]:
    """The user's turns of ``ids`` as raw rows of :data:`~proxy.store.rows.TURN_COLS`, by id
    (no :class:`~proxy.store.models.Turn` made: a search builds those of the few results it
    keeps, :func:`~proxy.store.rows.turn_of`, and scores the rest from the rows)."""
    if not ids:
        return {}
    rows = conn.execute(
        f"SELECT {TURN_COLS} FROM turns WHERE id IN {ids_in(conn)} AND user_id = ?",
        (json_list(ids), user_id),
    )
    return {int(row[0]): tuple(row) for row in rows}
