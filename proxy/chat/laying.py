"""Memory blocks laid where they were laid before (``prompt.mode = "stable"``).

A model server reuses the longest prefix the new prompt shares with the last one. So the block
of memories made for a user message goes before that message's words and stays there: every
later request of the conversation lays the same block before the same message again, byte for
byte, and only the new message gets a new block (DESIGN.md, invariant 4). What was laid is kept
in the database (:mod:`proxy.store.blocks`: the memories' ids, by the message's chain hash and
the session), so a restart, another worker or another replica lays it the same way, and so does
a conversation the client edited or regenerated further on (for the messages it shares). The
block is rendered again from the turns with the tag of the session that laid it (the fence
secret is shared by every process on the database), so a memory forgotten or muted since is left
out of it.

The same record answers the same message again: an agent's tool loop (each follow-up request
ends with the same user message) and a regenerated reply get exactly the block the first request
had, without searching again. A decision to lay nothing is recorded too, so a later search
cannot add a block under a prefix the server already holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.chat.fence import Recalled, block_tag, memory_block, year_of
from proxy.chat.recall import Recall, recalled, words_recalled
from proxy.chat.turn import Laid
from proxy.store.blocks import Record, blocks_of
from proxy.store.models import RECALLED_ROLES, Turn
from proxy.store.queries import get_turns
from proxy.store.store import Store

UNLIMITED = 1 << 30  # a block laid again holds what it held: no budget cuts it


def user_chains(messages: Sequence[Mapping[str, Any]], chains: Sequence[str]) -> dict[int, str]:
    """The chain hash of every user message, by index."""
    return {
        i: h
        for i, (m, h) in enumerate(zip(messages, chains, strict=False))
        if m.get("role") == "user"
    }


class Layer:
    """Reads what earlier requests laid and renders it again; one per server."""

    def __init__(self, store: Store, recall: Recall) -> None:
        self.store = store
        self.recall = recall

    async def read(
        self,
        user: str,
        keys: Mapping[int, str],
        current: int | None,
        secret: bytes,
        session: str | None,
        anchor: int | None,
        last: int,
    ) -> Laid:
        """The records of these messages (index -> chain hash), rendered again: the session's
        own, else (a conversation forked from another: edited or regenerated further on, or an
        agent's tool loop whose calls were stored otherwise) the first one made, for a message
        after the first reply (``anchor``: how many messages run through it) or one that this
        request goes on after (``last``: the index of its last message). Two conversations may
        open alike: a new conversation's opening question, sent alone, is decided afresh."""
        laid = Laid(current_key=keys.get(current) if current is not None else None)
        # Another session's record serves a message after the first reply, or one this request
        # goes on after; the session's own, any message.
        usable = {
            i: k
            for i, k in keys.items()
            if session is not None or (anchor is not None and i >= anchor) or i < last
        }
        if not usable:  # a new conversation's opening message: nothing to read
            return laid
        keys = usable

        def read(c: Any) -> tuple[dict[str, list[Record]], list[Turn]]:
            records = blocks_of(c, user, list(keys.values()))
            wanted = sorted({i for rs in records.values() for r in rs for i in r.ids})
            return records, get_turns(c, wanted, user) if wanted else []

        records, turns = await self.store.read(read)
        if not records:
            return laid
        by_id = {t.id: t for t in turns}
        repeated = await self.recall.repeated(user, turns)
        for index, key in keys.items():
            found = records.get(key, [])
            own = [r for r in found if r.session_id == session]
            shared = (anchor is not None and index >= anchor) or index < last
            record = own[0] if own else found[0] if found and shared else None
            if record is None:
                continue
            memories = [
                m for i in record.ids if (m := self._memory(by_id.get(i), repeated)) is not None
            ]
            tag = block_tag(secret, record.session_id)
            year = year_of(record.created_at)
            block, used = (
                memory_block(memories, UNLIMITED, _free, tag, year) if memories else ("", [])
            )
            if index == current:
                laid.current_memories, laid.current_tag = used, tag
                laid.current_at = record.created_at
            elif block:
                laid.blocks[index], laid.ids[index] = block, [m.id for m in used]
        return laid

    @staticmethod
    def _memory(turn: Turn | None, repeated: frozenset[str]) -> Recalled | None:
        """A recorded memory as it is shown now; None when it is gone, muted or empty."""
        if turn is None or turn.recall < 0 or turn.role not in RECALLED_ROLES:
            return None
        words = words_recalled(turn.role, turn.content, repeated)
        if not words.strip():
            return None
        m = recalled(turn, 1.0)
        return m if words == m.content else dataclasses.replace(m, content=words)


def _free(_: str) -> int:
    """A token count that costs nothing: a block laid again is not cut to a budget."""
    return 0
