"""Users' full-text index in memory (proxy/store/caches/term_cache.py, term_index.py): BM25 over the
rows FTS5 holds, computed here independently from ``turns_fts``'s own tokens, with every filter,
and still so after each kind of write; per-user statistics; FTS5 alone when it is turned off."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from proxy.search.fts_query import match_of, query_words
from proxy.store import NewTurn, Store, backend, indexing, queries
from proxy.store.caches.term_index import K1, B, terms_of
from proxy.store.sqlite.db import Connection, driver
from proxy.store.sqlite.migrations import FTS_TOKENIZE

pytestmark = pytest.mark.asyncio

DAY = 86_400.0
T0 = 1_683_504_000.0  # Monday 8 May 2023
TOPICS = (
    "Caroline went hiking near the lake with her dog Max",
    "Melanie is painting a sunrise over the lake for the charity auction",
    "the running club meets on Friday mornings for a charity race",
    "my sister Marta lives in Porto and she breeds Siamese cats",
    "we adopted two kittens, the cats sleep on the sofa all day",
    "the café on the corner serves crème brûlée and espresso",
)
QUERIES = (
    "When did Caroline go hiking at the lake?",
    "Who breeds cats?",
    "charity race on Friday",
    "May 2023 painting",
    "crème brûlée café",
    "what did Max do",
)


def text(s: int, i: int) -> str:
    """A turn's text: a topic, some turns long enough to be cut in their neighbours' ctx."""
    base = TOPICS[(s * 7 + i) % len(TOPICS)]
    if i % 9 == 4:  # over CTX_CHARS: the words past the cut are not in the neighbours' ctx
        return base + " " + " ".join(f"filler{k}" for k in range(160)) + " zanzibar lake"
    return f"{base} ({i})"


async def archive(st: Store, user: str, sessions: int, *, indexed_last: bool = True) -> None:
    for s in range(sessions):
        sid = f"{user}-s{s}"
        await st.get_or_create_session(user, sid, indexed=indexed_last or s != sessions - 1)
        turns = [NewTurn(0, "system", "You are a helpful assistant.", timestamp=T0)]
        turns += [
            NewTurn(
                i,
                ("user", "assistant", "tool")[i % 3],
                text(s, i),
                speaker=("Caroline", "Melanie", None)[i % 3],
                timestamp=T0 + DAY * (s * 3 + i // 6),
            )
            for i in range(1, 20)
        ]
        await st.add_turns(sid, user, turns)


async def held(st: Store, user: str) -> None:
    """Search until the user's terms are held (the first search starts the load)."""
    for _ in range(500):
        if st.terms.held(user):
            return
        await st.fts_search(user, '"lake"', 1)
        await asyncio.sleep(0.01)
    raise AssertionError(f"{user}'s terms were never loaded")


def reference(
    st: Store, user: str, terms: Sequence[str], weights: Sequence[float], scope_sql: str
) -> list[tuple[int, float]]:
    """BM25 as FTS5 defines it over the user's rows of ``turns_fts``, each row's tokens read
    from FTS5 itself (``fts5vocab`` instance), with the user's own statistics; the rows
    ``scope_sql`` (a query of turn ids) selects, best first, ties by id. On PostgreSQL the rows
    are its ``turns_fts`` texts (as its triggers wrote them), tokenized by an FTS5 table of the
    same tokenizer."""
    if st.pg:
        db: Connection = backend.open_connection(st.target, readonly=True)
        conn: Connection = driver().module.connect(":memory:")
    else:
        db = conn = driver().module.connect(str(st.path))
    try:
        mine = {
            int(r[0])
            for r in db.execute(
                "SELECT id FROM turns WHERE user_id = ? AND fts_pending = 0", (user,)
            )
        }
        scope = {int(r[0]) for r in db.execute(scope_sql, (user,))}
        if st.pg:
            conn.execute(
                "CREATE VIRTUAL TABLE turns_fts USING fts5(body, ctx, date,"
                f" tokenize = '{FTS_TOKENIZE}')"
            )
            conn.executemany(
                "INSERT INTO turns_fts(rowid, body, ctx, date) VALUES (?, ?, ?, ?)",
                db.execute("SELECT turn_id, body, ctx, date FROM turns_fts").fetchall(),
            )
        conn.execute("CREATE VIRTUAL TABLE temp.inst USING fts5vocab(main, turns_fts, instance)")
        count: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])
        size: dict[int, int] = defaultdict(int)
        column = {"body": 0, "ctx": 1, "date": 2}
        for term, doc, col in conn.execute("SELECT term, doc, col FROM inst"):
            if int(doc) in mine:
                count[(str(term), int(doc))][column[str(col)]] += 1
                size[int(doc)] += 1
    finally:
        conn.close()
        if st.pg:
            db.close()
    n = len(mine)
    avgdl = sum(size.values()) / n
    score: dict[int, float] = defaultdict(float)
    for term in dict.fromkeys(terms):
        rows = {doc: c for (t, doc), c in count.items() if t == term}
        if not rows:
            continue
        idf = math.log((n - len(rows) + 0.5) / (len(rows) + 0.5))
        idf = idf if idf > 0 else 1e-6
        for doc, c in rows.items():
            f = sum(w * x for w, x in zip(weights, c, strict=True))
            norm = K1 * (1 - B + B * size[doc] / avgdl)
            score[doc] += idf * f * (K1 + 1) / (f + norm)
    ranked = sorted((-s, doc) for doc, s in score.items() if doc in scope)
    return [(doc, s) for s, doc in ranked]


def same(got: list[tuple[int, float]], want: list[tuple[int, float]], limit: int) -> None:
    want = want[:limit]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(math.isclose(g[1], w[1], rel_tol=1e-9) for g, w in zip(got, want, strict=True))


INDEXED = (
    "SELECT t.id FROM turns t JOIN sessions s ON s.id = t.session_id"
    " WHERE t.user_id = ? AND s.indexed = 1"
)


async def check_all(st: Store, user: str, **kw: Any) -> int:
    """Every query, under several weights and filters, equals the reference; the rows seen."""
    seen = 0
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, INDEXED),
        ({"exclude_roles": ["tool"]}, INDEXED + " AND t.role != 'tool'"),
        ({"session_ids": [f"{user}-s1", f"{user}-s3"]}, INDEXED.replace(
            " AND s.indexed = 1", f" AND t.session_id IN ('{user}-s1', '{user}-s3')")),
        ({"exclude_sessions": [f"{user}-s0"]}, INDEXED + f" AND t.session_id != '{user}-s0'"),
    ]  # fmt: skip
    for query in QUERIES:
        match = match_of(query_words(query))
        assert match is not None
        terms = terms_of(match)
        assert terms is not None
        for filters, scope in cases:
            got = await st.fts_search(user, match, 12, **filters)
            want = reference(st, user, terms, (1.0, 0.3, 1.0), scope)
            same(got, want, 12)
            seen += len(got)
    return seen


@pytest_asyncio.fixture
async def store(store_target: str | Path) -> AsyncIterator[Store]:
    async with Store(store_target) as st:
        await archive(st, "u", 5, indexed_last=False)
        await archive(st, "other", 2)
        await held(st, "u")
        yield st


async def test_ranks_as_bm25_over_the_rows_fts5_holds_with_every_filter(store: Store) -> None:
    assert store.terms.loads == 1
    assert await check_all(store, "u") > 100


async def test_new_turns_are_appended_and_rewire_their_neighbours(store: Store) -> None:
    loads = store.terms.loads
    # indexed at once (the insert trigger), then archived first and indexed after (the proxy)
    (heron_id,) = await store.add_turns(
        "u-s1", "u", [NewTurn(30, "user", "Caroline saw a heron at the lake")]
    )
    await store.get_or_create_session("u", "u-s9")
    late = [NewTurn(i, "user", f"{TOPICS[i % 6]} again {i}", timestamp=T0) for i in range(6)]
    ids = await store.write(
        lambda c: [i for i, _ in queries.insert_turns(c, "u-s9", "u", late, None, T0,
                                                      fts_pending=True)])  # fmt: skip
    await store.write(lambda c: indexing.index_deferred(c, ids[3:]))  # part first
    found = {i for i, _ in await store.fts_search("u", '"again"', 20)}
    assert found == set(ids[3:])  # a turn still pending is not searchable
    # (the ctx of rows next to a pending turn may differ from FTS5's until it is indexed)
    await store.write(lambda c: indexing.index_deferred(c, ids[:3]))  # then the rest
    assert {i for i, _ in await store.fts_search("u", '"again"', 20)} == set(ids)
    await check_all(store, "u")
    heron = await store.fts_search("u", '"heron"', 5)
    assert heron[0][0] == heron_id and len(heron) == 3  # itself, then two neighbours by ctx
    assert store.terms.loads == loads and store.terms.held("u")  # appended, never reloaded


async def test_a_rolled_back_write_leaves_nothing_behind(store: Store) -> None:
    def fails(c: Connection) -> None:
        queries.add_turns(c, "u-s1", "u", [NewTurn(40, "user", "a quokka smiled")], None, T0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await store.write(fails)
    assert await store.fts_search("u", '"quokka"', 5) == []
    await held(store, "u")
    assert await store.fts_search("u", '"quokka"', 5) == []
    await check_all(store, "u")


@pytest.mark.parametrize("change", ["delete", "update", "unindex"])
async def test_deletes_updates_and_indexed_flips_drop_the_user(store: Store, change: str) -> None:
    if change == "delete":
        assert await store.delete_session("u-s2", user_id="u")
    elif change == "update":
        await store.write(
            lambda c: c.execute(
                "UPDATE turns SET content = 'an axolotl by the lake' WHERE session_id = 'u-s0'"
                " AND position = 2"
            )
        )
    else:
        await store.set_session_indexed("u-s3", False)
    assert not store.terms.held("u")
    await held(store, "u")
    assert store.terms.loads == 2
    await check_all(store, "u")
    axolotl = await store.fts_search("u", '"axolotl"', 5)
    # the turn, then its three neighbours (position 0 is the system prompt: no one's ctx)
    assert len(axolotl) == (4 if change == "update" else 0)


async def test_another_users_archive_does_not_move_mine(store: Store) -> None:
    query = match_of(query_words("Who breeds Siamese cats near the lake?"))
    assert query is not None
    before = await store.fts_search("u", query, 20)
    await archive(store, "other", 12)  # many more rows holding the same words
    await store.write(
        lambda c: queries.add_turns(
            c, "other-s0", "other", [NewTurn(50 + i, "user", "siamese " * 5) for i in range(40)],
            None, T0)
    )  # fmt: skip
    assert await store.fts_search("u", query, 20) == before
    # FTS5's statistics span every user: the same query there does move; PostgreSQL's
    # ts_rank_cd has no statistics across rows: it does not
    fts5 = await store.read(lambda c: _fts5(c, "u", query))
    await archive(store, "third", 1)
    after = await store.read(lambda c: _fts5(c, "u", query))
    assert (after == fts5) if store.pg else (after != fts5)


def _fts5(c: Connection, user: str, match: str) -> list[tuple[int, float]]:
    from proxy.store.sqlite.search_sql import fts_search

    return fts_search(c, user, match, 20, session_ids=None, exclude_ids=())


async def test_fts_memory_zero_keeps_every_search_in_fts5(store_target: str | Path) -> None:
    async with Store(store_target, fts_memory=0) as st:
        await archive(st, "u", 2)
        for _ in range(20):
            assert await st.fts_search("u", '"lake"', 3)
            await asyncio.sleep(0.01)
        assert st.terms.loads == 0 and not st.terms.held("u")


async def test_terms_of_reads_only_match_of_expressions() -> None:
    assert terms_of('"cats" OR "running"') == ["cat", "run"]
    assert terms_of('"café"') == ["cafe"]
    for other in ('cats OR "dogs"', '"cats" AND "dogs"', '"ca"ts"', "", '"a" OR'):
        assert terms_of(other) is None
    assert terms_of('"ab""cd"') is None  # the tokenizer splits it: a phrase for FTS5


async def test_turns_another_process_imports_are_found(store: Store) -> None:
    """``engram import`` beside a running server: another connection (here a second Store on
    the same file, as another process holds one) inserts turns; the server's next search reads
    them from the ``changes`` log and appends them to what it holds (tests/store/test_changes.py
    has the rest of it)."""
    assert store.terms.held("u")
    before = store.terms.loads
    async with Store(store.target) as importer:
        await importer.get_or_create_session("u", "u-imported")
        await importer.add_turns("u-imported", "u", [NewTurn(0, "user", "a narwhal in the bay")])
    found = await store.fts_search("u", '"narwhal"', 5)
    assert [t.content for t in await store.get_turns([i for i, _ in found])] == [
        "a narwhal in the bay"
    ]
    assert store.terms.loads == before  # appended, not loaded again
    await check_all(store, "u")
    (mine,) = await store.add_turns("u-s1", "u", [NewTurn(60, "user", "another narwhal")])
    top = [i for i, _ in await store.fts_search("u", '"narwhal"', 5)]
    assert set(top[:2]) == {mine, found[0][0]}  # (then the neighbours that hold it in ctx)
    assert store.terms.loads == before


async def test_turns_indexed_while_a_user_loads_in_the_background_are_kept(
    store_target: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user too big to load on the spot (here: any) is loaded on the loader thread while
    FTS5 answers; turns committed during that load are added once it is in, none twice."""
    from proxy.store.caches import term_cache, term_index

    monkeypatch.setattr(term_cache, "LOAD_NOW_ROWS", 0)
    monkeypatch.setattr(term_index, "LOAD_CHUNK", 1)  # a slow load: one turn per statement
    during = 0
    async with Store(store_target) as st:
        await archive(st, "u", 30)
        assert await st.fts_search("u", '"lake"', 5)  # FTS5's answer; the load starts
        assert not st.terms.held("u")

        async def write(k: int) -> None:
            nonlocal during
            await st.add_turns(f"u-s{k % 6}", "u", [NewTurn(100 + k, "user", f"otter {k}")])
            during += "u" in st.terms._loading  # committed while the load was reading

        written = 0
        while not st.terms.held("u") and written < 60:  # writes while it loads
            await write(written)
            written += 1
        for _ in range(1000):
            if st.terms.held("u"):
                break
            await asyncio.sleep(0.01)
        assert st.terms.held("u") and st.terms.loads == 1
        assert during > 0
        for k in range(written, written + 10):  # and after
            await write(k)
        otters = await st.fts_search("u", '"otter"', 500)
        contents = {t.content for t in await st.get_turns([i for i, _ in otters])}
        assert {f"otter {k}" for k in range(written + 10)} <= contents
        await check_all(st, "u")
        index = st.terms._users["u"]
        assert len(index.held) == index.n == len(set(index.ids[: index.n].tolist()))
