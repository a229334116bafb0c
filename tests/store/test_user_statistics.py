"""Per-user ranking statistics (issue 12, row 12): the common-word cut-off
(``retrieval.fts_common_share``) weighs a word by the user's own turns, so a user whose archive
is small never loses words because another user's archive is huge."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.config import RetrievalSettings
from proxy.search import retrieval
from proxy.search.retrieval import Retriever
from proxy.store import NewTurn, Store

pytestmark = pytest.mark.asyncio


async def one_turn_sessions(store: Store, user: str, texts: list[str]) -> None:
    """One turn a session: no neighbours in ``ctx``, so shares are plain."""
    for i, text in enumerate(texts):
        await store.get_or_create_session(user, f"{user}-{i}")
        await store.add_turns(f"{user}-{i}", user, [NewTurn(0, "user", text)])


async def test_another_users_archive_takes_no_word_out_of_my_queries(
    store_target: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retrieval, "COMMON_WORDS_ABOVE", 3)
    async with Store(store_target) as store:
        await one_turn_sessions(store, "big", [f"hello number {i}" for i in range(40)])
        await one_turn_sessions(store, "tiny", ["hello there", "beagle walks", "cats", "dogs"])
        r = Retriever(store, None, RetrievalSettings(fts_common_share=0.5))
        # "hello" is in 41 of 44 rows, but in 1 of tiny's 4: tiny keeps it.
        assert await r._uncommon("tiny", ["hello", "beagle"]) == ["hello", "beagle"]
        hits = await r.search("tiny", "hello beagle", 10, mode="fts")
        assert {h.turn.content for h in hits} == {"hello there", "beagle walks"}
        # big holds "hello" in all of its rows, but others' rows leave that in doubt until its
        # own rows are counted (in the background): until then the word is kept.
        assert await r._uncommon("big", ["hello", "beagle"]) == ["hello", "beagle"]
        await counted(store)
        assert await r._uncommon("big", ["hello", "beagle"]) == ["beagle"]
        await counted(store)
        assert await r._uncommon("tiny", ["hello", "beagle"]) == ["hello", "beagle"]
        assert (await store.fts_word_shares("tiny", ["hello"], above=0.5)) == {"hello": 0.25}
        assert (await store.fts_word_shares("big", ["hello"], above=0.5)) == {"hello": 1.0}
        # A user below the size where the cut-off applies keeps every word, whatever others hold.
        await one_turn_sessions(store, "small", ["hello", "hello again", "beagle"])
        assert await r._uncommon("small", ["hello", "beagle"]) == ["hello", "beagle"]


async def test_alone_in_the_database_the_index_counts_are_exact(
    store_target: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retrieval, "COMMON_WORDS_ABOVE", 3)
    async with Store(store_target) as store:
        await one_turn_sessions(store, "me", [f"hello number {i}" for i in range(9)] + ["beagle"])
        r = Retriever(store, None, RetrievalSettings(fts_common_share=0.5))
        assert await r._uncommon("me", ["hello", "beagle"]) == ["beagle"]  # at once
        assert (await store.fts_word_shares("me", ["hello", "beagle"], above=0.5)) == {
            "hello": 0.9,
            "beagle": 0.1,
        }


async def counted(store: Store) -> None:
    """Wait for the background count of users' common words."""
    words = store._words
    for _ in range(500):
        if not words.running and not words.pending():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the word counts did not finish")


def count_reads(store: Store) -> list[int]:
    """From now on, ``[n]``: how many reader-thread jobs ``store`` was asked for."""
    reads = [0]
    plain = store.read

    async def counting(fn):  # type: ignore[no-untyped-def]
        reads[0] += 1
        return await plain(fn)

    store.read = counting  # type: ignore[method-assign]
    return reads


async def test_a_user_below_the_bar_costs_no_read_once_counted(store_target: str | Path) -> None:
    """Below ``min_turns`` the shares are empty; once the user's count is known (and recent),
    no reader thread is asked for them: a chat request below the bar saves a thread hop."""
    async with Store(store_target) as store:
        await one_turn_sessions(store, "tiny", ["hello there", "beagle walks"])
        assert await store.fts_word_shares("tiny", ["hello"], min_turns=10) == {}
        reads = count_reads(store)
        assert await store.fts_word_shares("tiny", ["hello"], min_turns=10) == {}
        assert reads == [0]
        assert await store.fts_word_shares("tiny", ["hello"], min_turns=2, above=1.0) == {
            "hello": 0.5
        }
        assert reads == [1]


@pytest.mark.asyncio
async def test_remembered_shares_cost_no_read(store_target: str | Path) -> None:
    """Once the user's count, the database's and each word's count in the index are known
    (and recent), the shares come from memory: no reader hop before the search starts, and
    the same answer as the read gave."""
    async with Store(store_target) as store:
        await one_turn_sessions(store, "u", ["hello there", "hello beagle", "quiet walks"])
        first = await store.fts_word_shares("u", ["hello", "beagle"], min_turns=2, above=1.0)
        assert first == {"hello": pytest.approx(2 / 3), "beagle": pytest.approx(1 / 3)}
        reads = count_reads(store)
        assert await store.fts_word_shares("u", ["beagle", "hello"], min_turns=2) == first
        assert reads == [0]
        await store.fts_word_shares("u", ["walks"], min_turns=2)  # a word not seen: one read
        assert reads == [1]


async def test_a_word_queued_while_the_count_runs_is_counted_without_another_search(
    store_target: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search that queues a word while the background count is running does not start
    another count (one runs); the running count must then queue itself again, or the word
    waits for the next search (what made the test above fail now and then)."""
    from proxy.store.caches import word_counts

    async with Store(store_target) as store:
        await one_turn_sessions(store, "u", ["hello there", "beagle walks"])
        words = store._words
        real = word_counts.user_term_rows
        late = [("u", "beagle")]

        def counting(conn: object, user_id: str, word: str) -> int:
            if late:  # a search queues its word meanwhile
                with words._lock:
                    words._queued.append(late.pop())
            return real(conn, user_id, word)  # type: ignore[arg-type]

        monkeypatch.setattr(word_counts, "user_term_rows", counting)
        words._queued.append(("u", "hello"))
        words.running = True
        store.loader.submit(words.run)
        await counted(store)
        assert set(words._known) == {("u", "hello"), ("u", "beagle")}
