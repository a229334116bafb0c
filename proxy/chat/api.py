"""The seam between a chat API's wire format and the protocol-neutral pipeline.

The memory stages and the pipeline work on a :class:`Conversation`: the client's body kept as
sent (opaque: it is forwarded unchanged except for its messages), and the messages in the one
neutral shape every stage reads — OpenAI-chat-shaped dicts: ``role`` (``system`` / ``developer``
text first, then ``user``, ``assistant``, ``tool``), ``content`` as a string or content parts,
``tool_calls`` on assistant messages and ``tool_call_id`` on their results. A :class:`ChatAPI`
adapter brings its API's request into that shape (:meth:`ChatAPI.parse`), puts rewritten
messages back into its own shape (:meth:`ChatAPI.encode`), and reassembles the upstream's reply,
streamed or whole, into an :class:`~proxy.sse.AssembledReply` (:meth:`ChatAPI.reader`), which
knows when the reply has ended (so the turn is archived before the client's last byte).

Adding a chat API is adding one adapter module (and its tests) and naming it in
:func:`proxy.chat.apis.chat_apis`: the app routes its paths to a pipeline of its own, renders
Engram's errors there in its shape (:meth:`ChatAPI.error_body`), and, when the upstream answers
404 on its path, translates the request to chat completions and the reply back
(:meth:`ChatAPI.to_chat`, :meth:`ChatAPI.from_chat`). :mod:`proxy.chat.openai.adapter` is the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from proxy.sse import AssembledReply

Message = dict[str, Any]


@dataclass
class Conversation:
    """One chat request, protocol-neutral."""

    body: dict[str, Any]  # the client's body, as its API shapes it (forwarded as sent)
    # The conversation in the neutral (OpenAI chat) shape, with any lone surrogate (legal in JSON,
    # not in UTF-8) already replaced by U+FFFD: what the memory stages hash, count and store.
    messages: list[Message]
    model: str | None = None
    stream: bool = False
    reply_tokens: int | None = None  # the room the client asked for the reply (max_tokens, …)
    # Body fields that name the user or the session (``user``, ``safety_identifier``,
    # ``metadata.session_id``), in OpenAI's shape, for :func:`proxy.chat.identity.identify`.
    hints: Mapping[str, Any] | None = None
    # The context size this request itself sets (Ollama's ``options.num_ctx``): the prompt's
    # budget is sized by it instead of the upstream's default context.
    context_size: int | None = None
    api: str | None = None  # the adapter's name (set by the pipeline), recorded per turn
    # The body must be re-encoded from the messages even when the memory stages change nothing
    # (an adapter that puts a client's body into the shape strict chat templates need).
    reshape: bool = False
    # The messages are not the whole conversation (the upstream holds earlier turns, e.g. by
    # ``previous_response_id``): the upstream's prompt token count says nothing of them.
    partial: bool = False
    # What else of the body the upstream renders into the prompt (tool definitions): counted in
    # the prompt's budget, never changed.
    rendered: tuple[Any, ...] = ()


RENDERED_FIELDS = ("tools", "functions")
"""Body fields every chat API names alike whose content a chat template renders into the prompt
(tool definitions; chat completions' legacy ``functions``)."""


def rendered_parts(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """The parts of ``body`` besides its messages that take room in the prompt."""
    return tuple(body[k] for k in RENDERED_FIELDS if body.get(k))


class ReplyReader(Protocol):
    """Reassembles one upstream reply from the chunks relayed to the client."""

    def feed(self, chunk: bytes) -> bool:
        """Take a chunk; True when it holds the end of the reply (a stream's end marker)."""
        ...

    def finish(self, ended_cleanly: bool) -> AssembledReply:
        """The reply so far (the upstream's body ended, cleanly or not). May be called again."""
        ...


class ReplyTranslator(Protocol):
    """Turns an upstream's chat-completions reply (streamed or whole) into another API's reply,
    for an upstream that lacks that API (:meth:`ChatAPI.from_chat`)."""

    content_type: str  # of the translated reply (e.g. text/event-stream, application/json)

    def feed(self, chunk: bytes) -> bytes:
        """Upstream bytes in (split anywhere), the client's bytes out (possibly empty)."""
        ...

    def finish(self) -> bytes:
        """What is left once the upstream's body ended."""
        ...


@runtime_checkable
class ContinuesReplies(Protocol):
    """An API whose requests may continue a stored reply by its id (Responses'
    ``previous_response_id``): told where each archived reply went."""

    def replied(self, conv: Conversation, reply: AssembledReply, session: str) -> None:
        """The turn was archived in ``session`` (its name)."""
        ...


class ChatAPI(Protocol):
    """One chat API's wire format."""

    name: str  # e.g. "openai-chat"; recorded as the protocol of each archived turn
    paths: tuple[str, ...]  # the request paths it serves (forwarded to the same upstream path)
    expansion: bool  # whether Engram may add its tool-result expansion tool (OpenAI tools)

    def parse(self, raw: bytes) -> Conversation:
        """The request, or :class:`proxy.errors.BadRequest` saying precisely what is wrong."""
        ...

    def encode(self, conv: Conversation, messages: list[Message]) -> bytes:
        """The body to forward: the client's, with these (neutral) messages in its own shape."""
        ...

    def reader(self, event_stream: bool) -> ReplyReader:
        """A reader for the upstream's reply (``text/event-stream`` or a whole body)."""
        ...

    def error_body(
        self, status: int, type: str, message: str, code: str | None, param: str | None
    ) -> dict[str, Any]:
        """Engram's own error in this API's shape (the middleware renders every error on the
        adapter's paths with it)."""
        ...

    def stream_error(self, message: str) -> bytes | None:
        """The event that tells this API's streaming client that the reply broke off (the
        upstream died mid-stream), or None to cut the connection."""
        ...

    def to_chat(self, conv: Conversation, messages: list[Message]) -> dict[str, Any]:
        """The request as an OpenAI chat-completions body, for an upstream that lacks this API
        (``messages``: the neutral messages to send)."""
        ...

    def from_chat(self, conv: Conversation, event_stream: bool) -> ReplyTranslator:
        """Translates the upstream's chat-completions reply into this API's reply."""
        ...
