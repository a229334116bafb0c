"""What ``engram doctor`` asks a PostgreSQL (:mod:`proxy.cli.doctor_pg` judges it): the server's
version, the ``vector`` extension installed in the database or available on the server (and,
installed, whether its distances compute: a pgvector compiled for another CPU kills the backend
with SIGILL on the first one), whether the role is a superuser, and the schema versions
applied. Opened with a short connect timeout and statement timeout, in autocommit, never
migrating or creating anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from proxy.store.postgres.connection import normalise_url
from proxy.store.postgres.migrate import applied_versions

CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT = "5s"
# The distance the store's search uses (cosine, ``<=>`` on ``vector``), on vectors long enough
# for pgvector's SIMD loops (384-d, as the default embedder's); the tests' PostgreSQL
# (testing.postgres) proves its build with it too.
VECTOR_PROBE = """
SELECT v <=> w
FROM (SELECT array_fill(0.25::real, ARRAY[384])::vector AS v,
             array_fill(0.5::real, ARRAY[384])::vector AS w) AS pair
"""


@dataclass(frozen=True)
class ServerFacts:
    version: str
    vector_installed: str | None  # the extension's version in this database
    vector_available: str | None  # the version the server could install
    superuser: bool
    schema_versions: list[int]
    # installed but a distance failed: why, and whether that broke the connection (the backend
    # died, as a pgvector built for a CPU feature this one lacks does)
    vector_error: str | None = None
    vector_crashed: bool = False


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
        facts = _facts(raw)
        if facts.vector_installed is None:
            return facts
        try:
            raw.execute(VECTOR_PROBE).fetchall()
        except Exception as exc:
            return replace(facts, vector_error=_first_line(exc), vector_crashed=bool(raw.broken))
        return facts
    finally:
        raw.close()


def _facts(raw: Any) -> ServerFacts:
    """Everything but the distance probe; :class:`QueryFailed` if a question fails."""
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
        raise QueryFailed(_first_line(exc)) from exc


def _first_line(exc: BaseException) -> str:
    said = str(exc).strip()
    return said.splitlines()[0] if said else type(exc).__name__
