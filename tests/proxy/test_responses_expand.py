"""Engram's expansion tool on the OpenAI Responses API, with the ``openai`` SDK's
``client.responses`` as the client against the fake upstream (strict templates) over real
sockets: the tool offered as a Responses function tool, the model's ``function_call`` of it
answered by Engram with a ``function_call_output`` holding the slot's content in the follow-up
request, the client seeing only the final reply (plain, and streamed through the SDK's strict
``responses.stream()``), and client calls winning."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from proxy.slots.refs import slot_id
from testing.fake_chunks import template_violations
from testing.fake_responses import call_item, events, message_item, response
from testing.fake_upstream import FakeUpstream, JsonReply, RecordedRequest, StreamReply
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

TOOL = "engram_expand"
PATH = "/v1/responses"
LISTING = "\n".join(f"{n:4d}  def f_{n}(x): return x * {n}  # app" for n in range(150))
RUN_TESTS = {
    "type": "function",
    "name": "run_tests",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
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


def sdk(engram: Engram) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=engram.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Engram-User": "alice"},
    )


def history() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Read src/app.py"},
        {
            "type": "function_call",
            "call_id": "call_read1",
            "name": "read_file",
            "arguments": '{"path": "src/app.py"}',
        },
        {"type": "function_call_output", "call_id": "call_read1", "output": LISTING},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It defines 150 functions."}],
        },
        {"role": "user", "content": "What does f_7 return?"},
    ]


def sid() -> str:
    return slot_id("read_file", LISTING)


def expand_item() -> dict[str, Any]:
    return call_item(TOOL, json.dumps({"slot_id": sid()}), "call_exp1", iid="fc_exp")


def sent(fake: FakeUpstream) -> list[RecordedRequest]:
    return [r for r in fake.requests if r.path == PATH]


def check_follow_up(fake: FakeUpstream) -> None:
    first, second = (r.json() for r in sent(fake))
    assert first["tools"][-1]["name"] == TOOL and first["tools"][-1]["type"] == "function"
    assert f"[TOOL_RESULT:{sid()}]" in json.dumps(first["input"])
    call, answer = second["input"][-2:]
    assert call == {
        "type": "function_call",
        "call_id": "call_exp1",
        "name": TOOL,
        "arguments": json.dumps({"slot_id": sid()}),
    }
    assert answer == {"type": "function_call_output", "call_id": "call_exp1", "output": LISTING}
    assert second["input"][: len(first["input"])] == first["input"]
    assert template_violations(fake.responses.chat_messages(second)) == []


async def test_plain_expansion_is_answered_by_engram(engram: Engram, strict: FakeUpstream) -> None:
    strict.enqueue(
        JsonReply(response([expand_item()], rid="resp_1", input_tokens=100)),
        JsonReply(response([message_item("It returns x * 7.")], rid="resp_2", input_tokens=1200)),
        path=PATH,
    )
    client = sdk(engram)
    resp = await client.responses.create(model="m", input=history())  # type: ignore[arg-type]
    await client.close()
    assert resp.output_text == "It returns x * 7."
    assert [i.type for i in resp.output] == ["message"] and resp.id == "resp_1"
    assert resp.usage is not None and resp.usage.input_tokens == 1300
    check_follow_up(strict)
    await settle(engram)
    final = engram.turns[-1]
    assert final.reply is not None and final.reply.tool_calls == []
    assert final.expansions == 1


async def test_streamed_expansion_is_invisible_to_the_sdk(
    engram: Engram, strict: FakeUpstream
) -> None:
    first = response([message_item("Let me look.", iid="msg_1"), expand_item()], rid="resp_1")
    second = response([message_item("It returns x * 7.", iid="msg_2")], rid="resp_2")
    strict.enqueue(StreamReply(events(first)), StreamReply(events(second)), path=PATH)
    client = sdk(engram)
    kinds: list[str] = []
    seqs: list[int] = []
    async with client.responses.stream(model="m", input=history()) as stream:  # type: ignore[arg-type]
        async for ev in stream:
            kinds.append(ev.type)
            seqs.append(ev.sequence_number)
        final = await stream.get_final_response()
    await client.close()
    assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
    assert "response.function_call_arguments.delta" not in kinds
    assert seqs == list(range(len(seqs)))
    assert [i.type for i in final.output] == ["message", "message"] and final.id == "resp_1"
    assert final.output_text == "Let me look.It returns x * 7."
    check_follow_up(strict)
    said = sent(strict)[1].json()["input"][-3]
    assert said["role"] == "assistant" and said["content"][0]["text"] == "Let me look."
    await settle(engram)
    turn = engram.turns[-1]
    assert turn.reply is not None and turn.reply.tool_calls == [] and turn.expansions == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_client_calls_win_over_an_internal_call_in_the_same_reply(
    engram: Engram, strict: FakeUpstream, stream: bool
) -> None:
    mine = call_item("run_tests", '{"path": "tests/"}', "call_cli1", iid="fc_cli")
    resp = response([expand_item(), mine])
    strict.enqueue(StreamReply(events(resp)) if stream else JsonReply(resp), path=PATH)
    client = sdk(engram)
    args: dict[str, Any] = {"model": "m", "input": history(), "tools": [RUN_TESTS]}
    if stream:
        async with client.responses.stream(**args) as s:
            final = await s.get_final_response()
    else:
        final = await client.responses.create(**args)
    await client.close()
    calls = [(i.type, getattr(i, "name", None)) for i in final.output]
    assert calls == [("function_call", "run_tests")]
    assert len(sent(strict)) == 1
    assert [t["name"] for t in sent(strict)[0].json()["tools"]] == ["run_tests", TOOL]
    await settle(engram)


async def test_tool_choice_none_gets_no_tool(engram: Engram, strict: FakeUpstream) -> None:
    client = sdk(engram)
    await client.responses.create(model="m", input=history(), tool_choice="none")  # type: ignore[arg-type]
    await client.close()
    body = sent(strict)[-1].json()
    assert f"[TOOL_RESULT:{sid()}]" in json.dumps(body["input"]) and "tools" not in body
