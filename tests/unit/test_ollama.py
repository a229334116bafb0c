"""Ollama's ``/api/chat`` adapter: parse into the neutral shape, encode back, reassemble replies
(pure; the shapes are those the ``ollama`` Python client sends and parses)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest

from proxy.chat.ollama.adapter import ORIGIN, OllamaChat
from proxy.chat.prompt import append_to_system, with_leading_text
from proxy.errors import BadRequest
from proxy.messages import chain_hashes, extend_chain
from proxy.slots.model import Slot
from proxy.slots.refs import Candidate
from proxy.slots.refs import apply as apply_slots
from testing.fake_ollama import PNG, ndjson, reply_lines, tool_call, whole_reply

API = OllamaChat()


def sdk_body(messages: list[Any], **kwargs: Any) -> bytes:
    """The bytes the ``ollama`` client sends for ``chat(model="m", messages=..., **kwargs)``
    (captured by an in-memory transport: the real client, no server)."""
    sent: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json=whole_reply("ok"))

    client = ollama.Client(host="http://ollama.invalid", transport=httpx.MockTransport(answer))
    client.chat(model="m", messages=messages, **kwargs)
    return sent[0]


def neutral(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != ORIGIN} for m in messages]


WEATHER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?", "images": [PNG]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [tool_call("weather", city="Paris"), tool_call("weather", city="Rome")],
    },
    {"role": "tool", "content": "21 C", "tool_name": "weather"},
    {"role": "tool", "content": "25 C", "tool_name": "weather"},
]


def test_parse_gives_the_neutral_conversation() -> None:
    raw = sdk_body(WEATHER, options={"num_ctx": 8192, "num_predict": 200}, keep_alive="5m")
    conv = API.parse(raw)
    assert conv.body == json.loads(raw)
    assert (conv.model, conv.stream, conv.reply_tokens, conv.context_size) == (
        "m",
        False,
        200,
        8192,
    )
    assert conv.hints == {}
    msgs = neutral(conv.messages)
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1]["content"] == [
        {"type": "text", "text": "Weather in Paris and Rome?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
    ]
    calls = msgs[2]["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "weather", "arguments": '{"city": "Paris"}'},
        {"name": "weather", "arguments": '{"city": "Rome"}'},
    ]
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)
    # Tool results answer the calls in order (same tool name twice).
    assert [m["tool_call_id"] for m in msgs[3:]] == ids
    assert [m[ORIGIN] for m in conv.messages] == [0, 1, 2, 3, 4]


def test_stream_is_the_default_and_options_are_read_leniently() -> None:
    def parse(body: dict[str, Any]) -> Any:
        return API.parse(json.dumps({"model": "m", "messages": [], **body}).encode())

    assert parse({}).stream is True  # the raw API streams unless told not to
    assert parse({"stream": None}).stream is True
    assert parse({"stream": False}).stream is False
    assert parse({"options": {"num_ctx": 4096.0}}).context_size == 4096
    for odd in (0, -1, 1.5, "4096", True, None):
        conv = parse({"options": {"num_ctx": odd, "num_predict": odd}})
        assert (conv.context_size, conv.reply_tokens) == (None, None), odd
    assert parse({}).messages == [] and API.parse(b'{"model": "m"}').messages == []


def test_tool_results_pair_by_client_id_then_name_then_order() -> None:
    calls = [
        {"id": "call_a", "function": {"name": "f", "arguments": {}}},
        {"id": "call_b", "function": {"name": "g", "arguments": {"x": 1}}},
    ]
    sent = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "from g", "tool_name": "g"},
        {"role": "tool", "content": "from f", "tool_call_id": "call_a"},
        {"role": "tool", "content": "stray"},
        {"role": "user", "content": "next"},
    ]
    msgs = API.parse(json.dumps({"messages": sent}).encode()).messages
    f_id, g_id = (c["id"] for c in msgs[1]["tool_calls"])
    assert msgs[2]["tool_call_id"] == g_id and msgs[3]["tool_call_id"] == f_id
    assert "tool_call_id" not in msgs[4]  # answers nothing: left as sent
    # The neutral id does not depend on the id the client kept (the ollama SDK drops it).
    without = [{**c} for c in calls]
    for c in without:
        c.pop("id")
    again = API.parse(json.dumps({"messages": [{**sent[1], "tool_calls": without}]}).encode())
    assert [c["id"] for c in again.messages[0]["tool_calls"]] == [f_id, g_id]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"", None),
        (b"{", None),
        (b"[]", None),
        (b'{"messages": {}}', "messages"),
        (b'{"messages": [1]}', "messages[0]"),
        (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": ["x"]}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "images": "abc"}]}', "messages[0].images"),
        (b'{"messages": [{"role": "user", "images": [1]}]}', "messages[0].images"),
        (b'{"messages": [{"role": "assistant", "tool_calls": {}}]}', "messages[0].tool_calls"),
        (b'{"messages": [{"role": "assistant", "tool_calls": [{}]}]}', "messages[0].tool_calls[0]"),
        (b'{"messages": [], "options": []}', "options"),
    ],
)
def test_parse_rejects_with_a_precise_400(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as err:
        API.parse(raw)
    assert err.value.param == param
    body = API.error_body(400, err.value.type, err.value.message, err.value.code, param)
    assert body == {"error": err.value.message}  # what the ollama client prints


def test_encode_unchanged_messages_are_the_clients_own() -> None:
    sent = [
        {"role": "User", "content": "hi", "x-vendor": [None]},
        {"role": "assistant", "content": "", "thinking": "hmm", "tool_calls": [tool_call("f")]},
        {"role": "tool", "content": "out", "tool_name": "f", "tool_call_id": "c9"},
    ]
    body = {"model": "m", "messages": sent, "tools": [], "keep_alive": 0, "format": None, "y": 1}
    conv = API.parse(json.dumps(body).encode())
    assert conv.messages[0]["role"] == "user"  # as Ollama reads it
    assert json.loads(API.encode(conv, conv.messages)) == body
    # A window that drops the first message keeps the others as sent.
    assert json.loads(API.encode(conv, conv.messages[1:]))["messages"] == sent[1:]


def test_encode_memory_block_after_the_system_text_byte_identical() -> None:
    sent = [
        {"role": "system", "content": "Du bist kurz. ✓", "extra": {"k": 1}},
        {"role": "user", "content": "q", "images": [PNG]},
    ]
    conv = API.parse(json.dumps({"model": "m", "messages": sent}).encode())
    block = "<memory>\nfact\n</memory>"
    out = json.loads(
        API.encode(conv, [append_to_system(conv.messages[0], block), conv.messages[1]])
    )
    system = out["messages"][0]
    assert system["content"].startswith(sent[0]["content"])
    assert system == {**sent[0], "content": sent[0]["content"] + "\n\n" + block}
    assert out["messages"][1] == sent[1]
    # No system message sent: one is made, first.
    conv = API.parse(json.dumps({"model": "m", "messages": sent[1:]}).encode())
    made = {"role": "system", "content": block}
    out = json.loads(API.encode(conv, [made, *conv.messages]))
    assert out["messages"] == [made, sent[1]]
    assert ORIGIN not in json.dumps(out)


def test_encode_copies_keep_every_other_field_and_the_images() -> None:
    conv = API.parse(sdk_body(WEATHER))
    # The summary (or stable-mode memory) leads a user message that has an image.
    user = with_leading_text(conv.messages[1], "<engram-summary>s</engram-summary>")
    # A tool result swapped for its slot reference.
    slot = Slot("weather-0123", "weather", "21 C", 3, "weather output, 3 tokens")
    tool = apply_slots(conv.messages, [Candidate(3, slot)])[3]
    out = json.loads(API.encode(conv, [conv.messages[0], user, conv.messages[2], tool]))
    sent = json.loads(sdk_body(WEATHER))["messages"]
    assert out["messages"][1] == {
        **sent[1],
        "content": "<engram-summary>s</engram-summary>\n\n" + sent[1]["content"],
    }
    assert out["messages"][1]["images"] == [PNG]
    assert out["messages"][2] == sent[2]  # arguments still objects, no ids added
    assert out["messages"][3]["tool_name"] == "weather"
    assert out["messages"][3]["content"].startswith("[TOOL_RESULT:weather-0123]")


def test_lone_surrogates_are_cleaned_for_memory_not_for_the_upstream() -> None:
    raw = b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}'
    conv = API.parse(raw)
    assert conv.messages[0]["content"] == "a \ufffd b"
    assert json.loads(API.encode(conv, conv.messages))["messages"][0]["content"] == "a \ud800 b"


def feed_split(reader: Any, data: bytes, size: int) -> list[bool]:
    return [reader.feed(data[i : i + size]) for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_reader_reassembles_ndjson_and_ends_on_the_done_line(size: int) -> None:
    lines = reply_lines(
        "It is sunny.",
        thinking="Let me see",
        tool_calls=[tool_call("weather", city="Paris")],
        prompt_eval_count=42,
        eval_count=7,
    )
    data = b"".join(ndjson(lines))
    reader = API.reader(event_stream=False)  # Ollama's Content-Type is application/x-ndjson
    ended = feed_split(reader, data, size)
    assert ended.count(True) == 1
    # True on the chunk holding the done line's end: the last chunk here.
    assert ended[-1] is True
    reply = reader.finish(ended_cleanly=True)
    assert reply.complete and reply.content == "It is sunny."
    assert reply.reasoning_content == "Let me see"
    assert reply.finish_reason == "stop" and reply.model == "fake-model"
    assert reply.usage == {"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}
    assert reply.tool_calls == [
        {
            "id": reply.tool_calls[0]["id"],
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        }
    ]


def test_reader_whole_body_error_and_cut_stream() -> None:
    reader = API.reader(event_stream=False)
    body = json.dumps(whole_reply("Hi there", eval_count=2)).encode()
    assert reader.feed(body) is False  # a whole body has no line end: finish reads it
    reply = reader.finish(ended_cleanly=True)
    assert reply.complete and reply.content == "Hi there" and reply.usage is not None
    # Pretty-printed, over several lines.
    reader = API.reader(event_stream=False)
    reader.feed(json.dumps(whole_reply("Hi"), indent=2).encode())
    assert reader.finish(ended_cleanly=True).content == "Hi"
    # An error line mid-stream: incomplete, the error kept.
    reader = API.reader(event_stream=False)
    lines = [*ndjson(reply_lines("partial answer")[:2]), b'{"error": "model crashed"}\n']
    assert not any(reader.feed(x) for x in lines)
    reply = reader.finish(ended_cleanly=True)
    assert not reply.complete and reply.error == "model crashed"
    assert reply.content == "partial answer"
    # The upstream died before the done line.
    reader = API.reader(event_stream=False)
    for x in ndjson(reply_lines("cut short")[:-1]):
        reader.feed(x)
    assert not reader.finish(ended_cleanly=False).complete


def test_reply_tool_call_ids_are_those_of_its_resend() -> None:
    """The archived reply and the same message resent by the client hash alike (the archive
    recognises the conversation by that chain), whatever ids the upstream or client kept."""
    history = [{"role": "user", "content": "Weather in Paris?"}]
    conv = API.parse(sdk_body(history))
    call = {
        "id": "call_x1y2z3",
        "function": {"index": 0, "name": "weather", "arguments": {"city": "Paris"}},
    }
    reader = API.reader(event_stream=False)
    for x in ndjson(reply_lines("", tool_calls=[call])):
        reader.feed(x)
    reply = reader.finish(ended_cleanly=True).message()
    archived = extend_chain(chain_hashes(conv.messages)[-1], reply)
    # The ollama client resends the reply: its ToolCall model drops the id and the index.
    resent = ollama.Message(role="assistant", content="", tool_calls=[call])
    nxt = API.parse(sdk_body([*history, resent, {"role": "tool", "content": "21 C"}]))
    assert chain_hashes(nxt.messages)[1] == archived
    assert nxt.messages[2]["tool_call_id"] == reply["tool_calls"][0]["id"]
