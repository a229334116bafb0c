"""The OpenAI Chat Completions API (``POST /v1/chat/completions``): the first chat API adapter,
and the identity one, since its messages are the neutral shape (:mod:`proxy.chat.api`)."""

from __future__ import annotations

import re
from typing import Any

from proxy.chat.api import Conversation, Message, rendered_parts
from proxy.chat.openai.expand import OpenAIChatDialect
from proxy.chat.wire import EventStreamReader, WholeBodyReader, json_object, json_type
from proxy.errors import BadRequest, error_body, sse_error_event
from proxy.messages import without_lone_surrogates
from proxy.relay import encode_json
from proxy.sse import ChatAssembler, reply_from_completion

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class OpenAIChat:
    """Requests and replies of ``/v1/chat/completions``."""

    name = "openai-chat"
    paths: tuple[str, ...] = ("/v1/chat/completions", "/chat/completions")
    expansion = True

    def parse(self, raw: bytes) -> Conversation:
        body = parse_chat_body(raw)
        # A lone surrogate can reach a parsed string only as a JSON escape (raw UTF-8 cannot hold
        # one), so one scan of the bytes tells whether the memory stages need a cleaned copy.
        clean = without_lone_surrogates(body) if _SURROGATE_ESCAPE.search(raw) else body
        model = body.get("model")
        reserve = body.get("max_completion_tokens") or body.get("max_tokens")
        valid_reserve = isinstance(reserve, int) and not isinstance(reserve, bool) and reserve > 0
        return Conversation(
            body=body,
            messages=clean["messages"],
            model=model if isinstance(model, str) else None,
            stream=body.get("stream") is True,
            reply_tokens=reserve if valid_reserve else None,
            hints=clean,
            rendered=rendered_parts(body),
        )

    def encode(self, conv: Conversation, messages: list[Message]) -> bytes:
        return encode_json({**conv.body, "messages": messages})

    def reader(self, event_stream: bool) -> StreamReader | WholeReader:
        return StreamReader() if event_stream else WholeReader()

    def expansion_dialect(self) -> OpenAIChatDialect:
        return OpenAIChatDialect(self.reader)

    def error_body(
        self, status: int, type: str, message: str, code: str | None, param: str | None
    ) -> dict[str, Any]:
        return error_body(message, type, code=code, param=param)

    def stream_error(self, message: str) -> bytes | None:
        return sse_error_event(message, code="upstream_disconnected")

    def to_chat(self, conv: Conversation, messages: list[Message]) -> dict[str, Any]:
        return {**conv.body, "messages": messages}  # it is chat completions: never translated

    def from_chat(self, conv: Conversation, event_stream: bool) -> Unchanged:
        return Unchanged("text/event-stream" if event_stream else "application/json")


class Unchanged:
    """The identity translation (chat completions is already chat completions)."""

    def __init__(self, content_type: str) -> None:
        self.content_type = content_type

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def finish(self) -> bytes:
        return b""


class StreamReader(EventStreamReader):
    """``chat.completion.chunk`` events; the reply ends at ``data: [DONE]``."""

    def __init__(self) -> None:
        super().__init__(ChatAssembler())


class WholeReader(WholeBodyReader):
    """A whole ``chat.completion`` body (or an error body)."""

    def __init__(self) -> None:
        super().__init__(reply_from_completion)


def parse_chat_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or a 400 saying precisely what is wrong with it."""
    body = json_object(raw, "`messages`")
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("`messages` is required.", param="messages", code="missing_messages")
    if not isinstance(messages, list):
        raise BadRequest(
            f"`messages` must be an array, not {json_type(messages)}.",
            param="messages",
            code="invalid_messages",
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(
                f"`messages[{i}]` must be an object, not {json_type(msg)}.",
                param=f"messages[{i}]",
                code="invalid_messages",
            )
        if not isinstance(msg.get("role"), str):
            raise BadRequest(
                f"`messages[{i}].role` must be a string.",
                param=f"messages[{i}].role",
                code="invalid_messages",
            )
    return body
