"""Feedback: the record of chat requests, flags, the consolidation queue, bad input."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from proxy.store.store import Store
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio


async def chat(
    http: aiohttp.ClientSession, engram: Engram, text: str, user: str = "u", **headers: str
) -> str:
    """Send a chat request; returns its X-Engram-Request-Id."""
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers={"X-Engram-User": user, **headers},
        json={"messages": [{"role": "user", "content": text}]},
    ) as r:
        assert r.status == 200
        return r.headers["X-Engram-Request-Id"]


async def feedback(
    http: aiohttp.ClientSession, engram: Engram, body: Any, user: str = "u"
) -> tuple[int, dict[str, Any]]:
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, str | bytes) else {"json": body}
    headers = {"X-Engram-User": user, "Content-Type": "application/json"}
    async with http.post(engram.url + "/engram/api/feedback", headers=headers, **kwargs) as r:
        return r.status, await r.json()


async def rows(store: Store, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    return await store.read(lambda c: [tuple(r) for r in c.execute(sql, args)])


async def test_flag_queues_the_request(engram: Engram, http: aiohttp.ClientSession) -> None:
    await chat(http, engram, "my sister lives in Tromso", **{"X-Engram-Session": "a"})
    await settle(engram)
    rid = await chat(http, engram, "where does my sister live?", **{"X-Engram-Session": "b"})
    # Named at once, before its record was written in the background.
    status, body = await feedback(
        http, engram, {"request_id": rid, "helpful": False, "note": "forgot Tromso"}
    )
    assert status == 200 and body == {"request_id": rid, "helpful": False, "queued": True}
    store = engram.app[SERVICES].store
    (req,) = await rows(
        store, "SELECT user_id, session_id, query, memory_ids FROM requests WHERE id = ?", rid
    )
    assert req[:3] == ("u", "b", "where does my sister live?")
    assert req[3] != "[]"  # the turn about Tromso was injected, and its id recorded
    assert await rows(store, "SELECT request_id, status, attempts FROM consolidation_queue") == [
        (rid, "pending", 0)
    ]
    assert await rows(store, "SELECT helpful, source, note FROM feedback") == [
        (0, "api", "forgot Tromso")
    ]
    # Helpful feedback is recorded and queues nothing (more).
    other = await chat(http, engram, "thanks")
    status, body = await feedback(http, engram, {"request_id": other, "helpful": True})
    assert status == 200 and body["queued"] is False
    assert len(await rows(store, "SELECT * FROM consolidation_queue")) == 1
    assert len(await rows(store, "SELECT * FROM feedback WHERE helpful = 1")) == 1


async def test_unknown_or_foreign_request_is_404(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    rid = await chat(http, engram, "alice's private question", user="alice")
    await settle(engram)
    status, body = await feedback(http, engram, {"request_id": rid, "helpful": False}, "bob")
    assert status == 404 and body["error"]["code"] == "request_not_found"
    status, body2 = await feedback(http, engram, {"request_id": "nope", "helpful": False}, "bob")
    assert status == 404
    assert body["error"]["message"].replace(rid, "?") == body2["error"]["message"].replace(
        "nope", "?"
    )
    # A request with memory off is not recorded.
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers={"X-Engram-User": "alice", "X-Engram-Memory": "off"},
        json={"messages": [{"role": "user", "content": "off the record"}]},
    ) as r:
        off = r.headers["X-Engram-Request-Id"]
    await settle(engram)
    status, _ = await feedback(http, engram, {"request_id": off, "helpful": False}, "alice")
    assert status == 404
    store = engram.app[SERVICES].store
    assert await rows(store, "SELECT * FROM feedback") == []
    assert await rows(store, "SELECT * FROM consolidation_queue") == []
    # Engram's own flag: the owner's request queues, another user's does not exist.
    fb = engram.app[SERVICES].memory.feedback
    assert fb is not None
    assert await fb.flag("bob", rid, "expired_slot") is False
    assert await fb.flag("alice", rid, "expired_slot") is True
    assert await rows(store, "SELECT source FROM feedback") == [("expired_slot",)]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ("{not json", None, "invalid_json"),
        ("", None, "invalid_json"),
        ("[1, 2]", None, "invalid_body"),
        ({"helpful": False}, "request_id", "invalid_request_id"),
        ({"request_id": 7, "helpful": False}, "request_id", "invalid_request_id"),
        ({"request_id": "  ", "helpful": False}, "request_id", "invalid_request_id"),
        ({"request_id": "x"}, "helpful", "invalid_helpful"),
        ({"request_id": "x", "helpful": "no"}, "helpful", "invalid_helpful"),
        ({"request_id": "x", "helpful": 0}, "helpful", "invalid_helpful"),
        ({"request_id": "x", "helpful": False, "note": 5}, "note", "invalid_note"),
        ({"request_id": "x", "helpful": False, "note": "n" * 5000}, "note", "invalid_note"),
    ],
)
async def test_bad_input_is_400_and_changes_nothing(
    engram: Engram, http: aiohttp.ClientSession, body: Any, param: str | None, code: str
) -> None:
    await chat(http, engram, "hello")
    await settle(engram)
    status, got = await feedback(http, engram, body)
    assert status == 400
    err = got["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code
    assert err["param"] == param
    if param:
        assert param in err["message"]
    store = engram.app[SERVICES].store
    assert await rows(store, "SELECT * FROM feedback") == []
    assert await rows(store, "SELECT * FROM consolidation_queue") == []


async def test_record_is_redacted_bounded_and_forgotten_with_its_session(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(fake.url, feedback={"keep_requests": 2})
    try:
        secret = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789"
        first = await chat(http, e, f"my key is {secret}", **{"X-Engram-Session": "s1"})
        ids = [await chat(http, e, f"question {i}", **{"X-Engram-Session": "s2"}) for i in range(3)]
        await settle(e)
        store = e.app[SERVICES].store
        (query,) = (await rows(store, "SELECT query FROM requests WHERE id = ?", first))[0]
        assert secret not in query and "[REDACTED:" in query
        status, _ = await feedback(http, e, {"request_id": first, "helpful": False})
        assert status == 200
        fb = e.app[SERVICES].memory.feedback
        assert fb is not None
        assert await fb.prune() == 1  # the two newest of the user, and the flagged one, stay
        kept = {r[0] for r in await rows(store, "SELECT id FROM requests")}
        assert kept == {first, ids[1], ids[2]}
        # Forgetting a session forgets its requests, their feedback and their queue entries.
        async with http.delete(
            f"{e.url}/engram/api/sessions/s1", headers={"X-Engram-User": "u"}
        ) as r:
            assert r.status == 200
        assert {r[0] for r in await rows(store, "SELECT id FROM requests")} == {ids[1], ids[2]}
        assert await rows(store, "SELECT * FROM feedback") == []
        assert await rows(store, "SELECT * FROM consolidation_queue") == []
    finally:
        await e.close()


async def test_read_only_request_stores_not_even_the_reply(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    """Regression: a read-only request to a stored session archived the upstream's reply."""
    await chat(http, engram, "first", **{"X-Engram-Session": "ro"})
    await settle(engram)
    await chat(
        http, engram, "probe 4417", **{"X-Engram-Session": "ro", "X-Engram-Memory": "read-only"}
    )
    await settle(engram)
    turns = await engram.app[SERVICES].store.session_turns("ro")
    assert [t.content for t in turns] == ["first", "echo: first"]
