"""The tool-result slot store, against a real redis-server and a real SQLite file.

The tests that take ``env`` run twice: ``redis`` (slots.redis_url pointing at a live server) and
``embedded`` (no Redis: the ``slots`` table). The failover tests kill and restart Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from redis.asyncio import Redis

from proxy.cli.main import main
from proxy.config import SlotsSettings
from proxy.services import SERVICES
from proxy.slots.model import Slot
from proxy.slots.redis import user_namespace
from proxy.slots.store import SlotStore
from proxy.store.store import Store
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, start_engram
from testing.redis_server import RedisServer, free_port

PREFIX = "engram:slot"


def slot(slot_id: str, content: str | None = None, tool: str = "read_file") -> Slot:
    text = content if content is not None else f"output of {slot_id} " * 50
    return Slot(id=slot_id, tool=tool, content=text, tokens=len(text) // 4, description="a file")


class LogRecords(logging.Handler):
    """Records of the ``engram.slots`` logger (caplog misses them once logging is set up)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def count(self, level: int, text: str = "") -> int:
        return sum(1 for r in self.records if r.levelno == level and text in r.getMessage())


@pytest.fixture
def slot_log() -> Iterator[LogRecords]:
    logger = logging.getLogger("engram.slots")
    handler, level = LogRecords(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@dataclass
class Env:
    """A database (and, for ``redis``, a server) and the SlotStore opened on them."""

    backend: str
    db: str | Path  # a SQLite file or a PostgreSQL URL
    redis: RedisServer | None
    opened: list[tuple[SlotStore, Store]] = field(default_factory=list)

    def settings(self, **changes: Any) -> SlotsSettings:
        base = SlotsSettings(
            redis_url=self.redis.url if self.redis else "",
            redis_key_prefix=PREFIX,
            redis_timeout=0.5,
            redis_retry=0.2,
        )
        return replace(base, **changes)

    async def open(self, **changes: Any) -> SlotStore:
        store = Store(self.db)
        await store.open()
        slots = SlotStore(self.settings(**changes), store)
        await slots.start()
        self.opened.append((slots, store))
        return slots

    async def close(self) -> None:
        while self.opened:
            slots, store = self.opened.pop()
            await slots.close()
            await store.close()


@pytest_asyncio.fixture(params=["redis", "embedded"])
async def env(request: pytest.FixtureRequest, store_target: str | Path) -> AsyncIterator[Env]:
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None
    e = Env(request.param, store_target, server)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def embedded(store_target: str | Path) -> AsyncIterator[Env]:
    e = Env("embedded", store_target, None)
    try:
        yield e
    finally:
        await e.close()


async def in_redis(server: RedisServer, user: str, slot_id: str) -> bool:
    client = Redis.from_url(server.url)
    try:
        return bool(await client.exists(f"{user_namespace(PREFIX, user)}:{slot_id}"))
    finally:
        await client.aclose()


async def embedded_rows(slots: SlotStore, user: str | None = None) -> list[str]:
    """Ids in the slots table (expired rows included), ``user``'s or all."""
    sql, args = "SELECT id FROM slots", ()
    if user is not None:
        sql, args = sql + " WHERE user_id = ?", (user,)
    rows = await slots.store.read(lambda c: c.execute(sql + " ORDER BY id", args).fetchall())
    return [r[0] for r in rows]


async def wait_for_backend(slots: SlotStore, backend: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while slots.backend != backend:
        assert time.monotonic() < deadline, f"still on {slots.backend}"
        await asyncio.sleep(0.05)


# --- both backends ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_put_and_get_round_trip(env: Env) -> None:
    slots = await env.open()
    assert slots.backend == env.backend
    a, b = slot("a"), slot("b", "naïve ünïcode ✓ " * 40, tool="grep")
    assert await slots.put_many("alice", [a, b, a]) == {"a", "b"}
    assert await slots.get("alice", "a") == a
    assert await slots.lookup("alice", "b") == (b, env.backend)
    assert await slots.get("alice", "nope") is None
    if env.redis is not None:
        assert await in_redis(env.redis, "alice", "a")
        assert await embedded_rows(slots) == []
    else:
        assert await embedded_rows(slots) == ["a", "b"]


@pytest.mark.asyncio
async def test_ttl_expires_and_use_refreshes_it(env: Env) -> None:
    slots = await env.open(ttl_seconds=1)
    await slots.put_many("alice", [slot("used"), slot("idle")])
    await asyncio.sleep(0.6)
    assert await slots.get("alice", "used") is not None  # lives 1 s from now on
    await asyncio.sleep(0.6)
    assert await slots.get("alice", "idle") is None  # 1.2 s after it was stored
    assert await slots.get("alice", "used") is not None  # 0.6 s after it was read
    await asyncio.sleep(1.2)
    assert await slots.get("alice", "used") is None
    # Storing it again brings it back (the confirmed cache does not pretend it is there).
    assert await slots.put_many("alice", [slot("used")]) == {"used"}
    assert await slots.get("alice", "used") == slot("used")


@pytest.mark.asyncio
async def test_a_user_never_reads_another_users_slot(env: Env) -> None:
    slots = await env.open()
    await slots.put_many("alice", [slot("same-id", "alice's secret")])
    assert await slots.get("bob", "same-id") is None
    await slots.put_many("bob", [slot("same-id", "bob's output")])
    alice, bob = await slots.get("alice", "same-id"), await slots.get("bob", "same-id")
    assert alice is not None and alice.content == "alice's secret"
    assert bob is not None and bob.content == "bob's output"


@pytest.mark.asyncio
async def test_slots_and_counters_survive_a_restart(env: Env) -> None:
    slots = await env.open()
    await slots.put_many("alice", [slot("kept")])
    assert await slots.get("alice", "kept") is not None
    await env.close()

    slots = await env.open()
    assert slots.backend == env.backend
    assert slots.counters()[env.backend] == {"puts": 1, "hits": 1, "misses": 0, "errors": 0}
    assert await slots.get("alice", "kept") == slot("kept")
    assert slots.counters()[env.backend]["hits"] == 2


@pytest.mark.asyncio
async def test_stats_count_slots_bytes_puts_hits_misses(env: Env) -> None:
    slots = await env.open(ttl_seconds=5)
    a, b = slot("a", "x" * 1000), slot("b", "é" * 100)
    await slots.put_many("alice", [a, b])
    await slots.put_many("alice", [a, b])  # confirmed a moment ago: not stored again
    await slots.put_many("bob", [a])
    assert await slots.get("alice", "a") is not None
    assert await slots.get("alice", "missing") is None
    stats = await slots.stats()
    figures = {k: v for k, v in stats[env.backend].items() if k != "up"}
    assert figures == {
        "slots": 3,
        "bytes": 1000 + 200 + 1000,
        "puts": 3,
        "hits": 1,
        "misses": 1,
        "errors": 0,
    }
    if env.redis is not None:
        assert stats["redis"]["up"] is True
        assert stats["embedded"]["slots"] == 0
    else:
        assert set(stats) == {"embedded"}


@pytest.mark.asyncio
async def test_forget_user_deletes_only_their_slots(env: Env) -> None:
    slots = await env.open()
    await slots.put_many("alice", [slot("a1"), slot("a2")])
    await slots.put_many("bob", [slot("a1")])
    assert await slots.forget_user("alice") == 2
    assert await slots.get("alice", "a1") is None and await slots.get("alice", "a2") is None
    assert await slots.get("bob", "a1") is not None
    # Forgotten slots are stored again on the next request (not taken as still confirmed).
    assert await slots.put_many("alice", [slot("a1")]) == {"a1"}
    assert await slots.get("alice", "a1") is not None


@pytest.mark.asyncio
async def test_a_slot_that_cannot_be_stored_is_left_out_without_an_outage(env: Env) -> None:
    slots = await env.open()
    bad = slot("bad", "lone surrogate \ud800 " * 30)
    assert await slots.put_many("alice", [bad]) == set()  # forwarded raw by the caller
    assert slots.backend == env.backend  # Redis is not taken for down
    assert await slots.put_many("alice", [slot("good")]) == {"good"}
    assert await slots.lookup("alice", "good") == (slot("good"), env.backend)


# --- the embedded table -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_purge_deletes_expired_rows(embedded: Env) -> None:
    slots = await embedded.open(ttl_seconds=1)
    await slots.put_many("alice", [slot("old")])
    await asyncio.sleep(0.6)
    await slots.put_many("alice", [slot("new")])
    await asyncio.sleep(0.6)
    assert await slots.purge() == 1
    assert await embedded_rows(slots) == ["new"]
    assert (await slots.stats())["embedded"]["slots"] == 1


@pytest.mark.asyncio
async def test_purge_runs_on_its_own(embedded: Env) -> None:
    slots = await embedded.open(ttl_seconds=1, purge_interval=0.2)
    await slots.put_many("alice", [slot("old")])
    await asyncio.sleep(1.5)
    assert await embedded_rows(slots) == []


@pytest.mark.asyncio
async def test_deleting_the_user_deletes_their_embedded_slots(embedded: Env) -> None:
    slots = await embedded.open()
    await slots.store.ensure_user("alice")
    await slots.put_many("alice", [slot("a")])
    await slots.put_many("bob", [slot("b")])
    assert await slots.store.delete_user("alice")
    assert await embedded_rows(slots) == ["b"]


@pytest.mark.asyncio
async def test_a_failing_store_without_redis_stores_nothing_and_never_raises(
    embedded: Env, slot_log: LogRecords
) -> None:
    slots = await embedded.open()
    await slots.store.close()
    assert await slots.put_many("alice", [slot("a"), slot("b")]) == set()
    assert await slots.put_many("alice", [slot("a")]) == set()
    assert await slots.get("alice", "a") is None
    assert slots.counters()["embedded"]["errors"] == 3
    assert slot_log.count(logging.WARNING, "embedded slot store failed") == 1


# --- failover -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_redis_down_at_start_uses_the_embedded_store(
    embedded: Env, slot_log: LogRecords
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    slots = await embedded.open(redis_url=dead, redis_retry=60)
    assert slots.backend == "embedded"
    assert await slots.put_many("alice", [slot("a")]) == {"a"}
    assert await slots.put_many("alice", [slot("b")]) == {"b"}
    assert await slots.get("alice", "a") == slot("a")
    assert await embedded_rows(slots) == ["a", "b"]
    assert slot_log.count(logging.WARNING) == 1
    assert slot_log.count(logging.WARNING, "Redis is unreachable") == 1
    stats = await slots.stats()
    assert stats["redis"]["up"] is False and stats["redis"]["slots"] is None
    assert stats["redis"]["errors"] == 1 and stats["embedded"]["puts"] == 2


@pytest.mark.asyncio
async def test_a_silent_redis_costs_one_timeout_then_nothing(
    embedded: Env, slot_log: LogRecords
) -> None:
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        began = time.monotonic()
        slots = await embedded.open(redis_url=url, redis_timeout=0.3, redis_retry=60)
        assert time.monotonic() - began < 2.0
        assert slots.backend == "embedded"
        began = time.monotonic()
        for i in range(5):
            assert await slots.put_many("alice", [slot(f"s{i}")]) == {f"s{i}"}
            assert await slots.get("alice", f"s{i}") is not None
        assert time.monotonic() - began < 0.3  # none of them waited on Redis
        assert slot_log.count(logging.WARNING, "Redis is unreachable") == 1
        await embedded.close()


@pytest.mark.asyncio
async def test_redis_killed_and_restarted(
    redis_server: RedisServer, tmp_path: Path, slot_log: LogRecords
) -> None:
    env = Env("redis", tmp_path / "engram.db", redis_server)
    try:
        slots = await env.open()
        assert await slots.put_many("alice", [slot("before")]) == {"before"}
        assert await in_redis(redis_server, "alice", "before")

        redis_server.kill()
        assert await slots.put_many("alice", [slot("during")]) == {"during"}
        assert slots.backend == "embedded"
        assert await slots.put_many("alice", [slot("during2")]) == {"during2"}
        assert await slots.get("alice", "during") == slot("during")
        assert await slots.get("alice", "before") is None  # it was in Redis only
        assert await embedded_rows(slots) == ["during", "during2"]
        assert slot_log.count(logging.WARNING, "Redis is unreachable") == 1

        redis_server.start()  # same port, empty
        await wait_for_backend(slots, "redis")
        assert slot_log.count(logging.INFO, "Redis is back") == 1
        assert await slots.put_many("alice", [slot("after")]) == {"after"}
        assert await in_redis(redis_server, "alice", "after")
        # A slot stored during the outage is still found (in the embedded table).
        assert await slots.lookup("alice", "during") == (slot("during"), "embedded")
        # The restarted Redis lost "before": storing it again goes to Redis (cache cleared).
        assert await slots.put_many("alice", [slot("before")]) == {"before"}
        assert await in_redis(redis_server, "alice", "before")
        assert slot_log.count(logging.WARNING) == 1
        counts = slots.counters()
        assert counts["redis"]["puts"] == 3 and counts["redis"]["errors"] >= 1
        assert counts["embedded"]["puts"] == 2
    finally:
        await env.close()


# --- engram stats, the admin API ----------------------------------------------------------------


def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)


def database_args(db: str | Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The command line's arguments naming ``db``: ``--db`` for a SQLite file; a PostgreSQL
    URL is configured, not a flag (``ENGRAM_MEMORY_BACKEND``, ``ENGRAM_MEMORY_POSTGRES_URL``)."""
    if isinstance(db, Path):
        return ["--db", str(db)]
    monkeypatch.setenv("ENGRAM_MEMORY_BACKEND", "postgres")
    monkeypatch.setenv("ENGRAM_MEMORY_POSTGRES_URL", db)
    return []


@pytest.mark.asyncio
async def test_engram_stats_shows_slot_figures(
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_environment(monkeypatch)
    if env.redis is not None:
        monkeypatch.setenv("ENGRAM_SLOTS_REDIS_URL", env.redis.url)
    db = database_args(env.db, monkeypatch)
    slots = await env.open()
    await slots.put_many("alice", [slot("a", "y" * 2000)])
    await slots.get("alice", "a")
    await slots.get("alice", "gone")
    await env.close()  # the counters are saved

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["stats", *db, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["slots"]
    assert data["backend"] == env.backend
    assert data[env.backend] | {"up": None} == {
        "up": None,
        "slots": 1,
        "bytes": 2000,
        "puts": 1,
        "hits": 1,
        "misses": 1,
        "errors": 0,
    }
    assert await asyncio.to_thread(main, ["stats", *db]) == 0
    text = capsys.readouterr().out
    assert f"slots           new slots go to {env.backend}" in text
    assert f"  {env.backend:<13} 1 slots, 0.00 MB; 1 hits, 1 misses" in text

    if env.redis is not None:
        env.redis.kill()
        assert await asyncio.to_thread(main, ["stats", *db, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)["slots"]
        assert data["backend"] == "embedded"
        assert data["redis"]["up"] is False and data["redis"]["hits"] == 1
        assert await asyncio.to_thread(main, ["stats", *db]) == 0
        assert "  redis         unreachable; 1 hits" in capsys.readouterr().out


@pytest.mark.asyncio
async def test_engram_forget_deletes_the_users_slots_in_redis(
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    clean_environment(monkeypatch)
    monkeypatch.setenv("ENGRAM_SLOTS_REDIS_URL", redis_server.url)
    env = Env("redis", tmp_path / "engram.db", redis_server)
    slots = await env.open()
    await slots.store.ensure_user("alice")
    await slots.put_many("alice", [slot("a"), slot("b")])
    await slots.put_many("bob", [slot("a")])
    await env.close()
    args = ["forget", "--db", str(env.db), "--user", "alice", "--all", "--yes"]
    assert await asyncio.to_thread(main, args) == 0
    assert "deleted 2 tool-result slots from Redis" in capsys.readouterr().out
    assert not await in_redis(redis_server, "alice", "a")
    assert await in_redis(redis_server, "bob", "a")


async def api_get(http: aiohttp.ClientSession, e: Engram, path: str, user: str) -> Any:
    async with http.get(f"{e.url}/engram/api/{path}", headers={"X-Engram-User": user}) as r:
        return r.status, await r.json()


@pytest.mark.asyncio
async def test_slot_api_answers_the_owner_only(
    fake: FakeUpstream, http: aiohttp.ClientSession, redis_server: RedisServer
) -> None:
    e = await start_engram(fake.url, slots={"redis_url": redis_server.url})
    try:
        slots = e.app[SERVICES].slots
        await slots.put_many("alice", [slot("s1", "the output")])
        status, body = await api_get(http, e, "slots/s1", "alice")
        assert status == 200
        assert body == {
            "id": "s1",
            "tool": "read_file",
            "description": "a file",
            "tokens": slot("s1", "the output").tokens,
            "content": "the output",
            "backend": "redis",
        }
        other = await api_get(http, e, "slots/s1", "bob")
        missing = await api_get(http, e, "slots/s2", "bob")
        assert other[0] == missing[0] == 404
        assert other[1]["error"]["code"] == "slot_not_found"
        assert other[1]["error"]["message"].replace("s1", "s2") == missing[1]["error"]["message"]
        status, stats = await api_get(http, e, "stats", "alice")
        assert stats["slots"]["backend"] == "redis"
        assert stats["slots"]["redis"]["slots"] == 1 and stats["slots"]["redis"]["hits"] == 1
        assert stats["slots"]["embedded"]["slots"] == 0
    finally:
        await e.close()


@pytest.mark.asyncio
async def test_slot_api_is_503_when_slots_are_off(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(fake.url, slots={"enabled": False})
    try:
        status, body = await api_get(http, e, "slots/s1", "alice")
        assert status == 503 and body["error"]["code"] == "slots_disabled"
        status, stats = await api_get(http, e, "stats", "alice")
        assert status == 200 and stats["slots"] is None
    finally:
        await e.close()
