"""Import conversations into memory: records of the JSON Lines format (:mod:`proxy.jsonl`),
stored in batches. Used by ``engram import`` and the benchmarks.

:func:`import_records` creates sessions per (user, session name: :mod:`proxy.store.naming`);
positions continue after what a session already holds; texts are embedded a batch at a time,
as the chat pipeline embeds them (``"<speaker or role>: <content>"``); a turn already stored in
its session (same :func:`~proxy.store.models.message_hash`, counted with multiplicity) is
skipped, so importing a file twice stores each turn once. Bad records are reported with their
line, good ones kept.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy import scaffold
from proxy.background.items import ITEM_ROLES
from proxy.jsonl import (
    LineError,
    Record,
    SessionRecord,
    Source,
    TurnRecord,
    export_line,
    parse_line,
    parse_record,
)
from proxy.search.embedder import Embedder
from proxy.store import scaffolds
from proxy.store.items import next_item_position
from proxy.store.models import (
    NewTurn,
    Session,
    SessionNotFound,
    StoreError,
    embed_text,
    message_hash,
    text_hash,
)
from proxy.store.naming import create_named, named_session
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store
from proxy.tokens import estimate
from proxy.vectors import Vector

__all__ = [
    "ImportReport",
    "LineError",
    "SessionRecord",
    "Source",
    "TurnRecord",
    "export_line",
    "import_records",
    "parse_line",
]

log = logging.getLogger("engram.importer")


@dataclass
class ImportReport:
    """What an import did."""

    lines: int = 0  # records seen, good and bad
    imported: int = 0  # turns stored
    duplicates: int = 0  # turns already stored in their session, skipped
    sessions: int = 0  # sessions created
    vectors: int = 0  # turns stored with a vector
    unembedded: int = 0  # turns stored without a vector because embedding failed
    errors: list[LineError] = field(default_factory=list)

    @property
    def good(self) -> int:
        return self.lines - len(self.errors)


Progress = Callable[[ImportReport], None]


def _create(
    conn: Connection, user: str, name: str, rec: SessionRecord | None, now: float
) -> Session:
    """The user's new session ``name`` (its parent, if any, a name of the same user)."""
    parent = None
    if rec is not None and rec.parent is not None:
        parent = named_session(conn, user, rec.parent)
        if parent is None:
            raise SessionNotFound(f"parent session {rec.parent!r} does not exist")
    return create_named(
        conn,
        user,
        name,
        parent_id=parent.id if parent is not None else None,
        agent=rec.agent if rec else None,
        fingerprint=None,
        indexed=rec.indexed if rec else True,
        now=now,
    )


@dataclass
class _SessionState:
    id: str  # the session's key (sessions.id)
    next_position: int
    stored: Counter[str]  # content hashes already in the session, not yet matched
    # Memory items (summaries, facts) take negative positions, as :mod:`proxy.background.items`
    # stores them.
    next_item: int = -1


@dataclass
class _Importer:
    store: Store
    embedder: Embedder | None
    redact: Callable[[str], str] | None
    report: ImportReport = field(default_factory=ImportReport)
    states: dict[tuple[str, str], _SessionState | str] = field(default_factory=dict)
    pending: list[tuple[TurnRecord, NewTurn]] = field(default_factory=list)
    storing: asyncio.Task[None] | None = None
    # The (redacted) text of each pending turn with long user paragraphs, by its index.
    texts: dict[int, str] = field(default_factory=dict)
    # user -> paragraph hash -> the session that sent it first in this import
    seen: dict[str, dict[str, str]] = field(default_factory=dict)

    async def session(self, user: str, name: str, rec: SessionRecord | None) -> _SessionState | str:
        """The state of the user's session ``name``, created if new; a string says why it
        cannot be used."""
        key = (user, name)
        known = self.states.get(key)
        if known is not None:
            return known
        state: _SessionState | str
        found = await self.store.read(lambda c: named_session(c, user, name))
        if found is not None:
            sid = found.id
            hashes = await self.store.session_turn_hashes(sid)
            item = await self.store.read(lambda c: next_item_position(c, sid))
            nxt = await self.store.next_position(sid)
            state = _SessionState(sid, nxt, Counter(hashes), item)
        else:
            now = time.time()
            try:
                created = await self.store.write(lambda c: _create(c, user, name, rec, now))
            except StoreError as exc:
                return str(exc)  # not cached: a later line may name an existing parent
            self.report.sessions += 1
            state = _SessionState(created.id, 0, Counter())
        self.states[key] = state
        return state

    async def add(self, rec: Record) -> None:
        state = await self.session(
            rec.user, rec.session, rec if isinstance(rec, SessionRecord) else None
        )
        if isinstance(state, str):
            self.report.errors.append(LineError(rec.line, state))
            return
        if isinstance(rec, SessionRecord):
            return
        content, calls = rec.content, rec.tool_calls
        if self.redact is not None:
            content = self.redact(content)
            calls = [_redact_call(c, self.redact) for c in calls] if calls else calls
        ident = message_hash(rec.role, content, rec.speaker, calls, rec.tool_call_id)
        if state.stored[ident] > 0:
            state.stored[ident] -= 1
            self.report.duplicates += 1
            return
        if rec.role in ITEM_ROLES:
            position, state.next_item = state.next_item, state.next_item - 1
        else:
            position, state.next_position = state.next_position, state.next_position + 1
        turn = _turn(rec, content, calls, position, None)
        if turn.sightings:
            self.texts[len(self.pending)] = content  # looked up again with the batch
        self.pending.append((rec, turn))

    async def repetitions(self, pending: list[tuple[TurnRecord, NewTurn]]) -> None:
        """Long user paragraphs sent in another session (stored, or earlier in this import)
        are scaffolding: the turns holding one are made again with what is known."""
        groups: dict[tuple[str, str], list[int]] = {}
        for i in self.texts:
            rec = pending[i][0]
            groups.setdefault((rec.user, rec.session), []).append(i)
        for (user, name), idx in groups.items():
            state = self.states[(user, name)]
            assert isinstance(state, _SessionState)
            sid = state.id
            hashes = sorted({h for i in idx for h in pending[i][1].sightings})
            known = await self.store.read(
                functools.partial(
                    scaffolds.known_paragraphs, user_id=user, hashes=hashes, session_id=sid
                )
            )
            seen = self.seen.setdefault(user, {})
            known |= {h for h in hashes if seen.get(h, sid) != sid}
            for i in idx:
                rec, turn = pending[i]
                if known.intersection(turn.sightings):
                    again = _turn(rec, self.texts[i], turn.tool_calls, turn.position, known)
                    pending[i] = (rec, again)
                for h in pending[i][1].sightings:
                    seen.setdefault(h, sid)
        self.texts.clear()

    async def flush(self) -> None:
        """Embed the pending turns, then store them while the caller reads and embeds the next
        batch (the writer thread and the model's cores work at once; batches are stored in
        order, one at a time)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        if self.texts:
            await self.repetitions(pending)
        vectors = await self._embed([t for _, t in pending])
        await self.finish()
        self.storing = asyncio.create_task(self._store(pending, vectors))

    async def finish(self) -> None:
        """Wait for the batch being stored (its error, if any, is raised here)."""
        storing, self.storing = self.storing, None
        if storing is not None:
            await storing

    async def _store(
        self, pending: list[tuple[TurnRecord, NewTurn]], vectors: list[Vector | None] | None
    ) -> None:
        groups: dict[tuple[str, str], list[int]] = {}
        for i, (rec, _) in enumerate(pending):
            groups.setdefault((rec.user, rec.session), []).append(i)
        for (user, name), idx in groups.items():
            state = self.states[(user, name)]
            assert isinstance(state, _SessionState)
            ids = await self.store.add_turns(
                state.id,
                user,
                [pending[i][1] for i in idx],
                [vectors[i] for i in idx] if vectors is not None else None,
            )
            self.report.imported += len(ids)
            if vectors is not None:
                self.report.vectors += sum(1 for i in idx if vectors[i] is not None)
            elif self.embedder is not None:
                self.report.unembedded += len(ids)

    async def _embed(self, turns: list[NewTurn]) -> list[Vector | None] | None:
        if self.embedder is None:
            return None
        wanted = [i for i, t in enumerate(turns) if t.content.strip()]
        try:
            vecs = await self.embedder.embed_passages(
                [embed_text(turns[i].role, turns[i].speaker, turns[i].content) for i in wanted]
            )
        except Exception:  # the text is kept; vectors can be backfilled later
            log.exception("embedding failed; importing this batch without vectors")
            return None
        out: list[Vector | None] = [None] * len(turns)
        for i, vec in zip(wanted, vecs, strict=True):
            out[i] = vec
        return out


def _turn(
    rec: TurnRecord,
    content: str,
    calls: list[dict[str, Any]] | None,
    position: int,
    known: set[str] | None,
) -> NewTurn:
    """The row of one imported turn: its words, with its scaffolding cut out
    (:mod:`proxy.scaffold`; ``known``: long paragraphs sent in other sessions)."""
    words, pieces, sightings = scaffold.archived(
        rec.role, content, known.__contains__ if known else None
    )
    return NewTurn(
        position=position,
        role=rec.role,
        content=words,
        speaker=rec.speaker,
        tool_calls=calls,
        tool_call_id=rec.tool_call_id,
        timestamp=rec.timestamp,
        token_count=max(1, estimate(words)),
        incomplete=rec.incomplete,
        content_hash=message_hash(rec.role, content, rec.speaker, calls, rec.tool_call_id),
        embed_hash=text_hash(embed_text(rec.role, rec.speaker, words)),
        scaffold=pieces,
        sightings=sightings,
    )


def _redact_call(call: dict[str, Any], redact: Callable[[str], str]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    return {**call, "function": {**fn, "arguments": redact(fn["arguments"])}}


async def import_records(
    store: Store,
    embedder: Embedder | None,
    records: Iterable[tuple[int, Source]],
    batch: int,
    on_progress: Progress | None = None,
    *,
    redact: Callable[[str], str] | None = None,
) -> ImportReport:
    """Store ``(line number, record)`` pairs; bad records are reported, good ones kept.

    A record is a decoded JSON object or what :func:`parse_line` returned. Every ``batch``
    records, pending turns are embedded (``embedder=None``: no vectors), stored and
    ``on_progress`` is called. ``redact`` rewrites texts before they are hashed and stored.
    """
    if batch < 1:
        raise ValueError("batch must be at least 1")
    job = _Importer(store, embedder, redact)
    report = job.report
    for line_no, source in records:
        report.lines += 1
        rec = source if isinstance(source, Record | LineError) else parse_record(line_no, source)
        if isinstance(rec, LineError):
            report.errors.append(rec)
        else:
            await job.add(rec)
        if report.lines % batch == 0:
            await job.flush()
            if on_progress is not None:
                on_progress(report)
    await job.flush()
    await job.finish()
    if on_progress is not None:
        on_progress(report)
    return report
