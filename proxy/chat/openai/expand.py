"""OpenAI chat completions' expansion dialect (:mod:`proxy.slots.dialect`): the function tool,
``tool_calls`` and ``role: "tool"`` answers, and ``chat.completion.chunk`` streams, with the
pure pieces in :mod:`proxy.slots.expand`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from proxy.chat.api import ReplyReader
from proxy.relay import encode_json
from proxy.slots import expand
from proxy.slots.dialect import SSEFraming, StreamRound, with_tools_of
from proxy.sse import SSEEvent


class OpenAIChatDialect(SSEFraming):
    """The expansion loop's view of ``/v1/chat/completions`` (``reader``: the adapter's)."""

    def __init__(self, reader: Callable[[bool], ReplyReader]) -> None:
        self.reader = reader

    def can_add_tool(self, body: Mapping[str, Any], name: str) -> bool:
        return expand.can_add_tool(body, name)

    def with_tool(self, body: Mapping[str, Any], name: str) -> dict[str, Any]:
        return expand.with_tool(body, name)

    def last_body(self, body: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
        return with_tools_of(body, base)

    def plain_calls(
        self, reply: Mapping[str, Any], name: str
    ) -> tuple[list[dict[str, Any]], bool, str | None]:
        msg = _first_message(reply)
        calls = msg.get("tool_calls")
        internal, client = expand.split_calls(calls if isinstance(calls, list) else [], name)
        content = msg.get("content") if isinstance(msg.get("content"), str) else None
        return internal, bool(client), content

    def call_arguments(self, call: Mapping[str, Any]) -> Any:
        fn = call.get("function")
        return fn.get("arguments") if isinstance(fn, dict) else None

    def follow_up(
        self,
        body: dict[str, Any],
        text: str | None,
        calls: list[dict[str, Any]],
        answers: list[str],
    ) -> dict[str, Any]:
        turn = expand.round_trip_messages(text, calls, answers)
        return {**body, "messages": [*body["messages"], *turn]}

    def final(
        self,
        reply: dict[str, Any],
        name: str,
        usage: dict[str, Any] | None,
        first_id: str | None,
    ) -> dict[str, Any]:
        return expand.final_completion(reply, name, usage, first_id)

    def usage(self, reply: Mapping[str, Any]) -> Any:
        return reply.get("usage")

    def stream_round(
        self, name: str, may_round_trip: bool, previous: StreamRound | None
    ) -> StreamRound:
        return ChunkRound(name, may_round_trip, previous.first_id if previous else None)


class ChunkRound:
    """One streamed round of ``chat.completion.chunk`` events (:class:`expand.StreamRound` does
    the filtering; this adds the wire: ``[DONE]`` and the usage chunk held for the tail)."""

    def __init__(self, name: str, may_round_trip: bool, first_id: str | None) -> None:
        self.rnd = expand.StreamRound(name, may_round_trip, first_id)

    @property
    def first_id(self) -> str | None:
        return self.rnd.first_id

    @property
    def round_trip(self) -> bool:
        return self.rnd.round_trip

    @property
    def usage(self) -> dict[str, Any] | None:
        return self.rnd.usage

    def feed(self, event: SSEEvent) -> bytes | None:
        if event.event is not None:
            return f"event: {event.event}\ndata: {event.data}\n\n".encode()
        data = event.data.strip()
        if data == "[DONE]":
            self.rnd.done = True  # sent by the tail, after the summed usage
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return f"data: {event.data}\n\n".encode()
        if self.rnd.first_id is None and isinstance(obj.get("id"), str):
            self.rnd.first_id = obj["id"]
        new = self.rnd.feed(obj)
        if new is None:
            return None
        text = event.data if new is obj else json.dumps(new, ensure_ascii=False)
        return f"data: {text}\n\n".encode()

    def calls(self) -> list[dict[str, Any]]:
        return self.rnd.calls()

    def text(self) -> str | None:
        return "".join(self.rnd.content) or None

    def tail(self, total: dict[str, Any] | None) -> bytes:
        out: list[bytes] = []
        rnd = self.rnd
        if total is not None:
            chunk = (
                dict(rnd.usage_chunk)
                if rnd.usage_chunk is not None
                else {"id": rnd.first_id, "object": "chat.completion.chunk", "choices": []}
            )
            if rnd.first_id:
                chunk["id"] = rnd.first_id
            chunk["usage"] = total
            out.append(b"data: " + encode_json(chunk) + b"\n\n")
        if rnd.done:
            out.append(b"data: [DONE]\n\n")
        return b"".join(out)


def _first_message(obj: Mapping[str, Any]) -> dict[str, Any]:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        msg = choices[0].get("message")
        if isinstance(msg, dict):
            return msg
    return {}
