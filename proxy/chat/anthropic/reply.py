"""Anthropic Messages replies reassembled for the archive: a streamed reply from its events, a
whole one from its ``message`` body, both into an :class:`~proxy.sse.AssembledReply` (pure).

The stream's events: ``message_start`` (id, model, the prompt's usage), per content block
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``, ``signature_delta``, ``citations_delta``) / ``content_block_stop``, then
``message_delta`` (``stop_reason``, usage) and ``message_stop``, the end of the reply; ``ping``
anywhere; ``error`` instead of the rest when the upstream fails. The reply as archived is the
neutral assistant message: the text blocks joined by a line break (as the request's parts are
read), the thinking as ``reasoning_content``, every ``tool_use`` as a tool call whose arguments
are its ``input`` spelled as the request's blocks are (:func:`proxy.chat.anthropic.neutral.
arguments`), so that the next request, which resends the reply as blocks, hashes the same.
Usage is given OpenAI's names (``prompt_tokens`` counts the cached input too).
"""

from __future__ import annotations

import json
from typing import Any

from proxy.chat.anthropic.neutral import arguments
from proxy.chat.wire import EventStreamReader, WholeBodyReader
from proxy.costs import from_anthropic_usage
from proxy.sse import AssembledReply, SSEEvent

STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "content_filter",
}


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Anthropic usage in OpenAI's names (``prompt_tokens`` includes cache reads and writes)."""
    if not isinstance(usage, dict):
        return None
    prompt = 0
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            prompt += value
    output = usage.get("output_tokens")
    completion = output if isinstance(output, int) and not isinstance(output, bool) else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class MessageAssembler:
    """Rebuilds a message from its stream events."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}
        self.reply = AssembledReply()
        self.stop_reason: str | None = None
        self.done = False

    def add_event(self, event: SSEEvent) -> None:
        try:
            data = json.loads(event.data)
        except (ValueError, RecursionError):
            return  # not ours to judge: relayed as sent, just not assembled
        if isinstance(data, dict):
            self.add(data, event.event)

    def add(self, data: dict[str, Any], name: str | None = None) -> None:
        kind = data.get("type", name)
        if kind == "message_start" and isinstance(data.get("message"), dict):
            msg = data["message"]
            self.reply.id = msg.get("id") if isinstance(msg.get("id"), str) else None
            self.reply.model = msg.get("model") if isinstance(msg.get("model"), str) else None
            if isinstance(msg.get("usage"), dict):
                self.usage.update(msg["usage"])
        elif kind == "content_block_start" and isinstance(data.get("content_block"), dict):
            block = dict(data["content_block"])
            block["_json"] = []
            self.blocks[_int(data.get("index"), len(self.blocks))] = block
        elif kind == "content_block_delta" and isinstance(data.get("delta"), dict):
            index = _int(data.get("index"), len(self.blocks) - 1)
            block = self.blocks.setdefault(index, {"type": "text", "_json": []})
            _apply_delta(block, data["delta"])
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self.stop_reason = delta["stop_reason"]
            if isinstance(data.get("usage"), dict):
                self.usage.update({k: v for k, v in data["usage"].items() if v is not None})
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.reply.error = data.get("error", data)

    def finish(self, *, ended_cleanly: bool) -> AssembledReply:
        """The reply so far; complete only if the stream reached ``message_stop`` cleanly."""
        reply = self.reply
        _fill(reply, [self.blocks[i] for i in sorted(self.blocks)], self.stop_reason)
        reply.usage = chat_usage(self.usage) if self.usage else None
        reply.cost = from_anthropic_usage(self.usage)
        reply.complete = ended_cleanly and self.done and reply.error is None
        return reply


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _apply_delta(block: dict[str, Any], delta: dict[str, Any]) -> None:
    kind = delta.get("type")
    if kind == "text_delta" and isinstance(delta.get("text"), str):
        block["text"] = str(block.get("text") or "") + delta["text"]
    elif kind == "thinking_delta" and isinstance(delta.get("thinking"), str):
        block["thinking"] = str(block.get("thinking") or "") + delta["thinking"]
    elif kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
        block["_json"].append(delta["partial_json"])


def _fill(reply: AssembledReply, blocks: list[dict[str, Any]], stop: str | None) -> None:
    """Content, reasoning, tool calls and finish reason from a message's content blocks."""
    texts = [
        b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str)
    ]
    thoughts = [
        b["thinking"]
        for b in blocks
        if b.get("type") == "thinking" and isinstance(b.get("thinking"), str)
    ]
    reply.content = "\n".join(texts) if texts else None
    reply.reasoning_content = "".join(thoughts) if thoughts else None
    reply.tool_calls = [
        {
            "id": b.get("id") or "",
            "type": "function",
            "function": {"name": b.get("name") or "", "arguments": _input(b)},
        }
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    reply.finish_reason = STOP_REASONS.get(stop, stop) if stop else None


def _input(block: dict[str, Any]) -> str:
    """A tool_use block's input as arguments: its streamed JSON (re-spelled when it parses, so
    it reads as the resent block will) or its ``input``."""
    parts = block.get("_json") or []
    if not parts:
        return arguments(block.get("input"))
    raw = "".join(parts)
    try:
        return arguments(json.loads(raw))
    except (ValueError, RecursionError):
        return raw


def reply_from_message(obj: Any) -> AssembledReply:
    """An AssembledReply from a whole ``message`` body (or an error body)."""
    reply = AssembledReply()
    if not isinstance(obj, dict):
        return reply
    if obj.get("type") == "error" or "error" in obj:
        reply.error = obj.get("error", obj)
        return reply
    reply.id = obj.get("id") if isinstance(obj.get("id"), str) else None
    reply.model = obj.get("model") if isinstance(obj.get("model"), str) else None
    reply.usage = chat_usage(obj.get("usage"))
    reply.cost = from_anthropic_usage(obj.get("usage"))
    content = obj.get("content")
    blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
    stop = obj.get("stop_reason")
    _fill(reply, blocks, stop if isinstance(stop, str) else None)
    reply.complete = obj.get("type") == "message" or isinstance(content, list)
    return reply


class StreamReader(EventStreamReader):
    """A streamed Messages reply; it ends at ``message_stop``."""

    def __init__(self) -> None:
        super().__init__(MessageAssembler())


class WholeReader(WholeBodyReader):
    """A whole Messages reply (or an error body)."""

    def __init__(self) -> None:
        super().__init__(reply_from_message)
