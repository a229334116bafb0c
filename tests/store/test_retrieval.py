"""The Retriever: hybrid search through the store, with sessions left out inside the SQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from proxy.config import RetrievalSettings
from proxy.search import retrieval
from proxy.search.embedder import HashEmbedder
from proxy.search.retrieval import Retriever
from proxy.store import NewTurn, Store


@pytest_asyncio.fixture
async def retriever(store_target: str | Path) -> AsyncIterator[Retriever]:
    embedder = HashEmbedder()
    async with Store(store_target) as store:
        for s, texts in {
            "current": ["my beagle puppy chewed the sofa", "oh no, the beagle again"],
            "older": ["we adopted a beagle puppy last spring", "what breed?", "a beagle"],
            "unrelated": ["the train to Lisbon was late"],
        }.items():
            await store.get_or_create_session("u", s)
            turns = [NewTurn(i, "user", t) for i, t in enumerate(texts)]
            await store.add_turns(s, "u", turns, await embedder.embed_passages(texts))
        yield Retriever(store, embedder, RetrievalSettings(candidates=2))
    await embedder.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["hybrid", "fts", "vec"])
async def test_exclude_sessions_frees_the_candidate_places(retriever: Retriever, mode: str) -> None:
    hits = await retriever.search("u", "beagle puppy", 2, mode=mode, exclude_sessions=["current"])
    # with two candidates a path, filtering afterwards could leave nothing from "older"
    assert len(hits) == 2
    assert {h.turn.session_id for h in hits} == {"older"}
    rest = await retriever.search(
        "u", "beagle", 5, mode=mode, exclude_sessions=["current", "older"]
    )
    assert {h.turn.session_id for h in rest} <= {"unrelated"}


@pytest.mark.asyncio
async def test_word_shares_count_rows_as_fts5_matches_them(store_target: str | Path) -> None:
    async with Store(store_target) as store:
        await store.get_or_create_session("u", "s")
        texts = ["I painted the fence", "painting is fun", "hello there", "hello again"]
        await store.add_turns("s", "u", [NewTurn(i, "user", t) for i, t in enumerate(texts)])
        shares = await store.fts_word_shares("u", ["painting", "zebra", "fence"], above=0)
        # porter: "painting" matches "painted" too; ctx carries each word to 2 neighbours each side
        assert shares["zebra"] == 0.0
        assert shares["painting"] == 1.0  # every row holds it, in its body or its ctx
        assert 0.0 < shares["fence"] <= 0.75


@pytest.mark.asyncio
async def test_words_most_turns_hold_are_left_out_of_the_fts_query(
    store_target: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Store(store_target) as store:
        for s in range(12):  # one turn a session: no neighbours, so shares are plain
            await store.get_or_create_session("u", f"s{s}")
            text = "hello beagle" if s == 3 else f"hello number {s}"
            await store.add_turns(f"s{s}", "u", [NewTurn(0, "user", text)])
        strict = Retriever(store, None, RetrievalSettings(fts_common_share=0.5))
        # a small archive keeps every word
        assert len(await strict.search("u", "hello beagle", 10, mode="fts")) == 10
        monkeypatch.setattr(retrieval, "COMMON_WORDS_ABOVE", 10)
        hits = await strict.search("u", "hello beagle", 10, mode="fts")
        assert [h.turn.content for h in hits] == ["hello beagle"]
        every = Retriever(store, None, RetrievalSettings(fts_common_share=1.0))
        assert len(await every.search("u", "hello beagle", 10, mode="fts")) == 10
        # every word common: the rarest one is searched for
        hits = await strict.search("u", "hello", 20, mode="fts")
        assert len(hits) == 12


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["hybrid", "fts", "vec"])
async def test_distinct_gives_one_place_per_text(store_target: str | Path, mode: str) -> None:
    """A model that answers alike every time must not fill the top k with one reply."""
    embedder = HashEmbedder()
    async with Store(store_target) as store:
        for n in range(6):
            sid = f"s{n}"
            await store.get_or_create_session("u", sid)
            texts = ["Hi there, I am here to help with your garden!", f"garden note {n}"]
            if n == 5:
                texts[0] = "hi there,  I am HERE to help with your garden!"  # case, spacing
            turns = [NewTurn(i, "assistant" if i == 0 else "user", t) for i, t in enumerate(texts)]
            await store.add_turns(sid, "u", turns, await embedder.embed_passages(texts))
        r = Retriever(store, embedder, RetrievalSettings())
        plain = await r.search("u", "help with the garden", 6, mode=mode)
        once = await r.search("u", "help with the garden", 6, mode=mode, distinct=True)
    await embedder.aclose()
    replies = [h for h in plain if h.turn.role == "assistant"]
    assert len(replies) >= 2  # without it, the same reply takes several places
    texts = [" ".join(h.turn.content.lower().split()) for h in once]
    assert len(texts) == len(set(texts)) == 6  # one place per text, the rest for the notes
    assert sum(h.turn.role == "assistant" for h in once) == 1
