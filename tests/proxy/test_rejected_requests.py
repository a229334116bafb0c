"""Only what the upstream accepted is archived (issue 12, row 2): a request the upstream answers
with an error, plain or streamed, leaves nothing in the database (no user, session, turn or
request record) and nothing for the indexer; the same conversation accepted later is stored as
if the rejected attempt had never happened."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from testing.fake_chunks import openai_error
from testing.fake_upstream import FakeUpstream, JsonReply, Reply, StreamReply
from testing.harness import Engram, settle

pytestmark = pytest.mark.asyncio

TABLES = ("users", "sessions", "turns", "requests", "summaries", "feedback")


async def counts(engram: Engram) -> dict[str, int]:
    store = engram.app[SERVICES].store

    def job(c: Any) -> dict[str, int]:
        return {t: int(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in TABLES}

    return await store.read(job)


def rejection(status: int, streamed: bool) -> Reply:
    body = openai_error("nope", "authentication_error" if status == 401 else "server_error")
    if not streamed:
        return JsonReply(body, status=status)
    # An error sent as an event stream, as some servers do once streaming was asked for.
    return StreamReply([f"data: {json.dumps(body)}\n\n".encode()], status=status)


async def send(
    http: aiohttp.ClientSession,
    engram: Engram,
    messages: list[dict[str, Any]],
    stream: bool,
    headers: dict[str, str],
) -> tuple[int, aiohttp.ClientResponse]:
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers={"X-Engram-User": "alice", **headers},
        json={"model": "m", "messages": messages, "stream": stream},
    ) as r:
        await r.read()
        return r.status, r


@pytest.mark.parametrize("status", [401, 400, 500])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("named", [False, True], ids=["chain", "named"])
async def test_rejected_request_leaves_no_trace(
    engram: Engram,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    status: int,
    streamed: bool,
    named: bool,
) -> None:
    headers = {"X-Engram-Session": "conv"} if named else {}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "my locker code is 4471"},
    ]
    fake.enqueue(rejection(status, streamed))
    got, _ = await send(http, engram, messages, streamed, headers)
    assert got == status
    await settle(engram)
    assert await counts(engram) == dict.fromkeys(TABLES, 0)
    memory = engram.app[SERVICES].require_memory().memory
    assert memory.archived_turns == 0
    assert memory.indexer is not None and memory.indexer.indexed == 0
    assert memory.feedback is not None and memory.feedback.recorded == 0
    # The same conversation, accepted this time, is stored as usual.
    got, r = await send(http, engram, messages, streamed, headers)
    assert got == 200
    await settle(engram)
    after = await counts(engram)
    assert after["sessions"] == 1 and after["requests"] == 1 and after["turns"] == 3
    store = engram.app[SERVICES].store
    (session,) = await store.list_sessions("alice")
    assert r.headers["X-Engram-Session"] == session.name
    turns = await store.session_turns(session.id)
    assert [(t.position, t.role) for t in turns] == [(0, "system"), (1, "user"), (2, "assistant")]
    assert memory.indexer.indexed == 3


async def test_rejected_request_of_a_stored_conversation_adds_nothing(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A follow-up the upstream rejects leaves the stored conversation as it was, and records
    no request, in every memory mode that writes or reads."""
    first = [{"role": "user", "content": "hello"}]
    got, _ = await send(http, engram, first, False, {})
    assert got == 200
    await settle(engram)
    before = await counts(engram)
    follow = [
        *first,
        {"role": "assistant", "content": "echo: hello"},
        {"role": "user", "content": "x"},
    ]
    for mode in ("on", "write-only", "read-only"):
        fake.enqueue(rejection(401, False))
        got, _ = await send(http, engram, follow, False, {"X-Engram-Memory": mode})
        assert got == 401
        await settle(engram)
        assert await counts(engram) == before, mode
    # Accepted in read-only mode: recorded for feedback, nothing archived.
    got, _ = await send(http, engram, follow, False, {"X-Engram-Memory": "read-only"})
    assert got == 200
    await settle(engram)
    assert await counts(engram) == {**before, "requests": before["requests"] + 1}
