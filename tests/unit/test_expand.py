"""The pure half of the expansion loop: when the tool is offered, how replies are filtered."""

from __future__ import annotations

import json
from typing import Any

from proxy.slots.expand import (
    StreamRound,
    add_usage,
    answer_text,
    can_add_tool,
    final_completion,
    requested_slot,
    round_trip_messages,
    with_tool,
)
from proxy.slots.model import Slot
from testing.fake_chunks import chat_chunks, chat_completion

TOOL = "engram_expand"


def chunks(**kw: Any) -> list[dict[str, Any]]:
    out = []
    for raw in chat_chunks(**kw):
        data = raw.decode().removeprefix("data: ").strip()
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


def call(
    name: str, cid: str, args: str = '{"slot_id": "read_file-0123456789ab"}'
) -> dict[str, Any]:
    return {"id": cid, "name": name, "arguments": args}


def test_when_the_tool_is_offered() -> None:
    assert can_add_tool({"messages": []}, TOOL)
    assert can_add_tool({"tool_choice": "auto", "tools": []}, TOOL)
    assert not can_add_tool({"tool_choice": "none"}, TOOL)
    assert not can_add_tool({"tool_choice": "required"}, TOOL)
    assert can_add_tool({"tool_choice": "required", "tools": [{"type": "function"}]}, TOOL)
    named = {"type": "function", "function": {"name": "x"}}
    assert not can_add_tool({"tool_choice": named, "tools": [named]}, TOOL)
    assert not can_add_tool({"functions": []}, TOOL)
    assert not can_add_tool({"n": 2}, TOOL)
    assert not can_add_tool({"tools": "bad"}, TOOL)
    own = {"type": "function", "function": {"name": TOOL}}
    assert not can_add_tool({"tools": [own]}, TOOL)
    body = {"tools": [named], "x": None}
    added = with_tool(body, TOOL)
    assert added["tools"][0] is named and added["tools"][1]["function"]["name"] == TOOL
    assert added["x"] is None and body["tools"] == [named]


def test_requested_slot_tolerates_forms_models_produce() -> None:
    assert requested_slot('{"slot_id": "read_file-0123456789ab"}') == "read_file-0123456789ab"
    assert requested_slot('{"slot_id": "[TOOL_RESULT:x-1]"}') == "x-1"
    assert requested_slot({"id": "a.b-c"}) == "a.b-c"
    assert requested_slot("{}") is None
    assert requested_slot('{"slot_id": "no spaces allowed"}') is None
    assert requested_slot("x-1") == "x-1"  # a bare id as the arguments
    assert requested_slot("not an id at all") is None


def test_answer_text_cuts_to_the_room_and_explains_misses() -> None:
    slot = Slot("t-1", "t", "x" * 4000, 1000, "d")
    assert answer_text("t-1", slot, None, TOOL) == "x" * 4000
    cut = answer_text("t-1", slot, 250, TOOL)
    assert cut.startswith("x" * 1000) and "about 250 of 1000 tokens" in cut
    assert "expired or is unknown" in answer_text("t-2", None, None, TOOL)
    assert "needs a slot_id" in answer_text(None, None, None, TOOL)


def test_usage_is_summed_deeply() -> None:
    a = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached": 4}}
    b = {"prompt_tokens": 30, "completion_tokens": 5, "prompt_tokens_details": {"cached": 6}}
    total = add_usage(add_usage(None, a), b)
    assert total == {
        "prompt_tokens": 40,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached": 10},
    }
    assert a["prompt_tokens"] == 10  # inputs untouched
    assert add_usage(total, None) is total


def test_round_trip_messages_pair_every_call() -> None:
    calls = [{"id": "", "function": {"name": TOOL, "arguments": "{}"}}]
    msgs = round_trip_messages("", calls, ["content"])
    cid = msgs[0]["tool_calls"][0]["id"]
    assert len(cid) == 9 and cid.isalnum() and msgs[0]["content"] is None
    assert msgs[1] == {"role": "tool", "tool_call_id": cid, "content": "content"}


def test_final_completion_drops_internal_calls() -> None:
    both = chat_completion("hm", tool_calls=[call(TOOL, "a"), call("run", "b")])
    out = final_completion(both, TOOL, {"total_tokens": 3}, "first")
    msg = out["choices"][0]["message"]
    assert [c["id"] for c in msg["tool_calls"]] == ["b"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["id"] == "first" and out["usage"] == {"total_tokens": 3}
    only = final_completion(chat_completion("", tool_calls=[call(TOOL, "a")]), TOOL, None, None)
    assert "tool_calls" not in only["choices"][0]["message"]
    assert only["choices"][0]["finish_reason"] == "stop"


def feed(rnd: StreamRound, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [out for c in items if (out := rnd.feed(c)) is not None]


def test_stream_round_holds_internal_calls_and_the_round_trip_ending() -> None:
    rnd = StreamRound(TOOL, may_round_trip=True)
    source = chunks(
        content_parts=["Checking."],
        tool_calls=[call(TOOL, "a")],
        usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    )
    out = feed(rnd, source)
    text = json.dumps(out)
    assert TOOL not in text and '"finish_reason": "tool_calls"' not in text
    assert "Checking." in text
    assert rnd.round_trip and rnd.usage == {
        "prompt_tokens": 5,
        "completion_tokens": 1,
        "total_tokens": 6,
    }
    [internal] = rnd.calls()
    assert internal["id"] == "a" and json.loads(internal["function"]["arguments"])["slot_id"]
    assert "".join(rnd.content) == "Checking."


def test_stream_round_with_client_calls_renumbers_them_and_ends_normally() -> None:
    rnd = StreamRound(TOOL, may_round_trip=True)
    source = chunks(content_parts=[], tool_calls=[call(TOOL, "a"), call("run", "b", "{}")])
    out = feed(rnd, source)
    deltas = [c["choices"][0] for c in out if c["choices"]]
    indexes = [tc["index"] for d in deltas for tc in d.get("delta", {}).get("tool_calls", [])]
    assert indexes and set(indexes) == {0}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not rnd.round_trip


def test_stream_round_at_the_limit_turns_a_lone_internal_call_into_a_stop() -> None:
    rnd = StreamRound(TOOL, may_round_trip=False)
    out = feed(rnd, chunks(content_parts=["x"], tool_calls=[call(TOOL, "a")]))
    assert not rnd.round_trip
    assert out[-1]["choices"][0]["finish_reason"] == "stop"
    assert TOOL not in json.dumps(out)


def test_stream_round_leaves_plain_chunks_untouched() -> None:
    rnd = StreamRound(TOOL, may_round_trip=True)
    source = chunks(content_parts=["a", "b"])
    out = feed(rnd, source)
    assert all(o is s for o, s in zip(out, source, strict=True))
    # A later round's chunks carry the id the client saw first.
    later = StreamRound(TOOL, may_round_trip=True, first_id="first")
    assert {c["id"] for c in feed(later, chunks(content_parts=["c"]))} == {"first"}
