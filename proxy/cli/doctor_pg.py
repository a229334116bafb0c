"""``engram doctor`` on PostgreSQL (``[memory] backend = "postgres"``): the server, pgvector, the
schema's version, one line each.

- ``postgres``: the server answers within :data:`CONNECT_TIMEOUT_S` (its version).
- ``pgvector``: the ``vector`` extension is installed in the database (its version) and its
  distances compute (one query over two 384-d vectors; a pgvector compiled with
  ``-march=native`` for another CPU kills the backend with SIGILL there, and the line says so);
  not yet installed is fine only where Engram's first start can create it (a superuser, schema
  not made yet), otherwise the line says who must run ``CREATE EXTENSION vector``.
- ``schema``: the schema's version is this Engram's
(:func:`proxy.store.postgres.migrate.latest_version`);
  behind or ahead fails, naming both versions. No schema yet is fine (made at first start).

The URL is shown as :func:`proxy.store.backend.display` shows it: no user, no password.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.cli.checks import Check
from proxy.redact import redact
from proxy.store.backend import display
from proxy.store.postgres.connection import redact_error
from proxy.store.postgres.migrate import latest_version
from proxy.store.postgres.probe import ServerFacts, facts_reached, server_facts


@dataclass(frozen=True)
class PgState:
    """What the checks found, and whether the store may be opened (the schema is current:
    opening it must not migrate a database behind, nor refuse one ahead)."""

    checks: list[Check]
    schema_current: bool


def _vector_check(facts: ServerFacts, has_schema: bool) -> Check:
    installed = facts.vector_installed
    if installed is not None and facts.vector_crashed:
        return Check(
            "pgvector",
            False,
            f"vector {installed} installed, but computing a distance dropped the connection "
            f"({facts.vector_error}): the server's backend died, as a pgvector compiled for "
            "another CPU does (built with -march=native where AVX-512 was; see the server's "
            'log for "signal 4"); rebuild it portably: make OPTFLAGS=""',
        )
    if installed is not None and facts.vector_error is not None:
        return Check(
            "pgvector",
            False,
            f"vector {installed} installed, but computing a distance failed: {facts.vector_error}",
        )
    if installed is not None:
        return Check("pgvector", True, f"vector {installed} installed, distances compute")
    available = facts.vector_available
    if available is None:
        return Check(
            "pgvector",
            False,
            "the vector extension is not installed in this database and not available on the "
            "server: install pgvector (https://github.com/pgvector/pgvector) on it",
        )
    if facts.superuser and not has_schema:
        return Check(
            "pgvector", True, f"vector {available} available, created by Engram's first start"
        )
    return Check(
        "pgvector",
        False,
        f"the vector extension is not installed in this database (the server has {available}): "
        "a superuser runs CREATE EXTENSION vector in it",
    )


def _schema_check(versions: list[int]) -> Check:
    latest = latest_version()
    if not versions:
        return Check("schema", True, f"none yet: Engram's first start creates version {latest}")
    current = max(versions)
    if current == latest:
        return Check("schema", True, f"version {current} (this Engram's)")
    if current < latest:
        return Check(
            "schema",
            False,
            f"version {current}, behind this Engram's {latest}: `engram serve` migrates it "
            "at start",
        )
    return Check(
        "schema",
        False,
        f"version {current}, newer than this Engram (knows up to {latest}): upgrade Engram",
    )


def postgres_state(url: str) -> PgState:
    """Connect to ``url`` and check the server, pgvector and the schema (blocking: run it off
    the event loop)."""
    shown = display(url)
    try:
        facts = server_facts(url)
    except Exception as exc:
        why = redact(redact_error(exc))
        reached = facts_reached(exc)
        if reached:
            return PgState([Check("postgres", False, f"{shown}: {why}")], False)
        return PgState(
            [
                Check("postgres", False, f"{shown}: no answer: {why}"),
                Check("pgvector", None, "server not reached"),
                Check("schema", None, "server not reached"),
            ],
            False,
        )
    versions = facts.schema_versions
    schema = _schema_check(versions)
    findings = [
        Check("postgres", True, f"{shown}: PostgreSQL {facts.version}"),
        _vector_check(facts, bool(versions)),
        schema,
    ]
    current = bool(versions) and schema.ok is True and all(c.ok is not False for c in findings)
    return PgState(findings, current)
