"""What the expansion loop (:mod:`proxy.slots.loop`) needs to know of one chat API's wire format.

The loop is the same for every API: send the body with Engram's tool, find the model's calls to
it in the reply, answer them with the slots' content in a follow-up request, repeat, and give
the client one reply without the internal calls. An :class:`ExpansionDialect` says how each of
those steps reads and writes in its API: the tool in the API's own tool shape, the calls in a
whole reply, the follow-up body (the assistant turn and the tool results in the API's shape),
the final reply's fix-up (internal calls dropped, usage summed, the stop reason as it applies to
what the client got), and a :class:`StreamRound` per streamed round, which relays the round's
events minus the internal calls and holds back the round's ending. A chat API adapter offers
expansion by having ``expansion = True`` and an ``expansion_dialect()`` (:class:`Expands`);
OpenAI chat's dialect is :mod:`proxy.chat.openai.expand`, Anthropic's
:mod:`proxy.chat.anthropic.expand`, Ollama's :mod:`proxy.chat.ollama.expand`.

A dialect also says how its streams are framed: which content type is a stream, the parser
that turns a stream's bytes into events (:class:`SSEFraming`: server-sent events; Ollama's
NDJSON lines come as events whose ``data`` is one line), and what the client may be sent while
Engram makes a round trip (an SSE comment; nothing in NDJSON, which has no comments).

Calls are kept in the API's own shape; :meth:`ExpansionDialect.call_arguments` gives what the
model passed (a JSON string or an object), for :func:`proxy.slots.expand.requested_slot`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from proxy.chat.api import ReplyReader
from proxy.sse import SSEEvent, SSEParser


class EventParser(Protocol):
    """A stream's bytes as events, fed as they arrive."""

    def feed(self, chunk: bytes) -> list[SSEEvent]: ...

    def close(self) -> list[SSEEvent]: ...


class StreamRound(Protocol):
    """One streamed round trip's events on their way to the client."""

    @property
    def first_id(self) -> str | None:
        """The reply id the client saw first (later rounds carry it too)."""
        ...

    @property
    def round_trip(self) -> bool:
        """The round ended with internal calls only: a follow-up request comes next."""
        ...

    @property
    def usage(self) -> dict[str, Any] | None:
        """This round's usage, in the API's names."""
        ...

    def feed(self, event: SSEEvent) -> bytes | None:
        """The bytes to relay for this upstream event (possibly rewritten), or None."""
        ...

    def calls(self) -> list[dict[str, Any]]:
        """The round's internal calls, in the API's shape."""
        ...

    def text(self) -> str | None:
        """The text the model wrote in this round (it reached the client already)."""
        ...

    def tail(self, total: dict[str, Any] | None) -> bytes:
        """The reply's ending, held back until now, with the usage summed over the rounds."""
        ...


class ExpansionDialect(Protocol):
    """One chat API's shapes, for the expansion loop."""

    progress: bytes  # sent to a streaming client while Engram makes a round trip

    def streams(self, content_type: str) -> bool:
        """Whether a reply of this content type is a stream (relayed round by round)."""
        ...

    def parser(self) -> EventParser:
        """A new parser for one streamed round's bytes."""
        ...

    def can_add_tool(self, body: Mapping[str, Any], name: str) -> bool:
        """Whether the expansion tool may join this request's tools."""
        ...

    def with_tool(self, body: Mapping[str, Any], name: str) -> dict[str, Any]:
        """``body`` with the tool appended to its tools (the client's first)."""
        ...

    def last_body(self, body: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` with the client's own tools only (``base``'s): the last round must answer."""
        ...

    def plain_calls(
        self, reply: Mapping[str, Any], name: str
    ) -> tuple[list[dict[str, Any]], bool, str | None]:
        """A whole reply's internal calls, whether it has calls of the client's, and its text."""
        ...

    def call_arguments(self, call: Mapping[str, Any]) -> Any:
        """What an internal call passed (``{"slot_id": ...}`` as a string or an object)."""
        ...

    def follow_up(
        self,
        body: dict[str, Any],
        text: str | None,
        calls: list[dict[str, Any]],
        answers: list[str],
    ) -> dict[str, Any]:
        """``body`` with the assistant turn holding ``calls`` and their answers appended."""
        ...

    def final(
        self,
        reply: dict[str, Any],
        name: str,
        usage: dict[str, Any] | None,
        first_id: str | None,
    ) -> dict[str, Any]:
        """A whole reply as the client gets it: internal calls dropped, usage summed."""
        ...

    def usage(self, reply: Mapping[str, Any]) -> Any:
        """A whole reply's usage (summed over the rounds with :func:`add_usage`)."""
        ...

    def stream_round(
        self, name: str, may_round_trip: bool, previous: StreamRound | None
    ) -> StreamRound:
        """The next streamed round (``previous``: the round before it, if any)."""
        ...

    def reader(self, event_stream: bool) -> ReplyReader:
        """Reassembles what the client got (the adapter's own reader)."""
        ...


def with_tools_of(body: dict[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``base``'s tools (the client's own) or none: the last round must answer.
    Every dialect's :meth:`ExpansionDialect.last_body` where tools sit under ``tools``."""
    out = dict(body)
    if "tools" in base:
        out["tools"] = base["tools"]
    else:
        out.pop("tools", None)
    return out


def with_tool_appended(body: Mapping[str, Any], tool: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``tool`` after the client's own tools (its ``tools`` list, if any)."""
    tools = body.get("tools")
    own = tools if isinstance(tools, list) else []
    return {**body, "tools": [*own, tool]}


class SSEFraming:
    """The framing of APIs that stream server-sent events (a base of their dialects)."""

    progress = b": engram is expanding a tool result\n\n"

    def streams(self, content_type: str) -> bool:
        return content_type == "text/event-stream"

    def parser(self) -> SSEParser:
        return SSEParser()


@runtime_checkable
class Expands(Protocol):
    """A chat API adapter that can offer Engram's expansion tool in its own shape."""

    def expansion_dialect(self) -> ExpansionDialect: ...
