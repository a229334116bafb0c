"""Ollama's ``/api/chat`` over an upstream without it (llama-server answers 404 there): Engram
sends chat completions and translates the reply back, and the ``ollama`` client cannot tell."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import ollama
import pytest
import pytest_asyncio

from proxy.services import SERVICES
from proxy.store.models import Turn
from testing.fake_chunks import chat_chunks, chat_completion, llamacpp_error, make_usage
from testing.fake_upstream import FakeUpstream, JsonReply, StreamReply
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

CHAT = "/v1/chat/completions"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(strict_templates=True) as upstream:  # llama.cpp: no /api/chat
        yield upstream


@pytest_asyncio.fixture
async def engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(fake.url)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def c(engram: Engram) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=engram.url, headers={"X-Engram-User": "tom"}) as client:
        yield client


async def turns_of(engram: Engram, user: str) -> list[Turn]:
    store = engram.app[SERVICES].store
    out: list[Turn] = []
    for s in await store.list_sessions(user):
        out += await store.session_turns(s.id)
    return out


def paths(fake: FakeUpstream) -> list[str]:
    return [r.path for r in fake.requests if r.method == "POST"]


async def test_plain_and_streamed_replies_are_translated(
    engram: Engram, fake: FakeUpstream, c: ollama.AsyncClient
) -> None:
    msgs = [{"role": "user", "content": "hello llama"}]
    reply = await c.chat(model="m", messages=msgs, options={"temperature": 0.1, "num_predict": 50})
    assert reply.message.content == "echo: hello llama"
    assert reply.done and reply.done_reason == "stop" and reply.prompt_eval_count
    assert paths(fake) == ["/api/chat", CHAT]
    sent = fake.requests[-1].json()
    assert (sent["temperature"], sent["max_tokens"], sent["stream"]) == (0.1, 50, False)
    parts = [p async for p in await c.chat(model="m", messages=msgs, stream=True)]
    assert "".join(p.message.content or "" for p in parts) == "echo: hello llama"
    assert parts[-1].done and parts[-1].eval_count
    # Remembered for this upstream: straight to chat completions, with usage asked for.
    assert paths(fake) == ["/api/chat", CHAT, CHAT]
    assert fake.requests[-1].json()["stream_options"] == {"include_usage": True}
    await settle(engram)
    turns = await turns_of(engram, "tom")
    assert [t.content for t in turns if t.role == "assistant"] == ["echo: hello llama"] * 2
    assert {t.api for t in turns} == {"ollama-chat"}


async def test_tool_calls_are_translated_both_ways(
    engram: Engram, fake: FakeUpstream, c: ollama.AsyncClient
) -> None:
    call = {"id": "ab12cd34e", "name": "weather", "arguments": '{"city": "Paris"}'}
    fake.enqueue(JsonReply(chat_completion(None, tool_calls=[call])), path=CHAT)
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = await c.chat(model="m", messages=history, tools=[WEATHER_TOOL])
    assert first.message.tool_calls is not None
    assert dict(first.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    history += [first.message, {"role": "tool", "content": "21 C", "tool_name": "weather"}]
    fake.enqueue(StreamReply(chat_chunks(["Sunny, ", "21 C."], usage=make_usage(40, 5))), path=CHAT)
    parts = [
        p
        async for p in await c.chat(model="m", messages=history, tools=[WEATHER_TOOL], stream=True)
    ]
    assert "".join(p.message.content or "" for p in parts) == "Sunny, 21 C."
    assert (parts[-1].prompt_eval_count, parts[-1].eval_count) == (40, 5)
    sent = fake.requests[-1].json()
    assert sent["tools"] == [WEATHER_TOOL]
    assistant, tool = sent["messages"][1], sent["messages"][2]
    assert assistant["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": '{"city": "Paris"}',
    }
    assert tool == {
        "role": "tool",
        "content": "21 C",
        "tool_call_id": assistant["tool_calls"][0]["id"],
    }


async def test_translated_tool_call_reply_matches_its_resend_in_the_archive(
    engram: Engram, fake: FakeUpstream, c: ollama.AsyncClient
) -> None:
    """The archived reply's call ids are those its resend gets: one session, no duplicates."""
    call = {"id": "ab12cd34e", "name": "weather", "arguments": '{"city": "Oslo"}'}
    fake.enqueue(JsonReply(chat_completion(None, tool_calls=[call])), path=CHAT)
    history: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await c.chat(model="m", messages=history, tools=[WEATHER_TOOL])
    history += [first.message, {"role": "tool", "content": "3 C", "tool_name": "weather"}]
    await c.chat(model="m", messages=history, tools=[WEATHER_TOOL])
    await settle(engram)
    turns = await turns_of(engram, "tom")
    assert [t.role for t in turns] == ["user", "assistant", "tool", "assistant"]


async def test_upstream_errors_come_back_in_ollamas_shape(
    engram: Engram, fake: FakeUpstream, c: ollama.AsyncClient
) -> None:
    await c.chat(model="m", messages=[{"role": "user", "content": "warm up"}])
    fake.enqueue(
        JsonReply(llamacpp_error("the request exceeds the available context size"), status=400),
        path=CHAT,
    )
    with pytest.raises(ollama.ResponseError) as err:
        await c.chat(model="m", messages=[{"role": "user", "content": "too long"}])
    assert err.value.status_code == 400
    assert isinstance(err.value.error, str) and "context size" in err.value.error
    # Mid-stream: an error event becomes Ollama's error line, which the client raises.
    events = chat_chunks(["par", "tial"], done=False)[:2]
    events.append(b'data: {"error": {"message": "slot crashed", "type": "server_error"}}\n\n')
    fake.enqueue(StreamReply(events), path=CHAT)
    with pytest.raises(ollama.ResponseError, match="slot crashed"):
        async for _ in await c.chat(
            model="m", messages=[{"role": "user", "content": "go"}], stream=True
        ):
            pass
    await settle(engram)
    assert json.dumps([t.content for t in await turns_of(engram, "tom")]).count("too long") == 0
