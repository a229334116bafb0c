"""The Responses adapter's reply side: the readers that reassemble a reply for the archive, and
the translation from chat completions, checked by the ``openai`` SDK's own parsers (pure: the
SDK reads the bytes through an in-memory transport)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from proxy.chat.api import Conversation
from proxy.chat.responses.adapter import OpenAIResponses
from proxy.chat.responses.reply import StreamReader, WholeReader
from testing.fake_chunks import chat_chunks, chat_completion, make_usage, sse
from testing.fake_responses import call_item, events, message_item, response

API = OpenAIResponses()
CALL = {"id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def read(chunks: list[bytes], reader: StreamReader | None = None, cut: int = 7) -> Any:
    """Feed the bytes split every ``cut`` bytes; (reply, index of the chunk that ended it)."""
    reader = reader or StreamReader()
    data = b"".join(chunks)
    ends = [i for i in range(0, len(data), cut) if reader.feed(data[i : i + cut])]
    return reader.finish(ended_cleanly=True), ends


def test_a_stream_is_reassembled_and_ends_at_its_terminal_event() -> None:
    resp = response([message_item("Hello there, friend.")], input_tokens=12)
    chunks = events(resp)
    reply, ends = read(chunks)
    assert reply.content == "Hello there, friend." and reply.complete
    assert reply.finish_reason == "stop" and reply.id == "resp_fake"
    assert reply.usage == {
        "completion_tokens": resp["usage"]["output_tokens"],
        "prompt_tokens": 12,
        "total_tokens": resp["usage"]["total_tokens"],
    }
    assert len(ends) == 1 and ends[0] >= len(b"".join(chunks[:-1])) - 7  # the completed event


def test_function_calls_are_tool_calls_by_call_id() -> None:
    resp = response(
        [message_item("Let me check."), call_item("get_weather", '{"city":"Paris"}', "call_1")]
    )
    for reply in (read(events(resp))[0], _whole(resp)):
        assert reply.content == "Let me check." and reply.finish_reason == "tool_calls"
        assert reply.message()["tool_calls"] == [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ]


def test_llama_server_events_without_output_index_are_read() -> None:
    """llama-server leaves out output_index, content_index and sequence_number."""
    iid = "msg_x"
    chunks = [
        sse(
            {"type": "response.created", "response": {"id": "r1", "status": "in_progress"}},
            event="response.created",
        ),
        sse(
            {
                "type": "response.output_item.added",
                "item": {"id": iid, "type": "message", "role": "assistant", "content": []},
            }
        ),
        sse(
            {
                "type": "response.content_part.added",
                "item_id": iid,
                "part": {"type": "output_text", "text": ""},
            }
        ),
        sse({"type": "response.output_text.delta", "item_id": iid, "delta": "Hi "}),
        sse({"type": "response.output_text.delta", "item_id": iid, "delta": "you"}),
    ]
    reply, ends = read(chunks)
    assert reply.content == "Hi you" and not reply.complete and ends == []  # cut short
    done = sse(
        {
            "type": "response.completed",
            "response": {
                "id": "r1",
                "status": "completed",
                "output": [message_item("Hi you", iid=iid)],
                "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
            },
        }
    )
    reply, ends = read([*chunks, done])
    assert reply.content == "Hi you" and reply.complete and len(ends) == 1


def test_an_error_event_makes_the_reply_incomplete() -> None:
    resp = response([message_item("partial")])
    chunks = events(resp)[:5]
    error = {"type": "error", "code": "server_error", "message": "boom", "param": None}
    reply, _ = read([*chunks, sse(error, event="error")])
    assert reply.error["message"] == "boom" and not reply.complete


def _whole(obj: Any) -> Any:
    reader = WholeReader()
    reader.feed(json.dumps(obj).encode())
    return reader.finish(ended_cleanly=True)


def test_whole_bodies_and_errors() -> None:
    reply = _whole(response([message_item("ok")], input_tokens=4))
    assert reply.content == "ok" and reply.complete and reply.usage["prompt_tokens"] == 4
    error = _whole({"error": {"message": "bad", "type": "invalid_request_error"}})
    assert error.error["message"] == "bad" and not error.complete
    incomplete = _whole(response([message_item("cut")], status="incomplete"))
    assert incomplete.finish_reason == "length" and incomplete.complete


# --- translation ---------------------------------------------------------------------------------


def conv_of(body: dict[str, Any]) -> Conversation:
    return API.parse(json.dumps(body).encode())


def test_to_chat_maps_the_request() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "data:x", "detail": "low"},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "done"}],
            },
        ],
        "max_output_tokens": 50,
        "temperature": 0.2,
        "tools": [
            {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        "stream": True,
        "store": False,
    }
    conv = conv_of(body)
    chat = API.to_chat(conv, conv.messages)
    assert chat == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        "model": "m",
        "max_tokens": 50,
        "temperature": 0.2,
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "object"}},
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def sdk(handler: Callable[[httpx.Request], httpx.Response]) -> openai.OpenAI:
    transport = httpx.MockTransport(handler)
    return openai.OpenAI(
        base_url="http://engram.test/v1",
        api_key="x",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def translated(body: dict[str, Any], upstream: list[bytes], stream: bool, cut: int = 5) -> bytes:
    translator = API.from_chat(conv_of(body), stream)
    data = b"".join(upstream)
    out = [translator.feed(data[i : i + cut]) for i in range(0, len(data), cut)]
    return b"".join(out) + translator.finish()


def serve(data: bytes, content_type: str) -> openai.OpenAI:
    return sdk(
        lambda request: httpx.Response(200, content=data, headers={"content-type": content_type})
    )


STREAM_BODY = {"model": "m", "input": "hi", "stream": True}


def test_a_translated_stream_satisfies_the_sdk_stream_helper() -> None:
    upstream = chat_chunks(["Hel", "lo ", "there"], usage=make_usage(9, 3))
    data = translated(STREAM_BODY, upstream, stream=True)
    client = serve(data, "text/event-stream")
    kinds = [e.type for e in client.responses.create(model="m", input="hi", stream=True)]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    with client.responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == ["Hel", "lo ", "there"] and final.output_text == "Hello there"
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 3)
    # and Engram's own reader archives it as the client saw it
    reply, _ = read([data])
    assert reply.content == "Hello there" and reply.complete


def test_translated_function_calls_and_reasoning() -> None:
    reasoning = sse({"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]})
    upstream = [reasoning, *chat_chunks(["Checking."], tool_calls=[CALL])]
    data = translated(STREAM_BODY, upstream, stream=True)
    with serve(data, "text/event-stream").responses.stream(model="m", input="hi") as stream:
        args = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        final = stream.get_final_response()
    assert args == CALL["arguments"]
    kinds = [item.type for item in final.output]
    assert kinds == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_7", "get_weather", CALL["arguments"])
    reply, _ = read([data])
    assert reply.reasoning_content == "think" and reply.tool_calls[0]["id"] == "call_7"


def test_a_translated_whole_reply_is_a_response_the_sdk_reads() -> None:
    completion = chat_completion("All good.", tool_calls=[CALL], usage=make_usage(5, 2))
    body = {"model": "m", "input": "hi"}
    data = translated(body, [json.dumps(completion).encode()], stream=False)
    resp = serve(data, "application/json").responses.create(model="m", input="hi")
    assert resp.output_text == "All good." and resp.status == "completed"
    assert [i.type for i in resp.output] == ["message", "function_call"]
    assert resp.usage is not None and resp.usage.input_tokens == 5
    length = chat_completion("cut", finish_reason="length")
    data = translated(body, [json.dumps(length).encode()], stream=False)
    resp = serve(data, "application/json").responses.create(model="m", input="hi")
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    error = json.dumps({"error": {"code": 400, "message": "bad", "type": "x"}}).encode()
    assert translated(body, [error], stream=False) == error


@pytest.mark.parametrize("how", ["error-chunk", "cut-short"])
def test_a_failed_upstream_stream_ends_in_response_failed(how: str) -> None:
    upstream = chat_chunks(["partial"])[:2]
    if how == "error-chunk":
        upstream.append(sse({"error": {"code": 500, "message": "model crashed"}}))
    data = translated(STREAM_BODY, upstream, stream=True)
    client = serve(data, "text/event-stream")
    kinds = [e.type for e in client.responses.create(model="m", input="hi", stream=True)]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    reply, ends = read([data])
    assert reply.content == "partial" and not reply.complete and len(ends) == 1


def test_previous_response_id_cannot_be_translated() -> None:
    conv = conv_of({"input": "x", "previous_response_id": "resp_1"})
    with pytest.raises(Exception) as err:
        API.to_chat(conv, conv.messages)
    assert getattr(err.value, "code", None) == "previous_response_not_supported"
