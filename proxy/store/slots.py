"""The ``slots`` table (migration 5): tool-result slots kept in the SQLite file, the embedded
backend of :mod:`proxy.slots` (:class:`proxy.slots.embedded.EmbeddedSlots` runs these).

A row belongs to one user namespace (``user_id``, ``id``) and lives until ``expires_at``; a row
past it counts as gone and :func:`purge_slots` deletes it. Forgetting a user deletes their rows
(trigger ``users_ad_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from proxy.store.dialect import binary_order
from proxy.store.sqlite.db import Connection


class SlotRow(NamedTuple):
    """What a slot row holds for its reader (besides sizes and times)."""

    id: str
    tool: str
    content: str
    tokens: int
    description: str


def upsert_slots(
    conn: Connection, user: str, slots: Sequence[SlotRow], now: float, ttl: float
) -> None:
    """Store ``slots`` for ``user``, expiring at ``now + ttl``; a slot stored again keeps its
    ``created_at`` unless it had expired."""
    conn.executemany(
        "INSERT INTO slots(user_id, id, tool, description, content, tokens, bytes, created_at,"
        " expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(user_id, id) DO UPDATE SET tool = excluded.tool,"
        " description = excluded.description, content = excluded.content,"
        " tokens = excluded.tokens, bytes = excluded.bytes, expires_at = excluded.expires_at,"
        " created_at = CASE WHEN slots.expires_at <= excluded.created_at"
        " THEN excluded.created_at ELSE slots.created_at END",
        [
            (
                user,
                s.id,
                s.tool,
                s.description,
                s.content,
                s.tokens,
                len(s.content.encode("utf-8", "surrogatepass")),
                now,
                now + ttl,
            )
            for s in slots
        ],
    )


def take_slot(conn: Connection, user: str, slot_id: str, now: float, ttl: float) -> SlotRow | None:
    """The unexpired slot with its expiry pushed to ``now + ttl``, or None."""
    row = conn.execute(
        "UPDATE slots SET expires_at = ? WHERE user_id = ? AND id = ? AND expires_at > ?"
        " RETURNING id, tool, content, tokens, description",
        (now + ttl, user, slot_id, now),
    ).fetchone()
    if row is None:
        return None
    return SlotRow(id=row[0], tool=row[1], content=row[2], tokens=int(row[3]), description=row[4])


def purge_slots(conn: Connection, now: float) -> int:
    """Delete the rows expired by ``now``; how many."""
    return conn.execute("DELETE FROM slots WHERE expires_at <= ?", (now,)).rowcount


def slot_figures(conn: Connection, now: float) -> tuple[int, int]:
    """(slots, bytes) of every user's rows not expired at ``now``."""
    row = conn.execute(
        "SELECT count(*), coalesce(sum(bytes), 0) FROM slots WHERE expires_at > ?", (now,)
    ).fetchone()
    return int(row[0]), int(row[1])


def forget_slots(conn: Connection, user: str) -> int:
    """Delete every row of ``user``; how many."""
    return conn.execute("DELETE FROM slots WHERE user_id = ?", (user,)).rowcount


def user_slot_sizes(conn: Connection, user: str, now: float) -> list[tuple[str, int, float]]:
    """(id, bytes, expires_at) of ``user``'s rows not expired at ``now`` (the per-user slot
    caps of ``[limits]`` start from these)."""
    rows = conn.execute(
        "SELECT id, bytes, expires_at FROM slots WHERE user_id = ? AND expires_at > ?",
        (user, now),
    )
    return [(str(r[0]), int(r[1]), float(r[2])) for r in rows]


class SlotSummary(NamedTuple):
    """A slot row without its content (the inspector's listing)."""

    id: str
    tool: str
    description: str
    tokens: int
    bytes: int
    created_at: float
    expires_at: float


def user_slot_page(
    conn: Connection,
    user: str,
    now: float,
    *,
    limit: int,
    offset: int = 0,
    description_chars: int = 200,
) -> tuple[list[SlotSummary], int]:
    """A page of ``user``'s rows not expired at ``now``, the latest expiry (last use) first,
    descriptions cut to ``description_chars``, content not read; and how many such rows."""
    live = "FROM slots WHERE user_id = ? AND expires_at > ?"
    (total,) = conn.execute(f"SELECT count(*) {live}", (user, now)).fetchone()
    rows = conn.execute(
        "SELECT id, tool, substr(description, 1, ?), tokens, bytes, created_at, expires_at"
        f" {live} ORDER BY expires_at DESC, id{binary_order(conn)} LIMIT ? OFFSET ?",
        (description_chars, user, now, limit, offset),
    )
    return [
        SlotSummary(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4]), float(r[5]), float(r[6]))
        for r in rows
    ], int(total)
