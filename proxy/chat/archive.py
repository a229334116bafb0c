"""Archiving a turn: the rows of the request's new messages (made beside the upstream call) and
of the reply, written in one transaction once the reply is whole, before the client's last byte.

Only the rows are written there (``fts_pending``; about a third of a millisecond): the next
request of the conversation, however fast it follows, finds them, and a turn the client received
survives a crash of Engram. Full-text rows and vectors follow in the background
(:mod:`proxy.background.indexer`). Secrets are redacted before anything is written. What a
client sends again and again (system prompts, reminder and environment blocks, retries) is cut
out of a turn's text and stored once per user (:mod:`proxy.scaffold`,
:mod:`proxy.store.scaffolds`): a turn holds the words. A message
longer than ``limits.max_message_bytes`` is stored cut there, with a note; a user over
``limits.max_turns_per_user`` gets no new turns (:mod:`proxy.chat.quota`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from proxy import scaffold
from proxy.background.indexer import Indexer
from proxy.chat.claims import Claims
from proxy.chat.quota import TurnQuota
from proxy.chat.sessions import commit_turns
from proxy.chat.turn import MemoryTurn
from proxy.limits import cut_text
from proxy.logs import event
from proxy.messages import content_text, extend_chain, without_lone_surrogates
from proxy.redact import redact
from proxy.said import client_reply, said_chain, step
from proxy.store import scaffolds
from proxy.store.blocks import put_block
from proxy.store.models import NewTurn, Session, embed_text, text_hash
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store
from proxy.tokens import estimate

log = logging.getLogger("engram.archive")

# A request with more text than this, or more messages, is made into archive rows on a thread.
THREAD_CHARS = 20_000
THREAD_MESSAGES = 32


def to_new_turns(
    messages: Sequence[Mapping[str, Any]],
    chains: Sequence[str],
    first: int,
    redact_secrets: bool,
    now: float,
    *,
    incomplete: bool = False,
    max_bytes: int = 0,
    api: str | None = None,
    texts: Sequence[str] | None = None,
    known: Collection[str] = (),
    said: Sequence[str | None] | None = None,
    client_replies: Sequence[bool] | None = None,
) -> list[NewTurn]:
    """Archive rows for ``messages`` (already known new), positions from ``first``; a text
    longer than ``max_bytes`` (UTF-8; 0: any length) is stored cut, with a note. Each row holds
    the message's words; its scaffolding (:mod:`proxy.scaffold`) goes with it as pieces, a user's
    long paragraph whose hash is in ``known`` among them. ``texts``: the messages' texts as
    :func:`archive_texts` made them, when the caller has them already; ``said``: each message's
    said hash (:mod:`proxy.said`); ``client_replies``: which are replies to a client's own
    context (:func:`proxy.said.client_reply`)."""
    if texts is None:
        texts = archive_texts(messages, redact_secrets, max_bytes)
    if said is None:
        said = [None] * len(messages)
    if client_replies is None:
        client_replies = [False] * len(messages)
    is_known = known.__contains__ if known else None
    out: list[NewTurn] = []
    for i, (msg, chain, text, said_hash, clients_own) in enumerate(
        zip(messages, chains, texts, said, client_replies, strict=True)
    ):
        calls = msg.get("tool_calls") if isinstance(msg.get("tool_calls"), list) else None
        if redact_secrets and calls:
            calls = [_redact_call(c) for c in calls]
        name = msg.get("name") if isinstance(msg.get("name"), str) else None
        call_id = msg.get("tool_call_id") if isinstance(msg.get("tool_call_id"), str) else None
        role = str(msg.get("role"))
        words, pieces, sightings = scaffold.archived(role, text, is_known, clients_own)
        out.append(
            NewTurn(
                position=first + i,
                role=role,
                content=words,
                speaker=name,
                tool_calls=calls,
                tool_call_id=call_id,
                timestamp=now,
                token_count=max(1, estimate(words)),
                incomplete=incomplete,
                content_hash=chain,
                embed_hash=text_hash(embed_text(role, name, words)),
                api=api,
                scaffold=pieces,
                sightings=sightings,
                said_hash=said_hash,
            )
        )
    return out


def archive_texts(
    messages: Sequence[Mapping[str, Any]], redact_secrets: bool, max_bytes: int
) -> list[str]:
    """Each message's text as it is archived: redacted, and cut past ``max_bytes``."""
    clean = redact if redact_secrets else None
    return [cut_text(content_text(m.get("content")), max_bytes, clean) for m in messages]


def repeat_candidates(messages: Sequence[Mapping[str, Any]], texts: Sequence[str]) -> list[str]:
    """Hashes of the long paragraphs of the user messages' words (by shape): the ones to look
    up, since one the user sent in another session is scaffolding."""
    out: list[str] = []
    for msg, text in zip(messages, texts, strict=True):
        if msg.get("role") == "user" and len(text) >= scaffold.REPEAT_MIN:
            out += scaffold.long_paragraphs(scaffold.split("user", text).words)
    return out


def _redact_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        fn["arguments"] = redact(fn["arguments"])
    return {**call, "function": fn}


class Archive:
    """Writes turns (once per request) and hands them to the indexer."""

    def __init__(
        self,
        store: Store,
        indexer: Indexer | None,
        redact_secrets: bool,
        max_bytes: int = 0,
        quota: TurnQuota | None = None,
        on_repeated: Callable[[str], None] | None = None,
        claims: Claims | None = None,
    ) -> None:
        self.store = store
        # Told the user whose paragraph became scaffolding by repetition (recall's cache).
        self.on_repeated = on_repeated
        self.indexer = indexer
        self.redact_secrets = redact_secrets
        self.max_bytes = max_bytes  # limits.max_message_bytes
        self.quota = quota  # limits.max_turns_per_user
        self.archived_turns = 0
        self.claims = claims  # the positions requests hold, given back by their commit

    async def request_rows(self, mt: MemoryTurn, now: float) -> list[NewTurn]:
        """Archive rows for the request's messages that its session does not hold yet."""
        placement = mt.placement
        assert placement is not None
        first = placement.matched
        # The said chain reads every message (4.5 ms for 400 short ones), the rows the new ones.
        big = len(mt.messages) > THREAD_MESSAGES or (
            sum(len(content_text(m.get("content"))) for m in mt.messages) > THREAD_CHARS
        )

        def texts() -> tuple[list[int], list[str | None], list[str], list[str], list[bool]]:
            said, mt.said = said_chain(mt.messages)
            # Placed by what was said: only the new messages that say something are stored.
            picked = [
                i
                for i in range(first, len(mt.messages))
                if not placement.by_words or said[i] is not None
            ]
            new = [mt.messages[i] for i in picked]
            made = archive_texts(new, self.redact_secrets, self.max_bytes)
            client = [client_reply(mt.messages[i], said[i]) for i in picked]
            return picked, said, made, repeat_candidates(new, made), client

        picked, said, made, candidates, client = await asyncio.to_thread(texts) if big else texts()
        known: set[str] = set()
        if candidates:  # a long paragraph the user sent in another session is scaffolding
            user, sid = placement.session.user_id, placement.session.id
            session = None if placement.created else sid
            known = await self.store.read(
                lambda c: scaffolds.known_paragraphs(c, user, candidates, session)
            )

        def make() -> list[NewTurn]:
            return to_new_turns(
                [mt.messages[i] for i in picked],
                [mt.chains[i] for i in picked],
                placement.next_position,
                self.redact_secrets,
                now,
                max_bytes=self.max_bytes,
                api=mt.api,
                texts=made,
                known=known,
                said=[said[i] for i in picked],
                client_replies=client,
            )

        return await asyncio.to_thread(make) if big else make()

    async def commit(
        self, mt: MemoryTurn, reply_message: dict[str, Any] | None, complete: bool
    ) -> bool:
        """Archive the request's new messages and the reply in one write transaction (at most
        once per request) and hand them to the indexer; False when there was nothing to do.
        The caller shields this from cancellation."""
        placement = mt.placement
        if placement is None or mt.committed:
            return False
        mt.committed = True
        rows = list(await mt.request_rows) if mt.request_rows is not None else []
        now = time.time()
        text = content_text(reply_message.get("content")) if reply_message is not None else ""
        if reply_message is not None and (text or reply_message.get("tool_calls")):
            reply = without_lone_surrogates(reply_message)
            prev = mt.chains[-1] if mt.chains else ""
            position = placement.next_position + len(rows)
            said = step(mt.said, reply)[1]

            def make() -> list[NewTurn]:
                chain = extend_chain(prev, reply)
                redact = self.redact_secrets
                return to_new_turns(
                    [reply],
                    [chain],
                    position,
                    redact,
                    now,
                    incomplete=not complete,
                    max_bytes=self.max_bytes,
                    api=mt.api,
                    said=[said],
                    client_replies=[client_reply(reply, said)],
                )

            # A long reply is redacted on a thread: the client is waiting for its last byte.
            rows += await asyncio.to_thread(make) if len(text) > THREAD_CHARS else make()
        user = placement.session.user_id
        if rows and self.quota is not None and not await self.quota.allows(user, len(rows)):
            return True  # over the user's turn cap (logged): the reply goes, unarchived
        key, shown, claims = mt.block_key, list(mt.injected), self.claims
        laid_at = mt.block_at  # the block's year is the one it was made in
        claim = mt.claim if mt.claim is not None and not mt.claim.released else None

        def commit(c: Connection) -> tuple[Session, list[tuple[int, NewTurn]]]:
            session, inserted = commit_turns(c, placement, rows, now)
            if key is not None:  # what was laid before the user message, for later requests
                put_block(c, session.user_id, key, session.id, shown, laid_at)
            if claim is not None and claims is not None:  # the position is taken: free it
                claims.release_in(c, claim)
            return session, inserted

        def record(c: Connection) -> None:
            if key is not None:
                put_block(c, user, key, placement.session.id, shown, laid_at)
            if claim is not None and claims is not None:
                claims.release_in(c, claim)

        if not rows:
            if key is not None or claim is not None:
                await self.store.write(record)
                if claim is not None and claims is not None:
                    claims.released(claim)
            return True
        session, inserted = await self.store.write(commit)
        if claim is not None and claims is not None:
            claims.released(claim, stored=True)
        self.archived_turns += len(inserted)
        if self.on_repeated is not None and any(
            p.kind == "repeated" for _, r in inserted for p in r.scaffold
        ):
            self.on_repeated(user)
        if self.quota is not None:
            self.quota.add(user, len(inserted))
        if session.id != placement.session.id:
            mt.placement = dataclasses.replace(placement, session=session)
        event(log, logging.DEBUG, "archived", session=session.id, turns=len(inserted))
        if self.indexer is not None:
            self.indexer.submit(inserted)
        return True
