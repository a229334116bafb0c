"""Forgetting that forgets (issue 12, row 8): a sentence stored through the proxy (turns, the
full-text index, vectors, the request record, a tool-result slot, the rolling summary) leaves no
byte in the database files once its sessions are forgotten, through the admin API or the
``engram forget`` command; what is derived from a session (a sub-agent's hand-back in its parent)
goes with it; its slots leave Redis too, and a Redis that is down does not fail the forget."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.cli.main import main
from proxy.services import SERVICES
from proxy.slots.redis import RedisSlots
from proxy.slots.refs import slot_id
from proxy.store.models import NewTurn
from proxy.store.sqlite.db import connect
from proxy.store.sqlite.scrub import fts_optimize
from proxy.store.summaries import get_summary
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, settle, start_engram
from testing.redis_server import RedisServer
from tests.proxy.test_rewrite import long_chat
from tests.proxy.test_slot_proxy import agent_chat, output

pytestmark = pytest.mark.asyncio

SENTENCE = "Quillon Marveth hid the qxzarquonkrag ledger under the ninth lighthouse"
TOKEN = "qxzarquonkrag"  # left alone by the porter stemmer: the full-text index holds it as is
# (its leaf pages store a term after the prefix it shares with the term before: "q" at most)
FTS_PART = TOKEN[2:]
KEPT = "the plumbravex orchard stays remembered"  # another session's: must survive
SUMMARY = f"The user asked forty numbered questions; question 2 said that {SENTENCE}."


def needles(*texts: str) -> list[bytes]:
    return [t.encode(enc) for t in texts for enc in ("utf-8", "utf-16-le", "utf-16-be")]


def database_bytes(db: Path) -> dict[str, bytes]:
    """Every byte of the database file and of any -wal / -shm / -journal beside it."""
    return {p.name: p.read_bytes() for p in sorted(db.parent.glob(db.name + "*")) if p.is_file()}


def found(db: Path, *texts: str) -> list[str]:
    """Which files hold which of ``texts`` (in UTF-8 or UTF-16)."""
    hits = []
    for name, data in database_bytes(db).items():
        for needle in needles(*texts):
            if needle in data:
                hits.append(f"{name}: {needle!r}")
    return hits


def rows_holding(db: Path, text: str = TOKEN) -> list[str]:
    """Which tables still hold ``text`` in a row (to say why a byte check failed)."""
    conn = connect(db)
    try:
        out = []
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            try:
                for row in conn.execute(f"SELECT * FROM {table}"):
                    if any(text in str(v) for v in row):
                        out.append(f"{table}: {str(row)[:200]}")
            except Exception as exc:  # virtual tables that cannot be scanned
                out.append(f"{table}: {exc}")
        return out
    finally:
        conn.close()


async def post(
    http: aiohttp.ClientSession,
    e: Engram,
    session: str,
    messages: list[dict[str, Any]],
    user: str = "alice",
) -> None:
    async with http.post(
        e.url + "/v1/chat/completions",
        json={"model": "m", "messages": messages},
        headers={"X-Engram-User": user, "X-Engram-Session": session},
    ) as r:
        assert r.status == 200, await r.text()


async def remember_everywhere(
    http: aiohttp.ClientSession, e: Engram, fake: FakeUpstream
) -> dict[str, Any]:
    """Store SENTENCE through the proxy in two sessions, so that it lands in turns, the FTS
    index, vectors, request records, a slot and a summary; KEPT in another user's."""
    await post(http, e, "other", [{"role": "user", "content": KEPT}], "bob")  # echoed back
    fake.enqueue(*[JsonReply(chat_completion(SUMMARY)) for _ in range(40)])
    story = long_chat(40)
    story[5]["content"] = f"Question 2: {SENTENCE}. " + story[5]["content"]
    await post(http, e, "story", story)
    tool_output = output("ledger") + f"\n# {SENTENCE}\n"
    await post(http, e, "agent", agent_chat([tool_output, output("b")], f"so {SENTENCE}?"))
    await settle(e)
    services = e.app[SERVICES]
    store = services.store
    assert store is not None and services.slots is not None
    # Where the sentence is before forgetting: each place the issue names.
    summary = await store.read(lambda c: get_summary(c, "story"))
    assert summary is not None and SENTENCE in summary.content
    slot = await services.slots.get("alice", slot_id("read_file", tool_output))
    assert slot is not None and SENTENCE in slot.content

    def counts(c: Any) -> dict[str, int]:
        like = f"%{TOKEN}%"
        return {
            "turns": c.execute(
                "SELECT count(*) FROM turns WHERE content LIKE ?", (like,)
            ).fetchone()[0],
            "fts": c.execute(
                "SELECT count(*) FROM turns_fts WHERE turns_fts MATCH ?", (TOKEN,)
            ).fetchone()[0],
            "vectors": c.execute(
                "SELECT count(*) FROM turn_vec WHERE session_id IN ('story', 'agent')"
            ).fetchone()[0],
            "requests": c.execute(
                "SELECT count(*) FROM requests WHERE query LIKE ?", (like,)
            ).fetchone()[0],
        }

    before = await store.read(counts)
    assert all(before.values()), before
    # An aged database: far more that is kept than what is forgotten, all merged into one
    # full-text segment long ago (a segment mostly deleted would be rewritten by FTS5 itself).
    await store.get_or_create_session("bob", "archive")
    lines = [f"archived note {i} about gardens and {KEPT.split()[1]} trees" for i in range(3000)]
    await store.add_turns("archive", "bob", [NewTurn(i, "user", t) for i, t in enumerate(lines)])
    await store.write(fts_optimize)
    blobs = await store.read(
        lambda c: [r[0] for r in c.execute("SELECT block FROM turns_fts_data")]
    )
    assert any(FTS_PART.encode() in bytes(b) for b in blobs if b)  # the index holds the term
    return before


async def stop(e: Engram) -> None:
    """Stop Engram cleanly (its background work drained, the database closed)."""
    await e.runner.cleanup()


@pytest.mark.parametrize("how", ["api", "cli", "cli-user"])
async def test_a_forgotten_sentence_leaves_no_byte_in_the_database_files(
    how: str, http: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)
    db = tmp_path / "engram.db"
    async with FakeUpstream() as fake:
        e = await start_engram(
            fake.url,
            memory={"db_path": str(db)},
            prompt={"reply_reserve": 256, "mode": "zones"},  # a summary at once
            summary={"budget_share": 1.0},
        )
        try:
            await remember_everywhere(http, e, fake)
            assert found(db, SENTENCE, TOKEN)  # the check can see it
            if how == "api":
                for session in ("story", "agent"):
                    async with http.delete(
                        f"{e.url}/engram/api/sessions/{session}",
                        headers={"X-Engram-User": "alice"},
                    ) as r:
                        assert r.status == 200, await r.text()
                await settle(e)  # the scrub that follows in the background
                assert found(db, SENTENCE, FTS_PART) == []  # while running: the -wal too
                await stop(e)
            elif how == "cli":
                await stop(e)
                for session in ("story", "agent"):
                    args = ["forget", session, "--db", str(db)]
                    assert await asyncio.to_thread(main, args) == 0
            else:  # the whole user
                await stop(e)
                args = ["forget", "--user", "alice", "--all", "--yes", "--db", str(db)]
                assert await asyncio.to_thread(main, args) == 0
        finally:
            await e.close()
    assert found(db, SENTENCE, FTS_PART, "Quillon Marveth", "quillon") == [], rows_holding(db)
    assert found(db, "plumbravex")  # what was not forgotten is still there
    conn = connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.execute("INSERT INTO turns_fts(turns_fts, rank) VALUES ('integrity-check', 0)")
        assert conn.execute(
            "SELECT count(*) FROM turns_fts WHERE turns_fts MATCH 'plumbravex'"
        ).fetchone() == (3002,)  # the message, its echo, the archive
        left = {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("summaries", "slots", "slot_sessions")
        }
        assert left == {"summaries": 0, "slots": 0, "slot_sessions": 0}
        (requests,) = conn.execute("SELECT count(*) FROM requests").fetchone()
        assert requests == 1  # the other session's
    finally:
        conn.close()


HANDBACK = (
    "Task: read the issue tracker.\nOutcome: found the crash cause.\nKey facts: the "
    "crash is in vexillon.py line 42, caused by an empty header.\nOpen problems: none."
)


async def test_a_subagents_handback_goes_with_the_subagent(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(
        fake.url, summary={"budget_share": 1.0, "max_tokens": 64}, prompt={"mode": "zones"}
    )
    headers = {"X-Engram-User": "u"}

    async def chat(text: str, **extra: str) -> str:
        async with http.post(
            e.url + "/v1/chat/completions",
            headers={**headers, **extra},
            json={"messages": [{"role": "user", "content": text}]},
        ) as r:
            assert r.status == 200
            return r.headers["X-Engram-Session"]

    try:
        top = await chat("please investigate the crash " + "context " * 400)
        kid = await chat("The crash is somewhere in the parser.", **{"X-Engram-Parent": top})
        await settle(e)
        fake.enqueue(JsonReply(chat_completion(HANDBACK)))
        async with http.post(f"{e.url}/engram/api/sessions/{kid}/complete", headers=headers) as r:
            assert r.status == 202
        await settle(e)
        store = e.app[SERVICES].store
        assert store is not None

        def items(c: Any) -> list[Any]:
            return c.execute(
                "SELECT t.id, t.content, (SELECT count(*) FROM turn_vec v WHERE v.turn_id = t.id)"
                " FROM turns t WHERE t.session_id = ? AND t.position < 0",
                (top,),
            ).fetchall()

        made = await store.read(items)
        assert len(made) == 1 and "vexillon.py" in made[0][1] and made[0][2] == 1
        async with http.delete(f"{e.url}/engram/api/sessions/{kid}", headers=headers) as r:
            assert r.status == 200
        await settle(e)
        assert await store.read(items) == []  # the hand-back, its index row and vector: gone
        assert await store.get_session(top) is not None  # the parent stays
        assert [t.position for t in await store.session_turns(top)] == [0, 1]
        async with http.get(
            f"{e.url}/engram/api/search", params={"q": "vexillon", "mode": "fts"}, headers=headers
        ) as r:
            assert r.status == 200
            assert (await r.json())["results"] == []
    finally:
        await e.close()


async def test_forgetting_a_session_deletes_its_slots_from_redis_and_survives_redis_down(
    http: aiohttp.ClientSession, redis_server: RedisServer
) -> None:
    async with FakeUpstream() as fake:
        e = await start_engram(fake.url, slots={"redis_url": redis_server.url})
        try:
            shared, mine, theirs = output("shared"), output("mine"), output("theirs")
            await post(http, e, "s1", agent_chat([shared, mine]))
            await post(http, e, "s2", agent_chat([shared, theirs]))
            await settle(e)
            redis = RedisSlots(redis_server.url, "engram:slot", 1.0)
            try:

                async def in_redis(out: str) -> bool:
                    return bool(
                        await redis.client.exists(redis.key("alice", slot_id("read_file", out)))
                    )

                assert [await in_redis(o) for o in (shared, mine, theirs)] == [True, True, True]
                async with http.delete(
                    f"{e.url}/engram/api/sessions/s1", headers={"X-Engram-User": "alice"}
                ) as r:
                    assert r.status == 200
                await settle(e)
                # s1's own slot is gone; the one s2 still uses stays.
                assert [await in_redis(o) for o in (shared, mine, theirs)] == [True, False, True]
            finally:
                await redis.aclose()
            redis_server.kill()
            async with http.delete(
                f"{e.url}/engram/api/sessions/s2", headers={"X-Engram-User": "alice"}
            ) as r:
                assert r.status == 200  # Redis down: the forget still succeeds
                assert json.loads(await r.text())["deleted"] is True
            await settle(e)
            store = e.app[SERVICES].store
            assert store is not None
            assert await store.get_session("s2") is None
            assert (
                await store.read(
                    lambda c: c.execute("SELECT count(*) FROM slot_sessions").fetchone()[0]
                )
                == 0
            )
        finally:
            await e.close()
