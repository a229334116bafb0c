"""Ollama's ``/api/chat`` for the fake model server (:mod:`testing.fake_upstream`,
``flavor="ollama"``): replies in the shapes the ``ollama`` Python client parses, and the
checks a real Ollama makes on a request.

With no reply enqueued it echoes the last user message, as NDJSON lines (``application/x-ndjson``;
the default when ``stream`` is absent) or one object with ``"stream": false``. Tests enqueue
exact replies with :func:`ndjson_reply` / :func:`json_reply` (tool calls, thinking, a done
reason, counts) and :func:`error_reply`. A request a real Ollama would refuse (a message whose
``content`` is not a string, tool-call arguments that are not an object, images that are not
base64 strings) gets Ollama's 400 ``{"error": "..."}``, so an adapter that writes the wrong
shape fails its tests. The llama.cpp flavor has no ``/api/chat`` (a 404, as llama-server).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from testing.fake_chunks import last_user_text, rough_tokens, text_of, words

CREATED_AT = "2024-01-01T00:00:00Z"
# A 1x1 PNG, base64: what an image in ``images`` looks like.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAAB"
    "JRU5ErkJggg=="
)
NDJSON = "application/x-ndjson"


def reply_lines(
    text: str,
    *,
    model: str = "fake-model",
    tool_calls: list[dict[str, Any]] | None = None,
    thinking: str | None = None,
    done_reason: str = "stop",
    prompt_eval_count: int | None = 1,
    eval_count: int | None = None,
) -> list[dict[str, Any]]:
    """A streamed reply's objects: ``thinking`` and ``text`` word by word, the tool calls whole
    on one line (``{"function": {"name", "arguments": {...}}}``, as Ollama sends them), then the
    ``done`` line with the reason and the counts."""
    base = {"model": model, "created_at": CREATED_AT}
    lines: list[dict[str, Any]] = []
    for part in words(thinking) if thinking else []:
        message = {"role": "assistant", "content": "", "thinking": part}
        lines.append({**base, "message": message, "done": False})
    for part in words(text) if text else []:
        lines.append({**base, "message": {"role": "assistant", "content": part}, "done": False})
    if tool_calls:
        calls: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": tool_calls}
        lines.append({**base, "message": calls, "done": False})
    final: dict[str, Any] = {
        **base,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": done_reason,
        "total_duration": 1000,
    }
    if prompt_eval_count:
        final["prompt_eval_count"] = prompt_eval_count
    final["eval_count"] = eval_count if eval_count is not None else max(1, rough_tokens(text))
    lines.append(final)
    return lines


def whole_reply(text: str, **kwargs: Any) -> dict[str, Any]:
    """A plain (``"stream": false``) reply: the stream's objects folded into one."""
    lines = reply_lines(text, **kwargs)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thinking = "".join(str(x["message"].get("thinking", "")) for x in lines)
    if thinking:
        message["thinking"] = thinking
    calls = [c for x in lines for c in x["message"].get("tool_calls", [])]
    if calls:
        message["tool_calls"] = calls
    return {**lines[-1], "message": message}


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    """A tool call as Ollama writes it: arguments an object, no id."""
    return {"function": {"name": name, "arguments": arguments}}


def ndjson(objects: list[dict[str, Any]]) -> list[bytes]:
    return [json.dumps(o).encode() + b"\n" for o in objects]


def ndjson_reply(text: str, delay: float = 0.0, **kwargs: Any) -> Any:
    """An enqueueable streamed reply (``fake.enqueue(..., path="/api/chat")``)."""
    from testing.fake_upstream import StreamReply

    return StreamReply(ndjson(reply_lines(text, **kwargs)), delay=delay, content_type=NDJSON)


def json_reply(text: str, **kwargs: Any) -> Any:
    """An enqueueable plain reply."""
    from testing.fake_upstream import JsonReply

    return JsonReply(whole_reply(text, **kwargs))


def error_reply(message: str, status: int = 400) -> Any:
    """An enqueueable error, in Ollama's shape."""
    from testing.fake_upstream import JsonReply

    return JsonReply({"error": message}, status=status)


def violations(payload: Any) -> list[str]:
    """Why a real Ollama would refuse this ``/api/chat`` body (its JSON decoding errors)."""
    if not isinstance(payload, dict):
        return ["request body must be a JSON object"]
    if not isinstance(payload.get("model"), str) or not payload["model"]:
        return ["model is required"]
    messages = payload.get("messages", [])
    if not isinstance(messages, list):
        return ["json: cannot unmarshal messages into []api.Message"]
    out: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            out.append(f"messages[{i}]: not a message with a role")
            continue
        if "content" in m and not isinstance(m["content"], str):
            out.append(f"messages[{i}].content: cannot unmarshal into a string")
        images = m.get("images", [])
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            out.append(f"messages[{i}].images: not base64 strings")
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("arguments", {}), dict):
                out.append(f"messages[{i}].tool_calls[{j}].function.arguments: not an object")
    return out


async def chat(request: web.Request, body: bytes, model: str) -> web.StreamResponse:
    """The default ``/api/chat`` answer: Ollama's checks, then an echo of the last user text."""
    try:
        payload = json.loads(body)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    if problems := violations(payload):
        return web.json_response({"error": "; ".join(problems)}, status=400)
    messages = payload.get("messages") or []
    text = f"echo: {last_user_text(messages)}"
    name = str(payload.get("model") or model)
    prompt = sum(rough_tokens(text_of(m.get("content"))) for m in messages) or None
    lines = reply_lines(text, model=name, prompt_eval_count=prompt)
    if payload.get("stream") is False:
        return web.json_response(whole_reply(text, model=name, prompt_eval_count=prompt))
    resp = web.StreamResponse(headers={"Content-Type": NDJSON})
    await resp.prepare(request)
    for line in ndjson(lines):
        await resp.write(line)
    await resp.write_eof()
    return resp
