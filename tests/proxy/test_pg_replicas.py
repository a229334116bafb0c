"""Two Engram servers on one PostgreSQL (the postgres backend): what one archives, the other
recalls, through the real HTTP surface; counters both flush into the one database."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import psycopg
import pytest

from testing.fake_upstream import FakeUpstream
from testing.harness import start_engram
from testing.postgres import PostgresError, PostgresServer, postgres_server

pytestmark = pytest.mark.asyncio


@pytest.fixture
def pg() -> Iterator[PostgresServer]:
    try:
        with postgres_server() as server:
            yield server
    except PostgresError as exc:
        pytest.fail(str(exc), pytrace=False)


async def test_a_fact_told_through_one_replica_is_recalled_through_the_other(
    pg: PostgresServer, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE memory")
    url = pg.url.rsplit("/", 1)[0] + "/memory"
    memory = {"backend": "postgres", "postgres_url": url}
    a = await start_engram(fake.url, memory=memory)
    b = await start_engram(fake.url, memory=memory)
    try:
        told = [{"role": "user", "content": "My cat is called Zorblax and she likes tuna."}]
        r = await http.post(f"{a.url}/v1/chat/completions", json={"model": "m", "messages": told})
        assert r.status == 200, await r.text()
        asked = [{"role": "user", "content": "What is my cat called?"}]
        for _ in range(50):  # archived in the background through A
            r = await http.post(
                f"{b.url}/v1/chat/completions", json={"model": "m", "messages": asked}
            )
            assert r.status == 200, await r.text()
            if int(r.headers["X-Engram-Memories"]) > 0:
                break
            await asyncio.sleep(0.2)
        assert int(r.headers["X-Engram-Memories"]) > 0
        assert "Zorblax" in str(fake.chat_requests()[-1].json()["messages"])
    finally:
        await a.close()
        await b.close()
    with psycopg.connect(url, autocommit=True) as conn:
        sessions = conn.execute("SELECT count(*) FROM sessions").fetchone()
        counters = conn.execute("SELECT count(*) FROM counters").fetchone()
    assert sessions is not None and sessions[0] >= 2
    assert counters is not None and counters[0] > 0  # both flushed at close, no conflict error
