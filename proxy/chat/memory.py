"""The memory stages of a chat turn: identify → place → recall → rewrite; then archive.

On the request path: resolve the user and session (one indexed query, plus a tiny write when a
session is new), then one hybrid search and the injection. The request's new messages (redacted
beside the upstream call) and the reply are archived by :meth:`MemoryService.commit` in one write
transaction, which the pipeline runs when the upstream's reply has ended and before the client
gets its last byte: the next request of a conversation, however fast it follows, finds this one
stored, and a turn the client received survives a crash of Engram. Vectors follow in the
background (:mod:`proxy.indexer`). A client that goes away loses nothing that reached Engram: what
arrived is committed in the background.

Sessions: an explicit id (header or body) names the session, scoped to its user. Without one the
conversation is recognised by its chain of message hashes (``proxy.identity``): a stored session
whose turns are a prefix of this request, matched through at least the first assistant reply, is
continued; one whose stored turns go on differently after the match (an edited or regenerated
message) is forked: the new session stores the turns from the point where they differ. The commit
checks the placement again inside its transaction: if a concurrent request of the same
conversation stored something else at these positions meanwhile, the rest forks there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.background.feedback import Feedback
from proxy.background.handback import Handback
from proxy.background.indexer import Indexer
from proxy.background.items import session_items
from proxy.background.summarizer import Summarizer, get_summary
from proxy.chat.fence import Memory, approx_tokens, memory_block
from proxy.chat.identity import Identity, identify, is_housekeeping
from proxy.chat.prompt import Assembly, Message, assemble
from proxy.config import Settings
from proxy.errors import NestingLimitExceeded, ParentNotFound
from proxy.logs import event
from proxy.messages import (
    anchor_length,
    chain_hashes,
    content_text,
    extend_chain,
    last_user_text,
    without_lone_surrogates,
)
from proxy.redact import redact
from proxy.search.embedder import Embedder
from proxy.search.retrieval import Hit, Retriever
from proxy.slots.refs import TOOL_ROLES, Candidate, references
from proxy.slots.refs import apply as apply_slots
from proxy.slots.refs import find as find_outputs
from proxy.slots.store import SlotStore
from proxy.store import queries
from proxy.store.db import Connection
from proxy.store.models import EMBED_CHARS, NewTurn, Session, Turn, embed_text, text_hash
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks
from proxy.tokens import TokenCounter

log = logging.getLogger("engram.memory")

# Roles whose turns are recalled into other conversations; system prompts and tool plumbing
# are archived (nothing is lost) but never injected.
RECALLED_ROLES = frozenset({"user", "assistant", "tool", "function", "summary", "fact"})
# Tokens kept spare beyond the reply's room: chat templates add their own.
PROMPT_MARGIN = 32
PROMPT_SAFETY = 0.05  # share of the budget left unused: token estimates err by a few percent
# Messages whose token counts are remembered (by chain hash) across requests.
SIZE_CACHE = 50_000
LAST_REQUESTS = 1000
# New messages with more text than this are made into archive rows on a thread.
THREAD_CHARS = 20_000


@dataclass
class Placement:
    """Where this request's messages belong: the session, and which of them are new."""

    session: Session
    matched: int  # leading messages of the request already stored in this session
    explicit: bool
    created: bool
    next_position: int  # the position the first new message takes


@dataclass
class MemoryTurn:
    """What the memory stages learned about one chat request."""

    identity: Identity
    messages: list[dict[str, Any]]  # as the client sent them (what is archived)
    chains: list[str]
    forward: list[dict[str, Any]] | None = None  # what to forward instead, when changed
    model: str | None = None
    assembly: Assembly | None = None
    summary: str | None = None
    previous_start: int | None = None  # where this conversation's last window began
    memory_room: int = 0  # tokens the memory block may take in this request
    placement: Placement | None = None
    # The archive rows of the request's new messages, made beside the upstream call; committed
    # with the reply by MemoryService.commit (once: ``committed``).
    request_rows: asyncio.Task[list[NewTurn]] | None = None
    committed: bool = False
    summary_upto: int | None = None  # after the commit, fold the turns before this into the summary
    injected: list[int] = field(default_factory=list)
    skipped: str | None = None  # why memory did nothing (housekeeping, …)
    budget: int | None = None  # prompt tokens the upstream's context allows (None: unknown)
    # The client's messages with old bulky tool outputs swapped for slot references (same
    # length and order as ``messages``); what the assembler works on.
    view: list[dict[str, Any]] | None = None
    slot_refs: list[str] = field(default_factory=list)  # slot ids the forwarded prompt holds
    query_vector: asyncio.Task[Any] | None = None  # the recall query's embedding, under way


def scoped_session_id(explicit: str, user: str, owner: str | None) -> str:
    """A client-chosen session id, kept as is unless another user already owns it."""
    if owner is None or owner == user:
        return explicit
    return f"{explicit}~{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def _max_position(conn: Connection, session_id: str) -> int:
    row = conn.execute(
        "SELECT max(position) FROM turns WHERE session_id = ?", (session_id,)
    ).fetchone()
    return -1 if row is None or row[0] is None else int(row[0])


def _turns_at(
    conn: Connection, user_id: str, places: Sequence[tuple[str, int]]
) -> dict[tuple[str, int], Memory]:
    """The user's turns at these (session id, position) places, as memories (score 0), by place:
    one query, each place an exact lookup in the (session_id, position) index (CROSS JOIN keeps
    SQLite from walking the user's whole turns_user index instead)."""
    if not places:
        return {}
    rows = conn.execute(
        "SELECT t.id, t.session_id, t.position, t.role, t.speaker, t.content, t.timestamp"
        " FROM json_each(?) AS p CROSS JOIN turns AS t"
        " ON t.session_id = json_extract(p.value, '$[0]')"
        " AND t.position = json_extract(p.value, '$[1]')"
        " WHERE t.user_id = ?",
        (json.dumps(places), user_id),
    )
    return {(r[1], r[2]): Memory(r[0], r[3], r[4], r[5], r[6], r[1], 0.0) for r in rows}


def _owner(conn: Connection, session_id: str) -> str | None:
    row = conn.execute("SELECT user_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return None if row is None else str(row[0])


def _new_session(
    conn: Connection,
    user: str,
    sid: str,
    fingerprint: str | None,
    now: float,
    parent: Session | None = None,
    agent: str | None = None,
) -> Session:
    return queries.get_or_create_session(
        conn,
        user,
        sid,
        parent_id=parent.id if parent else None,
        agent=agent,
        fingerprint=fingerprint,
        indexed=parent is None,  # a sub-agent's raw turns stay out of everyone else's search
        max_level=None,
        now=now,
    )


def check_parent(conn: Connection, user: str, parent_id: str, max_depth: int) -> Session:
    """The parent session of a sub-agent request, or the 4xx that says why not."""
    parent = queries.get_session(conn, parent_id)
    if parent is None or parent.user_id != user:
        raise ParentNotFound(
            f"X-Engram-Parent names session {parent_id!r}, which does not exist for this user."
        )
    if parent.level + 1 > max_depth:
        raise NestingLimitExceeded(
            f"Sub-agent sessions nest at most {max_depth} deep (sessions.max_depth = "
            f"{max_depth}); session {parent_id!r} is already at depth {parent.level}."
        )
    return parent


@dataclass(frozen=True)
class Request:
    """Who is asking, about which conversation (the inputs of :func:`place`)."""

    user: str
    explicit: str | None
    chains: Sequence[str]
    anchor: int | None
    parent: str | None = None
    agent: str | None = None
    max_depth: int = 2


def place(conn: Connection, req: Request, create: bool, now: float) -> Placement | None:
    """Find (and with ``create``, make) the session of a request. Runs in one transaction."""
    user, chains, anchor = req.user, req.chains, req.anchor
    parent = check_parent(conn, user, req.parent, req.max_depth) if req.parent else None
    if req.explicit is not None:
        sid = req.explicit
        owner = _owner(conn, sid)
        if owner is not None and owner != user:
            sid = scoped_session_id(req.explicit, user, owner)
            owner = _owner(conn, sid)
        if owner is None:
            if not create:
                return None
            session = _new_session(conn, user, sid, None, now, parent, req.agent)
            return Placement(session, 0, True, True, 0)
        found_session = queries.get_session(conn, sid)
        assert found_session is not None
        session = found_session
        stored = set(queries.session_turn_hashes(conn, sid))
        matched = 0
        for h in chains:  # the longest stored prefix; chain hashes make prefixes unique
            if h not in stored:
                break
            matched += 1
        return Placement(session, matched, True, False, _max_position(conn, sid) + 1)

    found = (
        queries.resolve_session(
            conn, user, list(chains), min_length=anchor, parent_id=parent.id if parent else None
        )
        if anchor is not None
        else None
    )
    if found is not None:
        session, matched = found
        last = _max_position(conn, session.id)
        if last < matched:  # nothing stored past the match: the same conversation, continued
            return Placement(session, matched, False, False, matched)
        if matched == len(chains) and last == matched - 1:
            return Placement(session, matched, False, False, matched)
        fork_from = session
    else:
        fork_from = None
        matched = 0
    if not create:
        return None
    fingerprint = chains[anchor - 1] if anchor is not None and len(chains) >= anchor else None
    sid = "s-" + uuid.uuid4().hex[:20]
    session = _new_session(conn, user, sid, fingerprint, now, parent, req.agent)
    if fork_from is not None:
        log.debug("conversation forked from %s at message %d", fork_from.id, matched)
    return Placement(session, matched, False, True, matched)


def to_new_turns(
    messages: Sequence[Mapping[str, Any]],
    chains: Sequence[str],
    first: int,
    redact_secrets: bool,
    now: float,
    *,
    incomplete: bool = False,
) -> list[NewTurn]:
    """Archive rows for ``messages`` (already known new), positions from ``first``."""
    out: list[NewTurn] = []
    for i, (msg, chain) in enumerate(zip(messages, chains, strict=True)):
        text = content_text(msg.get("content"))
        calls = msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else None
        if redact_secrets:
            text = redact(text)
            if calls:
                calls = [_redact_call(c) for c in calls]
        name = msg.get("name") if isinstance(msg.get("name"), str) else None
        call_id = msg.get("tool_call_id") if isinstance(msg.get("tool_call_id"), str) else None
        role = str(msg.get("role"))
        out.append(
            NewTurn(
                position=first + i,
                role=role,
                content=text,
                speaker=name,
                tool_calls=calls,
                tool_call_id=call_id,
                timestamp=now,
                token_count=approx_tokens(text),
                incomplete=incomplete,
                content_hash=chain,
                embed_hash=text_hash(embed_text(role, name, text)),
            )
        )
    return out


def _redact_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        fn["arguments"] = redact(fn["arguments"])
    return {**call, "function": fn}


class MemoryService:
    """Owns the memory stages for the chat pipeline."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        embedder: Embedder | None,
        retriever: Retriever,
        tasks: BackgroundTasks,
        tokens: TokenCounter | None = None,
        context_size: Callable[[str | None], Awaitable[int | None]] | None = None,
        summarizer: Summarizer | None = None,
        handback: Handback | None = None,
        feedback: Feedback | None = None,
        slots: SlotStore | None = None,
        indexer: Indexer | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.embedder = embedder
        self.retriever = retriever
        self.tasks = tasks
        self.tokens = tokens or TokenCounter()
        self.context_size = context_size
        self.summarizer = summarizer
        self.handback = handback
        self.feedback = feedback
        self.slots = slots
        self.indexer = indexer
        self._sizes: OrderedDict[str, int] = OrderedDict()  # chain hash -> message tokens
        self._raw_counts: OrderedDict[str, int] = OrderedDict()  # text hash -> tokens
        # session id -> (when, assembly) of its last forwarded prompt, for the visibility API
        self.last_requests: OrderedDict[str, tuple[float, Assembly]] = OrderedDict()
        extra = settings.memory.housekeeping_patterns
        self._housekeeping = (
            re.compile("|".join(f"(?:{p})" for p in extra), re.I) if extra else None
        )
        self.archived_turns = 0

    async def before_forward(
        self, headers: Mapping[str, str], body: dict[str, Any], mode: str
    ) -> MemoryTurn:
        """Identify, schedule the archive, retrieve and inject. Mutates nothing it is given;
        returns what it decided (``mt.forward``, when set, is the messages to forward)."""
        messages: list[dict[str, Any]] = without_lone_surrogates(body["messages"])
        ident = identify(headers, body)
        housekeeping = is_housekeeping(messages, self._housekeeping)
        write = mode in ("on", "write-only")
        recall = mode in ("on", "read-only")
        # The query's embedding starts now, on the embedder's thread, while the conversation is
        # hashed and placed.
        query = self._query_vector(messages) if recall and not housekeeping else None
        try:
            return await self._before_forward(
                ident, messages, body, housekeeping, write, recall, query
            )
        finally:
            if query is not None and not query.done():
                query.cancel()

    def _query_vector(self, messages: Sequence[Mapping[str, Any]]) -> asyncio.Task[Any] | None:
        s = self.settings.retrieval
        if s.top_k <= 0 or s.budget_tokens <= 0:
            return None
        task = self.retriever.embed_query(last_user_text(messages))
        if task is not None:  # an unused or failed embedding is dropped quietly
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _before_forward(
        self,
        ident: Identity,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        housekeeping: bool,
        write: bool,
        recall: bool,
        query: asyncio.Task[Any] | None,
    ) -> MemoryTurn:
        mt = MemoryTurn(ident, messages, chain_hashes(messages), query_vector=query)
        mt.model = body.get("model") if isinstance(body.get("model"), str) else None
        if housekeeping:
            mt.skipped = "housekeeping"
            return mt
        now = time.time()
        anchor = anchor_length(messages)
        req = Request(
            ident.user,
            ident.explicit_session,
            mt.chains,
            anchor,
            ident.parent,
            ident.agent,
            self.settings.sessions.max_depth,
        )
        mt.placement = await (self.store.write if write else self.store.read)(
            lambda c: place(c, req, write, now)
        )
        try:
            await self._compose(mt, body, recall=recall)
        finally:
            # The archive rows are made while the upstream answers; the commit writes them.
            if write and mt.placement is not None:
                mt.request_rows = self.tasks.spawn(self._request_rows(mt, now), name="archive-rows")
        a = mt.assembly
        if write and a is not None and a.rewritten and mt.placement is not None:
            mt.summary_upto = a.window_start
        return mt

    def record_request(self, request_id: str, mt: MemoryTurn) -> None:
        """Remember the request (in the background) so that feedback can name it."""
        if self.feedback is None or mt.skipped is not None:
            return
        self.feedback.record(
            request_id,
            mt.identity.user,
            mt.placement.session.id if mt.placement is not None else None,
            last_user_text(mt.messages),
            mt.injected,
            mt.model,
        )

    def _schedule_summary(self, mt: MemoryTurn, upto: int) -> None:
        """Fold what aged out of the window into the session's summary, after the archive."""
        summarizer, placement = self.summarizer, mt.placement
        if summarizer is None or placement is None:
            return
        if not summarizer.wanted(placement.session.id, upto):
            return

        async def run() -> None:
            await summarizer.update(placement.session.id, upto, mt.model)

        self.tasks.spawn(run(), name="summary")

    async def _budget(self, body: Mapping[str, Any], model: str | None) -> int | None:
        """Prompt tokens available: the context size minus the room kept for the reply."""
        if self.context_size is None:
            return None
        try:
            ctx = await self.context_size(model)
        except Exception:
            log.exception("could not learn the upstream's context size")
            return None
        if not ctx:
            return None
        reserve = body.get("max_completion_tokens") or body.get("max_tokens")
        if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve <= 0:
            reserve = min(self.settings.prompt.reply_reserve, ctx // 4)
        # Counts are estimates (another tokenizer, corrected on average): keep a safety share.
        return max(0, int((ctx - reserve) * (1 - PROMPT_SAFETY)) - PROMPT_MARGIN)

    async def _message_sizes(self, mt: MemoryTurn) -> dict[int, int]:
        """Token counts of the client's messages by ``id()``, cached by chain hash across
        requests (clients resend the history); large uncached batches go to a thread."""
        missing = [
            (m, h) for m, h in zip(mt.messages, mt.chains, strict=True) if h not in self._sizes
        ]
        if missing:

            def count_all() -> list[int]:
                return [self.tokens.messages([m]) for m, _ in missing]

            chars = sum(len(content_text(m.get("content"))) for m, _ in missing)
            counts = await asyncio.to_thread(count_all) if chars > 20_000 else count_all()
            for (_, h), n in zip(missing, counts, strict=True):
                self._sizes[h] = n
            while len(self._sizes) > SIZE_CACHE:
                self._sizes.popitem(last=False)
        ratio = self.tokens.factor(mt.model)
        return {
            id(m): round(self._sizes[h] * ratio)
            for m, h in zip(mt.messages, mt.chains, strict=True)
        }

    async def _compose(self, mt: MemoryTurn, body: Mapping[str, Any], recall: bool) -> None:
        """Recall memories for what the window does not hold, then assemble the prompt."""
        s = self.settings
        budget = mt.budget = await self._budget(body, mt.model)
        sizes = await self._message_sizes(mt)
        model = mt.model
        view = mt.view = await self._slot_view(mt)
        if view is not mt.messages:  # the references, counted once (the assembler asks often)
            factor = self.tokens.factor(model)
            for m in view:
                if id(m) not in sizes:
                    sizes[id(m)] = round(self.tokens.messages([m]) * factor)

        def count_text(text: str) -> int:
            return self.tokens.count(text, model)

        def count(msg: Message) -> int:
            n = sizes.get(id(msg))
            return (
                n
                if n is not None
                else round(self.tokens.messages([msg]) * self.tokens.factor(model))
            )

        if budget is not None and mt.placement is not None and self.summarizer is not None:
            sid = mt.placement.session.id
            found = await self.store.read(lambda c: get_summary(c, sid))
            mt.summary = found.content if found else None
        if mt.placement is not None:
            last = self.last_requests.get(mt.placement.session.id)
            mt.previous_start = last[1].window_start if last and last[1].rewritten else None
        mt.memory_room = self._memory_room(budget) if recall else 0
        mem_room = mt.memory_room
        draft = assemble(
            view,
            budget=None if budget is None else budget - mem_room,
            count=count,
            count_text=count_text,
            mode=s.prompt.mode,
            whole_share=s.prompt.whole_share,
            summary=mt.summary,
            previous_start=mt.previous_start,
        )
        memories = await self._recall(mt, draft.window_start) if recall else []
        final = self._assemble(mt, memories, budget, count, count_text)
        in_window = _texts(mt.messages[final.window_start :])
        if any(text_hash(m.content[:EMBED_CHARS]) in in_window for m in memories):
            memories = [m for m in memories if text_hash(m.content[:EMBED_CHARS]) not in in_window]
            final = self._assemble(mt, memories, budget, count, count_text)
        if view is not mt.messages:  # the client's own count, before its outputs became slots
            final.original_tokens = sum(count(m) for m in mt.messages)
        mt.assembly = final
        if self.summarizer is not None:
            self.summarizer.account_prompt(final.tokens)
        if final.messages != mt.messages:
            mt.forward = final.messages
            mt.slot_refs = references(final.messages) if mt.slot_refs else []
        if mt.placement is not None:
            self.last_requests[mt.placement.session.id] = (time.time(), final)
            while len(self.last_requests) > LAST_REQUESTS:
                self.last_requests.popitem(last=False)

    async def _slot_view(self, mt: MemoryTurn) -> list[dict[str, Any]]:
        """The messages with old bulky tool outputs swapped for references to stored slots.
        An output that could be stored nowhere stays raw: nothing is ever dropped."""
        s = self.settings.slots
        if self.slots is None or not s.enabled:
            return mt.messages
        tool_chars = sum(
            len(content_text(m.get("content")))
            for m in mt.messages
            if m.get("role") in TOOL_ROLES or (s.detect_text_results and m.get("role") == "user")
        )
        if tool_chars <= s.min_tokens:
            return mt.messages

        def plan() -> list[Candidate]:
            return find_outputs(
                mt.messages,
                min_tokens=s.min_tokens,
                keep_recent=s.keep_recent,
                count=self._raw_tokens,
                detect_text=s.detect_text_results,
            )

        found = await asyncio.to_thread(plan) if tool_chars > 20_000 else plan()
        if not found:
            return mt.messages
        unique = list({c.slot.id: c.slot for c in found}.values())
        try:
            stored = await self.slots.put_many(mt.identity.user, unique)
        except Exception:  # put_many never raises; if it did, the outputs go raw
            log.exception("storing tool-result slots failed; forwarding them raw")
            return mt.messages
        keep = [c for c in found if c.slot.id in stored]
        mt.slot_refs = list(dict.fromkeys(c.slot.id for c in keep))
        return apply_slots(mt.messages, keep) if keep else mt.messages

    def _raw_tokens(self, text: str) -> int:
        """Tokens of a tool output by the fixed tokenizer (deterministic: the reference's
        description holds it), cached by content hash."""
        key = hashlib.sha1(text.encode()).hexdigest()
        n = self._raw_counts.get(key)
        if n is None:
            n = self._raw_counts[key] = self.tokens.raw(text)
            while len(self._raw_counts) > SIZE_CACHE:
                self._raw_counts.popitem(last=False)
        return n

    def _memory_room(self, budget: int | None) -> int:
        """Tokens the memory block may take: its cap, and a share of the prompt budget."""
        r = self.settings.retrieval
        if budget is None:
            return r.budget_tokens
        return max(0, min(r.budget_tokens, int(r.budget_share * budget)))

    def _assemble(
        self,
        mt: MemoryTurn,
        memories: list[Memory],
        budget: int | None,
        count: Callable[[Message], int],
        count_text: Callable[[str], int],
    ) -> Assembly:
        s = self.settings
        block, used = memory_block(memories, mt.memory_room, count_text)
        mt.injected = [m.id for m in used]
        return assemble(
            mt.view if mt.view is not None else mt.messages,
            budget=budget,
            count=count,
            count_text=count_text,
            memory_block=block,
            memory_ids=mt.injected,
            mode=s.prompt.mode,
            whole_share=s.prompt.whole_share,
            summary=mt.summary,
            previous_start=mt.previous_start,
        )

    async def _recall(self, mt: MemoryTurn, window_start: int) -> list[Memory]:
        """The best memories for the new user message that the forwarded window lacks."""
        s = self.settings.retrieval
        query = last_user_text(mt.messages)
        if not query or s.top_k <= 0 or s.budget_tokens <= 0:
            return []
        head = (
            mt.messages[:1]
            if mt.messages and mt.messages[0].get("role") in ("system", "developer")
            else []
        )
        present = _texts([*head, *mt.messages[window_start:]])

        def wanted(role: str, content: str) -> bool:
            if role not in RECALLED_ROLES or not content.strip():
                return False
            return text_hash(content[:EMBED_CHARS]) not in present

        def keep(turn: Turn) -> bool:
            return wanted(turn.role, turn.content)

        session = mt.placement.session if mt.placement else None
        if session is None and mt.identity.parent is not None:
            return []  # a sub-agent with nothing stored yet (read-only) has nothing of its own
        # A sub-agent recalls from its own session only: never a sibling's or its parent's turns.
        scope = [session.id] if session is not None and session.parent_id else None
        extra: list[Memory] = []
        if (
            scope
            and session is not None
            and session.parent_id
            and self.settings.sessions.subagent_sees_parent_summary
        ):
            parent_id = session.parent_id
            found = await self.store.read(lambda c: get_summary(c, parent_id))
            if found is not None:
                extra.append(
                    Memory(
                        0,
                        "summary",
                        "parent conversation (summary)",
                        found.content,
                        found.updated_at,
                        parent_id,
                        1.0,
                    )
                )
        if session is not None and not scope:
            # What this conversation's sub-agents handed back comes first, searched or not.
            sid = session.id
            for item in await self.store.read(lambda c: session_items(c, sid, "summary", 3)):
                if keep(item):
                    extra.append(
                        Memory(
                            item.id,
                            item.role,
                            item.speaker,
                            item.content,
                            item.timestamp,
                            item.session_id,
                            1.0,
                        )
                    )
        try:
            hits = await self.retriever.search(
                mt.identity.user,
                query,
                s.top_k,
                keep=keep,
                session_ids=scope,
                query_vector=mt.query_vector,
            )
        except Exception:  # memory degrades, the request goes on
            log.exception("retrieval failed; forwarding without memories")
            return extra
        near: dict[int, list[Memory]] = {}
        if s.neighbours > 0 and hits:
            try:
                near = await self._neighbours(mt.identity.user, hits, s.neighbours, wanted)
            except Exception:  # the hits alone still help
                log.exception("reading neighbour turns failed; recalling the hits alone")
        out = list(extra)
        seen = {m.id for m in extra}
        for h in hits:
            hit = Memory(
                h.turn.id,
                h.turn.role,
                h.turn.speaker,
                h.turn.content,
                h.turn.timestamp,
                h.turn.session_id,
                h.score,
            )
            for m in (hit, *near.get(h.turn.id, ())):
                if m.id not in seen:
                    seen.add(m.id)
                    out.append(m)
        return out

    async def _neighbours(
        self,
        user: str,
        hits: Sequence[Hit],
        n: int,
        wanted: Callable[[str, str], bool],
    ) -> dict[int, list[Memory]]:
        """Each hit's same-session neighbours (positions ±1..n) that ``wanted`` keeps, by hit id:
        nearest first, the next turn before the previous one; each scores slightly below its hit.
        One store read for all hits. Memory items (negative positions) have no neighbours."""
        offsets = [d for i in range(1, n + 1) for d in (i, -i)]
        places = sorted(
            {
                (h.turn.session_id, h.turn.position + d)
                for h in hits
                if h.turn.position >= 0
                for d in offsets
                if h.turn.position + d >= 0
            }
        )
        found = await self.store.read(lambda c: _turns_at(c, user, places))
        out: dict[int, list[Memory]] = {}
        for h in hits:
            if h.turn.position < 0:
                continue
            for d in offsets:
                m = found.get((h.turn.session_id, h.turn.position + d))
                if m is not None and wanted(m.role, m.content):
                    score = h.score * (1 - 0.01 * abs(d))
                    out.setdefault(h.turn.id, []).append(dataclasses.replace(m, score=score))
        return out

    async def _request_rows(self, mt: MemoryTurn, now: float) -> list[NewTurn]:
        """Archive rows for the request's messages that its session does not hold yet."""
        placement = mt.placement
        assert placement is not None
        first = placement.matched
        new = mt.messages[first:]

        def make() -> list[NewTurn]:
            return to_new_turns(
                new,
                mt.chains[first:],
                placement.next_position,
                self.settings.memory.redact_secrets,
                now,
            )

        chars = sum(len(content_text(m.get("content"))) for m in new)
        return await asyncio.to_thread(make) if chars > THREAD_CHARS else make()

    async def commit(
        self, mt: MemoryTurn, reply_message: dict[str, Any] | None, complete: bool
    ) -> None:
        """Archive the request's new messages and the reply in one write transaction (at most
        once per request), then embed them and fold aged turns into the summary, both in the
        background. The caller shields this from cancellation."""
        placement = mt.placement
        if placement is None or mt.committed:
            return
        mt.committed = True
        rows = list(await mt.request_rows) if mt.request_rows is not None else []
        now = time.time()
        if reply_message is not None and (
            content_text(reply_message.get("content")) or reply_message.get("tool_calls")
        ):
            reply_message = without_lone_surrogates(reply_message)
            prev = mt.chains[-1] if mt.chains else ""
            position = placement.next_position + len(mt.messages) - placement.matched
            rows += to_new_turns(
                [reply_message],
                [extend_chain(prev, reply_message)],
                position,
                self.settings.memory.redact_secrets,
                now,
                incomplete=not complete,
            )
        if rows:
            session, inserted = await self.store.write(
                lambda c: commit_turns(c, placement, rows, now)
            )
            self.archived_turns += len(inserted)
            if session.id != placement.session.id:
                mt.placement = dataclasses.replace(placement, session=session)
            event(log, logging.DEBUG, "archived", session=session.id, turns=len(inserted))
            if self.indexer is not None:
                self.indexer.submit(inserted)
        if mt.summary_upto is not None:
            self._schedule_summary(mt, mt.summary_upto)


def commit_turns(
    conn: Connection, placement: Placement, rows: list[NewTurn], now: float
) -> tuple[Session, list[tuple[int, NewTurn]]]:
    """Store a request's rows where its placement says, checked again inside this transaction;
    returns the session they went to and the (id, row) of each row inserted.

    In a session named by the client, rows are appended after its last turn (those it holds
    already are skipped). Otherwise each row has its position: one the session holds with the
    same chain hash is already stored; one it holds with another hash means a concurrent request
    of this conversation went another way meanwhile, so this row and the rest go to a new
    session forked there (as :func:`place` forks an edited conversation).
    """
    session = queries.get_session(conn, placement.session.id)
    if session is None:  # forgotten while the request ran: nothing to add it to
        log.info("session %s was deleted during the request; not archived", placement.session.id)
        return placement.session, []
    if placement.explicit:
        return session, _append(conn, session, rows, now)
    stored = dict(
        conn.execute(
            "SELECT position, content_hash FROM turns WHERE session_id = ? AND position >= ?",
            (session.id, min(r.position for r in rows)),
        ).fetchall()
    )
    fresh: list[NewTurn] = []
    for i, row in enumerate(rows):
        held = stored.get(row.position)
        if held is None:
            fresh.append(row)
        elif held != row.identity():
            parent = queries.get_session(conn, session.parent_id) if session.parent_id else None
            fork = _new_session(
                conn,
                session.user_id,
                "s-" + uuid.uuid4().hex[:20],
                session.fingerprint,
                now,
                parent,
                session.agent,
            )
            log.debug("concurrent requests diverged: forked %s at %d", session.id, row.position)
            inserted = _insert(conn, session, fresh, now)
            return fork, inserted + _insert(conn, fork, rows[i:], now)
    return session, _insert(conn, session, fresh, now)


def _insert(
    conn: Connection, session: Session, rows: list[NewTurn], now: float
) -> list[tuple[int, NewTurn]]:
    """Archive rows now, index them later (proxy.indexer): what the commit can afford."""
    return queries.insert_turns(
        conn, session.id, session.user_id, rows, None, now, fts_pending=True
    )


def _append(
    conn: Connection, session: Session, rows: list[NewTurn], now: float
) -> list[tuple[int, NewTurn]]:
    """Append the rows the session does not hold yet, numbered after its last turn."""
    stored = set(queries.session_turn_hashes(conn, session.id))
    keep = [r for r in rows if r.identity() not in stored]
    base = _max_position(conn, session.id) + 1
    fresh = [dataclasses.replace(r, position=base + n) for n, r in enumerate(keep)]
    return _insert(conn, session, fresh, now)


# Characters past EMBED_CHARS that redaction reads too, so that a secret straddling the cut is
# still recognised (redacting the whole of a 30 kB tool output on every request cost 35 ms).
REDACT_MARGIN = 4096
_TEXT_HASHES: OrderedDict[str, tuple[str, str]] = OrderedDict()


def _texts(messages: Sequence[Mapping[str, Any]]) -> set[str]:
    """Hashes of the messages' texts as archived (redacted) and as sent (their first
    EMBED_CHARS characters), remembered by the hash as sent: clients resend the history."""
    out: set[str] = set()
    for m in messages:
        text = content_text(m.get("content"))
        plain = text_hash(text[:EMBED_CHARS])
        found = _TEXT_HASHES.get(plain)
        if found is None:
            redacted = text_hash(redact(text[: EMBED_CHARS + REDACT_MARGIN])[:EMBED_CHARS])
            found = _TEXT_HASHES[plain] = (plain, redacted)
            while len(_TEXT_HASHES) > SIZE_CACHE:
                _TEXT_HASHES.popitem(last=False)
        out.update(found)
    return out
