"""The Anthropic Messages API through Engram, with the ``anthropic`` SDK as the client, against
the fake upstream over real sockets: replies plain, streamed and with tool use; archive, recall
into ``system`` (also across APIs), tool-result slots, pass-through, errors in Anthropic's shape,
and the translation to chat completions for an upstream without ``/v1/messages``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.cli.main import main as engram_main
from proxy.services import SERVICES
from proxy.store.models import Turn
from testing.fake_anthropic import anthropic_events, anthropic_message, without_messages_api
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply, RecordedRequest, StreamReply
from testing.harness import Engram, forwarded_memory, settle, start_engram

pytestmark = pytest.mark.asyncio

REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
MODEL = "claude-sonnet-4"
FACT = "My sister Marta lives in Porto and she breeds Siamese cats."
TOOL = {"id": "toolu_01A", "name": "get_weather", "input": {"city": "Lisbon"}}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
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


@pytest_asyncio.fixture
async def real(strict: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(strict.url, embedder=REAL_MODEL)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def real_zones(strict: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(strict.url, embedder=REAL_MODEL, prompt={"mode": "zones"})
    try:
        yield e
    finally:
        await e.close()


def sdk(engram: Engram, user: str = "ann", **headers: str) -> anthropic.AsyncAnthropic:
    """The SDK as Claude Code's users point it: the base URL without ``/v1``."""
    return anthropic.AsyncAnthropic(
        base_url=engram.url,
        api_key="sk-ant-test",
        max_retries=0,
        default_headers={"X-Engram-User": user, **headers},
    )


def sent(fake: FakeUpstream, path: str = "/v1/messages") -> list[RecordedRequest]:
    return [r for r in fake.requests if r.path == path]


def last_body(fake: FakeUpstream) -> dict[str, Any]:
    body: dict[str, Any] = sent(fake)[-1].json()
    return body


async def turns_of(engram: Engram, user: str) -> list[Turn]:
    store = engram.app[SERVICES].store
    out: list[Turn] = []
    for s in await store.list_sessions(user):
        out += await store.session_turns(s.id)
    return out


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# --- replies -------------------------------------------------------------------------------------


async def test_plain_and_streamed_replies_reach_the_sdk_and_are_archived(
    engram: Engram, strict: FakeUpstream
) -> None:
    async with sdk(engram) as c:
        msg = await c.messages.create(
            model=MODEL, max_tokens=64, system="Be brief.", messages=[user("Hello there")]
        )
        async with c.messages.stream(
            model=MODEL, max_tokens=64, messages=[user("Stream me please")]
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
    assert msg.content[0].type == "text" and msg.content[0].text == "echo: Hello there"
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens > 0
    assert text == "echo: Stream me please" and final.stop_reason == "end_turn"
    await settle(engram)
    replies = [t.reply for t in engram.turns]
    assert all(r is not None and r.complete for r in replies)
    stored = await turns_of(engram, "ann")
    assert {(t.role, t.content) for t in stored} >= {
        ("user", "Hello there"),
        ("assistant", "echo: Hello there"),
        ("user", "Stream me please"),
        ("assistant", "echo: Stream me please"),
    }
    assert {t.api for t in stored} == {"anthropic-messages"}


async def test_headers_query_and_count_tokens_go_through_as_sent(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    headers = {
        "x-api-key": "sk-ant-key",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14",
    }
    body = {"model": MODEL, "max_tokens": 16, "messages": [user("hi")]}
    async with http.post(engram.url + "/v1/messages?beta=true", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Engram-Request-Id"]
    got = sent(strict)[-1]
    assert got.query_string == "beta=true"
    for name, value in headers.items():
        assert got.headers[name] == value
    raw = json.dumps({"model": MODEL, "messages": [user("count me")]}, indent=1).encode()
    async with http.post(
        engram.url + "/v1/messages/count_tokens?beta=true", data=raw, headers=headers
    ) as r:
        assert r.status == 200 and (await r.json())["input_tokens"] > 0
    counted = sent(strict, "/v1/messages/count_tokens")[-1]
    assert counted.body == raw and counted.query_string == "beta=true"
    await settle(engram)
    assert len(engram.turns) == 1  # counting tokens is no chat turn


async def test_tool_use_plain_and_streamed_then_its_result_continues_the_session(
    engram: Engram, strict: FakeUpstream
) -> None:
    strict.enqueue(
        JsonReply(anthropic_message("Let me check.", tool_uses=[TOOL])),
        StreamReply(anthropic_events(["Checking", " again."], tool_uses=[TOOL])),
        path="/v1/messages",
    )
    ask = [user("What is the weather in Lisbon?")]
    async with sdk(engram) as c:
        msg = await c.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=ask)  # type: ignore[arg-type]
        async with c.messages.stream(
            model=MODEL,
            max_tokens=64,
            tools=TOOLS,  # type: ignore[arg-type]
            messages=[user("And in Porto?")],
        ) as stream:
            final = await stream.get_final_message()
        assert msg.stop_reason == "tool_use" and final.stop_reason == "tool_use"
        use = msg.content[1]
        assert use.type == "tool_use" and use.input == {"city": "Lisbon"}
        assert final.content[1].type == "tool_use" and final.content[1].input == {"city": "Lisbon"}
        # The client runs the tool and sends its result, resending the reply as it got it.
        follow = await c.messages.create(
            model=MODEL,
            max_tokens=64,
            tools=TOOLS,  # type: ignore[arg-type]
            messages=[
                *ask,
                {"role": "assistant", "content": [b.model_dump() for b in msg.content]},  # type: ignore[misc]
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}
                    ],
                },
            ],
        )
    assert follow.content[0].type == "text"
    await settle(engram)
    first, second, third = engram.turns
    assert first.reply is not None and first.reply.tool_calls[0]["id"] == "toolu_01A"
    assert second.reply is not None and second.reply.complete
    assert second.reply.tool_calls[0]["function"]["arguments"] == '{"city": "Lisbon"}'
    assert first.memory and third.memory and first.memory.placement and third.memory.placement
    assert third.memory.placement.session.id == first.memory.placement.session.id
    stored = await turns_of(engram, "ann")
    results = [t for t in stored if t.role == "tool"]
    assert [(t.tool_call_id, t.content) for t in results] == [("toolu_01A", "18 C, sunny")]


# --- memory --------------------------------------------------------------------------------------


async def test_a_fact_is_recalled_before_the_question_the_system_as_sent(
    real: Engram, strict: FakeUpstream
) -> None:
    """The default (prompt.mode stable): the memory is a text block leading the new user
    message; the system and every earlier message go as sent, cache_control where it was."""
    async with sdk(real, "alice") as c:
        await c.messages.create(model=MODEL, max_tokens=32, messages=[user(FACT)])
        await settle(real)
        question = {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Where does my sister live, and what cats does she breed?",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        }
        r = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=32,
            system="You are a helpful assistant.",
            messages=[question],  # type: ignore[list-item]
        )
        assert int(r.headers["X-Engram-Memories"].split(";")[0]) >= 1
        body = last_body(strict)
        assert body["system"] == "You are a helpful assistant."
        [sent_question] = body["messages"]
        memory, *rest = sent_question["content"]
        assert memory["type"] == "text" and memory["text"].startswith(BLOCK_OPEN)
        assert "Porto" in memory["text"] and "cache_control" not in memory
        assert rest == question["content"]  # the client's block, its breakpoint unmoved


async def test_a_fact_is_recalled_into_system_after_the_clients_own_text(
    real_zones: Engram, strict: FakeUpstream
) -> None:
    """prompt.mode zones: the memory follows the client's system text."""
    real = real_zones
    async with sdk(real, "alice") as c:
        await c.messages.create(model=MODEL, max_tokens=32, messages=[user(FACT)])
        await settle(real)
        r = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=32,
            system="You are a helpful assistant.",
            messages=[user("Where does my sister live, and what cats does she breed?")],
        )
        assert int(r.headers["X-Engram-Memories"].split(";")[0]) >= 1
        system = last_body(strict)["system"]
        assert system.startswith("You are a helpful assistant.\n\n" + BLOCK_OPEN)
        assert "Porto" in system
        # With blocks, the client's blocks go as sent and the memory follows as a text block.
        blocks = [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ]
        await c.messages.create(
            model=MODEL,
            max_tokens=32,
            system=blocks,  # type: ignore[arg-type]
            messages=[user("Which cats does Marta breed?")],
        )
        system = last_body(strict)["system"]
        assert system[0] == blocks[0]
        assert system[1]["type"] == "text" and system[1]["text"].startswith("\n\n" + BLOCK_OPEN)
        assert "Siamese" in system[1]["text"]
    # Another user never gets it.
    async with sdk(real, "bob") as c:
        await c.messages.create(
            model=MODEL, max_tokens=32, system="S.", messages=[user("Where does Marta live?")]
        )
    assert "Porto" not in json.dumps(last_body(strict))


async def test_memory_is_shared_across_apis(
    real: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    chat = openai.AsyncOpenAI(
        base_url=real.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Engram-User": "carol"},
    )
    async with chat, sdk(real, "carol") as c:
        await chat.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "My bicycle is a green Brompton."}]
        )
        await settle(real)
        await c.messages.create(
            model=MODEL, max_tokens=32, system="S.", messages=[user("What bicycle do I ride?")]
        )
        assert "Brompton" in forwarded_memory(last_body(strict)["messages"])
        await c.messages.create(
            model=MODEL, max_tokens=32, messages=[user("I keep bees on a rooftop in Ghent.")]
        )
        await settle(real)
        await chat.chat.completions.create(
            model="m",
            messages=[
                {"role": "system", "content": "S."},
                {"role": "user", "content": "Where do I keep my bees?"},
            ],
        )
        forwarded = strict.chat_requests()[-1].json()["messages"]
        assert forwarded[0] == {"role": "system", "content": "S."}
        assert "Ghent" in forwarded_memory(forwarded)
    stored = await turns_of(real, "carol")
    assert {t.api for t in stored} == {"openai-chat", "anthropic-messages"}


async def test_thinking_cache_control_and_role_system_messages_with_memory(
    real: Engram, strict: FakeUpstream
) -> None:
    async with sdk(real, "dora") as c:
        await c.messages.create(model=MODEL, max_tokens=32, messages=[user(FACT)])
        await settle(real)
        assistant = {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Recall the family.", "signature": "c2ln"},
                {"type": "text", "text": "Go on."},
            ],
        }
        question = {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Where does my sister live?",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        }
        messages = [
            user("Let's talk about my family."),
            {"role": "system", "content": "Available agents: none."},
            assistant,
            question,
        ]
        await c.messages.create(model=MODEL, max_tokens=32, system="Sys.", messages=messages)  # type: ignore[arg-type]
    body = last_body(strict)  # the strict template accepted it: one system message
    assert body["system"] == "Sys.\n\nAvailable agents: none."
    first, kept, asked = body["messages"]
    assert [first, kept] == [messages[0], assistant]  # thinking and its signature as sent
    memory, *rest = asked["content"]
    assert memory["text"].startswith(BLOCK_OPEN) and "Porto" in memory["text"]
    assert rest == question["content"]  # cache_control stays on the client's block


async def test_a_long_old_tool_result_becomes_a_slot_reference(
    engram: Engram, strict: FakeUpstream
) -> None:
    listing = "\n".join(f"{n:4d}  def f_{n}(x): return x * {n}" for n in range(150))
    messages = [
        user("Read src/app.py"),
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
                    "content": [{"type": "text", "text": listing}],
                    "is_error": False,
                }
            ],
        },
        {"role": "assistant", "content": "It defines 150 functions."},
        user("Thanks. Now what is 2 + 2?"),
    ]
    async with sdk(engram) as c:
        await c.messages.create(model=MODEL, max_tokens=32, messages=messages)  # type: ignore[arg-type]
    body = last_body(strict)
    [result] = body["messages"][2]["content"]
    assert result["tool_use_id"] == "toolu_1" and result["is_error"] is False
    [block] = result["content"]
    assert block["type"] == "text" and block["text"].startswith("[TOOL_RESULT:read_file-")
    assert "path: a" in block["text"] and listing not in json.dumps(body)
    assert body["messages"][1] == messages[1] and body["messages"][3:] == messages[3:]


async def test_claude_codes_max_tokens_leaves_the_history_in_the_prompt(
    engram: Engram, strict: FakeUpstream
) -> None:
    """Claude Code asks max_tokens 32,000 of a model with a 32,768-token context: kept free
    for the reply, it would leave no room for the conversation."""
    history: list[dict[str, Any]] = []
    for i in range(20):
        history += [
            user(f"Step {i}: " + "refactor the parser " * 40),
            {"role": "assistant", "content": f"Done {i}."},
        ]
    messages = [*history, user("Next step?")]
    async with (
        sdk(engram) as c,
        c.messages.stream(
            model=MODEL,
            max_tokens=32000,
            system="You are Claude Code.",
            messages=messages,  # type: ignore[arg-type]
        ) as stream,
    ):
        await stream.get_final_message()
        headers = stream.response.headers
    forwarded, original = headers["X-Engram-Prompt-Tokens"].split("/")
    assert forwarded == original
    assert last_body(strict)["messages"] == messages


async def test_memory_off_is_a_byte_identical_pass_through(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    raw = (
        b'{"model":"x", "max_tokens": 8,\n "system": [{"type":"text","text":"S"}],'
        b' "messages": [{"role":"user","content":"hi \\u00e9"}], "odd": null}'
    )
    async with http.post(
        engram.url + "/v1/messages?beta=true",
        data=raw,
        headers={"X-Engram-Memory": "off", "Content-Type": "application/json"},
    ) as r:
        assert r.status == 200
    assert sent(strict)[-1].body == raw
    await settle(engram)
    assert await turns_of(engram, "default") == []


async def test_claude_code_conversations_stay_one_session_across_billing_stamps(
    engram: Engram, strict: FakeUpstream
) -> None:
    meta = {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s"})}

    def system(stamp: str) -> list[dict[str, Any]]:
        return [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.90.a1; cc_entrypoint=cli; "
                f"cch={stamp};",
            },
            {"type": "text", "text": "You are Claude Code."},
        ]

    first = [user("Fix the failing test")]
    async with sdk(engram, "eve") as c:
        r1 = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=32,
            system=system("a5145"),
            metadata=meta,
            messages=first,  # type: ignore[arg-type]
        )
        reply = await r1.parse()
        r2 = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=32,
            system=system("77e0c"),  # type: ignore[arg-type]
            metadata=meta,  # type: ignore[arg-type]
            messages=[
                *first,
                {"role": "assistant", "content": [b.model_dump() for b in reply.content]},  # type: ignore[misc]
                user("Now run it"),
            ],
        )
    assert r1.headers["X-Engram-Session"] == r2.headers["X-Engram-Session"]
    assert "cch=77e0c;" in json.dumps(last_body(strict))  # the client's bytes keep the stamp


# --- errors --------------------------------------------------------------------------------------


async def test_bad_input_gets_anthropics_error_shape_and_nothing_is_stored(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with sdk(engram) as c:
        with pytest.raises(anthropic.BadRequestError) as err:
            await c.messages.create(
                model=MODEL,
                max_tokens=8,
                messages=[{"role": "user", "content": [{"type": "tool_result"}]}],  # type: ignore[list-item, typeddict-item]
            )
    assert err.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "`messages[0].content[0].tool_use_id` must be a string.",
        },
    }
    async with http.post(
        engram.url + "/v1/messages", data=b"{nope", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        body = await r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"]
    async with http.post(
        engram.url + "/v1/messages",
        json={"model": "m", "messages": []},
        headers={"X-Engram-Memory": "sometimes"},
    ) as r:
        assert r.status == 400 and (await r.json())["type"] == "error"
    assert sent(strict) == []
    await settle(engram)
    assert await engram.app[SERVICES].store.list_sessions("ann") == []


async def test_upstream_errors_reach_the_sdk(engram: Engram, strict: FakeUpstream) -> None:
    strict.enqueue(
        JsonReply(
            {"type": "error", "error": {"type": "overloaded_error", "message": "Busy"}},
            status=529,
        ),
        path="/v1/messages",
    )
    async with sdk(engram) as c:
        with pytest.raises(anthropic.APIStatusError) as err:
            await c.messages.create(model=MODEL, max_tokens=8, messages=[user("hi")])
    assert err.value.status_code == 529 and "Busy" in str(err.value)
    await settle(engram)
    assert await engram.app[SERVICES].store.list_sessions("ann") == []


async def test_engrams_own_upstream_failure_is_in_anthropics_shape() -> None:
    e = await start_engram("http://127.0.0.1:9")  # nothing listens there
    try:
        async with sdk(e) as c:
            with pytest.raises(anthropic.APIStatusError) as err:
                await c.messages.create(model=MODEL, max_tokens=8, messages=[user("hi")])
        assert err.value.status_code == 502
        assert isinstance(err.value.body, dict) and err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == "api_error"
    finally:
        await e.close()


# --- translation ---------------------------------------------------------------------------------


async def test_an_upstream_without_the_api_gets_chat_completions(
    engram: Engram, strict: FakeUpstream
) -> None:
    without_messages_api(strict)
    messages = [
        user("Read it"),
        {"role": "system", "content": "Reminder: be careful."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "ok", "signature": "s"},
                {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"c": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"},
                {"type": "text", "text": "Summarise it"},
            ],
        },
    ]
    async with sdk(engram) as c:
        msg = await c.messages.create(
            model=MODEL,
            max_tokens=32,
            system="Sys.",
            tools=TOOLS,
            messages=messages,  # type: ignore[arg-type]
        )
        async with c.messages.stream(
            model=MODEL, max_tokens=32, messages=[user("Stream it back")]
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
    assert msg.type == "message" and msg.content[0].text == "echo: Summarise it"  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn" and msg.id.startswith("msg_")
    assert text == "echo: Stream it back" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0
    assert len(sent(strict)) == 1  # the 404 is remembered: asked once
    chat = strict.chat_requests()[0].json()
    assert chat["messages"][0] == {"role": "system", "content": "Sys.\n\nReminder: be careful."}
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    await settle(engram)
    replies = [t.reply for t in engram.turns]
    assert [r.content if r else None for r in replies] == [
        "echo: Summarise it",
        "echo: Stream it back",
    ]
    assert all(r is not None and r.complete for r in replies)


async def test_role_system_messages_reach_a_strict_template_even_without_memory(
    engram: Engram, strict: FakeUpstream
) -> None:
    async with sdk(engram) as c:
        await c.messages.create(
            model=MODEL,
            max_tokens=8,
            system="Sys.",
            messages=[user("hi"), {"role": "system", "content": "Skills: none."}],  # type: ignore[list-item]
        )
    assert last_body(strict)["system"] == "Sys.\n\nSkills: none."


async def test_an_upstream_dying_mid_stream_raises_in_the_sdk(
    engram: Engram, strict: FakeUpstream
) -> None:
    events = anthropic_events(["one", " two", " three", " four"])
    strict.enqueue(StreamReply(events, die_after=5), path="/v1/messages")
    async with sdk(engram) as c:
        with pytest.raises(anthropic.APIStatusError):
            async with c.messages.stream(
                model=MODEL, max_tokens=8, messages=[user("hi")]
            ) as stream:
                await stream.get_final_message()
    await settle(engram)
    reply = engram.turns[-1].reply
    assert reply is not None and not reply.complete and reply.content == "one two"


async def test_engrams_keys_guard_messages_and_count_tokens(
    strict: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    """With accounts (auth.mode = keys) the SDK's key is Engram's: it names the user, never
    reaches the upstream, and without it both routes answer 401."""
    e = await start_engram(strict.url, auth={"mode": "keys", "loopback_admin": False})
    try:
        db = f"{e.tmp.name}/engram.db"
        argv = ["keys", "create", "--user", "alice", "--db", db]
        assert await asyncio.to_thread(engram_main, argv) == 0
        key = capsys.readouterr().out.strip().splitlines()[-1]
        good = anthropic.AsyncAnthropic(base_url=e.url, api_key=key, max_retries=0)
        bad = anthropic.AsyncAnthropic(base_url=e.url, api_key="egk_nope", max_retries=0)
        async with good, bad:
            msg = await good.messages.create(model=MODEL, max_tokens=8, messages=[user("hi")])
            assert msg.content[0].type == "text"
            counted = await good.messages.count_tokens(model=MODEL, messages=[user("hi")])
            assert counted.input_tokens > 0
            with pytest.raises(anthropic.AuthenticationError) as err:
                await bad.messages.create(model=MODEL, max_tokens=8, messages=[user("hi")])
            assert isinstance(err.value.body, dict) and err.value.body["type"] == "error"
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.count_tokens(model=MODEL, messages=[user("hi")])
        assert len(sent(strict)) == 1 and len(sent(strict, "/v1/messages/count_tokens")) == 1
        assert all(key not in str(dict(r.headers)) for r in strict.requests)
        await settle(e)
        assert [t.content for t in await turns_of(e, "alice")] == ["hi", "echo: hi"]
    finally:
        await e.close()


async def test_a_translated_tool_call_continues_the_same_session(
    engram: Engram, strict: FakeUpstream
) -> None:
    without_messages_api(strict)
    call = {"id": "call_7", "name": "get_weather", "arguments": '{"city":"Lisbon"}'}
    strict.enqueue(JsonReply(chat_completion(None, tool_calls=[call])))
    ask = [user("Weather in Lisbon?")]
    async with sdk(engram) as c:
        first = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=32,
            tools=TOOLS,
            messages=ask,  # type: ignore[arg-type]
        )
        msg = await first.parse()
        second = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=32,
            tools=TOOLS,  # type: ignore[arg-type]
            messages=[
                *ask,
                {"role": "assistant", "content": [b.model_dump() for b in msg.content]},  # type: ignore[misc]
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "call_7", "content": "9 C"}],
                },
            ],
        )
    assert msg.content[0].type == "tool_use"
    assert first.headers["X-Engram-Session"] == second.headers["X-Engram-Session"]
