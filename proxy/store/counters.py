"""The ``counters`` table, and the figures of the memory loop counted from its own rows.

``counters`` holds running totals by name (tokens proxied and spent, slot puts/hits/misses/errors
per backend): a server adds what it counted since its last write, so several servers on one
database add up. :func:`memory_counts` counts hand-backs, facts, requests, feedback and the queue
where they are stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from proxy.store.dialect import cross_join
from proxy.store.feedback import queue_counts
from proxy.store.sqlite.db import Connection


def all_counters(conn: Connection, names: Iterable[str] = ()) -> dict[str, int]:
    """Every stored counter by name, and 0 for those of ``names`` never written."""
    totals = dict.fromkeys(names, 0)
    for name, value in conn.execute("SELECT name, value FROM counters"):
        totals[str(name)] = int(value)
    return totals


def counter_values(conn: Connection, names: Iterable[str]) -> dict[str, int]:
    """The counters named (one point lookup each), 0 for those never written."""
    out: dict[str, int] = {}
    for name in names:
        row = conn.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        out[name] = int(row[0]) if row else 0
    return out


def add_counters(conn: Connection, deltas: Mapping[str, int]) -> None:
    """Add each non-zero delta to its counter (created at 0 when new)."""
    conn.executemany(
        "INSERT INTO counters(name, value) VALUES (?, ?)"
        " ON CONFLICT(name) DO UPDATE SET value = counters.value + excluded.value",
        [(k, v) for k, v in deltas.items() if v],
    )


def memory_counts(conn: Connection, user_id: str | None = None) -> dict[str, Any]:
    """Hand-backs, facts, recorded requests, feedback and the queue (one user's, or all)."""
    where, args = ("", ()) if user_id is None else (" AND user_id = ?", (user_id,))

    def count(sql: str) -> int:
        return int(conn.execute(sql + where, args).fetchone()[0])

    def items(role: str, sourced: bool = False) -> int:
        """Memory items (negative positions) of a role; one user's found session by session
        in the (session_id, position) index, not among all their turns (40 ms at 100,000
        turns, this way 3 ms)."""
        extra = " AND t.source_session IS NOT NULL" if sourced else ""
        if user_id is None:
            sql = f"SELECT count(*) FROM turns t WHERE t.role = ?{extra}"
            return int(conn.execute(sql, (role,)).fetchone()[0])
        sql = (
            f"SELECT count(*) FROM sessions s {cross_join(conn)} turns t"
            " ON t.session_id = s.id AND t.position < 0"
            f" WHERE s.user_id = ? AND t.role = ?{extra}"
        )
        return int(conn.execute(sql, (user_id, role)).fetchone()[0])

    return {
        "handbacks": items("summary", sourced=True),
        "facts": items("fact"),
        "requests": count("SELECT count(*) FROM requests WHERE TRUE"),
        "feedback": {
            "unhelpful": count("SELECT count(*) FROM feedback WHERE helpful = 0"),
            "helpful": count("SELECT count(*) FROM feedback WHERE helpful = 1"),
        },
        "queue": queue_counts(conn, user_id),
    }


CALIBRATION_KEY = "token_calibration"
"""The ``meta`` key of the token counts' per-model corrections (proxy.tokens.TokenCounter)."""


def token_calibration(conn: Connection) -> dict[str, Any]:
    """The per-model token corrections the processes on this database learned (empty: none)."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (CALIBRATION_KEY,)).fetchone()
    try:
        found = json.loads(row[0]) if row else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def save_token_calibration(conn: Connection, learned: Mapping[str, Mapping[str, float]]) -> None:
    """Merge ``learned`` into the stored corrections (its models' values replace theirs)."""
    stored = token_calibration(conn)
    for kind, values in learned.items():
        kept = stored.get(kind)
        merged = dict(kept) if isinstance(kept, dict) else {}
        merged.update(values)
        stored[kind] = merged
    conn.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?)"
        " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (CALIBRATION_KEY, json.dumps(stored, sort_keys=True)),
    )
