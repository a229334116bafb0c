"""The Anthropic Messages adapter's reply side: the reader that reassembles a reply for the
archive, and the translation to and from chat completions, checked with the ``anthropic`` SDK
parsing what the translators make (served by the fake upstream, over a real socket)."""

from __future__ import annotations

import json
import random
from typing import Any

import anthropic
import pytest

from proxy.chat.anthropic.adapter import AnthropicMessages
from proxy.chat.anthropic.neutral import ORIGIN, message_pieces
from proxy.chat.anthropic.reply import StreamReader, WholeReader
from proxy.messages import canonical
from testing.fake_anthropic import anthropic_events, anthropic_message, error_event
from testing.fake_chunks import DONE, chat_chunks, chat_completion, sse, template_violations
from testing.fake_upstream import FakeUpstream, JsonReply, StreamReply

API = AnthropicMessages()
TOOLS = [
    {"id": "toolu_01", "name": "get_weather", "input": {"city": "Lisbon", "units": ["c"]}},
    {"id": "toolu_02", "name": "get_time", "input": {}},
]


def feed_split(reader: StreamReader, data: bytes, seed: int) -> list[bool]:
    """Feed ``data`` in random pieces; what ``feed`` said for each."""
    rng = random.Random(seed)
    said = []
    i = 0
    while i < len(data):
        n = rng.randint(1, 40)
        said.append(reader.feed(data[i : i + n]))
        i += n
    return said


# --- the reader ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_a_stream_is_reassembled_and_its_end_seen_once(seed: int) -> None:
    events = anthropic_events(
        ["Let", " me", " check."],
        thinking=["The user", " wants weather."],
        tool_uses=TOOLS,
        usage={"input_tokens": 20, "cache_read_input_tokens": 100, "output_tokens": 9},
    )
    reader = API.reader(event_stream=True)
    assert isinstance(reader, StreamReader)
    said = feed_split(reader, b"".join(events), seed)
    assert said.count(True) == 1 and said[-1] is True  # the last piece holds message_stop
    reply = reader.finish(ended_cleanly=True)
    assert reply.complete and reply.error is None
    assert reply.content == "Let me check."
    assert reply.reasoning_content == "The user wants weather."
    assert reply.finish_reason == "tool_calls"
    assert reply.id == "msg_fake" and reply.model == "fake-model"
    assert reply.usage == {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129}
    assert [c["function"]["arguments"] for c in reply.tool_calls] == [
        '{"city": "Lisbon", "units": ["c"]}',
        "{}",
    ]


def test_the_archived_reply_hashes_as_the_client_resends_it() -> None:
    """The next request resends the reply as blocks: it must read as what was archived, or the
    conversation would not be recognised."""
    for streamed in (True, False):
        if streamed:
            reader: StreamReader | WholeReader = StreamReader()
            reader.feed(b"".join(anthropic_events(["A", "nswer."], tool_uses=TOOLS)))
        else:
            reader = WholeReader()
            reader.feed(json.dumps(anthropic_message("Answer.", tool_uses=TOOLS)).encode())
        reply = reader.finish(ended_cleanly=True)
        resent = anthropic_message("Answer.", thinking="hm", tool_uses=TOOLS)
        [neutral] = message_pieces(3, {"role": "assistant", "content": resent["content"]})
        assert canonical(reply.message()) == canonical(neutral)


def test_an_unfinished_or_failed_stream_is_incomplete() -> None:
    reader = StreamReader()
    assert not any(reader.feed(e) for e in anthropic_events(["Hi"], done=False))
    assert not reader.finish(ended_cleanly=False).complete
    reader = StreamReader()
    events = anthropic_events(["Hi"])
    for e in [*events[:3], error_event("Overloaded")]:
        reader.feed(e)
    reply = reader.finish(ended_cleanly=True)
    assert not reply.complete and reply.error == {
        "type": "overloaded_error",
        "message": "Overloaded",
    }


def test_a_whole_reply_and_an_error_body() -> None:
    reader = API.reader(event_stream=False)
    body = anthropic_message("Hello", thinking="hm", usage={"input_tokens": 3, "output_tokens": 1})
    reader.feed(json.dumps(body).encode())
    reply = reader.finish(ended_cleanly=True)
    assert reply.complete and reply.content == "Hello" and reply.reasoning_content == "hm"
    assert reply.finish_reason == "stop" and reply.usage is not None
    assert reply.usage["prompt_tokens"] == 3
    reader = API.reader(event_stream=False)
    reader.feed(b'{"type":"error","error":{"type":"invalid_request_error","message":"no"}}')
    reply = reader.finish(ended_cleanly=True)
    assert not reply.complete and reply.error["message"] == "no"


# --- translation: the request ----------------------------------------------------------------


def test_to_chat_makes_a_chat_completions_body() -> None:
    body = {
        "model": "claude",
        "max_tokens": 100,
        "temperature": 0.2,
        "top_k": 5,
        "stop_sequences": ["END"],
        "stream": True,
        "system": [{"type": "text", "text": "Sys.", "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "tool_choice": {"type": "tool", "name": "read", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "system", "content": "Reminder."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": "a"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "A"}],
                    },
                    {"type": "text", "text": "and?"},
                    {"type": "document", "source": {"type": "text", "data": "doc"}},
                ],
            },
        ],
    }
    conv = API.parse(json.dumps(body).encode())
    out = API.to_chat(conv, conv.messages)
    assert out == {
        "model": "claude",
        "messages": [
            {"role": "system", "content": "Sys.\n\nReminder."},
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "Reading.",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"p": "a"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "A"},
            {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        ],
        "max_tokens": 100,
        "temperature": 0.2,
        "top_k": 5,
        "stop": ["END"],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "read",
                    "description": "Read a file",
                    "parameters": {"type": "object"},
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "read"}},
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert ORIGIN not in json.dumps(out)
    assert not template_violations(out["messages"])


# --- translation: the reply, parsed by the SDK -----------------------------------------------


def reasoning_chunks() -> list[bytes]:
    def chunk(delta: dict[str, Any]) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return sse({"id": "chatcmpl-1", "model": "m", "choices": [choice]})

    return [
        chunk({"role": "assistant"}),
        chunk({"reasoning_content": "Think"}),
        chunk({"reasoning_content": "ing."}),
    ]


def translated(chunks: list[bytes], seed: int) -> list[bytes]:
    """The chat chunks through the stream translator, cut at random places."""
    t = API.from_chat(API.parse(b'{"model": "claude", "messages": []}'), event_stream=True)
    assert t.content_type == "text/event-stream"
    data = b"".join(chunks)
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, 30)
        out.append(t.feed(data[i : i + n]))
        i += n
    out.append(t.finish())
    return [o for o in out if o]


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(3))
async def test_a_translated_stream_is_what_the_sdk_accumulates(seed: int) -> None:
    calls = [
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Lisbon"}'},
        {"id": "call_2", "name": "get_time", "arguments": "{}"},
    ]
    usage = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    chat = (
        reasoning_chunks() + chat_chunks(["Let", " me", " see."], tool_calls=calls, usage=usage)[1:]
    )
    async with FakeUpstream() as fake:
        fake.enqueue(StreamReply(translated(chat, seed)), path="/v1/messages")
        c = anthropic.AsyncAnthropic(base_url=fake.url, api_key="k", max_retries=0)
        async with (
            c,
            c.messages.stream(
                model="claude", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            ) as stream,
        ):
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
    assert text == "Let me see."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "Thinking."  # type: ignore[union-attr]
    assert final.content[2].input == {"city": "Lisbon"}  # type: ignore[union-attr]
    assert final.content[2].id == "call_1" and final.content[3].name == "get_time"  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 7 and final.usage.input_tokens == 11
    assert final.model == "m"


@pytest.mark.asyncio
async def test_a_translated_whole_reply_and_errors_parse_in_the_sdk() -> None:
    conv = API.parse(b'{"model": "claude", "messages": []}')
    whole = API.from_chat(conv, event_stream=False)
    assert whole.content_type == "application/json"
    completion = chat_completion(
        "Sure.", tool_calls=[{"id": "call_9", "name": "ls", "arguments": '{"dir": "/"}'}]
    )
    data = json.dumps(completion).encode()
    body = b"".join([whole.feed(data[:10]), whole.feed(data[10:]), whole.finish()])
    error = API.from_chat(conv, event_stream=True)
    err_bytes = error.feed(sse({"error": {"message": "boom", "type": "server_error"}}) + DONE)
    async with FakeUpstream() as fake:
        fake.enqueue(JsonReply(json.loads(body)), path="/v1/messages")
        fake.enqueue(StreamReply([err_bytes]), path="/v1/messages")
        async with anthropic.AsyncAnthropic(base_url=fake.url, api_key="k", max_retries=0) as c:
            msg = await c.messages.create(
                model="claude", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
            with pytest.raises(anthropic.APIStatusError, match="boom"):
                async with c.messages.stream(
                    model="claude", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
                ) as stream:
                    await stream.get_final_message()
    assert msg.stop_reason == "tool_use" and msg.content[0].text == "Sure."  # type: ignore[union-attr]
    assert msg.content[1].input == {"dir": "/"}  # type: ignore[union-attr]
    assert msg.id.startswith("msg_")
