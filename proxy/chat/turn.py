"""What one chat request carries through the stages: the pipeline's :class:`ChatTurn` and the
memory stages' :class:`MemoryTurn` (with its :class:`Placement`). Data only."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from proxy.chat.api import Conversation
from proxy.chat.fence import Recalled, year_of
from proxy.chat.identity import Identity
from proxy.chat.prompt import Assembly
from proxy.said import Said
from proxy.sse import AssembledReply
from proxy.store.models import NewTurn, Session


@dataclass
class Placement:
    """Where this request's messages belong: the session, and which of them are new."""

    session: Session
    matched: int  # leading messages of the request already stored in this session
    explicit: bool  # named by the client (a name within its user)
    created: bool  # a new session, planned: the archive's commit creates it
    next_position: int  # the position the first new message takes
    # Other sessions holding the same messages up to here and nothing after (conversations that
    # started alike): where this request goes if another holds ``session``'s next position.
    alike: tuple[str, ...] = ()
    # Placed by what was said (proxy.said), the messages as sent being stored otherwise: of the
    # new messages only those that say something are stored (numbered from ``next_position``).
    by_words: bool = False


@dataclass
class Claim:
    """The position in its session a request holds while it runs (:mod:`proxy.chat.claims`):
    the lease's name and holder; ``released`` once given back."""

    name: str
    holder: str
    session_id: str = ""
    position: int = -1
    released: bool = False


@dataclass(frozen=True, slots=True)
class Why:
    """Why a memory was injected: ``via`` search (its fused ``score`` and 1-based ``ranks`` on
    each path), a neighbour (of the hit ``of``), a hand-back, or pinned."""

    via: str
    score: float
    ranks: dict[str, int | None]
    of: int | None = None


@dataclass
class Laid:
    """Mode ``stable`` (:mod:`proxy.chat.laying`): the blocks of one request. Earlier user
    messages' blocks laid again (index -> block text, and the memory ids each shows), and what
    is known of the current user message's."""

    blocks: dict[int, str] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    current_key: str | None = None  # the current user message's chain hash
    # A record for the current message exists: lay these memories (maybe none), search nothing,
    # with the tag its block was laid with.
    current_memories: list[Recalled] | None = None
    current_tag: str | None = None
    current_at: float | None = None  # when that block was laid (its year: fence.day)

    def shown_from(self, start: int) -> set[int]:
        """Memory ids the earlier blocks at or after ``start`` show (they stay in the prompt)."""
        return {m for i, ids in self.ids.items() if i >= start for m in ids}


@dataclass
class MemoryTurn:
    """What the memory stages learned about one chat request."""

    identity: Identity
    messages: list[dict[str, Any]]  # as the client sent them (what is archived)
    chains: list[str]
    forward_messages: list[dict[str, Any]] | None = None  # what to forward instead, when changed
    model: str | None = None
    api: str | None = None  # the chat API the request came through (recorded per turn)
    assembly: Assembly | None = None
    summary: str | None = None
    previous_start: int | None = None  # where this conversation's last window began
    memory_room: int = 0  # tokens the memory block may take in this request
    placement: Placement | None = None
    claim: Claim | None = None  # the placement's position, held until the commit stores it
    # The archive rows of the request's new messages, made beside the upstream call; committed
    # with the reply by the archive stage (once: ``committed``).
    request_rows: asyncio.Task[list[NewTurn]] | None = None
    committed: bool = False
    summary_upto: int | None = None  # after the commit, fold the turns before this into the summary
    injected: list[int] = field(default_factory=list)
    skipped: str | None = None  # why memory did nothing (housekeeping, …)
    # Why fewer memories than usual, said after the count in X-Engram-Memories: "fts-only",
    # "recall-timeout" (limits.recall_deadline), "too-many-messages" (limits.max_messages),
    # "over-budget" (the request alone fills the context: forwarded as sent).
    memory_note: str | None = None
    budget: int | None = None  # prompt tokens the upstream's context allows (None: unknown)
    # The client's messages with old bulky tool outputs swapped for slot references (same
    # length and order as ``messages``); what the assembler works on.
    view: list[dict[str, Any]] | None = None
    slot_refs: list[str] = field(default_factory=list)  # slot ids the forwarded prompt holds
    query_vector: asyncio.Task[Any] | None = None  # the recall query's embedding, under way
    request_id: str | None = None  # X-Engram-Request-Id, recorded for feedback once accepted
    recorded: bool = False  # the request record is written (or under way)
    why: dict[int, Why] = field(default_factory=dict)  # memory turn id -> why it was recalled
    memory_ms: float | None = None  # how long the memory stages took before forwarding
    # The forwarded prompt's tokens before the model's correction, as the assembler counted
    # them (what the upstream's usage report is learned against, without counting again).
    raw_tokens: int | None = None
    # Mode stable: the blocks earlier requests laid (proxy.chat.laying), and the key of the
    # current user message when what is laid before it now is to be recorded with the archive.
    laid: Laid | None = None
    block_key: str | None = None
    block_at: float = field(default_factory=time.time)  # when this request's block is laid
    said: Said = field(default_factory=Said)  # the said chain after the request's messages

    @property
    def block_year(self) -> int:
        """The year the memory block is laid in (its days of that year go without it): a
        block laid again keeps the year it was first laid in."""
        laid = self.laid.current_at if self.laid is not None else None
        return year_of(laid if laid is not None else self.block_at)


@dataclass
class ChatTurn:
    """Everything one chat request carries through the pipeline."""

    request_id: str
    mode: str  # the X-Engram-Memory mode
    conv: Conversation  # the request, protocol-neutral
    raw: bytes  # the client's bytes (forwarded as they are when nothing changed)
    forwarded: list[dict[str, Any]] | None = None  # the messages forwarded, when changed
    response_headers: dict[str, str] = field(default_factory=dict)
    memory: MemoryTurn | None = None
    status: int | None = None
    reply: AssembledReply | None = None
    client_gone: bool = False
    upstream_failed: bool = False
    expand: bool = False  # the expansion tool goes with this request (proxy.slots.expand)
    expansions: int = 0  # round trips Engram made answering its own tool
