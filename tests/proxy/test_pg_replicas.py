"""Two Engram servers on one PostgreSQL (the postgres backend) and one Redis (the tool-result
store), through the real HTTP surface (issue 25, "Tests"):

- what one archives, the other recalls; counters both flush into the one database;
- conversations whose turns alternate between the replicas are one session each, every message
  stored once and in order (read from the turns table itself), and a fact told through one is in
  the memory block the other forwards;
- the same first request reaching both replicas at the same instant: one session when the client
  names it; recognised by its messages, a session per copy, each named by its reply;
- new conversations opening alike, sent at once through both: each reply names the session that
  stores its turn (issue 39);
- two replies of one turn at once on the two replicas are both kept, the second placed in a
  fork its reply names.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import aiohttp
import psycopg
import pytest

from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, forwarded_memory, settle, start_engram
from testing.postgres import PostgresServer
from testing.redis_server import RedisServer
from tests.proxy.test_fast_clients import alike, assert_each_reply_names_its_turns_session

pytestmark = pytest.mark.asyncio

FACT = "my sister's tortoise is called Zanzibar and she eats dandelions"
REGENERATIONS = 10  # pairs of replies committed at once: enough that an unguarded commit races


def memory_database(pg: PostgresServer) -> str:
    """A new database ``memory`` on the server (not the maintenance one); its URL."""
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE memory")
    return pg.url.rsplit("/", 1)[0] + "/memory"


async def replicas(fake: FakeUpstream, url: str, redis: RedisServer) -> tuple[Engram, Engram]:
    """Two Engram servers on the one PostgreSQL database and the one Redis."""
    sections: dict[str, dict[str, Any]] = {
        "memory": {"backend": "postgres", "postgres_url": url},
        "slots": {"redis_url": redis.url},
    }
    a = await start_engram(fake.url, **sections)
    b = await start_engram(fake.url, **sections)
    return a, b


async def chat(
    http: aiohttp.ClientSession, engram: Engram, messages: list[dict[str, str]], **headers: str
) -> tuple[str, str]:
    """(the reply's text, the session it went to: "" for a read-only request)."""
    body = {"model": "m", "messages": messages}
    async with http.post(engram.url + "/v1/chat/completions", json=body, headers=headers) as r:
        data: Any = await r.json()
        assert r.status == 200, data
        return data["choices"][0]["message"]["content"], r.headers.get("X-Engram-Session", "")


def stored_sessions(url: str) -> dict[str, list[tuple[int, str, str]]]:
    """Every conversation session in the database, with its (position, role, content) rows
    in position order, straight from the turns table."""
    with psycopg.connect(url, autocommit=True) as conn:
        ids = conn.execute("SELECT id FROM sessions WHERE id NOT LIKE 'facts~%'").fetchall()
        rows = conn.execute(
            "SELECT session_id, position, role, content FROM turns"
            " WHERE role NOT IN ('summary', 'fact') ORDER BY session_id, position"
        ).fetchall()
    sessions: dict[str, list[tuple[int, str, str]]] = {sid: [] for (sid,) in ids}
    for sid, position, role, content in rows:
        sessions.setdefault(sid, []).append((position, role, content))
    return sessions


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


async def test_alternating_turns_on_two_replicas_are_one_session_each_stored_once(
    pg: PostgresServer,
    redis_server: RedisServer,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
) -> None:
    url = memory_database(pg)
    a, b = await replicas(fake, url, redis_server)
    try:

        async def conversation(c: int) -> tuple[str, list[dict[str, str]]]:
            msgs: list[dict[str, str]] = []
            seen = []
            for k in range(4):
                said = FACT if (c, k) == (0, 0) else f"conversation {c} says thing {k}"
                msgs.append({"role": "user", "content": said})
                reply, session = await chat(http, (a, b)[k % 2], msgs)  # turn 1 via A, 2 via B
                msgs.append({"role": "assistant", "content": reply})
                seen.append(session)
            assert len(set(seen)) == 1, (c, seen)
            return seen[0], msgs

        done = await asyncio.gather(*(conversation(c) for c in range(12)))
        # The fact went in through A (conversation 0, turn 1): B's memory block holds it.
        question = [{"role": "user", "content": "What is my sister's tortoise called?"}]
        t0, recalled = time.monotonic(), False
        while not recalled and time.monotonic() - t0 < 20:
            await chat(http, b, question, **{"X-Engram-Memory": "read-only"})
            forwarded = fake.chat_requests()[-1].json()["messages"]
            recalled = "Zanzibar" in forwarded_memory(forwarded)
            await asyncio.sleep(0.2)
        assert recalled, "B never recalled what was told through A"
        await settle(a)
        await settle(b)
    finally:
        await a.close()
        await b.close()
    sessions = stored_sessions(url)
    assert len(sessions) == 12, list(sessions)  # one per conversation, none for the question
    for sid, msgs in done:
        expected = [(i, m["role"], m["content"]) for i, m in enumerate(msgs)]
        assert sessions[sid] == expected, sid  # every message once, in order


@pytest.mark.parametrize("named", [False, True], ids=["by-messages", "client-named"])
async def test_the_same_first_request_on_both_replicas_at_once(
    pg: PostgresServer,
    redis_server: RedisServer,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    named: bool,
) -> None:
    """Named by the client (X-Engram-Session), the two copies are one session, its messages
    stored once. Recognised by its messages, each copy is a session of its own (only the
    replies could tell a hedged copy from another conversation that opened alike, and they
    come after the headers), each named by its reply; the conversation goes on in one."""
    url = memory_database(pg)
    a, b = await replicas(fake, url, redis_server)
    try:
        for n in range(5):  # five new conversations, each first request to both at the instant
            first = [{"role": "user", "content": f"conversation {n} opens with this question"}]
            headers = {"X-Engram-Session": f"twin-{n}"} if named else {}
            (reply_a, sid_a), (reply_b, sid_b) = await asyncio.gather(
                chat(http, a, first, **headers), chat(http, b, first, **headers)
            )
            assert reply_a == reply_b
            assert (sid_a == sid_b) is named
            then = [*first, {"role": "assistant", "content": reply_a}]
            then.append({"role": "user", "content": f"conversation {n} goes on"})
            _, sid = await chat(http, (a, b)[n % 2], then, **headers)
            assert sid in (sid_a, sid_b), (n, sid, sid_a, sid_b)
        await settle(a)
        await settle(b)
    finally:
        await a.close()
        await b.close()
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, failed  # no archive commit failed (a lost turn)
    sessions = stored_sessions(url)
    assert len(sessions) == (5 if named else 10), sessions
    went_on = [rows for rows in sessions.values() if len(rows) == 4]
    assert len(went_on) == 5, sessions
    for rows in went_on:
        n = rows[0][2].split()[1]
        assert [(p, role) for p, role, _ in rows] == [
            (0, "user"),
            (1, "assistant"),
            (2, "user"),
            (3, "assistant"),
        ], rows
        assert rows[2][2] == f"conversation {n} goes on"
    assert all(len(rows) in (2, 4) for rows in sessions.values()), sessions


@pytest.mark.parametrize("replies", ["sampled", "identical"])
async def test_conversations_opening_alike_on_two_replicas_each_reply_names_its_session(
    pg: PostgresServer,
    redis_server: RedisServer,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    replies: str,
) -> None:
    """Issue 39, item 1, across replicas: eight new conversations of one user at once, all
    opening alike, each next turn sent the instant the reply ends to the other replica. Every
    reply names the session that stores its turn, from the first on; with a sampling model,
    one id per conversation."""
    if replies == "sampled":
        count = itertools.count()
        fake.reply_text = lambda last: f"{last}, said once ({next(count)})"
    url = memory_database(pg)
    a, b = await replicas(fake, url, redis_server)
    try:
        results = await asyncio.gather(*(alike(http, [a, b], "alike", n, 6) for n in range(8)))
        await assert_each_reply_names_its_turns_session([a, b], list(results))
    finally:
        await a.close()
        await b.close()
    sessions = stored_sessions(url)
    assert sum(len(rows) for rows in sessions.values()) == 8 * 12  # every message once
    if replies == "sampled":
        assert len(sessions) == 8, sessions
        for messages, seen in results:
            assert len(set(seen)) == 1, seen
            assert [c for _, _, c in sessions[seen[0]]] == [m["content"] for m in messages]


async def test_the_same_first_request_again_after_the_first_is_another_conversation(
    pg: PostgresServer,
    redis_server: RedisServer,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
) -> None:
    """Only a twin sent while the first ran is joined: asked again later (through either
    replica), the same question starts a session of its own, as on one server."""
    url = memory_database(pg)
    a, b = await replicas(fake, url, redis_server)
    try:
        first = [{"role": "user", "content": "the same question, asked twice"}]
        _, sid_a = await chat(http, a, first)
        _, sid_b = await chat(http, b, first)
        _, sid_a2 = await chat(http, a, first)
        await settle(a)
        await settle(b)
    finally:
        await a.close()
        await b.close()
    sessions = stored_sessions(url)
    assert set(sessions) == {sid_a, sid_b, sid_a2} and len(sessions) == 3, sessions
    assert all(len(rows) == 2 for rows in sessions.values()), sessions


async def test_two_replies_committed_at_once_on_two_replicas_both_kept_one_forks(
    pg: PostgresServer,
    redis_server: RedisServer,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
) -> None:
    """One conversation's next turn sent to both replicas at once (a regenerate), each with its
    own reply: both replies are kept, the later commit's in a fork, as on one server."""
    url = memory_database(pg)
    a, b = await replicas(fake, url, redis_server)
    named: dict[int, dict[str, str]] = {}  # each pair's reply -> the session its reply named
    try:
        for n in range(REGENERATIONS):
            first = [{"role": "user", "content": f"conversation {n}: name a colour"}]
            text, _ = await chat(http, a, first)
            history = [*first, {"role": "assistant", "content": text}]
            history.append({"role": "user", "content": f"conversation {n}: another one"})
            fake.enqueue(JsonReply(chat_completion("blue")), JsonReply(chat_completion("green")))
            both = await asyncio.gather(chat(http, a, history), chat(http, b, history))
            named[n] = dict(both)
        await settle(a)
        await settle(b)
    finally:
        await a.close()
        await b.close()
    sessions = stored_sessions(url)
    assert len(sessions) == 2 * REGENERATIONS, sessions  # each conversation and its fork
    mains = [rows for rows in sessions.values() if rows[0][0] == 0]
    forks = [rows for rows in sessions.values() if rows[0][0] != 0]
    assert len(mains) == len(forks) == REGENERATIONS, sessions
    for rows in mains:
        assert [(p, role) for p, role, _ in rows] == [
            (0, "user"),
            (1, "assistant"),
            (2, "user"),
            (3, "assistant"),
        ], rows
    replies = sorted([main[3][2] for main in mains] + [fork[1][2] for fork in forks])
    assert replies == ["blue"] * REGENERATIONS + ["green"] * REGENERATIONS  # each pair's, once
    # The one placed second is a fork from the user message on, and its reply names it.
    assert all([(p, r) for p, r, _ in fork] == [(2, "user"), (3, "assistant")] for fork in forks)
    for pair in named.values():
        for reply, sid in pair.items():
            assert sessions[sid][-1][1:] == ("assistant", reply), (pair, sessions[sid])
