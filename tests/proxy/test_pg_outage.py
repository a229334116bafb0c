"""PostgreSQL going away under load, then coming back, behind a real ``engram serve``: no chat
request fails, memory degrades (forwarded unchanged, one warning in the log, no traceback per
request), and it is back by itself once the server is (proxy.store.gate, proxy.store.held)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from typing import Any

import aiohttp
import psycopg
import pytest

from testing.fake_upstream import FakeUpstream
from testing.postgres import PostgresServer
from tests.proxy.test_serve import start_serve

pytestmark = pytest.mark.asyncio

PASSWORD = "s3cret-never-shown"  # trust logins ignore it; it must show up nowhere


async def chat(http: aiohttp.ClientSession, url: str, text: str) -> tuple[int, int]:
    """One new chat of one user message: the status and how many memories went in."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status, int(r.headers.get("X-Engram-Memories", "0"))


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/engram/health") as r:
        body: dict[str, Any] = await r.json()
        return body


async def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


async def test_postgres_stopped_under_load_fails_no_request_and_memory_comes_back(
    pg: PostgresServer,
) -> None:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE memory")
    db_url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{pg.port}/memory"
    env = {
        "ENGRAM_MEMORY_BACKEND": "postgres",
        "ENGRAM_MEMORY_POSTGRES_URL": db_url,
        "ENGRAM_AUTH_LOOPBACK_ADMIN": "true",  # /engram/metrics without the token
    }
    output: list[bytes] = []
    async with FakeUpstream() as fake:
        proc, url = await start_serve("--upstream", fake.url, env_extra=env)

        async def drain() -> None:  # the pipe must never fill, or the server blocks on a log
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                output.append(line)

        drainer = asyncio.create_task(drain())
        statuses: list[int] = []
        errors: list[str] = []
        try:
            async with aiohttp.ClientSession() as http:
                assert (await chat(http, url, "My cat is called Zorblax and she likes tuna."))[
                    0
                ] == 200

                async def recalled(word: str) -> bool:
                    status, memories = await chat(http, url, f"What is my {word} called?")
                    return status == 200 and memories > 0

                await wait_for("the fact told before", lambda: recalled("cat"), 20)

                stop = asyncio.Event()
                numbers = itertools.count()

                async def client() -> None:  # each sends the next request when one ends
                    while not stop.is_set():
                        n = next(numbers)
                        try:
                            status, _ = await chat(http, url, f"Question {n}: what about tuna?")
                            statuses.append(status)
                        except aiohttp.ClientError as exc:
                            errors.append(repr(exc))

                clients = [asyncio.create_task(client()) for _ in range(8)]
                await asyncio.sleep(1.0)
                before = len(statuses)
                await asyncio.to_thread(pg.stop, "fast")

                async def down() -> bool:
                    return (await health(http, url))["memory"]["up"] is False

                await wait_for("health saying memory is down", down, 10)
                seen_down = await health(http, url)
                await asyncio.sleep(3.0)  # load goes on against a stopped database
                during = len(statuses) - before
                await asyncio.to_thread(pg.start)

                async def up() -> bool:
                    return (await health(http, url))["memory"]["up"] is True

                await wait_for("memory back after the restart", up, 40)
                await asyncio.sleep(1.0)
                stop.set()
                await asyncio.gather(*clients)

                # what is told now is archived and recalled again; what was told before is there
                assert (await chat(http, url, "My dog is called Quaxle and he likes bones."))[
                    0
                ] == 200
                await wait_for("the fact told after", lambda: recalled("dog"), 20)
                assert await recalled("cat")
                async with http.get(f"{url}/engram/metrics") as r:
                    metrics = await r.text()
        finally:
            if proc.returncode is None:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 20)
            await drainer

    assert not errors, errors[:3]
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert during >= 8, f"only {during} requests while the database was down"
    assert seen_down["status"] == "degraded"
    assert seen_down["memory"]["backend"] == "postgres" and seen_down["memory"]["error"]
    with psycopg.connect(pg.url.rsplit("/", 1)[0] + "/memory", autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM turns WHERE content LIKE '%Quaxle%'").fetchone()
    assert row is not None and row[0] >= 1
    store_lines = [line for line in metrics.splitlines() if line.startswith("engram_store")]
    assert 'engram_store_up{backend="postgres"} 1' in store_lines, store_lines
    assert "engram_store_outages_total 1" in store_lines, store_lines
    log = b"".join(output).decode(errors="replace")
    warnings = [line for line in log.splitlines() if "is unavailable" in line]
    # one warning for the outage, not one per request
    assert len(warnings) == 1, "\n".join(warnings)
    assert " warning " in warnings[0] and "127.0.0.1" in warnings[0]
    back = [line for line in log.splitlines() if "answers again" in line]
    assert len(back) == 1, back
    # down 3 s; probes at 0.5, 1.5, 3.5, 7.5 s after the first failure: back well before the cap
    down_for = float(re.search(r"answers again after ([0-9.]+) s", back[0]).group(1))  # type: ignore[union-attr]
    assert down_for < 12.0, back[0]
    assert "Traceback" not in log, log[-3000:]
    assert PASSWORD not in log and PASSWORD not in json.dumps(seen_down) + metrics
