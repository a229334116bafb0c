"""Ollama's NDJSON framing for the expansion loop (pure): lines as events however the bytes are
split, and a streamed round that drops the internal calls and holds the ``done`` line."""

from __future__ import annotations

import json

from proxy.chat.ollama.expand import LineRound, NdjsonParser
from testing.fake_ollama import ndjson, reply_lines, tool_call


def test_lines_are_events_however_the_bytes_are_split() -> None:
    data = b"".join(ndjson(reply_lines("one two three", eval_count=3)))
    for size in (1, 2, 7, len(data)):
        parser = NdjsonParser()
        events = []
        for i in range(0, len(data), size):
            events += parser.feed(data[i : i + size])
        events += parser.close()
        assert [json.loads(e.data) for e in events] == reply_lines("one two three", eval_count=3)
    parser = NdjsonParser()
    assert [e.data for e in parser.feed(b'{"done": false}\r\n\n{"done": tr')] == ['{"done": false}']
    assert [e.data for e in parser.close()] == ['{"done": tr']  # a cut line goes on as it came
    assert parser.close() == []


def test_a_round_drops_internal_calls_and_holds_the_done_line() -> None:
    lines = reply_lines("Hm.", tool_calls=[tool_call("engram_expand", slot_id="x")], eval_count=2)
    rnd = LineRound("engram_expand", may_round_trip=True)
    parser = NdjsonParser()
    out = [rnd.feed(e) for e in parser.feed(b"".join(ndjson(lines)))]
    assert out[-1] is None and out[-2] is None  # the call's line, the done line
    assert (
        rnd.round_trip
        and rnd.text() == "Hm."
        and rnd.usage
        == {
            "prompt_eval_count": 1,
            "eval_count": 2,
            "total_duration": 1000,
        }
    )
    assert rnd.calls() == [tool_call("engram_expand", slot_id="x")]
    last = LineRound("engram_expand", may_round_trip=False)
    for e in parser.feed(b"".join(ndjson(lines))):
        last.feed(e)
    assert not last.round_trip
    tail = json.loads(last.tail({"prompt_eval_count": 5, "eval_count": 4}))
    assert (tail["done_reason"], tail["prompt_eval_count"], tail["eval_count"]) == ("stop", 5, 4)
