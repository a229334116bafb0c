"""Counts behind the per-user caps of ``[limits]``: one user's turns (an indexed count on
``turns_user``, run rarely: :class:`proxy.chat.quota.TurnQuota` caches it between counts)."""

from __future__ import annotations

from proxy.store.sqlite.db import Connection


def user_turn_count(conn: Connection, user_id: str) -> int:
    """How many turns ``user_id``'s memory holds (a scan of their entries in ``turns_user``)."""
    row = conn.execute("SELECT count(*) FROM turns WHERE user_id = ?", (user_id,)).fetchone()
    return int(row[0])
