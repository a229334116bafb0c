"""Messages over chat completions, for an upstream without ``/v1/messages`` (pure).

:func:`to_chat` makes the chat-completions body: the one system message (the client's system,
the role ``system`` messages' text, the memory block: :func:`proxy.chat.anthropic.encode.
system_place`, as text), the neutral messages without Engram's bookkeeping and without the
blocks chat completions has no part for, ``max_tokens``, ``temperature`` / ``top_p`` /
``top_k``, ``stop_sequences`` as ``stop``, custom ``tools`` as functions, ``tool_choice``, and
``stream`` with ``stream_options.include_usage``.

:class:`ChatToMessage` turns the whole chat completion into a ``message`` body (an ``error``
body into Anthropic's error shape); :class:`ChatToEvents` turns the stream of chunks into the
Messages event sequence the ``anthropic`` SDK accumulates: ``message_start``, then for each
content block (thinking, text, each tool call) ``content_block_start``, its deltas and
``content_block_stop`` (indices from 0, one block open at a time), ``message_delta`` with the
stop reason and usage, ``message_stop``. Text and thinking stream as they come; a tool call goes
out whole once its arguments are (chat completions may interleave several calls' fragments,
which Messages blocks cannot). An error chunk becomes an ``error`` event.
"""

from __future__ import annotations

import json
import re
from typing import Any

from proxy import json_input
from proxy.chat.anthropic.encode import system_place
from proxy.chat.anthropic.neutral import AnthropicConversation, strip_origins
from proxy.chat.api import Conversation, Message
from proxy.sse import SSEParser

FINISH_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
CHAT_PARTS = ("text", "image_url")


def to_chat(conv: Conversation, messages: list[Message]) -> dict[str, Any]:
    """The request as a chat-completions body, with ``messages`` (neutral) as its messages."""
    body = conv.body
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    out["messages"] = chat_messages(conv, messages)
    if "max_tokens" in body:
        out["max_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p", "top_k"):
        if key in body:
            out[key] = body[key]
    if isinstance(body.get("stop_sequences"), list):
        out["stop"] = body["stop_sequences"]
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
            },
        }
        for t in body.get("tools") or []
        if isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and t.get("type", "custom") in ("custom", None)
    ]
    if tools:
        out["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            kind = choice.get("type")
            if kind in ("auto", "none"):
                out["tool_choice"] = kind
            elif kind == "any":
                out["tool_choice"] = "required"
            elif kind == "tool" and isinstance(choice.get("name"), str):
                out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
            if choice.get("disable_parallel_tool_use") is True:
                out["parallel_tool_calls"] = False
    if body.get("stream") is True:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def chat_messages(conv: Conversation, messages: list[Message]) -> list[Message]:
    """Neutral messages as chat-completions messages: one system message first."""
    system = [m for m in messages if m.get("role") in ("system", "developer")]
    out: list[Message] = []
    if isinstance(conv, AnthropicConversation):
        place = system_place(conv, system) if system else None
        text = _system_text(place if place is not None else conv.body.get("system"))
    else:
        text = "\n\n".join(str(m.get("content") or "") for m in system)
    if text:
        out.append({"role": "system", "content": text})
    for m in messages:
        if m.get("role") in ("system", "developer"):
            continue
        msg = strip_origins(m)
        content = msg.get("content")
        if isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict) and p.get("type") in CHAT_PARTS]
            if msg.get("role") in ("assistant", "tool") and all(
                p.get("type") == "text" for p in parts
            ):
                msg["content"] = "".join(str(p.get("text", "")) for p in parts)
            else:
                msg["content"] = parts
        elif content is None and not msg.get("tool_calls"):
            msg["content"] = ""  # an assistant turn of thinking only, say
        out.append(msg)
    return out


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(
            b["text"] for b in system if isinstance(b, dict) and isinstance(b.get("text"), str)
        )
    return ""


# --- the reply ----------------------------------------------------------------------------------


def error_object(error: Any) -> dict[str, Any]:
    """An upstream's chat-completions error as Anthropic's error body."""
    message = error.get("message") if isinstance(error, dict) else error
    kind = error.get("type") if isinstance(error, dict) else None
    return {
        "type": "error",
        "error": {
            "type": kind if isinstance(kind, str) and kind else "api_error",
            "message": str(message) if message is not None else "upstream error",
        },
    }


def _message_id(chat_id: Any) -> str:
    tail = re.sub(r"[^A-Za-z0-9_]", "", chat_id) if isinstance(chat_id, str) else ""
    return "msg_" + (tail.removeprefix("chatcmpl") or "engram")


def messages_usage(usage: Any) -> dict[str, int]:
    """Chat-completions usage in Anthropic's names."""
    u = usage if isinstance(usage, dict) else {}
    prompt = u.get("prompt_tokens")
    completion = u.get("completion_tokens")
    return {
        "input_tokens": prompt if isinstance(prompt, int) else 0,
        "output_tokens": completion if isinstance(completion, int) else 0,
    }


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    assert isinstance(fn, dict)
    raw = fn.get("arguments")
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except ValueError:
        value = {}
    return {
        "type": "tool_use",
        "id": call.get("id") or "toolu_engram",
        "name": fn.get("name") or "",
        "input": value if isinstance(value, dict) else {},
    }


def message_from_completion(obj: Any, model: Any = None) -> dict[str, Any]:
    """A whole chat completion as a Messages ``message`` body."""
    if not isinstance(obj, dict):
        return error_object("The upstream's reply was not a chat completion.")
    if "error" in obj:
        return error_object(obj["error"])
    choices = obj.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    msg = choice.get("message") if isinstance(choice, dict) else None
    msg = msg if isinstance(msg, dict) else {}
    blocks: list[dict[str, Any]] = []
    if isinstance(msg.get("reasoning_content"), str) and msg["reasoning_content"]:
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if isinstance(msg.get("content"), str) and msg["content"]:
        blocks.append({"type": "text", "text": msg["content"]})
    calls = msg.get("tool_calls")
    blocks += (
        [_tool_use(c) for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    )
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    return {
        "id": _message_id(obj.get("id")),
        "type": "message",
        "role": "assistant",
        "model": obj.get("model") or model or "",
        "content": blocks,
        "stop_reason": FINISH_REASONS.get(finish, "end_turn") if finish else "end_turn",
        "stop_sequence": None,
        "usage": messages_usage(obj.get("usage")),
    }


class ChatToMessage:
    """A whole chat completion in, a Messages body out (at the end)."""

    content_type = "application/json"

    def __init__(self, model: Any = None) -> None:
        self.model = model
        self.chunks: list[bytes] = []

    def feed(self, chunk: bytes) -> bytes:
        self.chunks.append(chunk)
        return b""

    def finish(self) -> bytes:
        data = b"".join(self.chunks)
        try:
            obj = json_input.loads(data) if data else None
        except (ValueError, UnicodeDecodeError):
            obj = None
        return json.dumps(message_from_completion(obj, self.model), ensure_ascii=False).encode()


def event(name: str, data: dict[str, Any]) -> bytes:
    """One Messages stream event."""
    payload = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


class ChatToEvents:
    """Chat-completion chunks in, Messages stream events out."""

    content_type = "text/event-stream"

    def __init__(self, model: Any = None) -> None:
        self.model = model
        self.parser = SSEParser()
        self.started = False
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # the open block's type
        self.tools: dict[int, dict[str, Any]] = {}  # chat tool index -> id, name, arguments
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.ended = False  # message_stop sent (or an error)

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        for ev in self.parser.feed(chunk):
            self._event(ev.data, out)
        return b"".join(out)

    def finish(self) -> bytes:
        out: list[bytes] = []
        for ev in self.parser.close():
            self._event(ev.data, out)
        if not self.ended and self.finish_reason is not None:
            self._end(out)
        return b"".join(out)

    def _event(self, data: str, out: list[bytes]) -> None:
        if self.ended:
            return
        if data.strip() == "[DONE]":
            self._end(out)
            return
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            out.append(event("error", {"error": error_object(obj["error"])["error"]}))
            self.ended = True
            return
        self._start(obj, out)
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta, out)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
                self._flush_tools(out)

    def _start(self, obj: dict[str, Any], out: list[bytes]) -> None:
        if self.started:
            return
        self.started = True
        message: dict[str, Any] = {
            "id": _message_id(obj.get("id")),
            "type": "message",
            "role": "assistant",
            "model": obj.get("model") or self.model or "",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        out.append(event("message_start", {"message": message}))

    def _block(self, kind: str, block: dict[str, Any], out: list[bytes]) -> None:
        """Close the open block and open a new one of ``kind``."""
        self._close(out)
        self.index += 1
        self.open = kind
        out.append(event("content_block_start", {"index": self.index, "content_block": block}))

    def _close(self, out: list[bytes]) -> None:
        if self.open is None:
            return
        if self.open == "thinking":
            sig = {"type": "signature_delta", "signature": ""}
            out.append(event("content_block_delta", {"index": self.index, "delta": sig}))
        out.append(event("content_block_stop", {"index": self.index}))
        self.open = None

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        thinking = delta.get("reasoning_content")
        if isinstance(thinking, str) and thinking:
            if self.open != "thinking":
                self._block("thinking", {"type": "thinking", "thinking": ""}, out)
            d = {"type": "thinking_delta", "thinking": thinking}
            out.append(event("content_block_delta", {"index": self.index, "delta": d}))
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.open != "text":
                self._block("text", {"type": "text", "text": ""}, out)
            d = {"type": "text_delta", "text": text}
            out.append(event("content_block_delta", {"index": self.index, "delta": d}))
        calls = delta.get("tool_calls")
        for pos, call in enumerate(calls if isinstance(calls, list) else []):
            if not isinstance(call, dict):
                continue
            slot = self.tools.setdefault(
                _index(call.get("index"), pos), {"id": "", "name": "", "arguments": ""}
            )
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            assert isinstance(fn, dict)
            if call.get("id") and not slot["id"]:
                slot["id"] = call["id"]
            if fn.get("name") and not slot["name"]:
                slot["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot["arguments"] += fn["arguments"]

    def _flush_tools(self, out: list[bytes]) -> None:
        for i in sorted(self.tools):
            slot = self.tools[i]
            block = {"type": "tool_use", "id": slot["id"] or f"toolu_{i}", "name": slot["name"]}
            self._block("tool_use", {**block, "input": {}}, out)
            if slot["arguments"]:
                d = {"type": "input_json_delta", "partial_json": slot["arguments"]}
                out.append(event("content_block_delta", {"index": self.index, "delta": d}))
        self.tools = {}

    def _end(self, out: list[bytes]) -> None:
        if not self.started:
            self._start({}, out)
        self._flush_tools(out)
        self._close(out)
        stop = FINISH_REASONS.get(self.finish_reason or "stop", "end_turn")
        delta = {"stop_reason": stop, "stop_sequence": None}
        out.append(event("message_delta", {"delta": delta, "usage": messages_usage(self.usage)}))
        out.append(event("message_stop", {}))
        self.ended = True


def _index(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
