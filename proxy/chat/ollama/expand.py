"""Ollama ``/api/chat``'s expansion dialect (:mod:`proxy.slots.dialect`): Engram's tool offered
as an Ollama tool (``{"type": "function", "function": {"name", "description", "parameters"}}``),
the model's ``message.tool_calls`` calling it (arguments an object, no ids) answered in a
follow-up request (the assistant message with the calls, then one ``{"role": "tool", "content",
"tool_name"}`` message each), and the reply the client gets without them.

A client tool of the same name keeps the tool out (Ollama has no ``tool_choice``). Streams are
NDJSON: :class:`NdjsonParser` hands the loop each line as an event whose ``data`` is the line.
In a stream the internal calls are taken out of the lines that carry them (a line left with
nothing for the client is dropped); every round's ``done`` line is held, and only the last
round's reaches the client, with ``done_reason`` ``"stop"`` when the only calls were Engram's
and ``prompt_eval_count``/``eval_count`` (and the durations) summed over the rounds. Client calls
win as in chat completions (:mod:`proxy.slots.expand`). No progress bytes go out during a round
trip: NDJSON has no comments, and the ``ollama`` client parses every line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from proxy.chat.api import ReplyReader
from proxy.relay import encode_json
from proxy.slots.dialect import StreamRound, with_tool_appended, with_tools_of
from proxy.slots.expand import tool_definition  # Ollama's tool shape is OpenAI's
from proxy.sse import SSEEvent

NDJSON_TYPES = ("application/x-ndjson", "application/ndjson")
# The counts and durations of a ``done`` object, summed over the rounds.
_USAGE_KEYS = (
    "prompt_eval_count",
    "eval_count",
    "total_duration",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
)


class NdjsonParser:
    """NDJSON bytes as events: one per non-empty line, ``data`` the line (without its newline)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        if b"\n" not in chunk:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [_line_event(line) for line in lines if line.strip()]

    def close(self) -> list[SSEEvent]:
        rest, self._buf = self._buf, b""
        return [_line_event(rest)] if rest.strip() else []


def _line_event(line: bytes) -> SSEEvent:
    return SSEEvent(data=line.rstrip(b"\r").decode("utf-8", "surrogateescape"))


def _fn_name(call: Any) -> str | None:
    fn = call.get("function") if isinstance(call, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else None


def _calls(message: Any) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def _usage(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    out = {
        k: obj[k]
        for k in _USAGE_KEYS
        if isinstance(obj.get(k), int) and not isinstance(obj.get(k), bool)
    }
    return out or None


def _summed(obj: dict[str, Any], total: Mapping[str, Any] | None) -> dict[str, Any]:
    if total is None:
        return obj
    return {**obj, **{k: total[k] for k in _USAGE_KEYS if isinstance(total.get(k), int)}}


class OllamaDialect:
    """The expansion loop's view of ``/api/chat`` (``reader``: the adapter's)."""

    progress = b""  # NDJSON has no comments

    def __init__(self, reader: Callable[[bool], ReplyReader]) -> None:
        self.reader = reader

    def streams(self, content_type: str) -> bool:
        return content_type in NDJSON_TYPES

    def parser(self) -> NdjsonParser:
        return NdjsonParser()

    def can_add_tool(self, body: Mapping[str, Any], name: str) -> bool:
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return False
        return not any(_fn_name(t) == name for t in tools or [])

    def with_tool(self, body: Mapping[str, Any], name: str) -> dict[str, Any]:
        return with_tool_appended(body, tool_definition(name))

    def last_body(self, body: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
        return with_tools_of(body, base)

    def plain_calls(
        self, reply: Mapping[str, Any], name: str
    ) -> tuple[list[dict[str, Any]], bool, str | None]:
        message = reply.get("message")
        calls = _calls(message)
        internal = [c for c in calls if _fn_name(c) == name]
        text = message.get("content") if isinstance(message, Mapping) else None
        return internal, len(internal) < len(calls), text if isinstance(text, str) else None

    def call_arguments(self, call: Mapping[str, Any]) -> Any:
        fn = call.get("function")
        return fn.get("arguments") if isinstance(fn, Mapping) else None

    def follow_up(
        self,
        body: dict[str, Any],
        text: str | None,
        calls: list[dict[str, Any]],
        answers: list[str],
    ) -> dict[str, Any]:
        made = []
        for call in calls:
            args = self.call_arguments(call)
            name = _fn_name(call) or ""
            made.append(
                {"function": {"name": name, "arguments": args if isinstance(args, dict) else {}}}
            )
        turn: list[dict[str, Any]] = [
            {"role": "assistant", "content": text or "", "tool_calls": made}
        ]
        turn += [
            {"role": "tool", "content": answer, "tool_name": call["function"]["name"]}
            for call, answer in zip(made, answers, strict=True)
        ]
        return {**body, "messages": [*body["messages"], *turn]}

    def final(
        self,
        reply: dict[str, Any],
        name: str,
        usage: dict[str, Any] | None,
        first_id: str | None,
    ) -> dict[str, Any]:
        out = _summed(dict(reply), usage)
        message = reply.get("message")
        calls = _calls(message)
        kept = [c for c in calls if _fn_name(c) != name]
        if isinstance(message, dict) and len(kept) < len(calls):
            fixed = {k: v for k, v in message.items() if k != "tool_calls"}
            if kept:
                fixed["tool_calls"] = kept
            else:
                out["done_reason"] = "stop"
            out["message"] = fixed
        return out

    def usage(self, reply: Mapping[str, Any]) -> Any:
        return _usage(reply)

    def stream_round(
        self, name: str, may_round_trip: bool, previous: StreamRound | None
    ) -> StreamRound:
        return LineRound(name, may_round_trip)


class LineRound:
    """One streamed round of NDJSON lines on its way to the client."""

    def __init__(self, name: str, may_round_trip: bool) -> None:
        self.name = name
        self.may_round_trip = may_round_trip
        self._usage: dict[str, Any] | None = None
        self._round_trip = False
        self.internal: list[dict[str, Any]] = []
        self.texts: list[str] = []
        self.client_calls = False
        self.held: dict[str, Any] | None = None  # the done line
        self.held_raw = b""

    @property
    def first_id(self) -> str | None:
        return None  # Ollama's replies have no id

    @property
    def round_trip(self) -> bool:
        return self._round_trip

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._usage

    def feed(self, event: SSEEvent) -> bytes | None:
        raw = event.data.encode("utf-8", "surrogateescape") + b"\n"
        try:
            obj = json.loads(event.data)
        except (ValueError, RecursionError):
            return raw
        if not isinstance(obj, dict) or "error" in obj:
            return raw
        if obj.get("done") is True:
            self._usage = _usage(obj)
            self.held, self.held_raw = obj, raw
            if self.internal and not self.client_calls and self.may_round_trip:
                self._round_trip = True
            return None
        message = obj.get("message")
        if not isinstance(message, dict):
            return raw
        if isinstance(message.get("content"), str) and message["content"]:
            self.texts.append(message["content"])
        calls = _calls(message)
        internal = [c for c in calls if _fn_name(c) == self.name]
        self.client_calls = self.client_calls or len(internal) < len(calls)
        if not internal:
            return raw
        self.internal += internal
        kept = [c for c in calls if _fn_name(c) != self.name]
        fixed = {k: v for k, v in message.items() if k != "tool_calls"}
        if kept:
            fixed["tool_calls"] = kept
        elif not fixed.get("content") and not fixed.get("thinking"):
            return None  # nothing left for the client
        return encode_json({**obj, "message": fixed}) + b"\n"

    def calls(self) -> list[dict[str, Any]]:
        return list(self.internal)

    def text(self) -> str | None:
        return "".join(self.texts) or None

    def tail(self, total: dict[str, Any] | None) -> bytes:
        if self.held is None:
            return b""
        out = self.held
        if self.internal and not self.client_calls:
            out = {**out, "done_reason": "stop"}
        if total is not None and total != self._usage:  # more than one round: summed
            out = _summed(out, total)
        return self.held_raw if out is self.held else encode_json(out) + b"\n"
