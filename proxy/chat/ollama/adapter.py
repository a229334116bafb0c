"""Ollama's native chat API (``POST /api/chat``): requests, replies and errors.

A request's ``messages`` (roles system/user/assistant/tool, ``content`` a string, ``images`` as
base64 strings, ``tool_calls`` with arguments as objects, ``tool_name`` on results) become the
neutral (OpenAI chat) shape (:mod:`proxy.chat.api`; the conversions are :mod:`.ollama_wire`'s).
Every other field (``tools``, ``options``, ``keep_alive``, ``format``, ``think``, unknown ones)
is the client's and goes on as sent. ``options.num_ctx`` is this request's context size (Ollama
loads the model with it), so it sizes the prompt's budget; ``options.num_predict`` is the room
asked for the reply.

:meth:`OllamaChat.encode` puts rewritten messages back: a message the stages left alone is the
client's own object, as sent; one whose content they changed (the memory block after the system
text, a tool result swapped for its slot reference) is the client's message with only
``content`` (and ``images``) replaced; one they made (a system message for the memory block when
the client sent none) is a plain Ollama message. Each neutral message carries the index of the
client's message it came from (:data:`ORIGIN`), which copies keep.

Replies stream as NDJSON (``application/x-ndjson``, the default when ``stream`` is absent), one
object a line, the last with ``"done": true``; plain replies are one such object.
:class:`OllamaReader` reassembles both. Errors are ``{"error": "text"}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from proxy import json_input
from proxy.chat.api import Conversation, Message, rendered_parts
from proxy.chat.ollama.expand import OllamaDialect
from proxy.chat.ollama.translate import ChatToOllama, to_chat_body
from proxy.chat.ollama.wire import (
    neutral_call,
    neutral_content,
    ollama_call,
    split_content,
    usage_of,
)
from proxy.chat.wire import json_object, json_type
from proxy.costs import from_ollama
from proxy.errors import BadRequest
from proxy.messages import without_lone_surrogates
from proxy.relay import encode_json
from proxy.sse import AssembledReply

ORIGIN = "_ollama_index"  # a neutral message's source: the index of the client's message
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class OllamaChat:
    """Requests and replies of Ollama's ``/api/chat``."""

    name = "ollama-chat"
    paths: tuple[str, ...] = ("/api/chat",)
    expansion = True  # engram_expand in Ollama's tool shape (proxy.chat.ollama.expand)

    def parse(self, raw: bytes) -> Conversation:
        body = _parse_body(raw)
        sent = body.get("messages")
        if sent is not None and not isinstance(sent, list):
            raise _bad(f"`messages` must be an array, not {json_type(sent)}.", "messages")
        messages = to_neutral(sent or [])
        if _SURROGATE_ESCAPE.search(raw):
            messages = without_lone_surrogates(messages)
        options = body.get("options")
        if options is not None and not isinstance(options, dict):
            raise _bad(
                f"`options` must be an object, not {json_type(options)}.",
                "options",
                "invalid_options",
            )
        options = options or {}
        model = body.get("model")
        return Conversation(
            body=body,
            messages=messages,
            model=model if isinstance(model, str) else None,
            stream=body.get("stream") is not False,  # Ollama streams unless told not to
            reply_tokens=_positive(options.get("num_predict")),
            hints={},  # Ollama's body names no user or session: identity comes from headers
            context_size=_positive(options.get("num_ctx")),
            rendered=rendered_parts(body),
        )

    def encode(self, conv: Conversation, messages: list[Message]) -> bytes:
        sent = conv.body.get("messages")
        sent = sent if isinstance(sent, list) else []
        out = [_to_ollama(m, conv.messages, sent) for m in messages]
        return encode_json({**conv.body, "messages": out})

    def reader(self, event_stream: bool) -> OllamaReader:
        return OllamaReader()

    def expansion_dialect(self) -> OllamaDialect:
        return OllamaDialect(self.reader)

    def error_body(
        self, status: int, type: str, message: str, code: str | None, param: str | None
    ) -> dict[str, Any]:
        return {"error": message}

    def stream_error(self, message: str) -> bytes | None:
        """An ``{"error": …}`` line: the ollama client raises ResponseError on it."""
        return json.dumps({"error": message}).encode() + b"\n"

    def to_chat(self, conv: Conversation, messages: list[Message]) -> dict[str, Any]:
        return to_chat_body(conv, messages)

    def from_chat(self, conv: Conversation, event_stream: bool) -> ChatToOllama:
        return ChatToOllama(conv.model, event_stream)


def to_neutral(sent: list[Any]) -> list[Message]:
    """The client's messages in the neutral shape (or a 400 naming what is malformed). Tool
    results are paired with the calls they answer: by the client's call id where it sent one,
    else by ``tool_name``, else in order."""
    out: list[Message] = []
    pending: list[tuple[str, str, Any]] = []  # unanswered calls: neutral id, name, client id
    for i, msg in enumerate(sent):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"`{where}` must be an object, not {json_type(msg)}.", where)
        role = msg.get("role")
        if not isinstance(role, str):
            raise _bad(f"`{where}.role` must be a string.", f"{where}.role")
        role = role.lower()  # as Ollama reads it
        content = msg.get("content")
        if content is not None and not isinstance(content, str):
            raise _bad(
                f"`{where}.content` must be a string, not {json_type(content)}.",
                f"{where}.content",
            )
        images = msg.get("images")
        if images is not None and (
            not isinstance(images, list) or not all(isinstance(x, str) for x in images)
        ):
            raise _bad(f"`{where}.images` must be an array of base64 strings.", f"{where}.images")
        neutral: Message = {
            ORIGIN: i,
            "role": role,
            "content": neutral_content(content or "", images or []),
        }
        calls = _tool_calls(msg.get("tool_calls"), where)
        if calls:
            neutral["tool_calls"] = [neutral_call(c, j) for j, c in enumerate(calls)]
            pending = [
                (n["id"], n["function"]["name"], c.get("id"))
                for n, c in zip(neutral["tool_calls"], calls, strict=True)
            ]
        elif role == "tool":
            answered = _answered(msg, pending)
            if answered is not None:
                neutral["tool_call_id"] = answered
        else:
            pending = []
        out.append(neutral)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _bad(f"`{where}.tool_calls` must be an array.", f"{where}.tool_calls")
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            at = f"{where}.tool_calls[{j}]"
            raise _bad(f"`{at}` must be an object with a `function` object.", at)
    return calls


def _answered(msg: Mapping[str, Any], pending: list[tuple[str, str, Any]]) -> str | None:
    """The neutral id of the pending call a tool result answers (taken off ``pending``)."""
    if not pending:
        return None
    wanted = msg.get("tool_call_id")
    name = msg.get("tool_name") or msg.get("name")
    pick = 0
    if isinstance(wanted, str) and any(wanted in (n, c) for n, _, c in pending):
        pick = next(k for k, (n, _, c) in enumerate(pending) if wanted in (n, c))
    elif isinstance(name, str) and any(name == f for _, f, _ in pending):
        pick = next(k for k, (_, f, _) in enumerate(pending) if f == name)
    return pending.pop(pick)[0]


def _to_ollama(m: Message, neutral: list[Message], sent: list[Any]) -> Any:
    """One forwarded message in Ollama's shape (see the module's docstring)."""
    i = m.get(ORIGIN)
    if isinstance(i, int) and 0 <= i < len(sent) and i < len(neutral):
        if m is neutral[i]:
            return sent[i]  # untouched: the client's own message, as sent
        original: dict[str, Any] = sent[i]
        out = dict(original)
        text, images = split_content(m.get("content"))
        out["content"] = text
        if images != (original.get("images") or []):
            out["images"] = images
        if m.get("tool_calls") is not neutral[i].get("tool_calls"):
            out["tool_calls"] = [ollama_call(c, j) for j, c in enumerate(m["tool_calls"] or [])]
        return out
    text, images = split_content(m.get("content"))
    made: dict[str, Any] = {"role": m.get("role"), "content": text}
    if images:
        made["images"] = images
    if m.get("tool_calls"):
        made["tool_calls"] = [ollama_call(c, j) for j, c in enumerate(m["tool_calls"])]
    return made


class OllamaReader:
    """Reassembles an ``/api/chat`` reply: NDJSON lines (the reply ends on the line with
    ``"done": true``) or one whole object. A line with ``error`` is the upstream's failure."""

    def __init__(self) -> None:
        self._buf = b""
        self._unparsed: list[bytes] = []  # nothing parsed yet: maybe one multi-line object
        self._content: list[str] = []
        self._thinking: list[str] = []
        self._reply = AssembledReply()
        self._lines = 0
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        self._buf += chunk
        if b"\n" not in chunk:
            return False
        *lines, self._buf = self._buf.split(b"\n")
        was_done = self.done
        for line in lines:
            self._line(line)
        return self.done and not was_done

    def finish(self, ended_cleanly: bool) -> AssembledReply:
        if self._buf:
            self._line(self._buf)
            self._buf = b""
        if not self._lines and self._unparsed:  # a whole body spread over lines
            self._line(b"".join(self._unparsed))
        reply = self._reply
        reply.content = "".join(self._content) if self._content else None
        reply.reasoning_content = "".join(self._thinking) if self._thinking else None
        reply.complete = ended_cleanly and self.done and reply.error is None
        return reply

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            obj = json_input.loads(line)
        except (ValueError, UnicodeDecodeError):
            if not self._lines:
                self._unparsed.append(line + b"\n")
            return
        if not isinstance(obj, dict):
            return
        self._lines += 1
        reply = self._reply
        if "error" in obj:
            reply.error = obj["error"]
            return
        if isinstance(obj.get("model"), str):
            reply.model = obj["model"]
        msg = obj.get("message")
        if isinstance(msg, dict):
            if isinstance(msg.get("content"), str):
                self._content.append(msg["content"])
            if isinstance(msg.get("thinking"), str) and msg["thinking"]:
                self._thinking.append(msg["thinking"])
            calls = msg.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict):
                        reply.tool_calls.append(neutral_call(call, len(reply.tool_calls)))
        if obj.get("done") is True:
            self.done = True
            reason = obj.get("done_reason")
            reply.finish_reason = reason if isinstance(reason, str) else "stop"
            reply.usage = usage_of(obj)
            reply.cost = from_ollama(obj)


def _parse_body(raw: bytes) -> dict[str, Any]:
    return json_object(raw, "`model` and `messages`")


def _positive(value: Any) -> int | None:
    """A positive whole number (JSON may spell it 4096.0), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if value > 0 else None


def _bad(message: str, param: str, code: str = "invalid_messages") -> BadRequest:
    return BadRequest(message, param=param, code=code)
