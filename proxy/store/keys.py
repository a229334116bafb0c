"""The ``api_keys`` table: Engram's own keys (``auth.mode = "keys"``), each naming its user.

Only a hash of a key's secret part is stored; the key itself is shown once, when made. The key
format and the hashing live in :mod:`proxy.keys`; this module is the SQL.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.store.sqlite.db import Connection


@dataclass(frozen=True)
class KeyRow:
    id: str
    user_id: str
    secret_hash: str
    admin: bool
    label: str
    created_at: float
    revoked_at: float | None


_COLUMNS = "id, user_id, secret_hash, admin, label, created_at, revoked_at"


def _row(r: tuple[object, ...]) -> KeyRow:
    rev = r[6]
    return KeyRow(
        str(r[0]),
        str(r[1]),
        str(r[2]),
        bool(r[3]),
        str(r[4]),
        float(r[5]),  # type: ignore[arg-type]
        float(rev) if rev is not None else None,  # type: ignore[arg-type]
    )


def insert_key(
    conn: Connection, key_id: str, user: str, secret_hash: str, admin: bool, label: str, now: float
) -> None:
    conn.execute(
        f"INSERT INTO api_keys({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, NULL)",
        (key_id, user, secret_hash, int(admin), label, now),
    )


def find_key(conn: Connection, key_id: str) -> KeyRow | None:
    """The key with this id, revoked or not."""
    row = conn.execute(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,)).fetchone()
    return _row(tuple(row)) if row else None


def list_keys(conn: Connection, user: str | None = None) -> list[KeyRow]:
    """Every key (or one user's), oldest first."""
    if user is None:
        rows = conn.execute(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id")
    else:
        rows = conn.execute(
            f"SELECT {_COLUMNS} FROM api_keys WHERE user_id = ? ORDER BY created_at, id", (user,)
        )
    return [_row(tuple(r)) for r in rows]


def revoke_key(conn: Connection, key_id: str, now: float) -> bool:
    """Revoke a working key; False when there is no such key or it was revoked already."""
    cur = conn.execute(
        "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, key_id)
    )
    return cur.rowcount > 0


def count_active_keys(conn: Connection) -> int:
    row = conn.execute("SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL").fetchone()
    return int(row[0])
