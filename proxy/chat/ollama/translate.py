"""Ollama's ``/api/chat`` over an upstream that speaks only chat completions (pure).

llama-server has no ``/api/chat``; when the upstream answers 404 there the pipeline sends
:func:`to_chat_body` to ``/v1/chat/completions`` instead and passes the reply through
:class:`ChatToOllama`, which writes what Ollama would have: NDJSON lines for a stream (content
and thinking as they come, tool calls whole once their arguments are, then the ``done`` line
with ``done_reason`` and the counts) or one JSON object, and ``{"error": "text"}`` for an error.

Options map to their chat-completions names (``num_predict`` is ``max_tokens``; ``num_ctx`` and
``keep_alive`` have no equivalent: the server's context is its own); ``format`` becomes
``response_format``; ``think`` becomes the template's ``enable_thinking`` (a level, such as
``"high"``, ``reasoning_effort``).
"""

from __future__ import annotations

import json
from typing import Any

from proxy import json_input
from proxy.chat.api import Conversation, Message
from proxy.chat.ollama.wire import now_iso, ollama_call
from proxy.sse import SSEEvent, SSEParser

# Ollama options with the same meaning (and name) in llama-server's chat completions.
_SAME_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "stop",
)
_NEUTRAL_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
# OpenAI's finish reasons in Ollama's words (a tool call ends with "stop" there).
_DONE_REASONS = {"tool_calls": "stop", "function_call": "stop"}


def to_chat_body(conv: Conversation, messages: list[Message]) -> dict[str, Any]:
    """The chat-completions request for an Ollama request with these (neutral) messages."""
    body = conv.body
    out: dict[str, Any] = {}
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    out["messages"] = [
        {k: ("" if k == "content" and m[k] is None else m[k]) for k in _NEUTRAL_KEYS if k in m}
        for m in messages
    ]
    out["stream"] = conv.stream
    if conv.stream:
        out["stream_options"] = {"include_usage": True}
    sent = body.get("options")
    options: dict[str, Any] = sent if isinstance(sent, dict) else {}
    for key in _SAME_OPTIONS:
        if options.get(key) is not None:
            out[key] = options[key]
    if conv.reply_tokens is not None:  # num_predict
        out["max_tokens"] = conv.reply_tokens
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        out["tools"] = tools  # Ollama's tools are OpenAI's function tools
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": fmt},
        }
    think = body.get("think")
    if isinstance(think, bool):
        out["chat_template_kwargs"] = {"enable_thinking": think}
    elif isinstance(think, str) and think:
        out["reasoning_effort"] = think
    if isinstance(body.get("logprobs"), bool):
        out["logprobs"] = body["logprobs"]
    if isinstance(body.get("top_logprobs"), int):
        out["top_logprobs"] = body["top_logprobs"]
    return out


def error_text(error: Any) -> str:
    """An upstream's error (OpenAI's object, llama.cpp's, a string) as Ollama's one line."""
    if isinstance(error, str):
        return error
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str):
        return message
    return json.dumps(error, ensure_ascii=False)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


class ChatToOllama:
    """Chat-completions reply bytes in, Ollama ``/api/chat`` reply bytes out (chunks split
    anywhere): NDJSON from a stream of ``chat.completion.chunk`` events, one object from a whole
    ``chat.completion`` (or error) body."""

    def __init__(self, model: str | None, event_stream: bool) -> None:
        self.event_stream = event_stream
        self.content_type = "application/x-ndjson" if event_stream else "application/json"
        self.model = model or ""
        self._parser = SSEParser()
        self._whole: list[bytes] = []
        self._calls: dict[int, dict[str, Any]] = {}  # streamed tool calls, merged by index
        self._calls_sent = 0
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self.done = False  # the done line (or an error line) went out

    def feed(self, chunk: bytes) -> bytes:
        if not self.event_stream:
            self._whole.append(chunk)
            return b""
        return b"".join(self._event(e) for e in self._parser.feed(chunk))

    def finish(self) -> bytes:
        if not self.event_stream:
            return self._from_whole(b"".join(self._whole))
        out = b"".join(self._event(e) for e in self._parser.close())
        if not self.done and self._finish is not None:  # finished, but no [DONE] came
            out += self._end()
        return out

    # ---- a stream ------------------------------------------------------------------------------

    def _event(self, event: SSEEvent) -> bytes:
        if self.done:
            return b""
        data = event.data.strip()
        if data == "[DONE]":
            return self._end()
        try:
            obj = json_input.loads(data)
        except (ValueError, UnicodeDecodeError):
            return b""
        if not isinstance(obj, dict):
            return b""
        if "error" in obj:
            self.done = True
            return _line({"error": error_text(obj["error"])})
        if isinstance(obj.get("model"), str) and obj["model"]:
            self.model = obj["model"]
        if isinstance(obj.get("usage"), dict):
            self._usage = obj["usage"]
        out = b""
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                out += self._delta(delta)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                out += self._tool_line()
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        calls = delta.get("tool_calls")
        for pos, call in enumerate(calls if isinstance(calls, list) else []):
            if not isinstance(call, dict):
                continue
            slot = self._calls.setdefault(
                call.get("index", pos),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id") and not slot["id"]:
                slot["id"] = call["id"]
            fn = call.get("function")
            if isinstance(fn, dict):
                if fn.get("name") and not slot["function"]["name"]:
                    slot["function"]["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    slot["function"]["arguments"] += fn["arguments"]
        content = delta.get("content")
        thinking = delta.get("reasoning_content")
        if not (isinstance(content, str) and content) and not (
            isinstance(thinking, str) and thinking
        ):
            return b""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if isinstance(content, str) else "",
        }
        if isinstance(thinking, str) and thinking:
            message["thinking"] = thinking
        return _line(self._object(message, done=False))

    def _tool_line(self) -> bytes:
        """The tool calls not yet written, whole, on one line (as Ollama sends them)."""
        ordered = [self._calls[i] for i in sorted(self._calls)][self._calls_sent :]
        if not ordered:
            return b""
        first = self._calls_sent
        self._calls_sent += len(ordered)
        calls = [ollama_call(c, first + k, with_id=True) for k, c in enumerate(ordered)]
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        return _line(self._object(message, done=False))

    def _end(self) -> bytes:
        self.done = True
        out = self._tool_line()
        final = self._object({"role": "assistant", "content": ""}, done=True)
        final["done_reason"] = _DONE_REASONS.get(self._finish or "stop", self._finish or "stop")
        final.update(_counts(self._usage))
        return out + _line(final)

    def _object(self, message: dict[str, Any], done: bool) -> dict[str, Any]:
        return {"model": self.model, "created_at": now_iso(), "message": message, "done": done}

    # ---- a whole body --------------------------------------------------------------------------

    def _from_whole(self, data: bytes) -> bytes:
        try:
            obj = json_input.loads(data) if data.strip() else None
        except (ValueError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict):
            text = data.decode("utf-8", "replace").strip()[:2000]
            return _line({"error": text or "The upstream model server sent an empty reply."})
        if "error" in obj:
            return _line({"error": error_text(obj["error"])})
        choices = obj.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        choice: dict[str, Any] = first if isinstance(first, dict) else {}
        found = choice.get("message")
        msg: dict[str, Any] = found if isinstance(found, dict) else {}
        content = msg.get("content")
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if isinstance(content, str) else "",
        }
        thinking = msg.get("reasoning_content")
        if isinstance(thinking, str) and thinking:
            message["thinking"] = thinking
        calls = msg.get("tool_calls")
        if isinstance(calls, list) and calls:
            message["tool_calls"] = [
                ollama_call(c, j, with_id=True) for j, c in enumerate(calls) if isinstance(c, dict)
            ]
        model = obj.get("model") if isinstance(obj.get("model"), str) else self.model
        out: dict[str, Any] = {
            "model": model,
            "created_at": now_iso(),
            "message": message,
            "done": True,
        }
        finish = choice.get("finish_reason")
        finish = finish if isinstance(finish, str) and finish else "stop"
        out["done_reason"] = _DONE_REASONS.get(finish, finish)
        out.update(_counts(obj.get("usage")))
        return json.dumps(out, ensure_ascii=False).encode()


def _counts(usage: Any) -> dict[str, int]:
    """OpenAI usage as Ollama's ``prompt_eval_count`` / ``eval_count``."""
    if not isinstance(usage, dict):
        return {}
    out: dict[str, int] = {}
    for ours, theirs in (
        ("prompt_tokens", "prompt_eval_count"),
        ("completion_tokens", "eval_count"),
    ):
        if isinstance(usage.get(ours), int):
            out[theirs] = usage[ours]
    return out
