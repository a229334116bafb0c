"""Background jobs across replicas on one PostgreSQL, with real ``engram serve`` processes: a
replica SIGKILLed in the middle of a rolling summary leaves the job to another, which does it
once (proxy/background/leases.py); the ``changes`` log is pruned by one replica at a time, and
by another once that one is gone (proxy/background/changes.py); a follower that missed pruned
rows starts its caches again (proxy/store/postgres/follow.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psycopg
import pytest
import pytest_asyncio

from proxy.background.changes import LEASE
from proxy.background.leases import Leases
from proxy.store import NewTurn, Store, leases
from proxy.store.postgres import follow
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply, RecordedRequest
from testing.postgres import PostgresServer
from tests.proxy.test_rewrite import long_chat
from tests.proxy.test_serve import start_serve
from tests.store.test_changes import _pair, contents

pytestmark = pytest.mark.asyncio

USER = {"X-Engram-User": "jobs"}
SUMMARY = "The user asked many numbered questions about lorem ipsum; question 3 was on lorem."
LEASE_S = 1.0  # memory.job_lease: a dead replica's job is taken over within a second


def database(pg: PostgresServer) -> str:
    """A fresh database ``memory`` on the server: its URL."""
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE memory")
    return pg.url.rsplit("/", 1)[0] + "/memory"


@dataclass
class Replica:
    """One ``engram serve`` subprocess; its output is read as it comes (a full pipe blocks it)."""

    proc: asyncio.subprocess.Process
    url: str
    output: list[bytes] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    def said(self, text: str) -> int:
        return sum(text.encode() in line for line in self.output)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        if self.reader is not None:
            await self.reader


async def start_replica(db_url: str, upstream: str, **env: str) -> Replica:
    extra = {"ENGRAM_MEMORY_BACKEND": "postgres", "ENGRAM_MEMORY_POSTGRES_URL": db_url, **env}
    proc, url = await start_serve("--upstream", upstream, env_extra=extra, wait_s=30)
    replica = Replica(proc, url)

    async def read() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            replica.output.append(line)

    replica.reader = asyncio.create_task(read())
    return replica


@pytest_asyncio.fixture
async def replicas() -> AsyncIterator[list[Replica]]:
    """The replicas a test starts, killed at its end."""
    started: list[Replica] = []
    yield started
    for replica in started:
        await replica.kill()


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> float:
    """Seconds until ``check()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await check():
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def summary_requests(fake: FakeUpstream) -> list[RecordedRequest]:
    return [
        r
        for r in fake.chat_requests()
        if "running summary" in str(r.json()["messages"][0].get("content"))
    ]


def query(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, args or None).fetchall()


async def chat(http: aiohttp.ClientSession, url: str, msgs: list[dict[str, Any]]) -> Any:
    async with http.post(f"{url}/v1/chat/completions", json={"messages": msgs}, headers=USER) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_a_replica_killed_mid_summary_leaves_it_to_another_which_makes_it_once(
    pg: PostgresServer, replicas: list[Replica]
) -> None:
    db = database(pg)
    env = {
        "ENGRAM_PROMPT_REPLY_RESERVE": "256",
        "ENGRAM_PROMPT_MODE": "zones",  # the first cut forwards enough for the summary's budget
        "ENGRAM_SUMMARY_BUDGET_SHARE": "1.0",
        "ENGRAM_MEMORY_JOB_LEASE": str(LEASE_S),
    }
    async with FakeUpstream(n_ctx=2048) as fake, aiohttp.ClientSession() as http:
        a = await start_replica(db, fake.url, **env)
        replicas.append(a)
        b = await start_replica(db, fake.url, **env)
        replicas.append(b)
        # A's reply, then A's summariser held by the upstream (A is mid-job when it is killed)
        fake.enqueue(
            JsonReply(chat_completion("Question 3 was about lorem.")),
            JsonReply(chat_completion(SUMMARY), delay=600),
        )
        msgs = long_chat(40)
        body = await chat(http, a.url, msgs)

        async def a_summarising() -> bool:
            return len(summary_requests(fake)) == 1

        await wait_for("A's summary request", a_summarising, 20)
        (held,) = summary_requests(fake)
        assert held.json()["messages"][1]["content"].startswith("Conversation:")  # a first one
        await a.kill()
        assert query(db, "SELECT count(*) FROM summaries") == [(0,)]  # A's job left nothing
        assert query(db, "SELECT count(*) FROM leases WHERE name LIKE 'summary:%'") == [(1,)]

        # The conversation goes on through B; its summariser finds A's lease, waits it out.
        fake.enqueue(JsonReply(chat_completion("More about lorem.")))
        fake.enqueue(*[JsonReply(chat_completion(f"{SUMMARY} Part {i}.")) for i in range(30)])
        killed = time.monotonic()
        more = [*msgs, body["choices"][0]["message"], {"role": "user", "content": "More?"}]
        await chat(http, b.url, more)

        async def made() -> bool:
            rows = query(db, "SELECT count(*) FROM leases WHERE name LIKE 'summary:%'")
            return rows == [(0,)] and bool(query(db, "SELECT 1 FROM summaries"))

        took = await wait_for("B's summary", made, 30)
        print(f"summary taken over and made {time.monotonic() - killed:.2f} s after the kill")
        assert took < 15
        ((upto, content),) = query(db, "SELECT upto, content FROM summaries")
        assert query(db, "SELECT count(*) FROM sessions") == [(1,)]  # one conversation
        assert content.startswith(SUMMARY)
        calls = summary_requests(fake)
        texts = [r.json()["messages"][1]["content"] for r in calls]
        print(f"summariser requests: {len(calls)} (A's held one, then B's), upto {upto}")
        # B did A's job from its start: its first request is the one A died on, seen twice;
        # every later one (the chunks after it) once: nothing summarised twice.
        assert texts[0] == texts[1] and texts.count(texts[0]) == 2
        assert len(set(texts[1:])) == len(texts) - 1
        assert all(t.startswith("Earlier summary:") for t in texts[2:])
        assert b.said("summary updated") == len(texts) - 1


async def test_the_changes_log_is_pruned_by_one_replica_then_by_another(
    pg: PostgresServer, replicas: list[Replica]
) -> None:
    db = database(pg)
    env = {"ENGRAM_CONSOLIDATION_INTERVAL": "0.5"}  # a pass (and a prune) every 0.5 s
    async with FakeUpstream() as fake, aiohttp.ClientSession() as http:
        for _ in range(2):
            replicas.append(await start_replica(db, fake.url, **env))
        a, b = replicas

        async def told(url: str, text: str) -> None:
            await chat(http, url, [{"role": "user", "content": text}])
            await wait_for("the turn logged", lambda: logged(text), 20)

        async def logged(text: str) -> bool:
            return bool(
                query(
                    db,
                    "SELECT 1 FROM changes c JOIN turns t ON t.id = c.turn_id WHERE t.content = %s",
                    text,
                )
            )

        def backdate() -> int:
            with psycopg.connect(db, autocommit=True) as conn:
                cur = conn.execute("UPDATE changes SET created_at = created_at - 7200")
                return cur.rowcount

        async def old_gone() -> bool:
            cut = time.time() - follow.KEEP_SECONDS
            return query(db, "SELECT count(*) FROM changes WHERE created_at < %s", cut) == [(0,)]

        await told(a.url, "My heron stands on one leg by the pond.")
        assert backdate() > 0
        await wait_for("old rows pruned", old_gone, 10)
        ((holder,),) = query(db, "SELECT holder FROM leases WHERE name = %s", LEASE)
        pruner, other = (a, b) if f":{a.proc.pid}:" in holder else (b, a)
        assert f":{pruner.proc.pid}:" in holder
        for _ in range(6):  # three passes of both: the lease stays with the one that prunes
            await asyncio.sleep(0.5)
            assert query(db, "SELECT holder FROM leases WHERE name = %s", LEASE) == [(holder,)]
        assert pruner.said("changes log pruned") >= 1 and other.said("changes log pruned") == 0

        await pruner.kill()  # the other takes over once the dead one's lease has run out
        await told(other.url, "And a stork stands beside it.")
        assert backdate() > 0
        took = await wait_for("old rows pruned by the other", old_gone, 15)
        print(f"the other replica pruned {took:.2f} s after the pruner was killed")
        ((holder,),) = query(db, "SELECT holder FROM leases WHERE name = %s", LEASE)
        assert f":{other.proc.pid}:" in holder

        async def said_so() -> bool:  # its log line, read from its output
            return other.said("changes log pruned") >= 1

        await wait_for("the other's log line", said_so, 5)
        print(b"".join(line for line in other.output if b"pruned" in line).decode())


async def test_a_follower_that_missed_pruned_rows_starts_again(pg: PostgresServer) -> None:
    db = database(pg)
    async for server, other in _pair(db):
        await other.get_or_create_session("u", "u-new")
        await other.add_turns("u-new", "u", [NewTurn(0, "user", "a heron on one leg")])
        await other.write(lambda c: c.execute("UPDATE changes SET created_at = created_at - 7200"))
        assert await other.write(lambda c: follow.prune(c, time.time())) > 0
        await other.add_turns("u-new", "u", [NewTurn(1, "assistant", "and a stork beside it")])
        assert server.follower.cleared == 0
        found = await server.fts_search("u", '"heron" OR "stork"', 5)
        assert server.follower.cleared == 1  # nothing held trusted: loaded again
        assert sorted(await contents(server, found)) == [
            "a heron on one leg",
            "and a stork beside it",
        ]
        cleared = server.follower.cleared
        await other.add_turns("u-new", "u", [NewTurn(2, "user", "then a crane")])
        found = await server.fts_search("u", '"crane"', 5)
        assert (await contents(server, found))[0] == "then a crane"
        assert server.follower.cleared == cleared  # back on the log: appended, not reloaded


async def test_a_waiting_claim_takes_a_dead_holders_lease_and_leaves_a_live_ones(
    pg: PostgresServer,
) -> None:
    db = database(pg)
    async with Store(db) as a, Store(db) as b:
        live, waiter = Leases(a, ttl=0.6), Leases(b, ttl=0.6)
        async with live.hold("summary:s1") as mine:  # renewed while it runs
            assert mine
            t0 = time.monotonic()
            async with waiter.hold("summary:s1", wait=True) as got:
                assert not got and 0.3 < time.monotonic() - t0 < 1.5  # tried once more, at its end
        now = time.time()  # a holder that claimed, then died: nobody renews its lease
        assert await a.write(lambda c: leases.claim(c, "summary:s2", "dead", now, 0.6))
        t0 = time.monotonic()
        async with waiter.hold("summary:s2", wait=True) as got:
            assert got and time.monotonic() - t0 < 1.2
        assert waiter.refused == 1
