"""Engram's expansion tool on the Anthropic Messages API, with the ``anthropic`` SDK as the client
against the fake upstream (strict templates) over real sockets: the tool offered in Anthropic's
tool shape, the model's ``tool_use`` of it answered by Engram with the slot's content in a
``tool_result`` of the follow-up request, the client seeing only the final reply (plain and
streamed), client calls winning, and no tool where the request forbids one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
import pytest_asyncio

from proxy.slots.refs import slot_id
from testing.fake_anthropic import (
    anthropic_events,
    anthropic_message,
    anthropic_usage,
    chat_messages,
    without_messages_api,
)
from testing.fake_chunks import template_violations
from testing.fake_upstream import FakeUpstream, JsonReply, RecordedRequest, StreamReply
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

MODEL = "claude-sonnet-4"
TOOL = "engram_expand"
PATH = "/v1/messages"
LISTING = "\n".join(f"{n:4d}  def f_{n}(x): return x * {n}  # app" for n in range(150))
CLIENT_TOOLS = [
    {
        "name": "run_tests",
        "description": "Run the tests",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


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


def sdk(engram: Engram) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=engram.url,
        api_key="sk-ant-test",
        max_retries=0,
        default_headers={"X-Engram-User": "ann"},
    )


def agent_messages() -> list[dict[str, Any]]:
    """Claude Code's shape: a file read long ago, then a new question."""
    return [
        {"role": "user", "content": "Read src/app.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": LISTING}],
                }
            ],
        },
        {"role": "assistant", "content": "It defines 150 functions."},
        {"role": "user", "content": "What does f_7 return?"},
    ]


def sid() -> str:
    return slot_id("read_file", LISTING)


def expand_use(call_id: str = "toolu_exp1") -> dict[str, Any]:
    return {"id": call_id, "name": TOOL, "input": {"slot_id": sid()}}


def client_use() -> dict[str, Any]:
    return {"id": "toolu_cli1", "name": "run_tests", "input": {"path": "tests/"}}


def sent(fake: FakeUpstream) -> list[RecordedRequest]:
    return [r for r in fake.requests if r.path == PATH]


def check_follow_up(fake: FakeUpstream) -> None:
    """The second request answers the call with the slot's content, in Anthropic's shape."""
    first, second = (r.json() for r in sent(fake))
    assert first["tools"][-1]["name"] == TOOL and "input_schema" in first["tools"][-1]
    assert f"[TOOL_RESULT:{sid()}]" in json.dumps(first["messages"])
    call, answer = second["messages"][-2:]
    assert call["role"] == "assistant"
    assert [b for b in call["content"] if b["type"] == "tool_use"] == [
        {"type": "tool_use", "id": "toolu_exp1", "name": TOOL, "input": {"slot_id": sid()}}
    ]
    assert answer == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_exp1", "content": LISTING}],
    }
    assert template_violations(chat_messages(second)) == []
    assert second["model"] == MODEL and second["max_tokens"] == 64


async def test_plain_expansion_is_answered_by_engram(engram: Engram, strict: FakeUpstream) -> None:
    strict.enqueue(
        JsonReply(anthropic_message("", tool_uses=[expand_use()], usage=anthropic_usage(100, 7))),
        JsonReply(anthropic_message("It returns x * 7.", usage=anthropic_usage(1200, 5))),
        path=PATH,
    )
    async with sdk(engram) as c:
        msg = await c.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=agent_messages(),  # type: ignore[arg-type]
        )
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "It returns x * 7."  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (1300, 12)
    check_follow_up(strict)
    await settle(engram)
    final = engram.turns[-1]
    assert final.reply is not None and final.reply.tool_calls == []
    assert final.reply.content == "It returns x * 7." and final.expansions == 1


async def test_streamed_expansion_is_invisible_to_the_sdk(
    engram: Engram, strict: FakeUpstream
) -> None:
    strict.enqueue(
        StreamReply(
            anthropic_events(
                ["Let me ", "look."], tool_uses=[expand_use()], usage=anthropic_usage(100, 9)
            )
        ),
        StreamReply(anthropic_events(["It returns ", "x * 7."], usage=anthropic_usage(1300, 4))),
        path=PATH,
    )
    kinds: list[str] = []
    async with (
        sdk(engram) as c,
        c.messages.stream(
            model=MODEL,
            max_tokens=64,
            messages=agent_messages(),  # type: ignore[arg-type]
        ) as stream,
    ):
        async for ev in stream:
            kinds.append(ev.type)
        msg = await stream.get_final_message()
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    assert [b.type for b in msg.content] == ["text", "text"]
    texts = [b.text for b in msg.content]  # type: ignore[union-attr]
    assert texts == ["Let me look.", "It returns x * 7."]
    assert msg.stop_reason == "end_turn"
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (1400, 13)
    check_follow_up(strict)
    second = sent(strict)[1].json()
    assert second["messages"][-2]["content"][0] == {"type": "text", "text": "Let me look."}
    await settle(engram)
    final = engram.turns[-1]
    assert final.reply is not None and final.reply.tool_calls == []
    assert final.reply.complete and final.expansions == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_client_calls_win_over_an_internal_call_in_the_same_reply(
    engram: Engram, strict: FakeUpstream, stream: bool
) -> None:
    uses = [expand_use(), client_use()]
    if stream:
        strict.enqueue(StreamReply(anthropic_events(["Running."], tool_uses=uses)), path=PATH)
    else:
        strict.enqueue(JsonReply(anthropic_message("Running.", tool_uses=uses)), path=PATH)
    async with sdk(engram) as c:
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 64,
            "messages": agent_messages(),
            "tools": CLIENT_TOOLS,
        }
        if stream:
            async with c.messages.stream(**kwargs) as s:
                msg = await s.get_final_message()
        else:
            msg = await c.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    call = msg.content[1]
    assert (call.id, call.name, call.input) == (  # type: ignore[union-attr]
        "toolu_cli1",
        "run_tests",
        {"path": "tests/"},
    )
    assert msg.stop_reason == "tool_use"
    assert len(sent(strict)) == 1  # no round trip: the client runs its tool first
    tools = sent(strict)[0].json()["tools"]
    assert [t["name"] for t in tools] == ["run_tests", TOOL]  # the client's first
    await settle(engram)


@pytest.mark.parametrize(
    "choice", [{"type": "none"}, {"type": "tool", "name": "run_tests"}, {"type": "any"}]
)
async def test_no_tool_where_the_request_forbids_one(
    engram: Engram, strict: FakeUpstream, choice: dict[str, Any]
) -> None:
    tools = CLIENT_TOOLS if choice["type"] != "any" else None
    async with sdk(engram) as c:
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        await c.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=agent_messages(),  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            **extra,
        )
    body = sent(strict)[-1].json()
    assert f"[TOOL_RESULT:{sid()}]" in json.dumps(body["messages"])
    assert TOOL not in json.dumps(body.get("tools", []))


async def test_an_upstream_without_the_api_gets_no_tool_and_the_client_a_reply(
    engram: Engram, strict: FakeUpstream
) -> None:
    without_messages_api(strict)
    async with sdk(engram) as c:
        for _ in range(2):  # the first finds out (404), the second knows
            msg = await c.messages.create(
                model=MODEL,
                max_tokens=64,
                messages=agent_messages(),  # type: ignore[arg-type]
            )
            assert msg.content[0].text == "echo: What does f_7 return?"  # type: ignore[union-attr]
    chats = strict.chat_requests()
    assert len(chats) == 2 and all(TOOL not in json.dumps(r.json()) for r in chats)
    assert len(sent(strict)) == 2  # the tool's try, then the plain try: both 404
