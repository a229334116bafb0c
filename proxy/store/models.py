"""Row types of the store, the hashes that identify messages and texts, and store errors.

- :class:`NewTurn` — a message to archive; :class:`Turn` — an archived one; :class:`Session`.
- ``turns.content_hash`` identifies a message as the caller sees it: pass the chain hash of
  :func:`proxy.messages.chain_hashes` as ``NewTurn.content_hash`` and
  :meth:`Store.resolve_session` finds the session a resent conversation continues; left out,
  it defaults to :func:`message_hash` (role, name, content, tool calls, tool call id).
  :meth:`Store.session_turn_hashes` returns them in position order.
- :func:`text_hash` identifies the exact text a vector was computed from (``turns.embed_hash``),
  so an identical text is embedded once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

JsonObject = dict[str, Any]


class StoreError(Exception):
    """Base of the errors the store raises on purpose."""


class SessionConflict(StoreError):
    """A session id is already used by another user namespace, or a parent is not the user's."""


class SessionNotFound(StoreError):
    """The session (or parent session) named does not exist."""


def _digest(payload: str) -> str:
    return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def message_hash(
    role: str,
    content: str,
    speaker: str | None = None,
    tool_calls: list[JsonObject] | None = None,
    tool_call_id: str | None = None,
) -> str:
    """A stable 128-bit hex id of a message's meaningful fields."""
    canonical = json.dumps(
        [role, speaker, content, tool_calls, tool_call_id],
        ensure_ascii=False,
        sort_keys=True,
        separators=(",", ":"),
    )
    return _digest(canonical)


def index_text(role: str, speaker: str | None, content: str) -> str:
    """The text a turn is embedded from: ``"<speaker or role>: <content>"``.

    Measured on LoCoMo: naming the speaker lifts vector recall@10 from 0.29 to 0.44.
    """
    return f"{speaker or role}: {content}"


EMBED_CHARS = 2000
"""Longest text embedded for a turn (the default model reads 256 tokens anyway)."""

RECALLED_ROLES = frozenset({"user", "assistant", "tool", "function", "summary", "fact"})
"""Roles whose turns are recalled into other conversations; system prompts and tool plumbing
are archived (nothing is lost) but never injected."""


def embed_text(role: str, speaker: str | None, content: str) -> str:
    """What a turn's vector is computed from: :func:`index_text`, cut to :data:`EMBED_CHARS`."""
    return index_text(role, speaker, content)[:EMBED_CHARS]


def text_hash(text: str) -> str:
    """A stable 128-bit hex id of a text (what its embedding is keyed by)."""
    return _digest(text)


@dataclass(frozen=True, slots=True)
class Scaffold:
    """A piece of scaffolding cut out of a turn's text (:mod:`proxy.scaffold`): stored once per
    user by ``hash`` (:mod:`proxy.store.scaffolds`), referenced by the turn at offset ``at`` of
    its words, ``lead`` and ``trail`` being the white space around ``content`` there."""

    hash: str
    kind: str
    content: str
    at: int
    lead: str = ""
    trail: str = ""


@dataclass(frozen=True, slots=True)
class NewTurn:
    """One message to archive at ``position`` (0-based, per session) of its session."""

    position: int
    role: str
    content: str
    speaker: str | None = None
    tool_calls: list[JsonObject] | None = None
    tool_call_id: str | None = None
    timestamp: float | None = None
    """Unix seconds; ``None`` means "when stored"."""
    token_count: int | None = None
    incomplete: bool = False
    """The reply was cut short (client went away, upstream failed mid-stream)."""
    content_hash: str | None = None
    """Defaults to :func:`message_hash` of the fields above."""
    embed_hash: str | None = None
    """:func:`text_hash` of the text its vector was computed from; defaults to that of
    ``content``. Only stored when a vector is."""
    api: str | None = None
    """The chat API it came through (``openai-chat``, ``anthropic``, …); None: imported."""
    scaffold: tuple[Scaffold, ...] = ()
    """What was cut out of ``content`` (the words) as scaffolding, in order."""
    sightings: tuple[str, ...] = ()
    """Hashes of the long paragraphs of ``content``: seen in another of the user's sessions,
    such a paragraph is scaffolding from then on."""
    said_hash: str | None = None
    """The hash over what was said through this message (:mod:`proxy.said`); None when it
    says nothing."""

    def identity(self) -> str:
        """``content_hash``, or the :func:`message_hash` of this message."""
        if self.content_hash is not None:
            return self.content_hash
        return message_hash(
            self.role, self.content, self.speaker, self.tool_calls, self.tool_call_id
        )


@dataclass(frozen=True, slots=True)
class Turn:
    """An archived message."""

    id: int
    session_id: str
    user_id: str
    position: int
    role: str
    speaker: str | None
    content: str
    tool_calls: list[JsonObject] | None
    tool_call_id: str | None
    timestamp: float
    token_count: int | None
    content_hash: str
    incomplete: bool
    api: str | None = None
    recall: int = 0
    """1: pinned (recalled into every chat of its user), -1: muted (never recalled), 0: as
    search finds it (:mod:`proxy.store.corrections`)."""


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation of one user namespace; sub-agent sessions have a parent."""

    id: str
    user_id: str
    parent_id: str | None
    level: int
    agent: str | None
    created_at: float
    last_seen: float
    fingerprint: str | None
    indexed: bool
    """Whether searches over all of the user's memory see this session's turns."""
    name: str
    """The id the owner's client knows it by (``X-Engram-Session``), unique per user; ``id`` is
    the global key, the same as ``name`` unless another user held that id first."""


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts and sizes for ``engram stats`` and ``/engram/metrics``."""

    schema_version: int
    users: int
    sessions: int
    turns: int
    vectors: int
    db_bytes: int
    wal_bytes: int
    per_user: dict[str, int] = field(default_factory=dict)
    """Turns per user namespace (only when stats were asked for one user or all)."""
