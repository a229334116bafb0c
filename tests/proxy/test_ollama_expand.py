"""Engram's expansion tool on Ollama's ``/api/chat``, with the ``ollama`` Python client as the
client against the fake upstream (as Ollama) over real sockets: the tool offered in Ollama's tool
shape, the model's call to it answered by Engram with the slot's content in a ``tool`` message
of the follow-up request, the client seeing only the final reply (plain and streamed NDJSON, the
counts summed, ``done_reason`` "stop"), client calls winning, and no tool where the client has
one of the same name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import ollama
import pytest
import pytest_asyncio

from proxy.slots.refs import slot_id
from testing.fake_ollama import json_reply, ndjson_reply, tool_call, violations
from testing.fake_upstream import FakeUpstream, RecordedRequest
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

TOOL = "engram_expand"
PATH = "/api/chat"
LISTING = "\n".join(f"{n:4d}  def f_{n}(x): return x * {n}  # app" for n in range(150))
CLIENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the tests",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(flavor="ollama", n_ctx=32768) as upstream:
        yield upstream


@pytest_asyncio.fixture
async def engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(fake.url)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def client(engram: Engram) -> AsyncIterator[ollama.AsyncClient]:
    c = ollama.AsyncClient(host=engram.url, headers={"X-Engram-User": "ann"})
    try:
        yield c
    finally:
        await c.close()


def agent_messages() -> list[dict[str, Any]]:
    """A file read long ago, then a new question."""
    return [
        {"role": "user", "content": "Read src/app.py"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("read_file", path="a")]},
        {"role": "tool", "content": LISTING, "tool_name": "read_file"},
        {"role": "assistant", "content": "It defines 150 functions."},
        {"role": "user", "content": "What does f_7 return?"},
    ]


def sid() -> str:
    return slot_id("read_file", LISTING)


def expand_call() -> dict[str, Any]:
    return tool_call(TOOL, slot_id=sid())


def sent(fake: FakeUpstream) -> list[RecordedRequest]:
    return [r for r in fake.requests if r.path == PATH]


def check_follow_up(fake: FakeUpstream, said: str = "") -> None:
    """The second request answers the call with the slot's content, in Ollama's shape."""
    first, second = (r.json() for r in sent(fake))
    assert first["tools"][-1] == {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": first["tools"][-1]["function"]["description"],
            "parameters": first["tools"][-1]["function"]["parameters"],
        },
    }
    assert f"[TOOL_RESULT:{sid()}]" in json.dumps(first["messages"])
    call, answer = second["messages"][-2:]
    assert call == {
        "role": "assistant",
        "content": said,
        "tool_calls": [{"function": {"name": TOOL, "arguments": {"slot_id": sid()}}}],
    }
    assert answer == {"role": "tool", "content": LISTING, "tool_name": TOOL}
    assert not violations(second)
    assert second["model"] == "m"


async def test_plain_expansion_is_answered_by_engram(
    engram: Engram, fake: FakeUpstream, client: ollama.AsyncClient
) -> None:
    fake.enqueue(
        json_reply("", tool_calls=[expand_call()], prompt_eval_count=100, eval_count=7),
        json_reply("It returns x * 7.", prompt_eval_count=1200, eval_count=5),
        path=PATH,
    )
    reply = await client.chat(model="m", messages=agent_messages(), stream=False)
    assert reply.message.content == "It returns x * 7."
    assert not reply.message.tool_calls
    assert reply.done and reply.done_reason == "stop"
    assert (reply.prompt_eval_count, reply.eval_count) == (1300, 12)
    check_follow_up(fake)
    await settle(engram)
    final = engram.turns[-1]
    assert final.reply is not None and final.reply.tool_calls == []
    assert final.reply.content == "It returns x * 7." and final.expansions == 1


async def test_streamed_expansion_is_invisible_to_the_client(
    engram: Engram, fake: FakeUpstream, client: ollama.AsyncClient
) -> None:
    fake.enqueue(
        ndjson_reply(
            "Let me look.", tool_calls=[expand_call()], prompt_eval_count=100, eval_count=9
        ),
        ndjson_reply("It returns x * 7.", prompt_eval_count=1300, eval_count=4),
        path=PATH,
    )
    parts = [p async for p in await client.chat(model="m", messages=agent_messages(), stream=True)]
    assert "".join(p.message.content or "" for p in parts) == "Let me look.It returns x * 7."
    assert not any(p.message.tool_calls for p in parts)
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].done_reason == "stop"
    assert (parts[-1].prompt_eval_count, parts[-1].eval_count) == (1400, 13)
    check_follow_up(fake, said="Let me look.")
    await settle(engram)
    final = engram.turns[-1]
    assert final.reply is not None and final.reply.tool_calls == []
    assert final.reply.complete and final.expansions == 1
    assert final.reply.content == "Let me look.It returns x * 7."


@pytest.mark.parametrize("stream", [False, True])
async def test_client_calls_win_over_an_internal_call_in_the_same_reply(
    engram: Engram, fake: FakeUpstream, client: ollama.AsyncClient, stream: bool
) -> None:
    calls = [expand_call(), tool_call("run_tests", path="tests/")]
    make = ndjson_reply if stream else json_reply
    fake.enqueue(make("Running.", tool_calls=calls), path=PATH)
    got = await client.chat(model="m", messages=agent_messages(), tools=CLIENT_TOOLS, stream=stream)
    parts = [p async for p in got] if stream else [got]
    seen = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in seen] == [
        ("run_tests", {"path": "tests/"})
    ]
    assert "".join(p.message.content or "" for p in parts) == "Running."
    assert len(sent(fake)) == 1  # no round trip: the client runs its tool first
    tools = sent(fake)[0].json()["tools"]
    assert [t["function"]["name"] for t in tools] == ["run_tests", TOOL]  # the client's first
    await settle(engram)


async def test_no_tool_when_the_client_has_one_of_the_same_name(
    engram: Engram, fake: FakeUpstream, client: ollama.AsyncClient
) -> None:
    own = [{**CLIENT_TOOLS[0], "function": {**CLIENT_TOOLS[0]["function"], "name": TOOL}}]
    reply = await client.chat(model="m", messages=agent_messages(), tools=own, stream=False)
    assert reply.message.content == "echo: What does f_7 return?"
    body = sent(fake)[-1].json()
    assert f"[TOOL_RESULT:{sid()}]" in json.dumps(body["messages"])
    assert body["tools"] == own
