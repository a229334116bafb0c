"""Prompt rewriting through the proxy, against the fake upstream in strict-template mode."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from testing.fake_chunks import template_violations
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

N_CTX = 2048


@pytest_asyncio.fixture
async def strict() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(n_ctx=N_CTX, strict_templates=True, enforce_ctx=True) as fake:
        yield fake


@pytest_asyncio.fixture
async def engram(strict: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(strict.url, prompt={"reply_reserve": 256})
    try:
        yield e
    finally:
        await e.close()


def long_chat(turns: int, words: int = 60) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: " + "lorem ipsum " * words})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + "dolor sit " * words})
    msgs.append({"role": "user", "content": "What was question 3 about?"})
    return msgs


def tokens_of(messages: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(m)) for m in messages) // 4


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json(), r


async def test_three_times_the_context_works_through_engram_not_direct(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs = long_chat(40)
    assert tokens_of(msgs) > 3 * N_CTX
    status, body, _ = await post(http, strict.url, {"messages": msgs})
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error"
    status, body, r = await post(http, engram.url, {"messages": msgs}, **{"X-Engram-User": "z"})
    assert status == 200, body
    fwd = strict.chat_requests()[-1].json()["messages"]
    assert not template_violations(fwd)
    assert fwd[0] == msgs[0] and fwd[-1] == msgs[-1]
    assert len(fwd) < len(msgs)
    forwarded, original = map(int, r.headers["X-Engram-Prompt-Tokens"].split("/"))
    assert forwarded < original and forwarded <= N_CTX


async def test_short_conversation_is_forwarded_whole(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs = long_chat(2, words=5)
    status, _, _ = await post(http, engram.url, {"messages": msgs}, **{"X-Engram-User": "w"})
    assert status == 200
    assert strict.chat_requests()[-1].json()["messages"] == msgs


async def test_tool_calls_parallel_calls_and_parts_stay_valid(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent"}]
    for i in range(25):
        msgs.append({"role": "user", "content": [{"type": "text", "text": f"task {i} " * 30}]})
        ids = [f"c{i}a", f"c{i}b"]
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": c, "type": "function", "function": {"name": "read", "arguments": "{}"}}
                    for c in ids
                ],
            }
        )
        msgs += [{"role": "tool", "tool_call_id": c, "content": "file body " * 40} for c in ids]
        msgs.append({"role": "assistant", "content": f"done {i}"})
    msgs.append({"role": "user", "content": "next"})
    msgs.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "cur", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        }
    )
    msgs.append({"role": "tool", "tool_call_id": "cur", "content": "a.py b.py"})
    status, body, _ = await post(
        http, engram.url, {"messages": msgs, "max_tokens": 64}, **{"X-Engram-User": "t"}
    )
    assert status == 200, body
    fwd = strict.chat_requests()[-1].json()["messages"]
    assert not template_violations(fwd)
    assert fwd[-3:] == msgs[-3:]


async def test_compacted_history_and_second_request_of_a_long_chat(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs = long_chat(30)
    status, body, r = await post(http, engram.url, {"messages": msgs}, **{"X-Engram-User": "c"})
    assert status == 200
    await settle(engram)
    # The next turn of the same conversation: memories of its own aged turns may be recalled.
    msgs2 = [*msgs, body["choices"][0]["message"], {"role": "user", "content": "Question 3?"}]
    status, _, r2 = await post(http, engram.url, {"messages": msgs2}, **{"X-Engram-User": "c"})
    assert status == 200
    assert r2.headers["X-Engram-Session"] == r.headers["X-Engram-Session"]
    fwd = strict.chat_requests()[-1].json()["messages"]
    assert not template_violations(fwd)
    # A client that compacted its history itself: a summary-like system note and recent turns.
    compacted = [
        {"role": "system", "content": "You are terse. Earlier: 30 questions."},
        *msgs2[-5:],
    ]
    status, _, _ = await post(http, engram.url, {"messages": compacted}, **{"X-Engram-User": "c"})
    assert status == 200
    assert not template_violations(strict.chat_requests()[-1].json()["messages"])


async def test_stable_mode_puts_memories_before_the_new_user_message(
    strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(
        strict.url, prompt={"mode": "stable"}, embedder={"model": "engram/all-MiniLM-L6-v2-q8"}
    )
    try:
        await post(
            http,
            e.url,
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "My favourite colour is teal."},
                ]
            },
            **{"X-Engram-User": "st"},
        )
        await settle(e)
        status, _, r = await post(
            http,
            e.url,
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "What is my favourite colour?"},
                ]
            },
            **{"X-Engram-User": "st"},
        )
        assert status == 200 and int(r.headers["X-Engram-Memories"]) >= 1
        fwd = strict.chat_requests()[-1].json()["messages"]
        assert fwd[0] == {"role": "system", "content": "S"}  # untouched: the cache prefix holds
        assert "teal" in json.dumps(fwd[-1]) and fwd[-1]["role"] == "user"
        assert fwd[-1]["content"][-1] == {"type": "text", "text": "What is my favourite colour?"}
        assert not template_violations(fwd)
    finally:
        await e.close()


async def test_last_request_is_visible_with_zones(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs = long_chat(40)
    status, _, r = await post(http, engram.url, {"messages": msgs}, **{"X-Engram-User": "v"})
    assert status == 200
    sid = r.headers["X-Engram-Session"]
    async with http.get(
        f"{engram.url}/engram/api/sessions/{sid}/requests/last", headers={"X-Engram-User": "v"}
    ) as resp:
        assert resp.status == 200
        last = await resp.json()
        assert resp.headers["X-Engram-Prompt-Tokens"] == r.headers["X-Engram-Prompt-Tokens"]
    assert last["rewritten"] is True and last["aged"] > 0
    sources = [p["source"] for p in last["parts"]]
    assert sources[0] == "system" and sources[-1] == "current"
    assert {p["zone"] for p in last["parts"]} <= {"primacy", "recency"}
    assert [p["message"] for p in last["parts"]] == strict.chat_requests()[-1].json()["messages"]
    async with http.get(
        f"{engram.url}/engram/api/sessions/{sid}/requests/last",
        headers={"X-Engram-User": "someone-else"},
    ) as resp:
        assert resp.status == 404
