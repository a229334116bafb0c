"""What ``engram doctor`` asks a PostgreSQL (:mod:`proxy.cli.doctor_pg` judges it): the server's
version, the ``vector`` extension installed in the database or available on the server, whether
the role is a superuser, and the schema versions applied. Opened with a short connect timeout
and statement timeout, in autocommit, never migrating or creating anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.store.pg.connection import normalise_url
from proxy.store.pg.migrate import applied_versions

CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT = "5s"


@dataclass(frozen=True)
class ServerFacts:
    version: str
    vector_installed: str | None  # the extension's version in this database
    vector_available: str | None  # the version the server could install
    superuser: bool
    schema_versions: list[int]


class QueryFailed(RuntimeError):
    """The server answered the connection but a question failed (``__cause__``: why)."""


def facts_reached(exc: BaseException) -> bool:
    """Whether :func:`server_facts` failed after the server answered."""
    return isinstance(exc, QueryFailed)


def _connect(url: str) -> Any:
    import psycopg

    raw = psycopg.connect(
        normalise_url(url),
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT_S,
        application_name="engram doctor",
    )
    raw.execute(f"SET statement_timeout = '{STATEMENT_TIMEOUT}'")
    return raw


def _one(raw: Any, sql: str) -> Any:
    row = raw.execute(sql).fetchone()
    return None if row is None else row[0]


def server_facts(url: str) -> ServerFacts:
    """Ask the server at ``url`` (blocking: run it off the event loop). A connection that
    fails raises the driver's error; a question that fails, :class:`QueryFailed`."""
    raw = _connect(url)
    try:
        return ServerFacts(
            version=str(_one(raw, "SHOW server_version")),
            vector_installed=_one(
                raw, "SELECT extversion FROM pg_extension WHERE extname = 'vector'"
            ),
            vector_available=_one(
                raw, "SELECT default_version FROM pg_available_extensions WHERE name = 'vector'"
            ),
            superuser=bool(_one(raw, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")),
            schema_versions=applied_versions(raw),
        )
    except Exception as exc:
        raise QueryFailed(str(exc).strip().splitlines()[0] if str(exc).strip() else "") from exc
    finally:
        raw.close()
