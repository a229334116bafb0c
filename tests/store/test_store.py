"""The async Store: round trips, scoping by user and session, search, deletion, export."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from proxy.search.embedder import HashEmbedder
from proxy.search.fts_query import match_of, to_match
from proxy.store import (
    NewTurn,
    SessionConflict,
    SessionNotFound,
    Store,
    message_hash,
    text_hash,
)
from proxy.store.sqlite import search_sql as search
from proxy.store.sqlite.migrations import latest_version
from proxy.vectors import Vector

DIM = 384


@pytest_asyncio.fixture
async def store(store_target: str | Path) -> AsyncIterator[Store]:
    async with Store(store_target) as s:
        yield s


@pytest_asyncio.fixture
async def embedder() -> AsyncIterator[HashEmbedder]:
    e = HashEmbedder(DIM)
    yield e
    await e.aclose()


def unit(i: int) -> Vector:
    v = np.zeros(DIM, dtype=np.float32)
    v[i % DIM] = 1.0
    return v


async def archive(
    store: Store, embedder: HashEmbedder, user: str, session: str, texts: list[str], start: int = 0
) -> list[int]:
    await store.get_or_create_session(user, session)
    turns = [
        NewTurn(position=start + i, role="user" if i % 2 == 0 else "assistant", content=t)
        for i, t in enumerate(texts)
    ]
    vectors = await embedder.embed_passages(texts)
    return await store.add_turns(session, user, turns, list(vectors))


@pytest.mark.asyncio
async def test_round_trip(store: Store) -> None:
    session = await store.get_or_create_session("alice", "s1", agent="cli", fingerprint="fp")
    assert (session.user_id, session.level, session.parent_id, session.indexed) == (
        "alice",
        0,
        None,
        True,
    )
    calls = [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    turns = [
        NewTurn(0, "system", "You are helpful."),
        NewTurn(1, "user", "Hi, I'm Alice", speaker="alice", timestamp=1_700_000_000.5),
        NewTurn(2, "assistant", "", tool_calls=calls),
        NewTurn(3, "tool", "42", tool_call_id="call_9", token_count=1),
        NewTurn(4, "assistant", "The answer is 42", incomplete=True),
    ]
    ids = await store.add_turns("s1", "alice", turns, [unit(0), unit(1), None, None, unit(4)])
    assert len(ids) == 5 and ids == sorted(ids)
    got = await store.get_turns(list(reversed(ids)))
    assert [t.id for t in got] == list(reversed(ids))
    got.reverse()
    assert [t.position for t in got] == [0, 1, 2, 3, 4]
    assert got[1].speaker == "alice" and got[1].timestamp == 1_700_000_000.5
    assert got[2].tool_calls == calls and got[2].content == ""
    assert got[3].tool_call_id == "call_9" and got[3].token_count == 1
    assert got[4].incomplete and not got[3].incomplete
    assert got[1].content_hash == message_hash("user", "Hi, I'm Alice", "alice")
    assert await store.count_turns("s1") == 5
    assert await store.session_turn_hashes("s1") == [t.content_hash for t in got]
    assert [t.position for t in await store.session_turns("s1", from_position=3)] == [3, 4]
    stats = await store.stats()
    assert (stats.users, stats.sessions, stats.turns, stats.vectors) == (1, 1, 5, 3)
    assert stats.schema_version == latest_version() and stats.per_user == {"alice": 5}
    assert stats.db_bytes > 0


@pytest.mark.asyncio
async def test_add_turns_skips_positions_already_stored(store: Store) -> None:
    await store.get_or_create_session("u", "s")
    first = await store.add_turns("s", "u", [NewTurn(0, "user", "a"), NewTurn(1, "assistant", "b")])
    again = await store.add_turns(
        "s", "u", [NewTurn(1, "assistant", "b"), NewTurn(2, "user", "c")], [unit(1), unit(2)]
    )
    assert len(first) == 2 and len(again) == 1
    assert [t.content for t in await store.session_turns("s")] == ["a", "b", "c"]
    assert (await store.stats()).vectors == 1


@pytest.mark.asyncio
async def test_caller_supplied_hashes_and_resolve_session(store: Store) -> None:
    await store.get_or_create_session("u", "s1")
    await store.get_or_create_session("u", "s2")
    await store.add_turns(
        "s1", "u", [NewTurn(i, "user", f"m{i}", content_hash=f"h{i}") for i in range(3)]
    )
    await store.add_turns("s2", "u", [NewTurn(0, "user", "m0", content_hash="h0")])
    assert await store.session_turn_hashes("s1") == ["h0", "h1", "h2"]
    found = await store.resolve_session("u", ["h0", "h1", "h2", "h3"])
    assert found is not None and found[0].id == "s1" and found[1] == 3
    assert await store.resolve_session("u", ["h0", "h1", "h2"], min_length=4) is None
    assert await store.resolve_session("other", ["h0"]) is None
    assert await store.resolve_session("u", ["h1", "x"]) is None  # position must match


@pytest.mark.asyncio
async def test_sessions_belong_to_one_user(store: Store) -> None:
    await store.get_or_create_session("alice", "shared-id")
    with pytest.raises(SessionConflict):
        await store.get_or_create_session("bob", "shared-id")
    with pytest.raises(SessionConflict):
        await store.add_turns("shared-id", "bob", [NewTurn(0, "user", "x")])
    with pytest.raises(SessionNotFound):
        await store.add_turns("nope", "bob", [NewTurn(0, "user", "x")])
    with pytest.raises(SessionConflict):
        await store.get_or_create_session("bob", "sub", parent_id="shared-id")
    assert await store.count_turns("shared-id") == 0


@pytest.mark.asyncio
async def test_sub_sessions_nest_and_cascade(store: Store, embedder: HashEmbedder) -> None:
    await archive(store, embedder, "u", "root", ["root talk about gardens"])
    child = await store.get_or_create_session("u", "child", parent_id="root", agent="coder")
    assert (child.level, child.parent_id, child.indexed) == (1, "root", False)
    grandchild = await store.get_or_create_session("u", "grand", parent_id="child")
    assert grandchild.level == 2
    with pytest.raises(SessionNotFound):
        await store.get_or_create_session("u", "orphan", parent_id="missing")
    await archive(store, embedder, "u", "child", ["child talk about gardens"])
    await archive(store, embedder, "u", "grand", ["grandchild talk about gardens"])
    await archive(store, embedder, "u", "other", ["other talk about gardens"])

    assert await store.delete_session("root", user_id="someone-else") is False
    assert await store.delete_session("root") is True
    assert {s.id for s in await store.list_sessions("u")} == {"other"}
    stats = await store.stats()
    assert (stats.turns, stats.vectors) == (1, 1)
    match = to_match("gardens")
    assert match is not None
    fts = await store.fts_search("u", match, 10, session_ids=["root", "child", "grand", "other"])
    (vec_q,) = await embedder.embed_queries(["gardens"])
    vec = await store.vec_search("u", vec_q, 10, session_ids=["root", "child", "grand", "other"])
    assert len(fts) == 1 and [i for i, _ in fts] == [i for i, _ in vec]


@pytest.mark.asyncio
async def test_fts_search_scopes(store: Store, embedder: HashEmbedder) -> None:
    a = await archive(store, embedder, "alice", "a1", ["I adopted a beagle puppy", "Nice!"])
    a2 = await archive(store, embedder, "alice", "a2", ["The beagle chewed my shoes"])
    await archive(store, embedder, "bob", "b1", ["My beagle is called Rex"])
    sub = await store.get_or_create_session("alice", "a-sub", parent_id="a1")
    await store.add_turns(sub.id, "alice", [NewTurn(0, "user", "beagle in the sub-agent")])
    match = to_match("beagle?")
    assert match is not None

    hits = await store.fts_search("alice", match, 10)
    # not bob's, not the sub-agent's; "Nice!" through its neighbour's words (the ctx column),
    # which weigh less than a turn's own
    assert sorted(i for i, _ in hits) == sorted([*a, a2[0]])
    assert hits[-1][0] == a[1]
    assert all(score < 0 for _, score in hits)  # bm25: lower is better
    only_a2 = await store.fts_search("alice", match, 10, session_ids=["a2"])
    assert [i for i, _ in only_a2] == a2
    sub_hits = await store.fts_search("alice", match, 10, session_ids=["a-sub"])
    assert len(sub_hits) == 1
    excluded = await store.fts_search("alice", match, 10, exclude_ids=[a[0]])
    assert [i for i, _ in excluded] == [a2[0], a[1]]
    other = await store.fts_search("alice", match, 10, exclude_sessions=["a1"])
    assert [i for i, _ in other] == a2
    assert await store.fts_search("alice", match, 10, exclude_sessions=["a1", "a2"]) == []
    sub_only = await store.fts_search(
        "alice", match, 10, session_ids=["a-sub", "a2"], exclude_sessions=["a2"]
    )
    assert len(sub_only) == 1 and sub_only[0][0] not in a2
    assert await store.fts_search("alice", match, 0) == []
    assert await store.fts_search("carol", match, 10) == []


@pytest.mark.asyncio
async def test_fts_search_takes_any_words_quoted(store_target: str | Path) -> None:
    """Words with the query syntax of FTS5 or of PostgreSQL's tsquery (``& | ! : * ( ) '``),
    stop words alone, backslashes: found or not, never an error; in the database's index
    (``fts_memory=0``) as in memory."""
    words = ["o'brien", "a&b", "x:*", "(beagle)", "!", "\\", "the", "don't", "naïve", "||"]
    for fts_memory in (0, 1 << 20):
        async with Store(store_target, fts_memory=fts_memory) as s:
            await s.get_or_create_session("u", "s")
            (tid,) = await s.add_turns("s", "u", [NewTurn(0, "user", "O'Brien's naïve beagle")])
            for word in words:
                match = match_of([word])
                assert match is not None
                hits = await s.fts_search("u", match, 5)
                assert [i for i, _ in hits] in ([], [tid]), word
            everything = match_of(words)
            assert everything is not None
            assert [i for i, _ in await s.fts_search("u", everything, 5)] == [tid]
            if s.pg:  # any other text: its words, never tsquery syntax
                assert [i for i, _ in await s.fts_search("u", "beagle & !(x:*", 5)] == [tid]
            await s.write(lambda c: c.execute("DELETE FROM turns"))


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["exact", "quantized"])
async def test_vec_search_scopes(store: Store, embedder: HashEmbedder, mode: str) -> None:
    texts = [f"topic{i} words{i} about thing{i}" for i in range(30)]
    ids = await archive(store, embedder, "alice", "s1", texts)
    await archive(store, embedder, "bob", "s2", texts)
    (q,) = await embedder.embed_queries(["topic7 words7 about thing7"])
    hits = await store.vec_search("alice", q, 5, mode=mode)  # type: ignore[arg-type]
    assert hits[0][0] == ids[7] and hits[0][1] == pytest.approx(0.0, abs=1e-5)
    assert len(hits) == 5 and set(i for i, _ in hits) <= set(ids)
    assert [d for _, d in hits] == sorted(d for _, d in hits)
    hits = await store.vec_search("alice", q, 5, exclude_ids=[ids[7]], mode=mode)  # type: ignore[arg-type]
    assert ids[7] not in {i for i, _ in hits} and len(hits) == 5
    assert await store.vec_search("alice", q, 5, session_ids=["s2"], mode=mode) == []  # type: ignore[arg-type]
    assert await store.vec_search("carol", q, 5, mode=mode) == []  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_fts_search_finds_a_users_rows_below_other_users_better_ones(
    store: Store, embedder: HashEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first pass looks at the index's best rows only; when the scope filters too many of
    them out, the search goes on over every match."""
    monkeypatch.setattr(search, "FTS_PROBE_MIN", 4)
    monkeypatch.setattr(search, "FTS_PROBE_FACTOR", 1)
    theirs = await archive(store, embedder, "big", "b1", ["beagle"] * 12)
    filler = " ".join(f"filler{i}" for i in range(40))  # long rows: worse bm25 than "beagle"
    mine = await archive(store, embedder, "small", "s1", [f"beagle {filler}", f"a beagle {filler}"])
    match = to_match("beagle")
    assert match is not None
    assert sorted(i for i, _ in await store.fts_search("small", match, 2)) == mine
    assert {i for i, _ in await store.fts_search("big", match, 3)} <= set(theirs)
    others = await archive(store, embedder, "big", "b2", ["beagle"] * 2)
    hits = await store.fts_search("big", match, 3, exclude_sessions=["b1"])
    assert [i for i, _ in hits] == others


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["exact", "quantized"])
async def test_vec_search_excludes_sessions_inside_the_knn(
    store: Store, embedder: HashEmbedder, mode: str
) -> None:
    """Excluded sessions take no candidate places, however many are excluded."""
    by_session: dict[str, list[int]] = {}
    for s in range(12):
        by_session[f"s{s}"] = await archive(
            store,
            embedder,
            "alice",
            f"s{s}",
            [f"puppy beagle walk number {s} {j}" for j in range(3)],
        )
    (q,) = await embedder.embed_queries(["puppy beagle walk"])
    for skip in (["s0"], [f"s{i}" for i in range(8)], [f"s{i}" for i in range(11)]):
        hits = await store.vec_search("alice", q, 3, exclude_sessions=skip, mode=mode)  # type: ignore[arg-type]
        allowed = {i for s, ids in by_session.items() if s not in skip for i in ids}
        assert len(hits) == 3 and {i for i, _ in hits} <= allowed, skip
    every = [f"s{i}" for i in range(12)]
    assert await store.vec_search("alice", q, 3, exclude_sessions=every, mode=mode) == []  # type: ignore[arg-type]
    some = await store.vec_search(
        "alice",
        q,
        10,
        session_ids=["s1", "s2"],
        exclude_sessions=["s1"],
        mode=mode,  # type: ignore[arg-type]
    )
    assert sorted(i for i, _ in some) == by_session["s2"]


@pytest.mark.asyncio
async def test_quantized_and_exact_agree_on_the_top_hits(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    vecs = rng.normal(size=(400, DIM)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    async with Store(tmp_path / "q.db") as store:
        await store.get_or_create_session("u", "s")
        ids = await store.add_turns(
            "s", "u", [NewTurn(i, "user", f"t{i}") for i in range(400)], list(vecs)
        )
        for probe in (3, 99, 250):
            q = vecs[probe] + 0.05 * rng.normal(size=DIM).astype(np.float32)
            exact = await store.vec_search("u", q, 5, mode="exact")
            quant = await store.vec_search("u", q, 5, mode="quantized")
            assert exact[0][0] == quant[0][0] == ids[probe]
            for (_, d1), (_, d2) in zip(exact, quant, strict=True):
                assert d2 >= d1 - 1e-5  # re-scored distances are exact cosine distances
    # auto picks the quantised plan above the threshold
    async with Store(tmp_path / "q.db", quantized_above=10) as store:
        assert (await store.vec_search("u", vecs[3], 1))[0][0] == ids[3]


@pytest.mark.asyncio
async def test_set_session_indexed_moves_vectors_in_and_out_of_general_search(
    store: Store, embedder: HashEmbedder
) -> None:
    ids = await archive(store, embedder, "u", "s", ["alpha beta", "gamma delta"])
    (q,) = await embedder.embed_queries(["alpha beta"])
    match = to_match("alpha")
    assert match is not None
    assert (await store.vec_search("u", q, 1))[0][0] == ids[0]
    await store.set_session_indexed("s", False)
    assert await store.vec_search("u", q, 1) == []
    assert await store.fts_search("u", match, 5) == []
    assert (await store.vec_search("u", q, 1, session_ids=["s"]))[0][0] == ids[0]
    await store.set_session_indexed("s", True)
    assert (await store.vec_search("u", q, 1))[0][0] == ids[0]


@pytest.mark.asyncio
async def test_vector_backfill(store: Store, embedder: HashEmbedder) -> None:
    await store.get_or_create_session("u", "s")
    v = (await embedder.embed_passages(["hello there"]))[0]
    await store.add_turns("s", "u", [NewTurn(0, "user", "hello there")], [v])

    (late,) = await store.add_turns("s", "u", [NewTurn(1, "assistant", "general kenobi")])
    missing = await store.turns_without_vectors("u")
    assert [t.id for t in missing] == [late]
    (lv,) = await embedder.embed_passages(["general kenobi"])
    assert await store.set_vectors([(late, lv, text_hash("general kenobi")), (999, lv, "x")]) == 1
    assert await store.turns_without_vectors("u") == []
    assert (await store.vec_search("u", lv, 1))[0][0] == late


@pytest.mark.asyncio
async def test_bad_vector_dimension_rejected_and_nothing_written(store: Store) -> None:
    await store.get_or_create_session("u", "s")
    with pytest.raises(ValueError, match="384"):
        await store.add_turns(
            "s",
            "u",
            [NewTurn(0, "user", "a"), NewTurn(1, "user", "b")],
            [unit(0), np.zeros(10, dtype=np.float32)],
        )
    assert await store.count_turns("s") == 0


@pytest.mark.asyncio
async def test_export_and_delete_user(store: Store, embedder: HashEmbedder) -> None:
    await archive(store, embedder, "u", "s1", [f"message {i}" for i in range(7)])
    await archive(store, embedder, "other", "s2", ["not yours"])
    rows = [row async for row in store.export("u", page_size=3)]
    assert rows[0]["type"] == "session" and rows[0]["id"] == "s1"
    turns = [r for r in rows if r["type"] == "turn"]
    assert [t["content"] for t in turns] == [f"message {i}" for i in range(7)]
    assert {t["user_id"] for t in turns} == {"u"}
    assert await store.list_users() == ["other", "u"]
    assert await store.delete_user("u") is True
    assert [row async for row in store.export("u")] == []
    assert (await store.stats()).turns == 1


@pytest.mark.asyncio
async def test_get_turns_can_be_confined_to_a_user(store: Store) -> None:
    await store.get_or_create_session("a", "sa")
    await store.get_or_create_session("b", "sb")
    (ta,) = await store.add_turns("sa", "a", [NewTurn(0, "user", "a's")])
    (tb,) = await store.add_turns("sb", "b", [NewTurn(0, "user", "b's")])
    assert [t.id for t in await store.get_turns([tb, ta], user_id="a")] == [ta]
    assert await store.get_turns([]) == []


@pytest.mark.asyncio
async def test_embedding_model_is_recorded_once(store: Store) -> None:
    assert await store.ensure_embedding_model("m1") is True
    assert await store.ensure_embedding_model("m1") is True
    # No vector stored yet: another model may take the table over, losing nothing.
    assert await store.ensure_embedding_model("m2") is True
    await store.get_or_create_session("u", "s")
    await store.add_turns("s", "u", [NewTurn(0, "user", "x")], [unit(1)])
    assert await store.ensure_embedding_model("m2") is True
    assert await store.ensure_embedding_model("m1") is False


@pytest.mark.asyncio
async def test_sqlite_work_stays_off_the_event_loop(store: Store) -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def probe(conn: object) -> int:
        seen.append(threading.get_ident())
        return 1

    await store.read(probe)
    await store.write(probe)
    assert loop_thread not in seen and len(seen) == 2


@pytest.mark.asyncio
async def test_write_survives_cancellation_of_its_caller(store: Store) -> None:
    await store.get_or_create_session("u", "s")
    started = threading.Event()
    release = threading.Event()

    def slow(conn: object) -> None:
        started.set()
        release.wait(5)

    blocker = asyncio.ensure_future(store.write(slow))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
    pending = asyncio.ensure_future(store.add_turns("s", "u", [NewTurn(0, "user", "kept")]))
    await asyncio.sleep(0.01)
    pending.cancel()
    release.set()
    await blocker
    with pytest.raises(asyncio.CancelledError):
        await pending
    await store.write(lambda c: None)  # queued after the cancelled write
    assert await store.count_turns("s") == 1


@pytest.mark.asyncio
async def test_concurrent_reads_and_writes(store: Store, embedder: HashEmbedder) -> None:
    await store.get_or_create_session("u", "s")
    vec = unit(3)

    async def writer(i: int) -> None:
        await store.add_turns("s", "u", [NewTurn(i, "user", f"note {i}")], [vec])

    async def reader() -> int:
        return len(await store.vec_search("u", vec, 5))

    results = await asyncio.gather(*(writer(i) for i in range(20)), *(reader() for _ in range(20)))
    assert all(isinstance(r, int) and r <= 5 for r in results[20:])
    assert await store.count_turns("s") == 20


@pytest.mark.asyncio
async def test_reopen_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "again.db"
    async with Store(path) as s:
        await s.get_or_create_session("u", "s")
        await s.add_turns("s", "u", [NewTurn(0, "user", "persisted")], [unit(1)])
    async with Store(path) as s:
        (turn,) = await s.session_turns("s")
        assert turn.content == "persisted"
        assert (await s.vec_search("u", unit(1), 1))[0][0] == turn.id


def test_memory_path_is_refused() -> None:
    with pytest.raises(ValueError):
        Store(":memory:")
