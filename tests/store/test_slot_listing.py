"""Listing one user's tool-result slots (``SlotStore.list_user``, the inspector's slot page),
against a real redis-server and a real SQLite file.

The tests that take ``env`` run twice: ``redis`` and ``embedded`` (see ``test_slotstore``). The
others kill, freeze (SIGSTOP) or never start Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import fields
from pathlib import Path

import pytest
import pytest_asyncio

from proxy.slots.model import DESCRIPTION_CHARS, Slot, SlotInfo
from proxy.slots.store import SlotStore
from testing.redis_server import RedisServer, free_port
from tests.store.test_slotstore import Env, slot

GLOB_USERS = ["a*", "a?", "a[b]", "*", "?", "[", "a", "b", "a\\*"]


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


async def everything(slots: SlotStore, user: str) -> list[SlotInfo]:
    listing = await slots.list_user(user, limit=10_000)
    assert listing.total == len(listing.slots)
    return listing.slots


def ids(infos: list[SlotInfo]) -> list[str]:
    return [i.id for i in infos]


# --- both backends ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_listed_slot_says_size_tool_times_and_backend(env: Env) -> None:
    slots = await env.open()
    long = Slot(id="grep-1", tool="grep", content="é" * 3000, tokens=750, description="d" * 1000)
    before = time.time()
    assert await slots.put_many("alice", [slot("read-1"), long]) == {"read-1", "grep-1"}
    after = time.time()
    listing = await slots.list_user("alice")
    assert listing.total == 2 and listing.redis_unreachable is False
    by_id = {i.id: i for i in listing.slots}
    info = by_id["grep-1"]
    assert (info.tool, info.tokens, info.bytes) == ("grep", 750, 6000)
    assert info.description == "d" * DESCRIPTION_CHARS
    assert info.backend == env.backend
    assert before - 0.01 <= info.created_at <= after + 0.01
    assert before - 0.05 <= info.last_used <= after + 0.05
    assert info.expires_at is not None
    assert info.expires_at == pytest.approx(info.last_used + 86400, abs=0.05)
    assert by_id["read-1"].description == "a file"
    assert "content" not in {f.name for f in fields(SlotInfo)}


@pytest.mark.asyncio
async def test_users_never_see_each_others_slots_even_with_glob_names(env: Env) -> None:
    slots = await env.open()
    for n, user in enumerate(GLOB_USERS):
        assert len(await slots.put_many(user, [slot(f"s{n}-{k}") for k in range(n + 1)])) == n + 1
    for n, user in enumerate(GLOB_USERS):
        assert sorted(ids(await everything(slots, user))) == [f"s{n}-{k}" for k in range(n + 1)]
    assert await everything(slots, "nobody") == []


@pytest.mark.asyncio
async def test_latest_use_first_and_listing_refreshes_nothing(env: Env) -> None:
    slots = await env.open()
    for sid in ("a", "b", "c"):
        await slots.put_many("alice", [slot(sid)])
        await asyncio.sleep(0.03)
    assert ids(await everything(slots, "alice")) == ["c", "b", "a"]
    assert await slots.get("alice", "a") is not None  # a read is a use
    first = await everything(slots, "alice")
    assert ids(first) == ["a", "c", "b"]
    await asyncio.sleep(0.05)
    again = await everything(slots, "alice")
    for x, y in zip(first, again, strict=True):
        assert x.expires_at is not None and y.expires_at is not None
        assert y.expires_at == pytest.approx(x.expires_at, abs=0.02)  # not pushed by listing


@pytest.mark.asyncio
async def test_expired_slots_are_not_listed(env: Env) -> None:
    slots = await env.open(ttl_seconds=1, purge_interval=3600)
    await slots.put_many("alice", [slot("old")])
    await asyncio.sleep(0.6)
    await slots.put_many("alice", [slot("new")])
    await asyncio.sleep(0.6)
    listing = await slots.list_user("alice")
    assert ids(listing.slots) == ["new"] and listing.total == 1
    await asyncio.sleep(0.6)
    listing = await slots.list_user("alice")
    assert listing.slots == [] and listing.total == 0


@pytest.mark.asyncio
async def test_paging_and_total(env: Env) -> None:
    slots = await env.open()
    for k in range(7):
        await slots.put_many("alice", [slot(f"s{k}")])
        await asyncio.sleep(0.01)
    await slots.put_many("bob", [slot("b0")])
    pages = [await slots.list_user("alice", limit=3, offset=o) for o in (0, 3, 6)]
    assert [p.total for p in pages] == [7, 7, 7]
    assert [len(p.slots) for p in pages] == [3, 3, 1]
    assert [i for p in pages for i in ids(p.slots)] == [f"s{k}" for k in reversed(range(7))]
    beyond = await slots.list_user("alice", limit=3, offset=50)
    assert beyond.slots == [] and beyond.total == 7
    none = await slots.list_user("alice", limit=0)
    assert none.slots == [] and none.total == 7
    with pytest.raises(ValueError):
        await slots.list_user("alice", limit=-1)


# --- embedded only ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_without_redis_nothing_is_unreachable(embedded: Env) -> None:
    slots = await embedded.open()
    await slots.put_many("alice", [slot("a")])
    listing = await slots.list_user("alice")
    assert ids(listing.slots) == ["a"] and listing.slots[0].backend == "embedded"
    assert listing.redis_unreachable is False


# --- both backends at once, and Redis going away ------------------------------------------------


async def slots_in_both(env: Env) -> SlotStore:
    """A store on Redis with r1, r2 in Redis and e1, e2 in the SQLite file (as if put during an
    outage), used in the order e1, r1, e2, r2; and bob's slots in both."""
    slots = await env.open()
    assert slots.backend == "redis"
    for sid in ("e1", "r1", "e2", "r2"):
        if sid.startswith("e"):
            await slots.embedded.put("alice", [slot(sid)], env.settings().ttl_seconds)
        else:
            assert await slots.put_many("alice", [slot(sid)]) == {sid}
        await asyncio.sleep(0.02)
    await slots.embedded.put("bob", [slot("be")], env.settings().ttl_seconds)
    await slots.put_many("bob", [slot("br")])
    return slots


@pytest.mark.asyncio
async def test_both_backends_merged_and_paged(redis_server: RedisServer, tmp_path: Path) -> None:
    env = Env("redis", tmp_path / "engram.db", redis_server)
    try:
        slots = await slots_in_both(env)
        listing = await slots.list_user("alice")
        assert listing.redis_unreachable is False and listing.total == 4
        assert [(i.id, i.backend) for i in listing.slots] == [
            ("r2", "redis"),
            ("e2", "embedded"),
            ("r1", "redis"),
            ("e1", "embedded"),
        ]
        pages = [await slots.list_user("alice", limit=1, offset=o) for o in range(5)]
        assert [p.total for p in pages] == [4] * 5
        assert [i for p in pages for i in ids(p.slots)] == ["r2", "e2", "r1", "e1"]
        assert sorted(ids(await everything(slots, "bob"))) == ["be", "br"]
    finally:
        await env.close()


@pytest.mark.asyncio
async def test_redis_down_lists_the_embedded_slots_and_says_so(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = Env("redis", tmp_path / "engram.db", redis_server)
    try:
        slots = await slots_in_both(env)
        redis_server.kill()  # the store still counts Redis as up: the listing finds out
        began = time.monotonic()
        listing = await slots.list_user("alice")
        assert time.monotonic() - began < 2.0
        assert listing.redis_unreachable is True
        assert [(i.id, i.backend) for i in listing.slots] == [
            ("e2", "embedded"),
            ("e1", "embedded"),
        ]
        assert listing.total == 2
        await slots.put_many("alice", [slot("e3")])  # now the store knows
        assert slots.backend == "embedded"
        listing = await slots.list_user("alice", limit=2)
        assert ids(listing.slots) == ["e3", "e2"] and listing.total == 3
        assert listing.redis_unreachable is True
    finally:
        await env.close()


@pytest.mark.asyncio
async def test_redis_down_at_start(embedded: Env) -> None:
    slots = await embedded.open(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_retry=60)
    await slots.put_many("alice", [slot("a")])
    listing = await slots.list_user("alice")
    assert ids(listing.slots) == ["a"] and listing.total == 1
    assert listing.redis_unreachable is True


@pytest.mark.asyncio
async def test_a_frozen_redis_costs_one_timeout(redis_server: RedisServer, tmp_path: Path) -> None:
    env = Env("redis", tmp_path / "engram.db", redis_server)
    assert redis_server.proc is not None
    pid = redis_server.proc.pid
    try:
        slots = await env.open(redis_timeout=0.3, redis_retry=60)
        await slots.put_many("alice", [slot("r")])
        await slots.embedded.put("alice", [slot("e")], 86400)
        os.kill(pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            began = time.monotonic()
            listing = await slots.list_user("alice")
            took = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
        assert 0.25 <= took < 1.5
        assert listing.redis_unreachable is True
        assert ids(listing.slots) == ["e"] and listing.total == 1
    finally:
        await env.close()


@pytest.mark.asyncio
async def test_a_glob_key_prefix_lists_no_other_prefix(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two Engrams on one Redis, prefixes ``engram:s*`` and ``engram:sx``: the same user's keys
    of the other never show (unescaped, ``engram:s*:<user>:*`` would match them)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    star = Env("redis", tmp_path / "a" / "engram.db", redis_server)
    plain = Env("redis", tmp_path / "b" / "engram.db", redis_server)
    try:
        a = await star.open(redis_key_prefix="engram:s*")
        b = await plain.open(redis_key_prefix="engram:sx")
        await a.put_many("alice", [slot("mine")])
        await b.put_many("alice", [slot("theirs")])
        assert ids(await everything(a, "alice")) == ["mine"]
        assert ids(await everything(b, "alice")) == ["theirs"]
    finally:
        await star.close()
        await plain.close()
