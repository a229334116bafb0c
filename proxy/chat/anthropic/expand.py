"""Anthropic Messages' expansion dialect (:mod:`proxy.slots.dialect`): Engram's tool offered as
an Anthropic tool (``name``, ``description``, ``input_schema``), the model's ``tool_use`` blocks
calling it answered in a follow-up request (the assistant turn with the ``tool_use`` blocks, then
a user turn with one ``tool_result`` block each), and the reply the client gets without them.

``tool_choice`` ``{"type": "none"}`` or ``{"type": "tool"}`` (or ``"any"`` without tools of the
client's own), or a client tool of the same name, keep the tool out. In a stream the internal
``tool_use`` blocks' events are dropped and the client's blocks renumbered to stay contiguous;
the first round's ``message_start`` is the only one the client sees, every later round's is
dropped; the ``message_delta`` (stop reason, usage) and ``message_stop`` are held to the end,
the stop reason ``tool_use`` becomes ``end_turn`` when the only calls were Engram's, and the
usage is summed over the rounds (``input_tokens`` and ``output_tokens`` in the last
``message_delta``, as the API's own deltas may carry them). Client calls win as in chat
completions (:mod:`proxy.slots.expand`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from proxy.chat.api import ReplyReader
from proxy.relay import encode_json
from proxy.slots.dialect import SSEFraming, StreamRound, with_tool_appended, with_tools_of
from proxy.slots.expand import DESCRIPTION, call_id
from proxy.sse import SSEEvent

_USAGE_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


def tool_definition(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": DESCRIPTION,
        "input_schema": {
            "type": "object",
            "properties": {
                "slot_id": {
                    "type": "string",
                    "description": "The id inside [TOOL_RESULT:...], e.g. read_file-0a1b2c3d4e5f",
                }
            },
            "required": ["slot_id"],
        },
    }


class AnthropicDialect(SSEFraming):
    """The expansion loop's view of ``/v1/messages`` (``reader``: the adapter's)."""

    def __init__(self, reader: Callable[[bool], ReplyReader]) -> None:
        self.reader = reader

    def can_add_tool(self, body: Mapping[str, Any], name: str) -> bool:
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return False
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else choice
        if kind not in (None, "auto") and not (kind == "any" and tools):
            return False
        return not any(isinstance(t, dict) and t.get("name") == name for t in tools or [])

    def with_tool(self, body: Mapping[str, Any], name: str) -> dict[str, Any]:
        return with_tool_appended(body, tool_definition(name))

    def last_body(self, body: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
        return with_tools_of(body, base)

    def plain_calls(
        self, reply: Mapping[str, Any], name: str
    ) -> tuple[list[dict[str, Any]], bool, str | None]:
        blocks = _blocks(reply)
        uses = [b for b in blocks if b.get("type") == "tool_use"]
        internal = [b for b in uses if b.get("name") == name]
        texts = [b["text"] for b in blocks if b.get("type") == "text" and _is_str(b.get("text"))]
        return internal, len(internal) < len(uses), "\n".join(texts) or None

    def call_arguments(self, call: Mapping[str, Any]) -> Any:
        return call.get("input")

    def follow_up(
        self,
        body: dict[str, Any],
        text: str | None,
        calls: list[dict[str, Any]],
        answers: list[str],
    ) -> dict[str, Any]:
        uses: list[dict[str, Any]] = [
            {
                "type": "tool_use",
                "id": c.get("id") or call_id(),
                "name": c.get("name"),
                "input": c.get("input") if isinstance(c.get("input"), dict) else {},
            }
            for c in calls
        ]
        said = [{"type": "text", "text": text}] if text else []
        results = [
            {"type": "tool_result", "tool_use_id": u["id"], "content": answer}
            for u, answer in zip(uses, answers, strict=True)
        ]
        turn = [
            {"role": "assistant", "content": [*said, *uses]},
            {"role": "user", "content": results},
        ]
        return {**body, "messages": [*body["messages"], *turn]}

    def final(
        self,
        reply: dict[str, Any],
        name: str,
        usage: dict[str, Any] | None,
        first_id: str | None,
    ) -> dict[str, Any]:
        out = dict(reply)
        if first_id:
            out["id"] = first_id
        if usage is not None:
            out["usage"] = usage
        blocks = _blocks(reply)
        kept = [b for b in blocks if not (b.get("type") == "tool_use" and b.get("name") == name)]
        if len(kept) < len(blocks):
            out["content"] = kept
            if reply.get("stop_reason") == "tool_use" and not any(
                b.get("type") == "tool_use" for b in kept
            ):
                out["stop_reason"] = "end_turn"
        return out

    def usage(self, reply: Mapping[str, Any]) -> Any:
        return reply.get("usage")

    def stream_round(
        self, name: str, may_round_trip: bool, previous: StreamRound | None
    ) -> StreamRound:
        before = previous if isinstance(previous, EventRound) else None
        return EventRound(name, may_round_trip, before)


class EventRound:
    """One streamed round of Messages events on its way to the client."""

    def __init__(self, name: str, may_round_trip: bool, previous: EventRound | None) -> None:
        self.name = name
        self.may_round_trip = may_round_trip
        self.started: bool = previous.started if previous else False  # message_start went out
        self.next_index: int = previous.next_index if previous else 0  # the client's next block
        self._first_id = previous.first_id if previous else None
        self._usage: dict[str, Any] | None = None
        self._round_trip = False
        self.index: dict[Any, int] = {}  # upstream block index -> the client's
        self.internal: dict[Any, dict[str, Any]] = {}  # upstream block index -> the call
        self.texts: dict[Any, list[str]] = {}
        self.client_calls = False
        self.stop_reason: str | None = None
        self.held: dict[str, Any] | None = None  # the message_delta
        self.held_raw: bytes | None = None
        self.stopped: bytes | None = None  # the message_stop

    @property
    def first_id(self) -> str | None:
        return self._first_id

    @property
    def round_trip(self) -> bool:
        return self._round_trip

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._usage

    def feed(self, event: SSEEvent) -> bytes | None:
        raw = _raw(event)
        try:
            data = json.loads(event.data)
        except (ValueError, RecursionError):
            return raw
        if not isinstance(data, dict):
            return raw
        kind = data.get("type", event.event)
        if kind == "message_start":
            msg: dict[str, Any] = data["message"] if isinstance(data.get("message"), dict) else {}
            if isinstance(msg.get("usage"), dict):
                self._usage = dict(msg["usage"])
            if self.started:
                return None  # the client has its message_start: later rounds continue it
            self.started = True
            self._first_id = msg.get("id") if _is_str(msg.get("id")) else None
            return raw
        if kind in ("content_block_start", "content_block_delta", "content_block_stop"):
            return self._block(kind, data, event, raw)
        if kind == "message_delta":
            self._delta(data)
            self.held, self.held_raw = data, raw
            return None
        if kind == "message_stop":
            self.stopped = raw
            return None
        return None if self._round_trip else raw  # ping, error

    def _block(self, kind: str, data: dict[str, Any], event: SSEEvent, raw: bytes) -> bytes | None:
        at = data.get("index")
        if kind == "content_block_start":
            block = data.get("content_block")
            block = block if isinstance(block, dict) else {}
            if block.get("type") == "tool_use" and block.get("name") == self.name:
                start = block.get("input")
                self.internal[at] = {**block, "input": start if isinstance(start, dict) else {}}
                self.internal[at]["_json"] = []
                return None
            self.client_calls = self.client_calls or block.get("type") == "tool_use"
            if block.get("type") == "text":
                self.texts[at] = [block["text"]] if _is_str(block.get("text")) else []
            self.index[at] = self.next_index
            self.next_index += 1
        elif at in self.internal:
            delta = data.get("delta")
            if isinstance(delta, dict) and _is_str(delta.get("partial_json")):
                self.internal[at]["_json"].append(delta["partial_json"])
            return None
        elif kind == "content_block_delta" and at in self.texts:
            delta = data.get("delta")
            if isinstance(delta, dict) and _is_str(delta.get("text")):
                self.texts[at].append(delta["text"])
        mine = self.index.get(at, at)
        if mine == at:
            return raw
        return _event(event.event, {**data, "index": mine})

    def _delta(self, data: dict[str, Any]) -> None:
        delta = data.get("delta")
        if isinstance(delta, dict) and _is_str(delta.get("stop_reason")):
            self.stop_reason = delta["stop_reason"]
        usage = data.get("usage")
        if isinstance(usage, dict):
            base = self._usage or {}
            self._usage = {**base, **{k: v for k, v in usage.items() if v is not None}}
        if self.internal and not self.client_calls and self.may_round_trip:
            self._round_trip = True

    def calls(self) -> list[dict[str, Any]]:
        out = []
        for at in sorted(self.internal, key=lambda i: i if isinstance(i, int) else 0):
            call = {k: v for k, v in self.internal[at].items() if k != "_json"}
            parts = self.internal[at]["_json"]
            if parts:
                try:
                    call["input"] = json.loads("".join(parts))
                except (ValueError, RecursionError):
                    call["input"] = {}
            out.append(call)
        return out

    def text(self) -> str | None:
        return "\n".join("".join(t) for t in self.texts.values() if t) or None

    def tail(self, total: dict[str, Any] | None) -> bytes:
        out: list[bytes] = []
        if self.held is not None and self.held_raw is not None:
            data: dict[str, Any] = self.held
            if self.internal and not self.client_calls and self.stop_reason == "tool_use":
                delta: dict[str, Any] = data["delta"] if isinstance(data.get("delta"), dict) else {}
                data = {**data, "delta": {**delta, "stop_reason": "end_turn"}}
            if total is not None and total != self._usage:  # more than one round: summed
                usage = dict(data.get("usage") or {})
                usage.update({k: total[k] for k in _USAGE_KEYS if isinstance(total.get(k), int)})
                data = {**data, "usage": usage}
            out.append(self.held_raw if data is self.held else _event("message_delta", data))
        if self.stopped is not None:
            out.append(self.stopped)
        return b"".join(out)


def _blocks(reply: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = reply.get("content")
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _is_str(value: Any) -> TypeGuard[str]:
    return isinstance(value, str)


def _raw(event: SSEEvent) -> bytes:
    name = f"event: {event.event}\n" if event.event is not None else ""
    data = "\n".join(f"data: {line}" for line in event.data.split("\n"))
    return f"{name}{data}\n\n".encode()


def _event(name: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {name}\n".encode() if name is not None else b""
    return head + b"data: " + encode_json(data) + b"\n\n"
