"""Responses API ↔ chat completions, for an upstream without ``/v1/responses`` (pure).

:func:`to_chat` makes the chat-completions body: the neutral messages (their marks dropped, the
Responses parts in chat's shape), ``max_output_tokens`` as ``max_tokens``, function tools and
``tool_choice`` in chat's shape, ``text.format`` as ``response_format``, usage asked for when
streaming. :class:`WholeTranslator` turns a ``chat.completion`` into a ``response`` object (an
error body goes through as it came: it is already OpenAI's shape); a stream is
:mod:`proxy.chat.responses.stream`'s. The objects both build are here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from proxy import json_input
from proxy.chat.responses.items import MARK
from proxy.messages import content_text

Message = dict[str, Any]


# --- the request ---------------------------------------------------------------------------------


def chat_part(part: Any) -> Any:
    """A neutral content part in chat completions' shape."""
    if not isinstance(part, Mapping):
        return part
    kind = part.get("type")
    if kind == "input_image":
        url = part.get("image_url") or part.get("file_id") or ""
        image: dict[str, Any] = {"url": url}
        if part.get("detail"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        file = {k: part[k] for k in ("file_data", "file_id", "filename") if k in part}
        return {"type": "file", "file": file}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal") or "")}
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    return part


def chat_message(msg: Mapping[str, Any]) -> Message:
    """A neutral message as a chat completions message (its mark dropped)."""
    out = {k: v for k, v in msg.items() if k != MARK}
    role = out.get("role")
    content = out.get("content")
    if role in ("assistant", "tool", "system", "developer") and isinstance(content, list):
        out["content"] = "".join(
            p.get("text", "") if isinstance(p, Mapping) else "" for p in map(chat_part, content)
        )
    elif isinstance(content, list):
        out["content"] = [chat_part(p) for p in content]
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools in chat's shape (hosted tools have no chat equivalent: left out)."""
    out = []
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, Mapping) and tool.get("type") == "function":
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice if isinstance(choice, str) else None


def response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if not isinstance(fmt, Mapping):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


def to_chat(body: Mapping[str, Any], messages: Sequence[Message], stream: bool) -> dict[str, Any]:
    """The chat completions body for a Responses request."""
    out: dict[str, Any] = {"messages": [chat_message(m) for m in messages]}
    if "model" in body:
        out["model"] = body["model"]
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("safety_identifier", "safety_identifier"),
    ):
        if body.get(ours) is not None:
            out[theirs] = body[ours]
    tools = chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        choice = chat_tool_choice(body.get("tool_choice"))
        if choice is not None:
            out["tool_choice"] = choice
    fmt = response_format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


# --- the reply -----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """Chat usage in the Responses shape."""
    if not isinstance(usage, Mapping):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
    details = usage.get("completion_tokens_details")
    reasoning = _count(details.get("reasoning_tokens")) if isinstance(details, Mapping) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def response_object(
    body: Mapping[str, Any],
    rid: str,
    model: Any,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``response`` object, the request's settings echoed as the API does."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model if isinstance(model, str) else body.get("model"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def message_item(text: str, status: str = "completed", iid: str | None = None) -> dict[str, Any]:
    return {
        "id": iid or new_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call: Mapping[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
    assert isinstance(fn, Mapping)
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call.get("id") or new_id("call"),
        "name": fn.get("name") or "",
        "arguments": fn.get("arguments") or "",
    }


def reasoning_item(text: str, iid: str | None = None) -> dict[str, Any]:
    return {
        "id": iid or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def status_of(finish_reason: Any) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class WholeTranslator:
    """A whole ``chat.completion`` body as a ``response`` object."""

    content_type = "application/json"

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.chunks: list[bytes] = []

    def feed(self, chunk: bytes) -> bytes:
        self.chunks.append(chunk)
        return b""

    def finish(self) -> bytes:
        data = b"".join(self.chunks)
        try:
            obj = json_input.loads(data)
        except (ValueError, UnicodeDecodeError):
            return data  # not a completion: relayed as it came
        if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list):
            return data
        choice = obj["choices"][0] if obj["choices"] else {}
        msg = choice.get("message") if isinstance(choice, Mapping) else None
        msg = msg if isinstance(msg, Mapping) else {}
        output: list[dict[str, Any]] = []
        reasoning = msg.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            output.append(reasoning_item(reasoning))
        text = content_text(msg.get("content"))
        calls = [c for c in msg.get("tool_calls") or [] if isinstance(c, Mapping)]
        if text or not calls:
            output.append(message_item(text))
        output += [call_item(c) for c in calls]
        created = _count(obj.get("created")) or int(time.time())
        finish = choice.get("finish_reason") if isinstance(choice, Mapping) else None
        response = response_object(
            self.body,
            new_id("resp"),
            obj.get("model"),
            created,
            status_of(finish),
            output,
            responses_usage(obj.get("usage")),
        )
        return json.dumps(response, ensure_ascii=False).encode()
