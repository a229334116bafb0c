"""The OpenAI Responses API (``POST /v1/responses``): the adapter of :mod:`proxy.chat.api`.

Its ``instructions`` and ``input`` items map to the neutral messages and back in
:mod:`proxy.chat.responses.items` (the memory block goes into ``instructions``, after the
client's text); replies are reassembled in :mod:`proxy.chat.responses.reply`; the translation for
an upstream without the API is :mod:`proxy.chat.responses.translate`.

Who and which conversation (:func:`proxy.chat.identity.identify`, the headers first): ``user``
and ``safety_identifier`` name the user; the session is ``metadata.session_id`` where a client
sends one, else the session of the response named by ``previous_response_id`` (this adapter
remembers where each archived reply went, :meth:`OpenAIResponses.replied`), else
``prompt_cache_key`` (Codex and other agents send their conversation id there), else the
messages' hash chain as for chat completions.

With ``previous_response_id`` the upstream holds the earlier history: the request carries only
what is new, so that is all that is archived, and the id is forwarded as sent. ``store`` is the
upstream's business (Codex always sends ``false``): Engram archives either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from proxy.cache import LRU
from proxy.chat.api import Conversation, Message, rendered_parts
from proxy.chat.responses.expand import ResponsesDialect
from proxy.chat.responses.items import encode_input, item_kind, neutral_messages
from proxy.chat.responses.reply import StreamReader, WholeReader
from proxy.chat.responses.stream import StreamTranslator
from proxy.chat.responses.translate import WholeTranslator, to_chat
from proxy.chat.wire import json_object, json_type
from proxy.errors import BadRequest, error_body
from proxy.messages import without_lone_surrogates
from proxy.relay import encode_json
from proxy.sse import AssembledReply

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
ROLES = ("user", "assistant", "system", "developer")
REMEMBERED_RESPONSES = 50_000  # response id -> session name (about 150 bytes each)


class OpenAIResponses:
    """Requests and replies of ``/v1/responses``."""

    name = "openai-responses"
    paths: tuple[str, ...] = ("/v1/responses", "/responses")
    expansion = True  # engram_expand as a Responses function tool (responses_expand)

    def __init__(self) -> None:
        # The session each archived reply went to, by the reply's id: a later request naming it
        # as previous_response_id continues there.
        self.sessions: LRU[str, str] = LRU(REMEMBERED_RESPONSES)

    def parse(self, raw: bytes) -> Conversation:
        body = parse_body(raw)
        check_body(body)
        clean = without_lone_surrogates(body) if _SURROGATE_ESCAPE.search(raw) else body
        model = body.get("model")
        reserve = body.get("max_output_tokens")
        valid_reserve = isinstance(reserve, int) and not isinstance(reserve, bool) and reserve > 0
        return Conversation(
            body=body,
            messages=neutral_messages(clean),
            model=model if isinstance(model, str) else None,
            stream=body.get("stream") is True,
            reply_tokens=reserve if valid_reserve else None,
            hints=self.hints(clean),
            partial=bool(body.get("previous_response_id")),
            rendered=rendered_parts(body),
        )

    def hints(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The body's user and session fields, in the shape :func:`identify` reads."""
        out = {k: body[k] for k in ("user", "safety_identifier") if k in body}
        meta = body.get("metadata")
        session = None
        if isinstance(meta, Mapping):
            session = _text(meta.get("session_id")) or _text(meta.get("sessionId"))
        previous = _text(body.get("previous_response_id"))
        if session is None and previous is not None:
            session = self.sessions.get(previous)
        session = session or _text(body.get("prompt_cache_key"))
        if session is not None:
            out["metadata"] = {"session_id": session}
        return out

    def replied(self, conv: Conversation, reply: AssembledReply, session: str) -> None:
        """The turn was archived in ``session`` (its name): a request continuing from this reply
        (``previous_response_id``) belongs there too."""
        if reply.id:
            self.sessions[reply.id] = session

    def encode(self, conv: Conversation, messages: list[Message]) -> bytes:
        return encode_json(encode_input(conv.body, conv.messages, messages))

    def reader(self, event_stream: bool) -> StreamReader | WholeReader:
        return StreamReader() if event_stream else WholeReader()

    def expansion_dialect(self) -> ResponsesDialect:
        return ResponsesDialect(self.reader)

    def error_body(
        self, status: int, type: str, message: str, code: str | None, param: str | None
    ) -> dict[str, Any]:
        return error_body(message, type, code=code, param=param)

    def stream_error(self, message: str) -> bytes | None:
        data = {"type": "error", "code": "upstream_disconnected", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()

    def to_chat(self, conv: Conversation, messages: list[Message]) -> dict[str, Any]:
        if conv.body.get("previous_response_id"):
            raise BadRequest(
                "The upstream model server has no /v1/responses, so Engram translates this "
                "request to chat completions, which cannot continue a stored response: send the "
                "whole conversation in `input` instead of `previous_response_id`.",
                param="previous_response_id",
                code="previous_response_not_supported",
            )
        return to_chat(conv.body, messages, conv.stream)

    def from_chat(
        self, conv: Conversation, event_stream: bool
    ) -> StreamTranslator | WholeTranslator:
        return StreamTranslator(conv.body) if event_stream else WholeTranslator(conv.body)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


# --- validation ----------------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or a 400 saying precisely what is wrong with it."""
    body = json_object(raw, "`input`")
    return body


def _bad(message: str, param: str, code: str = "invalid_input") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def check_body(body: Mapping[str, Any]) -> None:
    """A 400 for what the memory stages cannot read: ``input``, ``instructions`` and the items."""
    value = body.get("input")
    if value is None:
        raise _bad("`input` is required.", "input", "missing_input")
    if not isinstance(value, str | list):
        raise _bad(f"`input` must be a string or an array, not {json_type(value)}.", "input")
    for key in ("instructions", "previous_response_id"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise _bad(
                f"`{key}` must be a string, not {json_type(body[key])}.", key, f"invalid_{key}"
            )
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_item(item, f"input[{i}]")


def check_item(item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise _bad(f"`{where}` must be an object, not {json_type(item)}.", where)
    kind = item_kind(item)
    if not kind:
        raise _bad(f"`{where}` has neither a `type` nor a `role`.", where)
    if kind == "message":
        if item.get("role") not in ROLES:
            raise _bad(
                f"`{where}.role` must be one of {', '.join(ROLES)}; got {item.get('role')!r}.",
                f"{where}.role",
            )
        check_content(item.get("content"), f"{where}.content")
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise _bad(f"`{where}.{key}` must be a string.", f"{where}.{key}")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise _bad(f"`{where}.call_id` must be a string.", f"{where}.call_id")
        check_content(item.get("output"), f"{where}.output")


def check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(f"`{where}` must be a string or an array, not {json_type(content)}.", where)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"`{where}[{j}]` must be an object with a `type`.", f"{where}[{j}]")
