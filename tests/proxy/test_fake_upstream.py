"""The fake upstream itself, driven over real sockets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from testing.fake_upstream import (
    FakeUpstream,
    JsonReply,
    StreamReply,
    chat_chunks,
    template_violations,
)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    upstream = FakeUpstream()
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _data_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, ``[DONE]`` kept as a string."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


USER = {"role": "user", "content": "hello there"}


@pytest.mark.asyncio
async def test_default_chat_plain_echoes_and_records(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    body = {"model": "m", "messages": [USER], "cache_prompt": True}
    raw = json.dumps(body).encode()
    async with session.post(
        f"{fake.url}/v1/chat/completions",
        data=raw,
        headers={"Authorization": "Bearer k", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 200
        reply = await resp.json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "echo: hello there"}
    assert reply["usage"]["total_tokens"] > 0
    [rec] = fake.chat_requests()
    assert rec.body == raw
    assert rec.json() == body
    assert rec.headers["Authorization"] == "Bearer k"


@pytest.mark.asyncio
async def test_default_chat_stream_shape(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    body = {"messages": [USER], "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{fake.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = _data_events(await resp.read())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]"
    usage_chunk, finish_chunk = events[-2], events[-3]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert finish_chunk["choices"][0]["finish_reason"] == "stop"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-3])
    assert text == "echo: hello there"


@pytest.mark.asyncio
async def test_malformed_json_is_a_llamacpp_400(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    async with session.post(f"{fake.url}/v1/chat/completions", data=b"{nope") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == 400


@pytest.mark.asyncio
async def test_enqueued_stream_die_after_aborts(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    fake.enqueue(StreamReply(chat_chunks(["a", "b", "c"]), die_after=2))
    fake.enqueue(JsonReply({"ok": 1}, status=201))
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(f"{fake.url}/v1/chat/completions", json={}) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                got += chunk
    assert len(_data_events(got)) == 2  # role delta and "a", then the connection died
    async with session.post(f"{fake.url}/chat/completions", json={"messages": [USER]}) as resp:
        assert resp.status == 200  # other path: default behaviour
    async with session.post(f"{fake.url}/v1/chat/completions", json={}) as resp:
        assert resp.status == 201 and await resp.json() == {"ok": 1}


def test_template_violations_pure() -> None:
    call = {"id": "abc123XYZ", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    good = [
        {"role": "system", "content": "s"},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "content": "42"},
        {"role": "assistant", "content": "done"},
        USER,
    ]
    assert template_violations(good) == []
    assert template_violations([USER, {"role": "system", "content": "late"}])
    assert template_violations([USER, USER])
    assert template_violations([USER, {"role": "assistant", "content": ""}])
    assert template_violations([USER, {"role": "tool", "tool_call_id": "x", "content": "1"}])
    unanswered = [USER, {"role": "assistant", "content": None, "tool_calls": [call]}, USER]
    assert any("unanswered" in v for v in template_violations(unanswered))


@pytest.mark.asyncio
async def test_strict_templates_answer_500(session: aiohttp.ClientSession) -> None:
    fake = FakeUpstream(strict_templates=True)
    await fake.start()
    try:
        two_systems = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}]
        async with session.post(
            f"{fake.url}/v1/chat/completions", json={"messages": [*two_systems, USER]}
        ) as resp:
            assert resp.status == 500
            assert "index 0" in (await resp.json())["error"]["message"]
        async with session.post(
            f"{fake.url}/v1/chat/completions", json={"messages": [two_systems[0], USER]}
        ) as resp:
            assert resp.status == 200
    finally:
        await fake.stop()


@pytest.mark.asyncio
async def test_client_disconnect_recorded_promptly(
    fake: FakeUpstream, session: aiohttp.ClientSession
) -> None:
    fake.enqueue(StreamReply(chat_chunks(["x"] * 50), delay=0.5))
    resp = await session.post(f"{fake.url}/v1/chat/completions", json={"stream": True})
    assert await resp.content.readany()
    closed_at = time.monotonic()
    resp.close()  # drops the connection
    for _ in range(50):
        if fake.disconnects:
            break
        await asyncio.sleep(0.01)
    [(path, at)] = fake.disconnects
    assert path == "/v1/chat/completions"
    assert at - closed_at < 0.1


@pytest.mark.asyncio
async def test_flavor_routes(session: aiohttp.ClientSession) -> None:
    for flavor, present, absent in (
        ("llamacpp", "/props", "/api/version"),
        ("ollama", "/api/version", "/props"),
    ):
        fake = FakeUpstream(flavor=flavor, n_ctx=8192)
        await fake.start()
        try:
            async with session.get(fake.url + present) as resp:
                assert resp.status == 200
            async with session.get(fake.url + absent) as resp:
                assert resp.status == 404
            async with session.get(fake.url + "/v1/models") as resp:
                assert (await resp.json())["object"] == "list"
        finally:
            await fake.stop()


@pytest.mark.asyncio
async def test_openai_sdk_reads_tool_call_stream(fake: FakeUpstream) -> None:
    openai = pytest.importorskip("openai")
    call = {"id": "abc123XYZ", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    fake.enqueue(
        StreamReply(chat_chunks(["Let me check."], tool_calls=[call], usage=usage, ping=True))
    )
    async with openai.AsyncOpenAI(base_url=f"{fake.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[USER], stream=True, stream_options={"include_usage": True}
        )
        content, args, finish, got_usage = "", "", None, None
        async for chunk in stream:
            if chunk.usage:
                got_usage = chunk.usage.total_tokens
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    assert tc.index == 0
                    args += tc.function.arguments if tc.function and tc.function.arguments else ""
                finish = choice.finish_reason or finish
    assert (content, args, finish, got_usage) == (
        "Let me check.",
        call["arguments"],
        "tool_calls",
        8,
    )
