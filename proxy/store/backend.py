"""Which backend a store target names, and opening, migrating and naming it.

A target is a SQLite file path or a PostgreSQL URL (``postgresql://`` or ``postgres://``,
``[memory] backend = "postgres"`` with ``[memory] postgres_url``). What is shown of a URL
(logs, health, doctor) is :func:`display`'s: no user, password or query.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.store.sqlite import migrations
from proxy.store.sqlite.db import Connection, connect

PG_SCHEMES = ("postgresql://", "postgres://")


def is_url(target: str | Path) -> bool:
    """Whether ``target`` is a PostgreSQL URL (else a SQLite path)."""
    return isinstance(target, str) and target.startswith(PG_SCHEMES)


def display(target: str | Path) -> str:
    """``target`` as it may be shown: a URL without user, password, query or fragment."""
    if not is_url(target):
        return str(target)
    parts = urlsplit(str(target))
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def name(target: str | Path) -> str:
    """The backend's name: ``postgres`` or ``sqlite``."""
    return "postgres" if is_url(target) else "sqlite"


def open_connection(target: str | Path, *, readonly: bool = False) -> Connection:
    """A connection to ``target`` with the project's settings (typed as SQLite's: the store's
    functions use the surface both share)."""
    if is_url(target):
        from proxy.store.postgres.connection import connect as pg_connect

        conn: Any = pg_connect(str(target), readonly=readonly)
        return conn  # type: ignore[no-any-return]
    return connect(Path(target), readonly=readonly)


def migrate(conn: Connection) -> list[int]:
    """Apply the target's pending migrations; the versions applied."""
    from proxy.store.dialect import is_pg

    if is_pg(conn):
        from proxy.store.postgres.migrate import migrate as pg_migrate

        return pg_migrate(conn)
    return migrations.migrate(conn)
