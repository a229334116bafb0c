"""Pure builders for the fake upstream: chunk lists, completion objects, error bodies, and the
strict chat-template check. Shapes follow llama.cpp's llama-server (see docs/COMPAT.md)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

CREATED = 1_700_000_000
FINGERPRINT = "b5000-fake"


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``, with an ``event:`` line when named."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"


def rough_tokens(text: str) -> int:
    """About one token per four characters, at least one for non-empty text."""
    return (len(text) + 3) // 4


def _split3(s: str) -> list[str]:
    """``s`` cut into (up to) three fragments that join back to ``s``."""
    if len(s) < 3:
        return [s] if s else []
    a, b = len(s) // 3, 2 * len(s) // 3
    return [s[:a], s[a:b], s[b:]]


def _chunk(
    delta: dict[str, Any] | None,
    *,
    model: str,
    finish_reason: str | None = None,
    extra: dict[str, Any] | None = None,
    choices: list[Any] | None = None,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "choices": choices
        if choices is not None
        else [{"finish_reason": finish_reason, "index": 0, "delta": delta or {}}],
        "created": CREATED,
        "id": "chatcmpl-fake",
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "object": "chat.completion.chunk",
    }
    if extra:
        obj.update(extra)
    return obj


def chat_chunks(
    content_parts: list[str],
    *,
    model: str = "fake-model",
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    ping: bool = False,
    extra_fields: dict[str, Any] | None = None,
    done: bool = True,
) -> list[bytes]:
    """A streamed chat reply as raw SSE events: role delta, content deltas, tool-call deltas
    (by ``index``: id and name with empty arguments, then argument fragments), finish chunk,
    optional ``choices: []`` usage chunk, optional ``data: [DONE]``."""
    ex = extra_fields
    out: list[bytes] = []
    if ping:
        out.append(PING)
    out.append(sse(_chunk({"role": "assistant", "content": None}, model=model, extra=ex)))
    for part in content_parts:
        out.append(sse(_chunk({"content": part}, model=model, extra=ex)))
        if ping:
            out.append(PING)
    for i, tc in enumerate(tool_calls or []):
        head = {"index": i, "id": tc["id"], "type": "function"}
        head["function"] = {"name": tc["name"], "arguments": ""}
        out.append(sse(_chunk({"tool_calls": [head]}, model=model, extra=ex)))
        for frag in _split3(tc.get("arguments", "")):
            delta = {"tool_calls": [{"index": i, "function": {"arguments": frag}}]}
            out.append(sse(_chunk(delta, model=model, extra=ex)))
    fr = finish_reason or ("tool_calls" if tool_calls else "stop")
    out.append(sse(_chunk({}, model=model, finish_reason=fr, extra=ex)))
    if usage is not None:
        out.append(sse(_chunk(None, model=model, choices=[], extra={"usage": usage})))
    if done:
        out.append(DONE)
    return out


def chat_completion(
    content: str | None,
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    usage: dict[str, Any] | None = None,
    model: str = "fake-model",
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A whole non-streamed ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": tc["id"],
                "type": "function",
                "function": {"name": tc["name"], "arguments": tc.get("arguments", "")},
            }
            for tc in tool_calls
        ]
    fr = finish_reason or ("tool_calls" if tool_calls else "stop")
    return {
        "choices": [{"finish_reason": fr, "index": 0, "message": message}],
        "created": CREATED,
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "object": "chat.completion",
        "usage": usage or make_usage(1, rough_tokens(content or "")),
        "id": "chatcmpl-fake",
    }


def make_usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
    }


def llamacpp_error(
    message: str,
    code: int = 400,
    type: str = "exceed_context_size_error",
    *,
    n_prompt_tokens: int = 5000,
    n_ctx: int = 4096,
) -> dict[str, Any]:
    """llama-server's error body; context-size errors carry ``n_prompt_tokens`` and ``n_ctx``."""
    err: dict[str, Any] = {"code": code, "message": message, "type": type}
    if type == "exceed_context_size_error":
        err["n_prompt_tokens"] = n_prompt_tokens
        err["n_ctx"] = n_ctx
    return {"error": err}


def openai_error(
    message: str,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def text_of(content: Any) -> str:
    """The text of a message ``content``: a string, or the ``text`` parts of an array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _is_empty(content: Any) -> bool:
    return content is None or content == "" or content == []


def template_violations(messages: Any) -> list[str]:
    """What a strict Jinja chat template (Mistral, Gemma style) would reject; empty when fine."""
    if not isinstance(messages, list) or not messages:
        return ["messages must be a non-empty array"]
    out: list[str] = []
    pending: set[str] = set()  # tool_call ids not yet answered
    last: str | None = None  # previous role among user / assistant / tool
    last_had_calls = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(f"messages[{i}] is not an object")
            continue
        role = m.get("role")
        calls = m.get("tool_calls") or []
        if role in ("system", "developer"):
            if i != 0:
                out.append(f"messages[{i}]: system message only allowed at index 0")
        elif role == "tool":
            tcid = m.get("tool_call_id")
            if last != "tool" and not (last == "assistant" and last_had_calls):
                out.append(f"messages[{i}]: tool message must follow an assistant with tool_calls")
            if tcid not in pending:
                out.append(f"messages[{i}]: tool_call_id {tcid!r} answers no pending tool call")
            pending.discard(tcid)
        elif role in ("user", "assistant"):
            if pending:
                out.append(f"messages[{i}]: tool calls {sorted(pending)} left unanswered")
                pending.clear()
            expected = {None: "user", "user": "assistant", "assistant": "user"}.get(last)
            if expected is not None and role != expected:
                out.append(
                    f"messages[{i}]: Conversation roles must alternate "
                    f"user/assistant/user/assistant/... (got {role} after {last})"
                )
            pending.update(str(c.get("id")) for c in calls if isinstance(c, dict))
        else:
            out.append(f"messages[{i}]: unsupported role {role!r}")
            continue
        if _is_empty(m.get("content")) and not (role == "assistant" and calls):
            out.append(f"messages[{i}]: empty content")
        if role not in ("system", "developer"):
            last, last_had_calls = role, bool(calls)
    if pending:
        out.append(f"end of messages: tool calls {sorted(pending)} left unanswered")
    return out


def completion_object(text: str, *, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed legacy ``text_completion`` object."""
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "stop"}
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": CREATED,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def completion_chunks(parts: list[str], *, model: str) -> list[bytes]:
    """A streamed ``text_completion``: one event per part, a finish event, ``[DONE]``."""

    def ev(text: str, finish: str | None) -> bytes:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        obj = {"id": "cmpl-fake", "object": "text_completion", "created": CREATED}
        return sse({**obj, "model": model, "choices": [choice]})

    return [*(ev(p, None) for p in parts), ev("", "stop"), DONE]


def response_object(text: str, *, model: str, status: str = "completed") -> dict[str, Any]:
    """A Responses API ``response`` object with one assistant message."""
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": []}]
    item = {
        "type": "message",
        "id": "msg_fake",
        "role": "assistant",
        "status": status,
        "content": content if done else [],
    }
    usage = {"input_tokens": 1, "output_tokens": rough_tokens(text)}
    return {
        "id": "resp_fake",
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "model": model,
        "output": [item] if done else [],
        "usage": {**usage, "total_tokens": usage["input_tokens"] + usage["output_tokens"]}
        if done
        else None,
    }


def response_events(parts: list[str], *, model: str) -> list[bytes]:
    """A streamed Responses API reply: ``event:`` lines, ending at ``response.completed``
    (no ``[DONE]``)."""
    text = "".join(parts)
    seq = iter(range(1_000_000))
    loc = {"item_id": "msg_fake", "output_index": 0, "content_index": 0}

    def ev(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    item = response_object(text, model=model)["output"][0]
    out = [ev("response.created", response=response_object("", model=model, status="in_progress"))]
    out.append(ev("response.output_item.added", output_index=0, item={**item, "content": []}))
    out += [ev("response.output_text.delta", **loc, delta=p) for p in parts]
    out.append(ev("response.output_text.done", **loc, text=text))
    out.append(ev("response.output_item.done", output_index=0, item=item))
    out.append(ev("response.completed", response=response_object(text, model=model)))
    return out


def words(text: str) -> list[str]:
    """``text`` cut into word-sized stream deltas that join back to it."""
    return re.findall(r"\s*\S+|\s+", text) or [""]


_ENGRAM_BLOCK = re.compile(r"<(memory|engram-summary)(?:-[0-9a-f]+)?>.*?</\1[^>]*>\s*", re.S)


def users_words(text: str) -> str:
    """A user message's text without the blocks Engram lays before the user's words (memory,
    summary): what the fakes' echo answers, as a model answers the user, not its notes."""
    return _ENGRAM_BLOCK.sub("", text) if "<" in text else text


def last_user_text(messages: Any) -> str:
    """The words of the last user message (chat ``messages`` or a Responses API ``input``),
    without Engram's blocks (:func:`users_words`): what the fakes echo."""
    if isinstance(messages, str):
        return messages
    for m in reversed(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role", "user") == "user":
            content = m.get("content")
            if isinstance(content, list):  # Responses API parts are "input_text"
                content = [
                    {**p, "type": "text"}
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "input_text"
                ] or content
            return users_words(text_of(content))
    return ""


def embedding(item: Any) -> list[float]:
    """A deterministic 8-dimensional vector for one embeddings input."""
    digest = hashlib.sha256(json.dumps(item).encode()).digest()
    return [round((b - 127.5) / 127.5, 4) for b in digest[:8]]


def static_bodies(flavor: str, model: str, n_ctx: int) -> dict[tuple[str, str], Any]:
    """The JSON bodies of the fake's fixed GET / POST routes, by (method, path)."""
    owner = "llamacpp" if flavor == "llamacpp" else "library"
    models = {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": CREATED, "owned_by": owner}],
    }
    out: dict[tuple[str, str], Any] = {("GET", "/v1/models"): models, ("GET", "/models"): models}
    if flavor == "llamacpp":
        settings = {"n_ctx": n_ctx, "params": {"temperature": 0.8, "n_predict": -1}}
        out[("GET", "/health")] = {"status": "ok"}
        out[("GET", "/slots")] = [{"id": 0, "n_ctx": n_ctx, "is_processing": False}]
        out[("GET", "/props")] = {
            "default_generation_settings": settings,
            "total_slots": 1,
            "model_path": f"/models/{model}.gguf",
            "chat_template": "{{ messages }}",
            "build_info": FINGERPRINT,
        }
        return out
    details = {"format": "gguf", "family": "llama", "parameter_size": "1B"}
    tag = {"name": f"{model}:latest", "model": f"{model}:latest", "size": 1, "digest": "0" * 64}
    out[("GET", "/api/version")] = {"version": "0.5.7"}
    out[("GET", "/api/tags")] = {
        "models": [{**tag, "modified_at": "2024-01-01T00:00:00Z", "details": details}]
    }
    out[("POST", "/api/show")] = {
        "modelfile": f"FROM {model}",
        "parameters": "",
        "template": "{{ .Prompt }}",
        "details": {**details, "quantization_level": "Q4_0"},
        "model_info": {"general.architecture": "llama", "llama.context_length": n_ctx},
        "capabilities": ["completion", "tools"],
    }
    return out


def ollama_chat(text: str, *, model: str, stream: bool) -> list[dict[str, Any]]:
    """Ollama ``/api/chat`` reply objects: NDJSON lines when streamed, else one object."""
    base = {"model": model, "created_at": "2024-01-01T00:00:00Z"}
    final = {"done": True, "done_reason": "stop", "total_duration": 1000}
    final |= {"prompt_eval_count": 1, "eval_count": rough_tokens(text)}
    if not stream:
        return [{**base, "message": {"role": "assistant", "content": text}, **final}]
    lines: list[dict[str, Any]] = [
        {**base, "message": {"role": "assistant", "content": part}, "done": False}
        for part in words(text)
    ]
    lines.append({**base, "message": {"role": "assistant", "content": ""}, **final})
    return lines
