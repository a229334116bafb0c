"""The Anthropic Messages API (``POST /v1/messages``): Claude Code (``ANTHROPIC_BASE_URL``), the
``anthropic`` SDK and other agents, through the memory pipeline.

The adapter (:class:`AnthropicMessages`) checks the request and brings it into the neutral shape
(:mod:`proxy.chat.anthropic.neutral`), puts the forwarded messages back into the body
(:mod:`proxy.chat.anthropic.encode`: the memory block goes into the top-level ``system``, after
the client's own text, which stays a byte-identical prefix), reassembles the reply for the
archive (:mod:`proxy.chat.anthropic.reply`), renders Engram's errors as Anthropic's
``{"type": "error", "error": {"type", "message"}}``, and translates to and from chat completions
for an upstream that lacks the API (:mod:`proxy.chat.anthropic.translate`). Headers
(``anthropic-version``, ``anthropic-beta``, ``x-api-key``, ``Authorization``) and the query
(Claude Code's ``?beta=true``) go to the upstream as sent, as on every proxied route;
``/v1/messages/count_tokens`` is proxied untouched.

Who is asking: ``metadata.user_id`` names the user, as OpenAI's ``user`` does, unless it is
Claude Code's own (``user_<hash>_account_<id>_session_<uuid>``, or since 2.1.78 a JSON object
with ``device_id`` and ``session_id``): that one names an installation, not a person, and its
session id is shared by the conversation's sub-agents and side requests (titles, topics), so it
names neither the user nor a conversation (nor does its ``X-Claude-Code-Session-Id`` header).
Engram's hash chain tells Claude Code's conversations apart; its billing line's per-request stamp
is fixed in the neutral text for that. ``max_tokens``, which every request must send, is the
client's ceiling rather than the room a reply needs: the prompt budget keeps at most
``prompt.reply_share`` of the context free for it, as on every API.

Engram's expansion tool (``engram_expand``) is offered as an Anthropic tool and answered by
Engram (:mod:`proxy.chat.anthropic.expand`), as for chat completions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from proxy.chat.anthropic.encode import encode_body
from proxy.chat.anthropic.expand import AnthropicDialect
from proxy.chat.anthropic.neutral import AnthropicConversation, neutral_messages
from proxy.chat.anthropic.reply import StreamReader, WholeReader
from proxy.chat.anthropic.translate import ChatToEvents, ChatToMessage, to_chat
from proxy.chat.api import Conversation, Message, rendered_parts
from proxy.chat.openai.adapter import parse_chat_body
from proxy.errors import BadRequest
from proxy.messages import without_lone_surrogates
from proxy.relay import encode_json

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
ROLES = ("user", "assistant", "system")
ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "overloaded_error",
        "timeout_error",
        "billing_error",
    }
)
_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_CLAUDE_CODE_ID = re.compile(r"^user_[0-9a-fA-F]*_account_[^\s]*_session_[0-9a-fA-F-]+$")


class AnthropicMessages:
    """Requests and replies of ``/v1/messages``."""

    name = "anthropic-messages"
    paths: tuple[str, ...] = ("/v1/messages",)
    expansion = True

    def parse(self, raw: bytes) -> AnthropicConversation:
        body = parse_chat_body(raw)  # JSON, an object, ``messages`` an array of role objects
        check_request(body)
        clean = without_lone_surrogates(body) if _SURROGATE_ESCAPE.search(raw) else body
        messages, top, reshape = neutral_messages(clean)
        model = body.get("model")
        ceiling = body.get("max_tokens")  # every request must send one: not the room it needs
        room = (
            ceiling
            if isinstance(ceiling, int) and not isinstance(ceiling, bool) and ceiling > 0
            else None
        )
        return AnthropicConversation(
            body=body,
            messages=messages,
            model=model if isinstance(model, str) else None,
            stream=body.get("stream") is True,
            reply_tokens=room,
            hints=hints(clean),
            system_text=top,
            reshape=reshape,
            rendered=rendered_parts(body),
        )

    def encode(self, conv: Conversation, messages: list[Message]) -> bytes:
        assert isinstance(conv, AnthropicConversation)
        return encode_json(encode_body(conv, messages))

    def reader(self, event_stream: bool) -> StreamReader | WholeReader:
        return StreamReader() if event_stream else WholeReader()

    def expansion_dialect(self) -> AnthropicDialect:
        return AnthropicDialect(self.reader)

    def error_body(
        self, status: int, type: str, message: str, code: str | None, param: str | None
    ) -> dict[str, Any]:
        return error_body(status, type, message)

    def stream_error(self, message: str) -> bytes | None:
        return stream_error(message)

    def to_chat(self, conv: Conversation, messages: list[Message]) -> dict[str, Any]:
        return to_chat(conv, messages)

    def from_chat(self, conv: Conversation, event_stream: bool) -> ChatToEvents | ChatToMessage:
        model = conv.body.get("model")
        return ChatToEvents(model) if event_stream else ChatToMessage(model)


def error_body(status: int, type: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape; a type it does not know is named from the status."""
    if type not in ERROR_TYPES:
        type = _BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type, "message": message}}


def stream_error(message: str, type: str = "api_error") -> bytes:
    """A mid-stream ``error`` event (the ``anthropic`` SDK raises on it)."""
    payload = json.dumps(error_body(500, type, message))
    return f"event: error\ndata: {payload}\n\n".encode()


def hints(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's user, in OpenAI's shape: ``metadata.user_id`` unless it is Claude Code's."""
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, Mapping) else None
    if not isinstance(user, str) or not user.strip() or is_claude_code_id(user):
        return {}
    return {"user": user}


def is_claude_code_id(value: str) -> bool:
    """Whether a ``metadata.user_id`` is one Claude Code makes (legacy or JSON)."""
    text = value.strip()
    if _CLAUDE_CODE_ID.match(text):
        return True
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return isinstance(obj, dict) and ("session_id" in obj or "device_id" in obj)
    return False


# --- checking the request -----------------------------------------------------------------------


def check_request(body: dict[str, Any]) -> None:
    """A precise 400 for what the Messages API would reject in ``system`` and ``messages``."""
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        if not isinstance(system, list):
            raise _bad("`system` must be a string or an array of text blocks.", "system")
        for j, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise _bad(f"`system[{j}]` must be a text block.", f"system[{j}]")
            if not isinstance(block.get("text"), str):
                raise _bad(f"`system[{j}].text` must be a string.", f"system[{j}].text")
    for i, msg in enumerate(body["messages"]):
        where = f"messages[{i}]"
        if msg["role"] not in ROLES:
            raise _bad(
                f"`{where}.role` must be one of user, assistant, system; got {msg['role']!r}.",
                f"{where}.role",
            )
        content = msg.get("content")
        if "content" not in msg:
            raise _bad(f"`{where}.content` is required.", f"{where}.content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _bad(
                f"`{where}.content` must be a string or an array of content blocks.",
                f"{where}.content",
            )
        for j, block in enumerate(content):
            check_block(block, f"{where}.content[{j}]", msg["role"])


def check_block(block: Any, where: str, role: str) -> None:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"`{where}` must be an object with a string `type`.", where)
    kind = block["type"]
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _bad(f"`{where}.text` must be a string.", f"{where}.text")
    if kind == "tool_use":
        for key in ("id", "name"):
            if not isinstance(block.get(key), str):
                raise _bad(f"`{where}.{key}` must be a string.", f"{where}.{key}")
        if "input" in block and not isinstance(block["input"], dict):
            raise _bad(f"`{where}.input` must be an object.", f"{where}.input")
    if kind == "tool_result":
        if role != "user":
            raise _bad(f"`{where}`: tool_result blocks belong in user messages.", where)
        if not isinstance(block.get("tool_use_id"), str):
            raise _bad(f"`{where}.tool_use_id` must be a string.", f"{where}.tool_use_id")
        content = block.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(
                f"`{where}.content` must be a string or an array of content blocks.",
                f"{where}.content",
            )
        for j, inner in enumerate(content if isinstance(content, list) else []):
            if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
                raise _bad(
                    f"`{where}.content[{j}]` must be an object with a string `type`.",
                    f"{where}.content[{j}]",
                )


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_messages")
