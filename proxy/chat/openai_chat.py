"""The OpenAI Chat Completions API (``POST /v1/chat/completions``): the first chat API adapter,
and the identity one, since its messages are the neutral shape (:mod:`proxy.chat.api`)."""

from __future__ import annotations

import re
from typing import Any

from proxy import json_input
from proxy.chat.api import Conversation, Message
from proxy.chat.openai_expand import OpenAIChatDialect
from proxy.errors import BadRequest, error_body, sse_error_event
from proxy.messages import without_lone_surrogates
from proxy.relay import encode_json
from proxy.sse import AssembledReply, ChatAssembler, SSEParser, reply_from_completion

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


class StreamReader:
    """``chat.completion.chunk`` events; the reply ends at ``data: [DONE]``."""

    def __init__(self) -> None:
        self.parser = SSEParser()
        self.assembler = ChatAssembler()

    def feed(self, chunk: bytes) -> bool:
        was_done = self.assembler.done
        for event in self.parser.feed(chunk):
            self.assembler.add_event(event)
        return self.assembler.done and not was_done

    def finish(self, ended_cleanly: bool) -> AssembledReply:
        for event in self.parser.close():
            self.assembler.add_event(event)
        return self.assembler.finish(ended_cleanly=ended_cleanly)


class WholeReader:
    """A whole ``chat.completion`` body (or an error body)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def feed(self, chunk: bytes) -> bool:
        self.chunks.append(chunk)
        return False

    def finish(self, ended_cleanly: bool) -> AssembledReply:
        data = b"".join(self.chunks)
        try:
            obj = json_input.loads(data) if data else None
        except (ValueError, UnicodeDecodeError):  # not JSON, or nested too deep
            obj = None
        reply = reply_from_completion(obj)
        reply.complete = reply.complete and ended_cleanly
        return reply


def parse_chat_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict, or a 400 saying precisely what is wrong with it."""
    if not raw.strip():
        raise BadRequest(
            "Request body is empty; expected a JSON object with `messages`.", code="invalid_json"
        )
    try:
        body = json_input.loads(raw)
    except json_input.TooDeep:
        raise BadRequest(
            f"Request body nests arrays and objects deeper than {json_input.MAX_DEPTH} levels.",
            code="json_too_deep",
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(
            f"Request body must be a JSON object, not {_json_type(body)}.", code="invalid_body"
        )
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("`messages` is required.", param="messages", code="missing_messages")
    if not isinstance(messages, list):
        raise BadRequest(
            f"`messages` must be an array, not {_json_type(messages)}.",
            param="messages",
            code="invalid_messages",
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(
                f"`messages[{i}]` must be an object, not {_json_type(msg)}.",
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


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)
