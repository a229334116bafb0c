"""The OpenAI Responses API through Engram, with the ``openai`` SDK's ``client.responses`` as the
client: plain, streamed and function-calling replies, the archive, recall in ``instructions``
(across APIs too), tool-result slots, strict templates, pass-through, bad input and
``previous_response_id``; the fake upstream serves ``/v1/responses`` as llama-server does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.services import SERVICES
from proxy.slots.refs import REFERENCE
from proxy.store.models import Turn
from testing.fake_chunks import template_violations
from testing.fake_responses import events, function_call_response
from testing.fake_upstream import FakeUpstream, JsonReply, StreamReply
from testing.harness import Engram, forwarded_memory, settle, start_engram, turns_as_sent

pytestmark = pytest.mark.asyncio

REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest_asyncio.fixture
async def strict() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(strict_templates=True, n_ctx=32768) as fake:
        yield fake


@pytest_asyncio.fixture
async def engram(strict: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(strict.url)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def real(strict: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(strict.url, embedder=REAL_MODEL)
    try:
        yield e
    finally:
        await e.close()


CLIENTS: list[openai.AsyncOpenAI] = []


@pytest_asyncio.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while CLIENTS:
        await CLIENTS.pop().close()


def sdk(engram: Engram, user: str = "alice", **headers: str) -> openai.AsyncOpenAI:
    """The SDK as a client of Engram (closed after the test)."""
    client = openai.AsyncOpenAI(
        base_url=engram.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Engram-User": user, **headers},
    )
    CLIENTS.append(client)
    return client


def forwarded(fake: FakeUpstream, n: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = fake.responses.requests()[n].json()
    return body


async def turns_of(engram: Engram, user: str) -> dict[str, list[Turn]]:
    store = engram.app[SERVICES].store
    return {s.name: await turns_as_sent(engram, s.id) for s in await store.list_sessions(user)}


def roles(turns: list[Turn]) -> list[tuple[str, str]]:
    return [(t.role, t.content) for t in turns]


async def test_a_plain_reply_is_archived(engram: Engram, strict: FakeUpstream) -> None:
    raw = await sdk(engram).responses.with_raw_response.create(
        model="m", instructions="Be brief.", input="My cat is called Miso."
    )
    resp = raw.parse()
    assert resp.output_text == "echo: My cat is called Miso."
    session = raw.headers["X-Engram-Session"]
    await settle(engram)
    stored = (await turns_of(engram, "alice"))[session]
    assert roles(stored) == [
        ("system", "Be brief."),
        ("user", "My cat is called Miso."),
        ("assistant", "echo: My cat is called Miso."),
    ]
    assert {t.api for t in stored} == {"openai-responses"}


async def test_a_streamed_reply_is_archived_as_the_client_saw_it(
    engram: Engram, strict: FakeUpstream
) -> None:
    client = sdk(engram)
    async with client.responses.stream(model="m", input="Tell me about streams") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "echo: Tell me about streams"
    # The archive is written before the client's last byte: the turn is there at once.
    [stored] = (await turns_of(engram, "alice")).values()
    assert roles(stored)[-1] == ("assistant", "echo: Tell me about streams")
    assert stored[-1].incomplete is False


@pytest.mark.parametrize("stream", [False, True])
async def test_function_calls_round_trip_into_one_session(
    engram: Engram, strict: FakeUpstream, stream: bool
) -> None:
    call = function_call_response("get_weather", '{"city": "Paris"}', "call_paris1")
    strict.enqueue(StreamReply(events(call)) if stream else JsonReply(call), path="/v1/responses")
    client = sdk(engram)
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        async with client.responses.stream(model="m", input=history, tools=[WEATHER_TOOL]) as s:
            first = await s.get_final_response()
    else:
        first = await client.responses.create(model="m", input=history, tools=[WEATHER_TOOL])
    [fc] = first.output
    assert fc.type == "function_call" and fc.call_id == "call_paris1"
    # The client runs the tool and sends the whole history back, as Codex does (store=false).
    history += [fc.model_dump(exclude_none=True)]
    history += [{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 24 C"}]
    second = await client.responses.create(
        model="m", input=history, tools=[WEATHER_TOOL], store=False
    )
    assert second.output_text == "echo: Weather in Paris?"
    assert forwarded(strict)["input"] == history  # nothing to change: as sent
    await settle(engram)
    [stored] = (await turns_of(engram, "alice")).values()  # one conversation, one session
    assert [t.role for t in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1].tool_calls == [
        {
            "id": "call_paris1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert (stored[2].tool_call_id, stored[2].content) == ("call_paris1", "sunny, 24 C")


def read_output(tag: str, lines: int = 120) -> str:
    return "\n".join(f"{n:4d}  def {tag}_{n}(x): return x * {n}  # {tag}" for n in range(lines))


def agent_history(outputs: list[str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for i, out in enumerate(outputs):
        cid = f"call_{i:05d}"
        items += [
            {"role": "user", "content": f"look at module {i}"},
            {"type": "reasoning", "id": f"rs_{i}", "summary": []},
            {
                "type": "function_call",
                "call_id": cid,
                "name": "read_file",
                "arguments": json.dumps({"path": f"src/mod{i}.py"}),
            },
            {"type": "function_call_output", "call_id": cid, "output": out},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"Module {i} looks fine."}],
            },
        ]
    return [*items, {"role": "user", "content": "and now?"}]


async def test_old_function_outputs_become_slot_references(
    engram: Engram, strict: FakeUpstream
) -> None:
    outputs = [read_output("a"), read_output("b")]
    history = agent_history(outputs)
    raw = await sdk(engram).responses.with_raw_response.create(
        model="m", instructions="You are a coding agent.", input=history
    )
    assert raw.parse().output_text == "echo: and now?"
    sent, original = map(int, raw.headers["X-Engram-Prompt-Tokens"].split("/"))
    assert original > 4 * sent
    fwd = forwarded(strict)
    for i in (3, 8):  # each function_call_output: its output now a reference, its id kept
        item = fwd["input"][i]
        assert item["call_id"] == history[i]["call_id"]
        assert REFERENCE.search(item["output"]) and len(item["output"]) < 400
    # Every other item exactly as sent (reasoning items in place); Engram's tool offered as a
    # Responses function tool.
    others = [j for j in range(len(history)) if j not in (3, 8)]
    assert [fwd["input"][j] for j in others] == [history[j] for j in others]
    assert [(t["type"], t["name"]) for t in fwd["tools"]] == [("function", "engram_expand")]
    assert template_violations(strict.responses.chat_messages(fwd)) == []


async def test_a_fact_told_in_chat_is_recalled_in_responses_instructions_and_back(
    real: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    chat = sdk(real)
    await chat.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "My sister Marta breeds Siamese cats in Porto."}],
    )
    await settle(real)
    client = sdk(real)
    await client.responses.create(
        model="m", instructions="You are helpful.", input="What does my sister Marta breed?"
    )
    fwd = forwarded(strict)
    assert fwd["instructions"] == "You are helpful."  # as sent: the memory leads the question
    assert "Siamese cats in Porto" in json.dumps(fwd["input"])
    # … and the other way: told through Responses, recalled in a chat completion's system.
    await client.responses.create(model="m", input="My bicycle is a green Gazelle from 1987.")
    await settle(real)
    await chat.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Which bicycle do I ride?"}]
    )
    assert "green Gazelle from 1987" in forwarded_memory(
        strict.chat_requests()[-1].json()["messages"]
    )
    # Another user sees none of it.
    await sdk(real, "bob").responses.create(model="m", input="What does my sister breed?")
    assert "instructions" not in forwarded(strict)


async def test_memory_lands_in_instructions_so_a_strict_template_sees_one_system_message(
    real: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    client = sdk(real)
    await client.responses.create(model="m", input="Our office wifi password hint is 'teapot'.")
    await settle(real)
    body = {
        "model": "m",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": "Sandbox: workspace-write."},
            {"role": "user", "content": "What is the office wifi password hint?"},
        ],
    }
    async with http.post(strict.url + "/v1/responses", json=body) as r:
        assert r.status == 500  # llama-server's rendering: two system messages
    async with http.post(
        real.url + "/v1/responses", json=body, headers={"X-Engram-User": "alice"}
    ) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Engram-Memories"] != "0"
    fwd = forwarded(strict)
    # the leading developer item folded into the instructions, the memory before the question
    assert fwd["instructions"] == "You are a coding agent.\n\nSandbox: workspace-write."
    [asked] = fwd["input"]
    assert asked["role"] == "user" and "teapot" in json.dumps(asked["content"])
    assert asked["content"][0]["text"].startswith(BLOCK_OPEN)
    assert asked["content"][-1]["text"] == "What is the office wifi password hint?"


async def test_memory_off_is_a_byte_identical_pass_through(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    raw = b'{ "input" :"hi",\n "model":"m", "x-vendor": [null, 1.50]}'
    headers = {
        "X-Engram-Memory": "off",
        "X-Engram-User": "alice",
        "Content-Type": "application/json",
    }
    async with http.post(engram.url + "/v1/responses", data=raw, headers=headers) as r:
        assert r.status == 200
    assert strict.responses.requests()[-1].body == raw
    await settle(engram)
    assert await turns_of(engram, "alice") == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": "x", "instructions": {"a": 1}}, "instructions"),
    ],
)
async def test_bad_input_is_a_400_in_openai_shape_and_nothing_is_stored(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession, body: Any, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(engram).responses.create(**body)
    error = err.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]
    assert strict.responses.requests() == []
    json_type = {"Content-Type": "application/json"}
    async with http.post(engram.url + "/v1/responses", data=b"{not json", headers=json_type) as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_json"
    await settle(engram)
    assert await turns_of(engram, "alice") == {}


async def test_previous_response_id_is_forwarded_and_only_new_items_archived(
    engram: Engram, strict: FakeUpstream
) -> None:
    client = sdk(engram)
    first = await client.responses.create(model="m", input="Remember the number 4711.")
    second = await client.responses.create(
        model="m", input="Which number?", previous_response_id=first.id
    )
    assert second.output_text == "echo: Which number?"
    fwd = forwarded(strict)
    assert fwd["previous_response_id"] == first.id
    assert fwd["input"] == "Which number?" or (  # (a memory block may lead the question)
        fwd["input"].startswith(BLOCK_OPEN) and fwd["input"].endswith("\n\nWhich number?")
    )
    await settle(engram)
    stored = [roles(t) for t in (await turns_of(engram, "alice")).values()]
    everything = [pair for turns in stored for pair in turns]
    assert sorted(everything) == sorted(
        [
            ("user", "Remember the number 4711."),
            ("assistant", "echo: Remember the number 4711."),
            ("user", "Which number?"),
            ("assistant", "echo: Which number?"),
        ]
    )


async def test_previous_response_id_continues_the_session(
    engram: Engram, strict: FakeUpstream
) -> None:
    client = sdk(engram)
    first = await client.responses.with_raw_response.create(model="m", input="Hello, I am Ana.")
    second = await client.responses.with_raw_response.create(
        model="m", input="Who am I?", previous_response_id=first.parse().id
    )
    assert second.headers["X-Engram-Session"] == first.headers["X-Engram-Session"]


async def test_prompt_cache_key_names_the_session(engram: Engram, strict: FakeUpstream) -> None:
    client = sdk(engram)
    a = await client.responses.with_raw_response.create(
        model="m", input="first thing", prompt_cache_key="conv-42"
    )
    b = await client.responses.with_raw_response.create(
        model="m", input="something else entirely", prompt_cache_key="conv-42"
    )
    assert a.headers["X-Engram-Session"] == b.headers["X-Engram-Session"] == "conv-42"


async def test_an_upstream_refusal_is_relayed_and_nothing_archived(
    engram: Engram, strict: FakeUpstream
) -> None:
    strict.responses.reject_previous = True  # as the bundled llama-server does
    with pytest.raises(openai.BadRequestError) as err:
        await sdk(engram).responses.create(model="m", input="x", previous_response_id="resp_1")
    assert "previous_response_id" in str(err.value)
    await settle(engram)
    assert await turns_of(engram, "alice") == {}
