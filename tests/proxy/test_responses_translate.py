"""The Responses API through Engram to an upstream without it (a 404 on ``/v1/responses``):
translated to chat completions and back, so the ``openai`` SDK's ``client.responses`` still gets
replies it parses — plain, streamed (the strict ``responses.stream()`` helper), function calls —
and the turns are archived as Responses turns."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio

from proxy.services import SERVICES
from testing.fake_chunks import chat_completion, template_violations
from testing.fake_responses import without_responses
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

CALL = {"id": "call_abc123", "name": "get_weather", "arguments": '{"city": "Paris"}'}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest_asyncio.fixture
async def chat_only() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(strict_templates=True) as fake:
        without_responses(fake)
        yield fake


@pytest_asyncio.fixture
async def client(chat_only: FakeUpstream) -> AsyncIterator[tuple[Engram, openai.AsyncOpenAI]]:
    engram = await start_engram(chat_only.url)
    sdk = openai.AsyncOpenAI(
        base_url=engram.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Engram-User": "alice"},
    )
    try:
        yield engram, sdk
    finally:
        await sdk.close()
        await engram.close()


async def test_plain_and_streamed_replies_are_translated(
    client: tuple[Engram, openai.AsyncOpenAI], chat_only: FakeUpstream
) -> None:
    engram, sdk = client
    resp = await sdk.responses.create(
        model="m", instructions="Be brief.", input="Hello there", max_output_tokens=64
    )
    assert resp.object == "response" and resp.status == "completed"
    assert resp.output_text == "echo: Hello there"
    assert resp.usage is not None and resp.usage.input_tokens > 0
    sent = chat_only.chat_requests()[-1].json()
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    assert sent["max_tokens"] == 64
    async with sdk.responses.stream(model="m", input="Stream it") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "echo: Stream it"
    # /v1/responses was asked once; the upstream's lack of it is remembered.
    assert len(chat_only.responses.requests()) == 1
    await settle(engram)
    store = engram.app[SERVICES].store
    stored = [
        t for s in await store.list_sessions("alice") for t in await store.session_turns(s.id)
    ]
    assert ("assistant", "echo: Stream it") in [(t.role, t.content) for t in stored]
    assert {t.api for t in stored} == {"openai-responses"}


async def test_function_calls_are_translated_both_ways(
    client: tuple[Engram, openai.AsyncOpenAI], chat_only: FakeUpstream
) -> None:
    _, sdk = client
    chat_only.enqueue(JsonReply(chat_completion(None, tool_calls=[CALL])))
    first = await sdk.responses.create(model="m", input="Weather in Paris?", tools=[TOOL])
    [call] = first.output
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == (
        CALL["id"],
        CALL["name"],
        CALL["arguments"],
    )
    sent = chat_only.chat_requests()[-1].json()
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["parameters"]}}
    ]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = await sdk.responses.create(model="m", input=history, tools=[TOOL])
    assert second.output_text == "echo: Weather in Paris?"
    messages = chat_only.chat_requests()[-1].json()["messages"]
    assert template_violations(messages) == []
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == CALL["id"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


async def test_previous_response_id_cannot_be_translated(
    client: tuple[Engram, openai.AsyncOpenAI], chat_only: FakeUpstream
) -> None:
    _, sdk = client
    with pytest.raises(openai.BadRequestError) as err:
        await sdk.responses.create(model="m", input="more", previous_response_id="resp_1")
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "previous_response_not_supported"
    assert chat_only.chat_requests() == []
