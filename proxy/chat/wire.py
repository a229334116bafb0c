"""What the chat API adapters share (pure): a request body read as a JSON object with precise 400s,
JSON types named in error messages, the readers of a reply as an event stream or a whole
body, around each API's own assembler or parser of a reply, and the reader of the upstream's
own report of its prompt's cost beneath a translation (:class:`CostTap`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from proxy import json_input
from proxy.chat.api import ReplyTranslator
from proxy.costs import PromptCost, chat_cost
from proxy.errors import BadRequest
from proxy.sse import AssembledReply, SSEEvent, SSEParser

REPORTS = (b'"usage"', b'"timings"')  # what a chat reply reports its prompt's cost in

_TYPE_NAMES: dict[type, str] = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def json_type(value: Any) -> str:
    """How an error message names a JSON value's type ("an array", "null", …)."""
    if value is None:
        return "null"
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def json_object(raw: bytes, expected: str) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying precisely what is wrong with it (``expected``
    names what the body should hold, e.g. "`messages`")."""
    if not raw.strip():
        raise BadRequest(
            f"Request body is empty; expected a JSON object with {expected}.", code="invalid_json"
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
            f"Request body must be a JSON object, not {json_type(body)}.", code="invalid_body"
        )
    return body


class Assembler(Protocol):
    """Builds one reply from an API's stream events."""

    done: bool

    def add_event(self, event: SSEEvent) -> None: ...

    def finish(self, *, ended_cleanly: bool) -> AssembledReply: ...


class EventStreamReader:
    """An event-stream reply, event by event into ``assembler``; it ends when the assembler
    says it is done."""

    def __init__(self, assembler: Assembler) -> None:
        self.parser = SSEParser()
        self.assembler = assembler

    def feed(self, chunk: bytes) -> bool:
        was_done = self.assembler.done
        for event in self.parser.feed(chunk):
            self.assembler.add_event(event)
        return self.assembler.done and not was_done

    def finish(self, ended_cleanly: bool) -> AssembledReply:
        for event in self.parser.close():
            self.assembler.add_event(event)
        return self.assembler.finish(ended_cleanly=ended_cleanly)


class WholeBodyReader:
    """A whole reply body (or an error body), read by ``to_reply`` once it has all come."""

    def __init__(self, to_reply: Callable[[Any], AssembledReply]) -> None:
        self.to_reply = to_reply
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
        reply = self.to_reply(obj)
        reply.complete = reply.complete and ended_cleanly
        return reply


class CostTap:
    """A :class:`~proxy.chat.api.ReplyTranslator` around another, reading on the way what the
    upstream reported of its prompt in its own chat-completions reply, before translation (the
    translated reply has no room for llama-server's ``timings``): :attr:`cost`. Only the events
    (or the body) that name ``usage`` or ``timings`` are parsed."""

    def __init__(self, inner: ReplyTranslator, event_stream: bool) -> None:
        self.inner = inner
        self.content_type = inner.content_type
        self.parser = SSEParser() if event_stream else None
        self.chunks: list[bytes] = []
        self.usage: Any = None
        self.timings: Any = None

    @property
    def cost(self) -> PromptCost | None:
        return chat_cost(self.usage, self.timings)

    def feed(self, chunk: bytes) -> bytes:
        if self.parser is not None:
            for event in self.parser.feed(chunk):
                self._read(event.data)
        else:
            self.chunks.append(chunk)
        return self.inner.feed(chunk)

    def finish(self) -> bytes:
        if self.parser is not None:
            for event in self.parser.close():
                self._read(event.data)
        else:
            self._read(b"".join(self.chunks))
            self.chunks = []
        return self.inner.finish()

    def _read(self, data: str | bytes) -> None:
        if isinstance(data, str):
            named = '"usage"' in data or '"timings"' in data
        else:
            named = any(key in data for key in REPORTS)
        if not named:
            return
        try:
            obj = json_input.loads(data)
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(obj, dict):
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            if isinstance(obj.get("timings"), dict):
                self.timings = obj["timings"]
