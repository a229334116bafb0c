"""The fake upstream's Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``),
as llama-server serves it: builders of plain and streamed replies in the exact shapes the
``anthropic`` SDK accepts (text, thinking, tool use), its error body, and the route handlers
that :class:`testing.fake_upstream.FakeUpstream` mounts.

Requests are converted to chat messages as llama-server converts them (a role ``system``
message inside ``messages`` stays a second system message), so ``strict_templates`` rejects what
a strict chat template would. With the queue empty a reply echoes the last user text.
``without_messages_api(fake)`` makes the fake an upstream that lacks the API (404, as an older
server answers), for the translation to chat completions.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from testing.fake_chunks import last_user_text, rough_tokens, sse, template_violations, words

if TYPE_CHECKING:
    from testing.fake_upstream import FakeUpstream

MESSAGES_PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
MESSAGE_ID = "msg_fake"

Handler = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


def anthropic_usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "cache_read_input_tokens": 0,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
    }


def _blocks(
    text: str, thinking: str | None, tool_uses: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if thinking:
        out.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if text:
        out.append({"type": "text", "text": text})
    for t in tool_uses or []:
        out.append({"type": "tool_use", "id": t["id"], "name": t["name"], "input": t["input"]})
    return out


def anthropic_message(
    text: str,
    *,
    model: str = "fake-model",
    thinking: str | None = None,
    tool_uses: list[dict[str, Any]] | None = None,
    stop_reason: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A whole ``message`` reply (``tool_uses``: ``{"id", "name", "input"}`` each)."""
    return {
        "id": MESSAGE_ID,
        "type": "message",
        "role": "assistant",
        "content": _blocks(text, thinking, tool_uses),
        "model": model,
        "stop_reason": stop_reason or ("tool_use" if tool_uses else "end_turn"),
        "stop_sequence": None,
        "usage": usage or anthropic_usage(1, rough_tokens(text)),
    }


def event(name: str, data: dict[str, Any]) -> bytes:
    return sse({"type": name, **data}, event=name)


def anthropic_events(
    parts: list[str],
    *,
    model: str = "fake-model",
    thinking: list[str] | None = None,
    tool_uses: list[dict[str, Any]] | None = None,
    stop_reason: str | None = None,
    usage: dict[str, int] | None = None,
    ping: bool = True,
    done: bool = True,
) -> list[bytes]:
    """A streamed reply as llama-server sends it: ``message_start``, a thinking block, a text
    block, each tool use (its input in three ``input_json_delta`` fragments), ``message_delta``
    with the stop reason and usage, ``message_stop`` (left out with ``done=False``)."""
    use = usage or anthropic_usage(1, sum(rough_tokens(p) for p in parts))
    start = anthropic_message("", model=model, usage={**use, "output_tokens": 0})
    start.update(content=[], stop_reason=None)
    out = [event("message_start", {"message": start})]
    if ping:
        out.append(event("ping", {}))
    index = 0
    if thinking:
        out.append(block_start(index, {"type": "thinking", "thinking": ""}))
        out += [delta(index, {"type": "thinking_delta", "thinking": t}) for t in thinking]
        out.append(delta(index, {"type": "signature_delta", "signature": ""}))
        out.append(event("content_block_stop", {"index": index}))
        index += 1
    if any(parts):
        out.append(block_start(index, {"type": "text", "text": ""}))
        out += [delta(index, {"type": "text_delta", "text": p}) for p in parts]
        out.append(event("content_block_stop", {"index": index}))
        index += 1
    for t in tool_uses or []:
        out.append(block_start(index, {"type": "tool_use", "id": t["id"], "name": t["name"]}))
        raw = json.dumps(t["input"])
        cut = [
            raw[: len(raw) // 3],
            raw[len(raw) // 3 : 2 * len(raw) // 3],
            raw[2 * len(raw) // 3 :],
        ]
        out += [delta(index, {"type": "input_json_delta", "partial_json": c}) for c in cut if c]
        out.append(event("content_block_stop", {"index": index}))
        index += 1
    reason = stop_reason or ("tool_use" if tool_uses else "end_turn")
    out.append(
        event(
            "message_delta",
            {
                "delta": {"stop_reason": reason, "stop_sequence": None},
                "usage": {"output_tokens": use["output_tokens"]},
            },
        )
    )
    if done:
        out.append(event("message_stop", {}))
    return out


def block_start(index: int, block: dict[str, Any]) -> bytes:
    return event("content_block_start", {"index": index, "content_block": block})


def delta(index: int, d: dict[str, Any]) -> bytes:
    return event("content_block_delta", {"index": index, "delta": d})


def anthropic_error(message: str, type: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message}}


def error_event(message: str, type: str = "overloaded_error") -> bytes:
    return event("error", {"error": {"type": type, "message": message}})


# --- llama-server's conversion, for the strict template check ----------------------------------


def _text(blocks: list[Any]) -> str:
    return "".join(
        b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request as llama-server's chat messages (server-chat.cpp, convert_anthropic_to_oai)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str | list):
        out.append(
            {"role": "system", "content": system if isinstance(system, str) else _text(system)}
        )
    for msg in body.get("messages") or []:
        content = msg.get("content")
        if not isinstance(content, list):
            out.append(msg)
            continue
        texts = [b for b in content if b.get("type") == "text"]
        calls = [
            {
                "id": b.get("id"),
                "type": "function",
                "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))},
            }
            for b in content
            if b.get("type") == "tool_use"
        ]
        results = [
            {
                "role": "tool",
                "tool_call_id": b.get("tool_use_id"),
                "content": b["content"]
                if isinstance(b.get("content"), str)
                else _text(b.get("content") or []),
            }
            for b in content
            if b.get("type") == "tool_result"
        ]
        if texts or calls:
            new: dict[str, Any] = {"role": msg.get("role"), "content": texts or ""}
            if calls:
                new["tool_calls"] = calls
            out.append(new)
        out += results
    return out


# --- the routes ---------------------------------------------------------------------------------


def _json_error(status: int, message: str, type: str = "invalid_request_error") -> web.Response:
    return web.json_response(anthropic_error(message, type), status=status)


def _load(body: bytes) -> dict[str, Any] | web.Response:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        return _json_error(400, f"Failed to parse JSON: {exc}")
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        return _json_error(400, "'messages' is required")
    return payload


def messages_routes(fake: FakeUpstream) -> dict[tuple[str, str], Handler]:
    """The handlers of the fake's Messages API, by (method, path)."""

    async def messages(request: web.Request, body: bytes) -> web.StreamResponse:
        payload = _load(body)
        if isinstance(payload, web.Response):
            return payload
        chat = chat_messages(payload)
        if fake.strict_templates and (problems := template_violations(chat)):
            return _json_error(500, "; ".join(problems), "api_error")
        prompt = sum(rough_tokens(_plain(m.get("content"))) for m in chat)
        if (over := fake.over_context(prompt, payload)) is not None:
            return over
        text = fake.reply_text(last_user_text(chat))
        model = str(payload.get("model") or fake.model)
        usage = anthropic_usage(fake.prompt_tokens(prompt, payload), rough_tokens(text))
        if payload.get("stream"):
            from testing.fake_upstream import StreamReply

            events = anthropic_events(words(text), model=model, usage=usage)
            return await fake._stream(request, StreamReply(events))
        return web.json_response(anthropic_message(text, model=model, usage=usage))

    async def count_tokens(request: web.Request, body: bytes) -> web.StreamResponse:
        payload = _load(body)
        if isinstance(payload, web.Response):
            return payload
        n = sum(rough_tokens(_plain(m.get("content"))) for m in chat_messages(payload))
        return web.json_response({"input_tokens": n})

    return {("POST", MESSAGES_PATH): messages, ("POST", COUNT_PATH): count_tokens}


def _plain(content: Any) -> str:
    return (
        content if isinstance(content, str) else _text(content) if isinstance(content, list) else ""
    )


def without_messages_api(fake: FakeUpstream) -> None:
    """The fake answers 404 on the Messages API from now on (an upstream without it)."""
    for key in list(fake._routes):
        if key[1] in (MESSAGES_PATH, COUNT_PATH):
            del fake._routes[key]
