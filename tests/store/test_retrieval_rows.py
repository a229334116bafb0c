"""The search reads its candidates as raw rows (proxy.store.sqlite.search_sql.turn_rows) and makes
Turns
only of the results it keeps and the candidates ``keep`` is asked about."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import RetrievalSettings
from proxy.search.embedder import HashEmbedder
from proxy.search.retrieval import Retriever
from proxy.store import NewTurn, Store
from proxy.store.caches.scope import turn_rows
from proxy.store.models import Turn
from proxy.store.rows import turn_of

TEXTS = [f"the beagle puppy number {i} chewed sofa {i % 3}" for i in range(30)]


@pytest.mark.asyncio
async def test_hits_are_the_stored_turns_and_keep_is_asked_little(store_target: str | Path) -> None:
    embedder = HashEmbedder()
    async with Store(store_target) as store:
        await store.get_or_create_session("u", "s")
        await store.get_or_create_session("v", "t")
        turns = [NewTurn(i, "user", t, speaker="Ann") for i, t in enumerate(TEXTS)]
        ids = await store.add_turns("s", "u", turns, await embedder.embed_passages(TEXTS))
        other = await store.add_turns("t", "v", turns[:2], await embedder.embed_passages(TEXTS[:2]))
        rows = await store.read(lambda c: turn_rows(c, [*ids[:3], *other], "u"))
        assert sorted(rows) == sorted(ids[:3])  # another user's turns never come
        assert [turn_of(rows[i]) for i in ids[:3]] == await store.get_turns(ids[:3])
        retriever = Retriever(store, embedder, RetrievalSettings(candidates=20))
        asked: list[int] = []

        def keep(t: Turn) -> bool:
            asked.append(t.id)
            return t.id % 2 == 0

        hits = await retriever.search("u", "beagle puppy sofa", 4, keep=keep)
        assert [h.turn for h in hits] == await store.get_turns([h.turn.id for h in hits])
        assert all(h.turn.id % 2 == 0 for h in hits) and len(hits) == 4
        assert len(asked) < 20  # asked in order until four were kept, not of every candidate
        assert await store.read(lambda c: turn_rows(c, [], "u")) == {}
    await embedder.aclose()
