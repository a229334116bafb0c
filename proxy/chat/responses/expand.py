"""OpenAI Responses' expansion dialect (:mod:`proxy.slots.dialect`): Engram's tool offered as a
Responses function tool (``type``, ``name``, ``description``, ``parameters``), the model's
``function_call`` items calling it answered in a follow-up request (the ``input`` with the
model's text as an assistant ``message`` item, the ``function_call`` items and one
``function_call_output`` each; ``previous_response_id`` and every other field as sent), and the
reply the client gets without them.

``tool_choice`` ``"none"``, a named function or allowed-tools object (or ``"required"`` without
tools of the client's own), or a client tool of the same name, keep the tool out. In a stream the
internal items' events are dropped; the client's items keep contiguous ``output_index``es over
the rounds and every event a running ``sequence_number``; only the first round's
``response.created`` / ``response.in_progress`` reach the client; the last round's
``response.completed`` is held to the end and goes out as the whole reply the client got (the
first round's id, every round's kept items, the usage summed), which is what the SDK's
``responses.stream()`` returns as the final response. Client calls win as in chat completions
(:mod:`proxy.slots.expand`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from proxy.chat.api import ReplyReader
from proxy.relay import encode_json
from proxy.slots.dialect import SSEFraming, StreamRound, with_tool_appended, with_tools_of
from proxy.slots.expand import DESCRIPTION, call_id
from proxy.sse import SSEEvent

_ENDS = ("response.completed", "response.incomplete", "response.failed")
_HEAD = ("response.created", "response.in_progress", "response.queued")


def tool_definition(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": DESCRIPTION,
        "parameters": {
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


def _is_internal(item: Any, name: str) -> bool:
    return (
        isinstance(item, dict) and item.get("type") == "function_call" and item.get("name") == name
    )


class ResponsesDialect(SSEFraming):
    """The expansion loop's view of ``/v1/responses`` (``reader``: the adapter's)."""

    def __init__(self, reader: Callable[[bool], ReplyReader]) -> None:
        self.reader = reader

    def can_add_tool(self, body: Mapping[str, Any], name: str) -> bool:
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return False
        choice = body.get("tool_choice")
        if choice not in (None, "auto") and not (choice == "required" and tools):
            return False
        return not any(isinstance(t, dict) and t.get("name") == name for t in tools or [])

    def with_tool(self, body: Mapping[str, Any], name: str) -> dict[str, Any]:
        return with_tool_appended(body, tool_definition(name))

    def last_body(self, body: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
        return with_tools_of(body, base)

    def plain_calls(
        self, reply: Mapping[str, Any], name: str
    ) -> tuple[list[dict[str, Any]], bool, str | None]:
        items = _output(reply)
        calls = [i for i in items if i.get("type") == "function_call"]
        internal = [i for i in calls if i.get("name") == name]
        texts = [_item_text(i) for i in items if i.get("type") == "message"]
        return internal, len(internal) < len(calls), "".join(texts) or None

    def call_arguments(self, call: Mapping[str, Any]) -> Any:
        return call.get("arguments")

    def follow_up(
        self,
        body: dict[str, Any],
        text: str | None,
        calls: list[dict[str, Any]],
        answers: list[str],
    ) -> dict[str, Any]:
        given = body.get("input")
        items: list[Any] = (
            [{"type": "message", "role": "user", "content": given}]
            if isinstance(given, str)
            else list(given)
            if isinstance(given, list)
            else []
        )
        if text:
            content = [{"type": "output_text", "text": text}]
            items.append({"type": "message", "role": "assistant", "content": content})
        fixed = [
            {
                "type": "function_call",
                "call_id": c.get("call_id") or call_id(),
                "name": c.get("name"),
                "arguments": c.get("arguments") if isinstance(c.get("arguments"), str) else "{}",
            }
            for c in calls
        ]
        items += fixed
        items += [
            {"type": "function_call_output", "call_id": c["call_id"], "output": answer}
            for c, answer in zip(fixed, answers, strict=True)
        ]
        return {**body, "input": items}

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
        if isinstance(reply.get("output"), list):
            out["output"] = [i for i in reply["output"] if not _is_internal(i, name)]
        return out

    def usage(self, reply: Mapping[str, Any]) -> Any:
        return reply.get("usage")

    def stream_round(
        self, name: str, may_round_trip: bool, previous: StreamRound | None
    ) -> StreamRound:
        before = previous if isinstance(previous, EventRound) else None
        return EventRound(name, may_round_trip, before)


class EventRound:
    """One streamed round of Responses events on its way to the client."""

    def __init__(self, name: str, may_round_trip: bool, previous: EventRound | None) -> None:
        self.name = name
        self.may_round_trip = may_round_trip
        self.later = previous is not None  # the client has its response.created already
        self.seq: int = previous.seq if previous else 0  # the client's next sequence_number
        self.next_index: int = previous.next_index if previous else 0  # its next output_index
        self.items: list[Any] = list(previous.items) if previous else []  # what it got so far
        self._first_id = previous.first_id if previous else None
        self._usage: dict[str, Any] | None = None
        self._round_trip = False
        self.index: dict[Any, int] = {}  # upstream output_index -> the client's
        self.internal: dict[Any, dict[str, Any]] = {}
        self.texts: list[str] = []
        self.client_calls = False
        self.end: dict[str, Any] | None = None  # the held response.completed (or its kin)
        self.end_raw: bytes | None = None

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
        try:
            data = json.loads(event.data)
        except (ValueError, RecursionError):
            return _raw(event)
        if not isinstance(data, dict):
            return _raw(event)
        kind = data.get("type", event.event)
        if kind in _HEAD:
            resp = data.get("response")
            if self._first_id is None and isinstance(resp, dict):
                rid = resp.get("id")
                self._first_id = rid if isinstance(rid, str) else None
            return None if self.later else self._out(_raw(event), event.event, data, False)
        if kind in _ENDS:
            resp = data.get("response")
            if isinstance(resp, dict) and isinstance(resp.get("usage"), dict):
                self._usage = resp["usage"]
            self.end, self.end_raw = data, _raw(event)
            if (
                kind == "response.completed"
                and self.internal
                and not self.client_calls
                and self.may_round_trip
            ):
                self._round_trip = True
            return None
        if "output_index" in data:
            return self._item_event(kind, data, event)
        return None if self._round_trip else self._out(_raw(event), event.event, data, False)

    def _item_event(self, kind: Any, data: dict[str, Any], event: SSEEvent) -> bytes | None:
        at = data.get("output_index")
        item = data.get("item")
        if kind == "response.output_item.added" and at not in self.index:
            if _is_internal(item, self.name):
                assert isinstance(item, dict)
                self.internal[at] = {**item, "arguments": item.get("arguments") or ""}
                return None
            if isinstance(item, dict) and item.get("type") == "function_call":
                self.client_calls = True
            self.index[at] = self.next_index
            self.next_index += 1
        if at in self.internal:
            call = self.internal[at]
            if kind == "response.function_call_arguments.delta" and isinstance(
                data.get("delta"), str
            ):
                call["arguments"] += data["delta"]
            elif kind == "response.output_item.done" and isinstance(item, dict):
                self.internal[at] = {**call, **item}
            return None
        if kind == "response.output_text.delta" and isinstance(data.get("delta"), str):
            self.texts.append(data["delta"])
        if kind == "response.output_item.done":
            self.items.append(item)
        mine = self.index.get(at, at)
        if mine == at:
            return self._out(_raw(event), event.event, data, False)
        return self._out(_raw(event), event.event, {**data, "output_index": mine}, True)

    def _out(self, raw: bytes, name: str | None, data: dict[str, Any], changed: bool) -> bytes:
        """The event as the client gets it, its ``sequence_number`` the next one."""
        seq = data.get("sequence_number")
        if seq is not None:
            if seq != self.seq:
                data = {**data, "sequence_number": self.seq}
                changed = True
            self.seq += 1
        return _event(name, data) if changed else raw

    def calls(self) -> list[dict[str, Any]]:
        return [self.internal[at] for at in sorted(self.internal, key=_order)]

    def text(self) -> str | None:
        return "".join(self.texts) or None

    def tail(self, total: dict[str, Any] | None) -> bytes:
        if self.end is None or self.end_raw is None:
            return b""
        data = self.end
        resp = data.get("response")
        if isinstance(resp, dict) and (self.later or self.internal):
            new = {**resp, "output": self.items}
            if self._first_id:
                new["id"] = self._first_id
            if total is not None:
                new["usage"] = total
            data = {**data, "response": new}
        name = data.get("type") if isinstance(data.get("type"), str) else None
        return self._out(self.end_raw, name, data, data is not self.end)


def _order(at: Any) -> int:
    return at if isinstance(at, int) else 0


def _output(reply: Mapping[str, Any]) -> list[dict[str, Any]]:
    items = reply.get("output")
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _item_text(item: Mapping[str, Any]) -> str:
    parts = item.get("content")
    return "".join(
        p["text"]
        for p in (parts if isinstance(parts, list) else [])
        if isinstance(p, dict) and p.get("type") == "output_text" and isinstance(p.get("text"), str)
    )


def _raw(event: SSEEvent) -> bytes:
    name = f"event: {event.event}\n" if event.event is not None else ""
    data = "\n".join(f"data: {line}" for line in event.data.split("\n"))
    return f"{name}{data}\n\n".encode()


def _event(name: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {name}\n".encode() if name is not None else b""
    return head + b"data: " + encode_json(data) + b"\n\n"
