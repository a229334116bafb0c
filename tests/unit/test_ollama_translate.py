"""Ollama's ``/api/chat`` over a chat-completions upstream: the request (``to_chat``) and the
reply (``from_chat``), checked with the ``ollama`` client's own models parsing the output."""

from __future__ import annotations

import json
from typing import Any

import ollama
import pytest

from proxy.chat.ollama.adapter import OllamaChat
from proxy.chat.prompt import append_to_system
from testing.fake_chunks import DONE, chat_chunks, chat_completion, make_usage, sse
from testing.fake_ollama import PNG, tool_call

API = OllamaChat()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def conversation(**body: Any) -> Any:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?", "images": [PNG]},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("weather", city="Paris")]},
        {"role": "tool", "content": "21 C", "tool_name": "weather"},
    ]
    return API.parse(json.dumps({"model": "m", "messages": messages, **body}).encode())


def test_to_chat_maps_messages_options_and_fields() -> None:
    conv = conversation(
        tools=TOOLS,
        options={"num_ctx": 8192, "num_predict": 99, "temperature": 0.2, "stop": ["\n\n"]},
        keep_alive="5m",
        format={"type": "object"},
        think=False,
    )
    out = API.to_chat(conv, [append_to_system(conv.messages[0], "MEM"), *conv.messages[1:]])
    call_id = conv.messages[2]["tool_calls"][0]["id"]
    assert out["messages"] == [
        {"role": "system", "content": "Be brief.\n\nMEM"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in Paris?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "21 C", "tool_call_id": call_id},
    ]
    assert out["model"] == "m" and out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}
    assert (out["max_tokens"], out["temperature"], out["stop"]) == (99, 0.2, ["\n\n"])
    assert out["tools"] == TOOLS
    assert out["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert out["chat_template_kwargs"] == {"enable_thinking": False}
    assert "num_ctx" not in json.dumps(out) and "keep_alive" not in out


def test_to_chat_plain_json_format_and_no_empty_tools() -> None:
    out = API.to_chat(conversation(stream=False, tools=[], format="json", think="high"), [])
    assert out["stream"] is False and "stream_options" not in out and "tools" not in out
    assert out["response_format"] == {"type": "json_object"}
    assert out["reasoning_effort"] == "high"


def translate(events: list[bytes], size: int, event_stream: bool = True) -> bytes:
    t = API.from_chat(conversation(), event_stream)
    data = b"".join(events)
    out = b"".join(t.feed(data[i : i + size]) for i in range(0, len(data), size))
    return out + t.finish()


def parsed_lines(out: bytes) -> list[ollama.ChatResponse]:
    """What the ollama client yields for this NDJSON body (it raises on an ``error`` line)."""
    lines = out.split(b"\n")
    assert lines[-1] == b"" and all(lines[:-1]), "one object a line, no blank lines"
    parts = []
    for line in lines[:-1]:
        part = json.loads(line)
        if err := part.get("error"):
            raise ollama.ResponseError(err)
        parts.append(ollama.ChatResponse(**part))
    return parts


@pytest.mark.parametrize("size", [1, 13, 1_000_000])
def test_from_chat_stream_is_ollama_ndjson(size: int) -> None:
    events = chat_chunks(
        ["The ", "weather ", "is fine."],
        tool_calls=[{"id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}],
        usage=make_usage(31, 9),
        ping=True,
    )
    t = API.from_chat(conversation(), True)
    assert t.content_type == "application/x-ndjson"
    parts = parsed_lines(translate(events, size))
    assert "".join(p.message.content or "" for p in parts) == "The weather is fine."
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"})
    ]
    last = parts[-1]
    assert (last.done_reason, last.prompt_eval_count, last.eval_count) == ("stop", 31, 9)
    assert last.model == "fake-model"


def test_from_chat_stream_round_trips_through_the_reader() -> None:
    events = chat_chunks(
        ["Sun", "ny"], tool_calls=[{"id": "c", "name": "weather", "arguments": '{"city": "Rome"}'}]
    )
    reader = API.reader(event_stream=False)
    ended = [reader.feed(line + b"\n") for line in translate(events, 5).split(b"\n")[:-1]]
    assert ended[-1] is True and ended.count(True) == 1
    reply = reader.finish(ended_cleanly=True)
    assert reply.complete and reply.content == "Sunny"
    # The reply's call gets the id its resend will get (not the upstream's "c").
    again = API.parse(
        json.dumps(
            {"messages": [{"role": "assistant", "tool_calls": [tool_call("weather", city="Rome")]}]}
        ).encode()
    )
    assert reply.tool_calls == again.messages[0]["tool_calls"]


def test_from_chat_stream_errors_and_missing_done() -> None:
    events = [*chat_chunks(["par", "tial"], done=False)[:3], sse({"error": {"message": "boom"}})]
    with pytest.raises(ollama.ResponseError, match="boom"):
        parsed_lines(translate(events, 4))
    # Finished without [DONE]: the done line still goes out, from finish().
    parts = parsed_lines(translate(chat_chunks(["ok"], done=False, finish_reason="length"), 3))
    assert parts[-1].done and parts[-1].done_reason == "length"
    # Cut before any finish: no done line (the client sees a truncated stream).
    parts = parsed_lines(translate(chat_chunks(["cut"], done=False)[:2], 3))
    assert parts and not any(p.done for p in parts)
    # Anything after [DONE] is not Ollama's to see.
    parts = parsed_lines(translate([*chat_chunks(["a"]), DONE], 7))
    assert [p.done for p in parts] == [False, True]


def test_from_chat_whole_body_is_one_ollama_object() -> None:
    body = chat_completion(
        None,
        tool_calls=[{"id": "call_9", "name": "weather", "arguments": '{"city": "Oslo"}'}],
        usage=make_usage(12, 3),
    )
    t = API.from_chat(conversation(stream=False), False)
    assert t.content_type == "application/json"
    raw = json.dumps(body).encode()
    out = b"".join(t.feed(raw[i : i + 10]) for i in range(0, len(raw), 10)) + t.finish()
    reply = ollama.ChatResponse(**json.loads(out))
    assert reply.done and reply.done_reason == "stop"
    assert (reply.prompt_eval_count, reply.eval_count) == (12, 3)
    assert reply.message.tool_calls is not None
    assert dict(reply.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert json.loads(out)["message"]["tool_calls"][0]["id"] == "call_9"
    plain = translate([json.dumps(chat_completion("Hello")).encode()], 4, event_stream=False)
    assert ollama.ChatResponse(**json.loads(plain)).message.content == "Hello"


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (
            b'{"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}}',
            "too long",
        ),
        (b'{"error": "plain"}', "plain"),
        (b"File Not Found", "File Not Found"),
        (b"", "The upstream model server sent an empty reply."),
    ],
)
def test_from_chat_errors_are_ollama_shaped(body: bytes, text: str) -> None:
    out = translate([body], 5, event_stream=False)
    assert json.loads(out) == {"error": text}
    err = ollama.ResponseError(out.decode(), 400)
    assert err.error == text  # what the ollama client prints
