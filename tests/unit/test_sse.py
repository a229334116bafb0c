"""SSE parsing and stream reassembly (pure)."""

from __future__ import annotations

import json

from proxy.sse import ChatAssembler, SSEParser, reply_from_completion


def _events(raw: bytes, step: int) -> list[tuple[str | None, str]]:
    parser = SSEParser()
    out = []
    for i in range(0, len(raw), step):
        out += parser.feed(raw[i : i + step])
    out += parser.close()
    return [(e.event, e.data) for e in out]


def test_parser_handles_any_chunking_comments_and_crlf() -> None:
    raw = (
        b': ping\n\ndata: {"a": 1}\n\nevent: response.created\r\ndata: x\r\ndata: y\r\n\r\n'
        b"data: [DONE]\n\n"
    )
    expected = [(None, '{"a": 1}'), ("response.created", "x\ny"), (None, "[DONE]")]
    for step in (1, 2, 3, 7, len(raw)):
        assert _events(raw, step) == expected


def test_parser_keeps_unterminated_last_line_only_as_whole_event() -> None:
    events = [e.data for e in SSEParser().feed(b"data: one\n\ndata: tw")]
    assert events == ["one"]
    p = SSEParser()
    p.feed(b"data: one\n\ndata: tw")
    assert [e.data for e in p.close()] == ["tw"]


def _chunk(delta: dict | None = None, finish: str | None = None, **extra: object) -> dict:
    choices = (
        []
        if delta is None and finish is None
        else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    return {
        "id": "c1",
        "model": "m",
        "object": "chat.completion.chunk",
        "choices": choices,
        **extra,
    }


def test_assembler_merges_content_tool_calls_and_usage() -> None:
    a = ChatAssembler()
    for c in [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get", "arguments": ""},
                    }
                ]
            }
        ),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "put", "arguments": '{"b"'},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": ": 2}"}}]}),
        _chunk(None, "tool_calls"),
        _chunk(None, None, usage={"prompt_tokens": 5, "completion_tokens": 7}),
    ]:
        a.add_chunk(c)
    r = a.finish(ended_cleanly=True)
    assert r.content == "Hello"
    assert [t["id"] for t in r.tool_calls] == ["call_1", "call_2"]
    assert json.loads(r.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    assert json.loads(r.tool_calls[1]["function"]["arguments"]) == {"b": 2}
    assert r.finish_reason == "tool_calls"
    assert r.usage == {"prompt_tokens": 5, "completion_tokens": 7}
    assert r.complete
    assert r.message()["tool_calls"][1]["function"]["name"] == "put"


def test_assembler_marks_interrupted_and_errored_streams_incomplete() -> None:
    a = ChatAssembler()
    a.add_chunk(_chunk({"content": "par"}))
    r = a.finish(ended_cleanly=False)
    assert r.content == "par" and not r.complete

    b = ChatAssembler()
    b.add_chunk(_chunk({"content": "x"}))
    b.add_chunk({"error": {"message": "boom"}})
    r2 = b.finish(ended_cleanly=True)
    assert r2.error == {"message": "boom"} and not r2.complete

    c = ChatAssembler()  # ended cleanly but never finished: a truncated stream
    c.add_chunk(_chunk({"content": "x"}))
    assert not c.finish(ended_cleanly=True).complete


def test_reasoning_and_junk_events() -> None:
    a = ChatAssembler()
    p = SSEParser()
    for e in p.feed(
        b"data: not json\n\ndata: "
        + json.dumps(_chunk({"reasoning_content": "think"}, "stop")).encode()
        + b"\n\ndata: [DONE]\n\n"
    ):
        a.add_event(e)
    r = a.finish(ended_cleanly=True)
    assert r.reasoning_content == "think" and r.complete and a.done


def test_reply_from_plain_completion() -> None:
    r = reply_from_completion(
        {
            "id": "x",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"total_tokens": 3},
        }
    )
    assert (r.content, r.finish_reason, r.complete, r.usage) == (
        "hi",
        "stop",
        True,
        {"total_tokens": 3},
    )
    assert not reply_from_completion({"error": {"message": "x"}}).complete
    assert not reply_from_completion([1, 2]).complete
