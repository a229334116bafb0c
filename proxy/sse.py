"""Server-sent events: an incremental parser and the reassembly of a streamed chat reply (pure).

The proxy relays the upstream's bytes unchanged; a copy of each chunk is fed to
:class:`SSEParser`, whose events go to :class:`ChatAssembler`, which rebuilds the assistant
message (content, reasoning, tool calls merged by ``index``, finish reason, usage) for archiving.
Only choice 0 is assembled: ``n > 1`` replies are archived by their first choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proxy.costs import PromptCost, chat_cost


@dataclass(slots=True)
class SSEEvent:
    """One dispatched event: its ``event:`` name (None for the default) and joined data lines."""

    data: str
    event: str | None = None


class SSEParser:
    """Incremental parser: feed it bytes as they arrive, get whole events back."""

    __slots__ = ("_buf", "_data", "_event")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        if b"\n" not in chunk and b"\r" not in chunk:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        out: list[SSEEvent] = []
        for raw in lines:
            self._line(raw.rstrip(b"\r"), out)
        return out

    def close(self) -> list[SSEEvent]:
        """The stream ended: a final unterminated line still counts, a half event does not."""
        out: list[SSEEvent] = []
        if self._buf:
            self._line(self._buf.rstrip(b"\r"), out)
            self._buf = b""
        self._line(b"", out)
        return out

    def _line(self, line: bytes, out: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                out.append(SSEEvent("\n".join(self._data), self._event))
            self._data = []
            self._event = None
            return
        if line.startswith(b":"):
            return  # comment, e.g. llama-server's ": ping"
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        text = value.decode("utf-8", "replace")
        if name == b"data":
            self._data.append(text)
        elif name == b"event":
            self._event = text


@dataclass
class AssembledReply:
    """The assistant's reply as archived: rebuilt from a stream or taken from a plain response."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    id: str | None = None
    error: Any = None
    complete: bool = False
    # What the model server said it computed and reused of the prompt (proxy.costs).
    cost: PromptCost | None = None

    def message(self) -> dict[str, Any]:
        """The reply as an OpenAI assistant message."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ChatAssembler:
    """Rebuilds a chat completion from its ``chat.completion.chunk`` events."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}
        self._reply = AssembledReply()
        self._timings: Any = None  # llama-server's, in the last chunk
        self.done = False

    def add_event(self, event: SSEEvent) -> None:
        data = event.data.strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return  # not ours to judge: relayed as sent, just not assembled
        if isinstance(obj, dict):
            self.add_chunk(obj)

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        reply = self._reply
        if "error" in chunk:
            reply.error = chunk["error"]
            return
        if isinstance(chunk.get("model"), str):
            reply.model = chunk["model"]
        if isinstance(chunk.get("id"), str):
            reply.id = chunk["id"]
        if isinstance(chunk.get("usage"), dict):
            reply.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self._timings = chunk["timings"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta)
            if choice.get("finish_reason"):
                reply.finish_reason = choice["finish_reason"]

    def _delta(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            self._reasoning.append(delta["reasoning_content"])
        calls = delta.get("tool_calls")
        if not isinstance(calls, list):
            return
        for pos, call in enumerate(calls):
            if not isinstance(call, dict):
                continue
            index = call.get("index", pos)
            slot = self._tools.setdefault(
                index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if call.get("id") and not slot["id"]:
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function")
            if isinstance(fn, dict):
                if fn.get("name") and not slot["function"]["name"]:
                    slot["function"]["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    slot["function"]["arguments"] += fn["arguments"]

    def finish(self, *, ended_cleanly: bool) -> AssembledReply:
        """The reply so far. Complete only if the stream ended normally and without an error."""
        reply = self._reply
        reply.content = "".join(self._content) if self._content else None
        reply.reasoning_content = "".join(self._reasoning) if self._reasoning else None
        reply.tool_calls = [self._tools[i] for i in sorted(self._tools)]
        finished = self.done or reply.finish_reason is not None
        reply.cost = chat_cost(reply.usage, self._timings)
        reply.complete = ended_cleanly and finished and reply.error is None
        return reply


def reply_from_completion(obj: Any) -> AssembledReply:
    """An AssembledReply from a plain (non-streamed) chat completion body."""
    reply = AssembledReply()
    if not isinstance(obj, dict):
        return reply
    if "error" in obj:
        reply.error = obj["error"]
        return reply
    reply.model = obj.get("model") if isinstance(obj.get("model"), str) else None
    reply.id = obj.get("id") if isinstance(obj.get("id"), str) else None
    reply.usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    reply.cost = chat_cost(reply.usage, obj.get("timings"))
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        msg: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
        content = msg.get("content")
        reply.content = content if isinstance(content, str) else None
        reasoning = msg.get("reasoning_content")
        reply.reasoning_content = reasoning if isinstance(reasoning, str) else None
        calls = msg.get("tool_calls")
        reply.tool_calls = (
            [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
        )
        reply.finish_reason = choice.get("finish_reason")
        reply.complete = True
    return reply
