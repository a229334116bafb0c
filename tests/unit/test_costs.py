"""What the model server computed and reused of a prompt, as each API reports it (pure): the
extraction in ``proxy.costs``, each chat API's reader of a reply (streamed and whole), the tap
beneath a translation, and the recent requests' share."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.chat.anthropic.adapter import AnthropicMessages
from proxy.chat.api import ReplyReader
from proxy.chat.ollama.adapter import OllamaChat
from proxy.chat.openai.adapter import OpenAIChat
from proxy.chat.recent import RecentRequests
from proxy.chat.responses.adapter import OpenAIResponses
from proxy.chat.wire import CostTap
from proxy.costs import (
    MAX_TOKENS,
    PromptCost,
    chat_cost,
    count,
    describe,
    from_anthropic_usage,
    from_chat_usage,
    from_ollama,
    from_responses_usage,
    from_timings,
    pick,
)
from proxy.sse import AssembledReply
from testing.fake_cache import KVCache, on_last_chunk, rendered
from testing.fake_chunks import chat_chunks, chat_completion, sse

HOSTILE: list[Any] = [
    "12",
    -1,
    1.5,
    12.0,
    True,
    None,
    [3],
    {"n": 3},
    MAX_TOKENS + 1,
    float("nan"),
]


def cost(computed: int | None, reused: int | None, total: int | None, source: str) -> PromptCost:
    return PromptCost(computed, reused, total, source)


# --- the extraction ---------------------------------------------------------------------------


def test_a_count_is_a_plausible_whole_number_and_nothing_else() -> None:
    assert [count(v) for v in (0, 7, MAX_TOKENS)] == [0, 7, MAX_TOKENS]
    assert [count(v) for v in HOSTILE] == [None] * len(HOSTILE)


def test_llama_server_timings() -> None:
    assert from_timings({"prompt_n": 12, "cache_n": 300, "prompt_ms": 4.5}) == cost(
        12, 300, 312, "timings"
    )
    assert from_timings({"prompt_n": 12}) == cost(12, None, None, "timings")
    assert from_timings({"cache_n": 0}) == cost(None, 0, None, "timings")
    for bad in HOSTILE:
        assert from_timings({"prompt_n": bad, "cache_n": bad}) is None
        assert from_timings(bad) is None
    assert from_timings({"prompt_n": -1, "cache_n": 5}) == cost(None, 5, None, "timings")


def test_chat_completions_usage() -> None:
    usage = {"prompt_tokens": 320, "prompt_tokens_details": {"cached_tokens": 300}}
    assert from_chat_usage(usage) == cost(20, 300, 320, "usage")
    assert from_chat_usage({"prompt_tokens": 320}) == cost(None, None, 320, "usage")
    # More reused than the whole: the split is wrong, the whole is kept.
    bad_split = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}
    assert from_chat_usage(bad_split) == cost(None, None, 10, "usage")
    for bad in HOSTILE:
        assert from_chat_usage({"prompt_tokens": bad, "prompt_tokens_details": bad}) is None
        odd = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": bad}}
        assert from_chat_usage(odd) == cost(None, None, 5, "usage")
        assert from_chat_usage(bad) is None


def test_responses_usage() -> None:
    usage = {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 40}}
    assert from_responses_usage(usage) == cost(10, 40, 50, "usage")
    assert from_responses_usage({"input_tokens": 50}) == cost(None, None, 50, "usage")
    assert from_responses_usage({"prompt_tokens": 50}) is None  # not this API's name
    for bad in HOSTILE:
        assert from_responses_usage({"input_tokens": bad, "input_tokens_details": bad}) is None


def test_anthropic_usage() -> None:
    # llama-server's: input_tokens is what it computed, the cache read what it reused.
    assert from_anthropic_usage({"input_tokens": 7, "cache_read_input_tokens": 93}) == cost(
        7, 93, 100, "usage"
    )
    both = {"input_tokens": 5, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 75}
    assert from_anthropic_usage(both) == cost(25, 75, 100, "usage")
    # Without a cache read the reuse is unknown: the whole only.
    assert from_anthropic_usage({"input_tokens": 9, "output_tokens": 3}) == cost(
        None, None, 9, "usage"
    )
    assert from_anthropic_usage({"cache_read_input_tokens": 4}) == cost(None, 4, None, "usage")
    for bad in HOSTILE:
        keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        assert from_anthropic_usage(dict.fromkeys(keys, bad)) is None
        assert from_anthropic_usage(bad) is None


def test_ollama_counts() -> None:
    final = {"done": True, "prompt_eval_count": 200, "prompt_eval_cached_count": 180}
    assert from_ollama(final) == cost(20, 180, 200, "prompt_eval_count")
    assert from_ollama({"prompt_eval_count": 200}) == cost(None, None, 200, "prompt_eval_count")
    assert from_ollama({"done": True}) is None
    for bad in HOSTILE:
        assert from_ollama({"prompt_eval_count": bad, "prompt_eval_cached_count": bad}) is None
        assert from_ollama(bad) is None


def test_the_usage_wins_where_it_tells_the_split_else_the_timings() -> None:
    timings = {"prompt_n": 2, "cache_n": 8}
    split = {"prompt_tokens": 30, "prompt_tokens_details": {"cached_tokens": 20}}
    assert chat_cost(split, timings) == cost(10, 20, 30, "usage")  # summed over round trips
    assert chat_cost({"prompt_tokens": 10}, timings) == cost(2, 8, 10, "timings")
    assert chat_cost({"prompt_tokens": 10}, None) == cost(None, None, 10, "usage")
    assert chat_cost(None, None) is None
    assert pick(None, None) is None


def test_described_for_the_inspector() -> None:
    assert describe(None) == "not reported by the upstream"
    assert describe(cost(12, 300, 312, "timings")) == (
        "computed 12 prompt tokens, reused 300 from its cache (96.2 %) (from its timings)"
    )
    assert describe(cost(0, 0, 0, "usage")).startswith("computed 0 prompt tokens, reused 0 from")
    assert "320 prompt tokens; what it reused" in describe(cost(None, None, 320, "usage"))
    assert "computed 5 prompt tokens; what it reused" in describe(cost(5, None, None, "timings"))
    assert "reused 4 prompt tokens from its cache; what it computed" in describe(
        cost(None, 4, None, "usage")
    )


# --- each API's reader, streamed and whole ------------------------------------------------------


def read(reader: ReplyReader, chunks: list[bytes], step: int = 7) -> AssembledReply:
    """The reply, its bytes fed in pieces of ``step``."""
    raw = b"".join(chunks)
    for i in range(0, len(raw), step):
        reader.feed(raw[i : i + step])
    return reader.finish(True)


TIMINGS = {"cache_n": 300, "prompt_n": 12, "prompt_ms": 3.0, "predicted_n": 4}


def test_chat_completions_streamed_timings_in_the_last_chunk() -> None:
    events = on_last_chunk(chat_chunks(["Hel", "lo"]), {"timings": TIMINGS})
    reply = read(OpenAIChat().reader(True), events)
    assert reply.content == "Hello" and reply.cost == cost(12, 300, 312, "timings")
    # With the usage chunk asked for, llama-server's usage says the same.
    usage = {"prompt_tokens": 312, "prompt_tokens_details": {"cached_tokens": 300}}
    events = on_last_chunk(chat_chunks(["Hi"], usage=usage), {"timings": TIMINGS})
    assert read(OpenAIChat().reader(True), events).cost == cost(12, 300, 312, "usage")
    # Per-token timings (timings_per_token): the last one counts; a null never overwrites.
    events = chat_chunks(["a", "b"], extra_fields={"timings": {"prompt_n": 1, "cache_n": 1}})
    events = on_last_chunk(events, {"timings": TIMINGS})
    events.insert(-1, sse({"choices": [], "timings": None}))
    assert read(OpenAIChat().reader(True), events).cost == cost(12, 300, 312, "timings")


def test_chat_completions_whole_body() -> None:
    body = {**chat_completion("hi", usage={"prompt_tokens": 312}), "timings": TIMINGS}
    reply = read(OpenAIChat().reader(False), [json.dumps(body).encode()])
    assert reply.cost == cost(12, 300, 312, "timings")
    plain = chat_completion("hi", usage={"prompt_tokens": 9, "completion_tokens": 1})
    assert read(OpenAIChat().reader(False), [json.dumps(plain).encode()]).cost == cost(
        None, None, 9, "usage"
    )


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_fields_are_ignored_by_every_reader(bad: Any) -> None:
    chat = {**chat_completion("hi", usage={"prompt_tokens": bad}), "timings": {"prompt_n": bad}}
    assert read(OpenAIChat().reader(False), [json.dumps(chat).encode()]).cost is None
    chunks = on_last_chunk(chat_chunks(["hi"]), {"timings": bad, "usage": bad})
    assert read(OpenAIChat().reader(True), chunks).cost is None
    message = {"type": "message", "content": [], "usage": {"input_tokens": bad}}
    assert read(AnthropicMessages().reader(False), [json.dumps(message).encode()]).cost is None
    resp = {"object": "response", "status": "completed", "output": [], "usage": bad}
    assert read(OpenAIResponses().reader(False), [json.dumps(resp).encode()]).cost is None
    final = {"done": True, "message": {"content": ""}, "prompt_eval_count": bad}
    assert read(OllamaChat().reader(False), [json.dumps(final).encode()]).cost is None


def test_hostile_bodies_never_raise() -> None:
    for api in (OpenAIChat(), AnthropicMessages(), OpenAIResponses(), OllamaChat()):
        for sse_ in (True, False):
            for raw in (b"", b"\x00\xff", b"data: {\n\n", b"[1, 2]", b'data: {"usage": 5}\n\n'):
                assert read(api.reader(sse_), [raw]).cost is None


def anthropic_event(name: str, data: dict[str, Any]) -> bytes:
    return sse({"type": name, **data}, event=name)


def test_anthropic_streamed_and_whole() -> None:
    usage = {"input_tokens": 7, "cache_read_input_tokens": 93, "output_tokens": 0}
    start = {"id": "msg_1", "type": "message", "content": [], "usage": usage}
    events = [
        anthropic_event("message_start", {"message": start}),
        anthropic_event("content_block_start", {"index": 0, "content_block": {"type": "text"}}),
        anthropic_event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}
        ),
        anthropic_event(
            "message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}}
        ),
        anthropic_event("message_stop", {}),
    ]
    reply = read(AnthropicMessages().reader(True), events)
    assert reply.content == "hi" and reply.cost == cost(7, 93, 100, "usage")
    assert reply.usage is not None and reply.usage["prompt_tokens"] == 100  # unchanged
    whole = {"type": "message", "content": [{"type": "text", "text": "hi"}], "usage": usage}
    assert read(AnthropicMessages().reader(False), [json.dumps(whole).encode()]).cost == cost(
        7, 93, 100, "usage"
    )


def test_responses_streamed_and_whole() -> None:
    usage = {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 40}}
    done = {"id": "r", "object": "response", "status": "completed", "output": [], "usage": usage}
    created = {**done, "status": "in_progress", "usage": None}
    events = [
        sse({"type": "response.created", "response": created}, event="response.created"),
        sse({"type": "response.completed", "response": done}, event="response.completed"),
    ]
    assert read(OpenAIResponses().reader(True), events).cost == cost(10, 40, 50, "usage")
    # llama-server's stream: the timings beside the terminal event's response.
    bare = {**done, "usage": {"input_tokens": 50}}
    events[-1] = sse({"type": "response.completed", "response": bare, "timings": TIMINGS})
    assert read(OpenAIResponses().reader(True), events).cost == cost(12, 300, 312, "timings")
    assert read(OpenAIResponses().reader(False), [json.dumps(done).encode()]).cost == cost(
        10, 40, 50, "usage"
    )


def test_ollama_streamed_and_whole() -> None:
    lines = [
        {"message": {"role": "assistant", "content": "hi"}, "done": False},
        {
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "prompt_eval_count": 200,
            "prompt_eval_cached_count": 180,
            "eval_count": 1,
        },
    ]
    ndjson = [json.dumps(x).encode() + b"\n" for x in lines]
    want = cost(20, 180, 200, "prompt_eval_count")
    assert read(OllamaChat().reader(False), ndjson).cost == want
    whole = {**lines[1], "message": {"role": "assistant", "content": "hi"}}
    assert read(OllamaChat().reader(False), [json.dumps(whole).encode()]).cost == want


# --- beneath a translation ----------------------------------------------------------------------


class Upper:
    """A stand-in translator: the client gets the upstream's bytes upper-cased."""

    content_type = "text/plain"

    def __init__(self) -> None:
        self.seen = b""

    def feed(self, chunk: bytes) -> bytes:
        self.seen += chunk
        return chunk.upper()

    def finish(self) -> bytes:
        return b"<END>"


def tapped(tap: CostTap, raw: bytes, step: int = 5) -> bytes:
    out = b"".join(tap.feed(raw[i : i + step]) for i in range(0, len(raw), step))
    return out + tap.finish()


def test_the_tap_reads_the_upstreams_own_report_and_changes_nothing() -> None:
    raw = b"".join(on_last_chunk(chat_chunks(["a", "b"]), {"timings": TIMINGS}))
    inner = Upper()
    tap = CostTap(inner, event_stream=True)
    assert tap.content_type == "text/plain"
    assert tapped(tap, raw) == raw.upper() + b"<END>" and inner.seen == raw
    assert tap.cost == cost(12, 300, 312, "timings")
    body = json.dumps({**chat_completion("hi", usage={"prompt_tokens": 312}), "timings": TIMINGS})
    whole = CostTap(Upper(), event_stream=False)
    assert tapped(whole, body.encode()) == body.upper().encode() + b"<END>"
    assert whole.cost == cost(12, 300, 312, "timings")
    for junk in (b"", b"data: nope\n\n", b'{"usage": "x"', b'{"timings": [1]}', b"\xff\xfe"):
        for stream in (True, False):
            t = CostTap(Upper(), event_stream=stream)
            tapped(t, junk)
            assert t.cost is None


# --- the recent requests ------------------------------------------------------------------------


def test_the_recent_share_counts_only_requests_that_told_the_split() -> None:
    recent = RecentRequests(1 << 20)
    assert recent.reuse() == (0, 0, 0)
    recent.reported("a", cost(10, 90, 100, "timings"))
    recent.reported("b", cost(None, None, 50, "usage"))
    recent.reported("c", None)
    recent.reported("d", cost(30, 70, 100, "usage"))
    assert recent.reuse() == (2, 40, 160)


# --- the fake upstream's cache ------------------------------------------------------------------


def test_the_fake_cache_reuses_the_shared_prefix_never_the_last_token() -> None:
    kv = KVCache()
    first = rendered([{"role": "user", "content": "hello there, how are you"}])
    assert kv.use(first, 10) == (10, 0)
    second = rendered(
        [
            {"role": "user", "content": "hello there, how are you"},
            {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "good"},
        ]
    )
    computed, reused = kv.use(second, 20)
    assert reused == len(first) // 4 and computed == 20 - reused
    assert kv.use(second, 20) == (1, 19)  # the same prompt again: all but the last token
    assert kv.use(rendered([{"role": "system", "content": "new"}]), 5)[1] == 0
