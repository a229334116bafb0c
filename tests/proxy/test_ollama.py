"""Ollama's ``/api/chat`` through Engram, with the ``ollama`` Python client as the client and the
fake upstream as Ollama: plain and streamed replies, tool use, the archive, recall in the system
message (also across APIs), tool-result slots, ``num_ctx`` as the budget, memory off, errors."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import ollama
import openai
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.services import SERVICES
from proxy.store.models import Turn
from testing.fake_ollama import (
    NDJSON,
    PNG,
    error_reply,
    json_reply,
    ndjson,
    ndjson_reply,
    reply_lines,
    tool_call,
    violations,
)
from testing.fake_upstream import FakeUpstream, RecordedRequest, StreamReply
from testing.harness import Engram, forwarded_memory, settle, start_engram

pytestmark = pytest.mark.asyncio

REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
JSON = "application/json"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(flavor="ollama") as upstream:
        yield upstream


@pytest_asyncio.fixture
async def real(fake: FakeUpstream) -> AsyncIterator[Engram]:
    """Engram with the real embedding model (recall tests)."""
    e = await start_engram(fake.url, embedder=REAL_MODEL)
    try:
        yield e
    finally:
        await e.close()


Client = Callable[..., ollama.AsyncClient]


@pytest_asyncio.fixture
async def client() -> AsyncIterator[Client]:
    """Makes ollama clients pointed at an Engram (``client(engram, user, **headers)``; the
    client lower-cases header names), closed after the test."""
    made: list[ollama.AsyncClient] = []

    def make(engram: Engram, user: str = "alice", **headers: str) -> ollama.AsyncClient:
        c = ollama.AsyncClient(host=engram.url, headers={"X-Engram-User": user, **headers})
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


def sent(fake: FakeUpstream, n: int = -1) -> RecordedRequest:
    return [r for r in fake.requests if r.path == "/api/chat"][n]


def system_text(request: RecordedRequest) -> str:
    msgs = request.json()["messages"]
    return str(msgs[0]["content"]) if msgs and msgs[0]["role"] == "system" else ""


async def turns_of(engram: Engram, user: str) -> list[Turn]:
    store = engram.app[SERVICES].store
    out: list[Turn] = []
    for s in await store.list_sessions(user):
        out += await store.session_turns(s.id)
    return out


async def test_sdk_plain_and_streamed_and_archived(
    engram: Engram, fake: FakeUpstream, client: Client
) -> None:
    c = client(engram)
    reply = await c.chat(model="m", messages=[{"role": "user", "content": "hello there"}])
    assert reply.message.content == "echo: hello there" and reply.done
    assert reply.prompt_eval_count and reply.eval_count
    # Nothing to add to a first conversation: the client's exact bytes went on.
    async with ollama.AsyncClient(host=fake.url) as direct:
        await direct.chat(model="m", messages=[{"role": "user", "content": "hello there"}])
    assert sent(fake, 0).body == sent(fake, 1).body
    parts = [
        p
        async for p in await c.chat(
            model="m", messages=[{"role": "user", "content": "stream me"}], stream=True
        )
    ]
    assert "".join(p.message.content or "" for p in parts) == "echo: stream me"
    assert parts[-1].done and parts[-1].done_reason == "stop"
    await settle(engram)
    turns = await turns_of(engram, "alice")
    assert sorted((t.role, t.content) for t in turns) == [
        ("assistant", "echo: hello there"),
        ("assistant", "echo: stream me"),
        ("user", "hello there"),
        ("user", "stream me"),
    ]
    assert {t.api for t in turns} == {"ollama-chat"}
    # Usage calibrates the token counts, as prompt_tokens does for chat completions.
    assert engram.turns[-1].reply is not None
    assert engram.turns[-1].reply.usage is not None
    assert engram.turns[-1].reply.usage["prompt_tokens"] > 0


async def test_ndjson_streams_by_default_unbuffered_and_archived_before_the_last_line(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake.enqueue(ndjson_reply("one two three four", delay=0.3), path="/api/chat")
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}]}  # no "stream"
    start = time.monotonic()
    async with http.post(
        engram.url + "/api/chat", json=body, headers={"X-Engram-User": "bob"}
    ) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        assert r.headers["X-Engram-Memories"] == "0" and r.headers["X-Engram-Session"]
        first = await r.content.readline()
        first_at = time.monotonic() - start
        lines = [first]
        while line := await r.content.readline():
            lines.append(line)
            if json.loads(line)["done"]:
                # The done line is the client's last byte: the turn is already stored.
                stored = await turns_of(engram, "bob")
                assert [t.role for t in stored] == ["user", "assistant"]
                assert stored[-1].content == "one two three four" and not stored[-1].incomplete
    assert json.loads(first)["message"]["content"] == "one"
    assert first_at < 0.25  # the next line comes 0.3 s later: nothing waited for it
    assert json.loads(lines[-1])["done"] is True and len(lines) == 5


async def test_tool_use_round_trip_forwards_the_clients_calls_as_sent(
    engram: Engram, fake: FakeUpstream, client: Client
) -> None:
    c = client(engram, "carol")
    history: list[Any] = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    fake.enqueue(json_reply("", tool_calls=[tool_call("weather", city="Paris")]), path="/api/chat")
    first = await c.chat(model="m", messages=history, tools=[WEATHER_TOOL])
    calls = first.message.tool_calls
    assert calls and calls[0].function.name == "weather"
    assert dict(calls[0].function.arguments) == {"city": "Paris"}
    history += [first.message, {"role": "tool", "content": "21 C", "tool_name": "weather"}]
    fake.enqueue(ndjson_reply("", tool_calls=[tool_call("weather", city="Rome")]), path="/api/chat")
    parts = [p async for p in await c.chat(model="m", messages=history, stream=True)]
    streamed = [tc for p in parts for tc in p.message.tool_calls or []]
    assert dict(streamed[0].function.arguments) == {"city": "Rome"}
    msg = ollama.Message(role="assistant", content="", tool_calls=streamed)
    history += [msg, {"role": "tool", "content": "25 C", "tool_name": "weather"}]
    final = await c.chat(model="m", messages=history, tools=[WEATHER_TOOL])
    assert final.message.content == "echo: Weather in Paris?"
    forwarded = sent(fake).json()
    assert not violations(forwarded)  # arguments objects, content strings: what Ollama takes
    assert forwarded["tools"] == [WEATHER_TOOL]
    calls_sent = [m["tool_calls"] for m in forwarded["messages"] if m.get("tool_calls")]
    assert calls_sent == [
        [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        [{"function": {"name": "weather", "arguments": {"city": "Rome"}}}],
    ]  # no ids or indexes added: the client's messages as sent
    await settle(engram)
    turns = await turns_of(engram, "carol")
    # One session, each message once: the archived replies match their resends (same ids).
    assert len(await engram.app[SERVICES].store.list_sessions("carol")) == 1
    assert [t.role for t in turns] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert turns[3].tool_call_id == turns[2].tool_calls[0]["id"]  # type: ignore[index]


async def test_fact_told_via_ollama_is_recalled_before_the_question(
    real: Engram, fake: FakeUpstream, client: Client
) -> None:
    c = client(real, "dana")
    fact = "My sister Marta lives in Porto and she breeds Siamese cats."
    await c.chat(model="m", messages=[SYSTEM, {"role": "user", "content": fact}])
    await settle(real)
    question = {"role": "user", "content": "Which cat breed does my sister raise?"}
    await c.chat(model="m", messages=[SYSTEM, question])
    msgs = sent(fake).json()["messages"]
    assert msgs[0] == SYSTEM  # the client's system message, byte-identical
    asked = msgs[-1]["content"]  # Ollama's content is a string: the block, then the question
    assert asked.startswith(BLOCK_OPEN) and asked.endswith("\n\n" + question["content"])
    assert "Siamese" in asked
    # No system message sent: none is made.
    parts = [p async for p in await c.chat(model="m", messages=[question], stream=True)]
    assert parts and parts[-1].done
    msgs = sent(fake).json()["messages"]
    assert [m["role"] for m in msgs] == ["user"] and "Siamese" in msgs[0]["content"]
    # Another user asks: nothing of dana's.
    await client(real, "erik").chat(model="m", messages=[SYSTEM, question])
    assert "Siamese" not in sent(fake).body.decode()


async def test_memory_crosses_apis_both_ways(
    real: Engram, fake: FakeUpstream, client: Client
) -> None:
    oa = openai.AsyncOpenAI(
        base_url=real.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Engram-User": "fay"},
    )
    await oa.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "My boat is called the Albatross, moored in Kiel."}],
    )
    await settle(real)
    c = client(real, "fay")
    await c.chat(model="m", messages=[{"role": "user", "content": "Where is my boat moored?"}])
    assert "Albatross" in forwarded_memory(sent(fake).json()["messages"])
    await c.chat(
        model="m", messages=[{"role": "user", "content": "My piano teacher is named Ottoline."}]
    )
    await settle(real)
    await oa.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is my piano teacher's name?"}]
    )
    forwarded = fake.chat_requests()[-1].json()["messages"]
    assert "Ottoline" in forwarded_memory(forwarded)
    await oa.close()
    apis = {t.api for t in await turns_of(real, "fay")}
    assert apis == {"openai-chat", "ollama-chat"}


async def test_long_tool_results_become_slot_references(fake: FakeUpstream, client: Client) -> None:
    engram = await start_engram(fake.url, slots={"min_tokens": 100})
    try:
        listing = "\n".join(f"{n:4d}  def f_{n}(x): return x * {n}" for n in range(120))
        history = [
            {"role": "user", "content": "read the module"},
            {"role": "assistant", "content": "", "tool_calls": [tool_call("read", path="m.py")]},
            {"role": "tool", "content": listing, "tool_name": "read"},
            {"role": "assistant", "content": "It multiplies."},
            {"role": "user", "content": "and now?", "images": [PNG]},
        ]
        await client(engram).chat(model="m", messages=history)
        forwarded = sent(fake).json()
        assert not violations(forwarded)
        tool = forwarded["messages"][2]
        assert tool["content"].startswith("[TOOL_RESULT:read-") and tool["tool_name"] == "read"
        assert forwarded["messages"][4] == history[4]  # the image went on untouched
        assert len(sent(fake).body) < len(json.dumps(history))
    finally:
        await engram.close()


async def test_num_ctx_is_the_budget(fake: FakeUpstream, client: Client) -> None:
    engram = await start_engram(fake.url)  # the fake's /api/show says 4096
    try:
        history: list[dict[str, Any]] = [SYSTEM]
        for i in range(12):
            history += [
                {"role": "user", "content": f"question {i} " + "lorem ipsum " * 40},
                {"role": "assistant", "content": f"answer {i} " + "dolor sit " * 40},
            ]
        history.append({"role": "user", "content": "and the last one?"})
        c = client(engram, "gus")
        await c.chat(model="m", messages=history)
        assert engram.turns[-1].memory is not None
        wide = engram.turns[-1].memory.budget
        assert wide is not None and 2048 < wide < 4096  # the model's 4096 (/api/show)
        await c.chat(model="m", messages=history, options={"num_ctx": 1024})
        cut = sent(fake).json()
        assert cut["options"] == {"num_ctx": 1024}  # the client's options, as sent
        assert len(cut["messages"]) < len(history)
        assert cut["messages"][0]["content"].startswith(SYSTEM["content"])
        assert cut["messages"][-1] == history[-1]
        assert engram.turns[-1].memory is not None
        assert engram.turns[-1].memory.budget is not None
        assert engram.turns[-1].memory.budget < 1024
    finally:
        await engram.close()


async def test_memory_off_is_byte_identical_and_stores_nothing(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"private \\u00e9"}],"x":null}'
    headers = {"X-Engram-Memory": "off", "X-Engram-User": "hal", "Content-Type": JSON}
    async with http.post(engram.url + "/api/chat", data=raw, headers=headers) as r:
        assert r.status == 200
        await r.read()
    assert sent(fake).body == raw
    await settle(engram)
    assert await turns_of(engram, "hal") == []


async def test_load_model_request_goes_as_sent(
    engram: Engram, fake: FakeUpstream, client: Client
) -> None:
    """``{"model": "m", "messages": []}`` loads the model in Ollama: it stays that."""
    c = client(engram, "ida")
    await c.chat(model="m", messages=[{"role": "user", "content": "I like green tea a lot."}])
    await settle(engram)
    await c.chat(model="m", messages=[])
    assert sent(fake).json()["messages"] == []


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "m", "messages": {}}', "`messages` must be an array"),
        (b'{"model": "m", "messages": [{"role": "user", "content": ["x"]}]}', "must be a string"),
    ],
)
async def test_bad_input_is_an_ollama_error_and_stores_nothing(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, raw: bytes, words: str
) -> None:
    async with http.post(
        engram.url + "/api/chat", data=raw, headers={"X-Engram-User": "jo", "Content-Type": JSON}
    ) as r:
        assert r.status == 400
        text = await r.text()
    body = json.loads(text)
    assert list(body) == ["error"] and words in body["error"]
    assert ollama.ResponseError(text, 400).error == body["error"]  # printed as text, no dict
    assert not [r for r in fake.requests if r.path == "/api/chat"]
    await settle(engram)
    assert await turns_of(engram, "jo") == []


async def test_the_sdk_reads_engrams_own_errors_as_text(engram: Engram, client: Client) -> None:
    c = client(engram, "kim", **{"X-Engram-Memory": "sometimes"})
    with pytest.raises(ollama.ResponseError) as err:
        await c.chat(model="m", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 400
    assert isinstance(err.value.error, str) and "X-Engram-Memory" in err.value.error


async def test_upstream_errors_are_relayed_as_sent(
    engram: Engram, fake: FakeUpstream, client: Client
) -> None:
    fake.enqueue(error_reply("model 'nope' not found", 404), path="/api/chat")
    with pytest.raises(ollama.ResponseError) as err:
        await client(engram).chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert (err.value.status_code, err.value.error) == (404, "model 'nope' not found")
    # Not taken for a missing API: the next request goes to /api/chat again.
    await client(engram).chat(model="m", messages=[{"role": "user", "content": "hi"}])
    assert [r.path for r in fake.requests if "chat" in r.path] == ["/api/chat", "/api/chat"]
    await asyncio.sleep(0)


async def test_upstream_dying_mid_stream_archives_what_came_as_incomplete(
    engram: Engram, fake: FakeUpstream, client: Client
) -> None:
    lines = ndjson(reply_lines("half of a long answer"))
    fake.enqueue(StreamReply(lines, delay=0.05, die_after=3, content_type=NDJSON), path="/api/chat")
    got: list[str] = []
    # Engram ends the stream with an Ollama error line: the client raises ResponseError.
    with pytest.raises(ollama.ResponseError, match="closed the connection"):
        async for part in await client(engram, "lena").chat(
            model="m", messages=[{"role": "user", "content": "talk"}], stream=True
        ):
            got.append(part.message.content or "")
    assert "".join(got) == "half of a"
    await settle(engram)
    turns = await turns_of(engram, "lena")
    assert [(t.role, t.incomplete) for t in turns] == [("user", False), ("assistant", True)]
    assert turns[-1].content == "half of a"
