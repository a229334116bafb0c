"""The chat API seam: the OpenAI chat adapter's parse, encode and reply readers (pure)."""

from __future__ import annotations

import json

import pytest

from proxy.chat.openai.adapter import OpenAIChat
from proxy.errors import BadRequest
from testing.fake_chunks import chat_chunks, chat_completion

API = OpenAIChat()


def test_parse_gives_the_neutral_conversation() -> None:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 64,
        "user": "alice",
        "messages": [{"role": "user", "content": "hi"}],
        "vendor_field": {"x": None},
    }
    conv = API.parse(json.dumps(body).encode())
    assert conv.body == body and conv.messages == body["messages"]
    assert (conv.model, conv.stream, conv.reply_tokens) == ("m", True, 64)
    assert conv.hints is not None and conv.hints["user"] == "alice"
    # max_completion_tokens wins; nonsense reserves are no reserve.
    for extra, want in (
        ({"max_completion_tokens": 9, "max_tokens": 64}, 9),
        ({"max_tokens": True}, None),
        ({"max_tokens": -3}, None),
        ({}, None),
    ):
        conv = API.parse(json.dumps({"messages": [], **extra}).encode())
        assert conv.reply_tokens == want, extra


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "invalid_json"),
        (b"{", "invalid_json"),
        (b"[]", "invalid_body"),
        (b"{}", "missing_messages"),
        (b'{"messages": {}}', "invalid_messages"),
        (b'{"messages": [1]}', "invalid_messages"),
        (b'{"messages": [{"role": 3}]}', "invalid_messages"),
    ],
)
def test_parse_rejects_with_a_precise_400(raw: bytes, code: str) -> None:
    with pytest.raises(BadRequest) as err:
        API.parse(raw)
    assert err.value.code == code


def test_lone_surrogates_are_cleaned_for_memory_not_for_the_upstream() -> None:
    raw = b'{"user": "ev\\udc00e", "messages": [{"role": "user", "content": "a \\ud800 b"}]}'
    conv = API.parse(raw)
    assert conv.messages == [{"role": "user", "content": "a \ufffd b"}]
    assert conv.hints is not None and conv.hints["user"] == "ev\ufffde"
    assert conv.body["messages"][0]["content"] == "a \ud800 b"  # forwarded as sent
    plain = API.parse(b'{"messages": [{"role": "user", "content": "no escape \\\\ud800"}]}')
    assert plain.messages is plain.body["messages"]  # nothing to clean: no copy made


def test_encode_changes_only_the_messages() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}], "x": [1, None]}
    conv = API.parse(json.dumps(body).encode())
    out = json.loads(API.encode(conv, [{"role": "user", "content": "b"}]))
    assert out == {**body, "messages": [{"role": "user", "content": "b"}]}
    # A lone surrogate elsewhere in the body goes out escaped, never as an encoding error.
    conv = API.parse(b'{"messages": [], "note": "\\ud800"}')
    assert json.loads(API.encode(conv, []))["note"] == "\ud800"


def test_stream_reader_ends_at_done_and_reassembles() -> None:
    reader = API.reader(event_stream=True)
    events = chat_chunks(["Hel", "lo"])
    ends = [reader.feed(e) for e in events]
    assert ends == [False] * (len(events) - 1) + [True]  # the last event is data: [DONE]
    reply = reader.finish(ended_cleanly=True)
    assert reply.content == "Hello" and reply.complete
    assert reader.finish(ended_cleanly=True).content == "Hello"  # finishing again is harmless
    cut = API.reader(event_stream=True)
    cut.feed(b"".join(events[:2]))
    assert not cut.finish(ended_cleanly=False).complete


def test_whole_reader_reads_a_completion_in_any_chunking() -> None:
    data = json.dumps(chat_completion("whole reply")).encode()
    reader = API.reader(event_stream=False)
    assert not any(reader.feed(data[i : i + 7]) for i in range(0, len(data), 7))
    reply = reader.finish(ended_cleanly=True)
    assert reply.content == "whole reply" and reply.complete
    broken = API.reader(event_stream=False)
    broken.feed(data[:20])
    assert not broken.finish(ended_cleanly=False).complete
