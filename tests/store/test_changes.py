"""Processes sharing one database keep their search caches in step through the ``changes`` log
(proxy/store/changes.py): what one process writes is searchable through another at its next
search, appended to what it holds (no reload), deletions and hidden sessions included; its own
writes are never applied twice; a process that fell behind the pruned log starts again.

"Another process" is a second :class:`Store` on the same file: its own connections, threads and
caches, exactly what a second ``engram serve`` (or ``engram import``) holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from proxy.store import NewTurn, Store, changes, indexing, queries
from proxy.store.sqlite.db import Connection, connect
from proxy.store.sqlite.migrations import EMBED_DIM, migrate
from proxy.store.sqlite.migrations_later import CHANGES_KEEP
from tests.store.test_term_cache import archive, check_all
from tests.store.test_term_cache import held as terms_held
from tests.store.test_vec_cache import both, unit
from tests.store.test_vec_cache import held as vectors_held

pytestmark = pytest.mark.asyncio

Pair = tuple[Store, Store]


async def _pair(target: str | Path) -> AsyncIterator[Pair]:
    """(the server, holding user u's terms and vectors; another process on the same file)."""
    rng = np.random.default_rng(3)
    async with Store(target, vec_mode="exact") as server:
        await archive(server, "u", 3)
        ids = await server.read(lambda c: [r[0] for r in c.execute("SELECT id FROM turns")])
        await server.set_vectors([(i, unit(rng), f"h{i}") for i in ids])
        await terms_held(server, "u")
        await vectors_held(server, "u")
        async with Store(server.target, vec_mode="exact") as other:
            yield server, other


@pytest_asyncio.fixture
async def pair(store_target: str | Path) -> AsyncIterator[Pair]:
    """Two processes on one SQLite file, or on one PostgreSQL database."""
    async for both_ in _pair(store_target):
        yield both_


@pytest_asyncio.fixture
async def sqlite_pair(tmp_path: Path) -> AsyncIterator[Pair]:
    """Two processes on one SQLite file: for what only SQLite's log does (sequence numbers
    handed out again after a rollback, pruning by count, a process's own rows marked; the
    PostgreSQL log's are the test_pg_ ones at the end)."""
    async for both_ in _pair(tmp_path / "memory.db"):
        yield both_


def loads(st: Store) -> tuple[int, int]:
    return st.terms.loads, st.vectors.loads


async def contents(st: Store, ranked: list[tuple[int, float]]) -> list[str]:
    return [t.content for t in await st.get_turns([i for i, _ in ranked])]


async def session_ids(st: Store, session_id: str) -> set[int]:
    return {t.id for t in await st.session_turns(session_id)}


async def test_what_another_process_archives_is_found_without_a_reload(pair: Pair) -> None:
    server, other = pair
    before = loads(server)
    vec = unit(np.random.default_rng(11))
    await other.get_or_create_session("u", "u-new")
    (new,) = await other.add_turns(
        "u-new", "u", [NewTurn(0, "user", "a narwhal in the bay")], [vec]
    )
    found = await server.fts_search("u", '"narwhal"', 5)
    assert await contents(server, found) == ["a narwhal in the bay"]
    cached, vec0 = await both(server, "u", vec, 5)
    assert cached == vec0 and cached[0][0] == new
    assert loads(server) == before  # appended to what it holds: nothing loaded again
    assert server.follower.applied >= 2  # the turn's full-text row and its vector
    await check_all(server, "u")


async def test_a_turn_indexed_later_by_another_process_is_found_once_indexed(pair: Pair) -> None:
    server, other = pair
    before = loads(server)
    await other.get_or_create_session("u", "u-new")
    row = NewTurn(0, "user", "the walrus sunbathes on the pier")
    ((new, _),) = await other.write(
        lambda c: queries.insert_turns(c, "u-new", "u", [row], None, time.time(), fts_pending=True)
    )
    assert await server.fts_search("u", '"walrus"', 5) == []  # archived, not indexed yet
    await other.write(lambda c: indexing.index_deferred(c, [new]))
    assert [i for i, _ in await server.fts_search("u", '"walrus"', 5)] == [new]
    assert loads(server) == before
    await check_all(server, "u")


async def test_forgetting_through_another_process_forgets_here(pair: Pair) -> None:
    server, other = pair
    gone = await session_ids(server, "u-s1")
    probe = (await server.turn_vectors("u", sorted(gone)[:1]))[sorted(gone)[0]]
    assert sorted(gone)[0] in [i for i, _ in await server.vec_search("u", probe, 5)]
    assert await other.delete_session("u-s1", user_id="u")
    assert not {i for i, _ in await server.fts_search("u", '"lake" OR "cats"', 200)} & gone
    assert not {i for i, _ in await server.vec_search("u", probe, 200)} & gone
    await check_all(server, "u")


async def test_a_session_hidden_through_another_process_is_hidden_here(pair: Pair) -> None:
    server, other = pair
    hidden = await session_ids(server, "u-s0")
    assert {i for i, _ in await server.fts_search("u", '"lake" OR "cats"', 200)} & hidden
    await other.set_session_indexed("u-s0", False)
    assert not {i for i, _ in await server.fts_search("u", '"lake" OR "cats"', 200)} & hidden
    probe = np.ones(EMBED_DIM, np.float32) / np.sqrt(EMBED_DIM)
    assert not {i for i, _ in await server.vec_search("u", probe, 200)} & hidden
    await check_all(server, "u")


async def test_a_vector_replaced_by_another_process_is_replaced_here(pair: Pair) -> None:
    server, other = pair
    (turn,) = sorted(await session_ids(server, "u-s2"))[3:4]
    fresh = unit(np.random.default_rng(99))
    await other.set_vectors([(turn, fresh, "re-embedded")])
    await vectors_held(server, "u")  # dropped (held rows were stale), then loaded again
    cached, vec0 = await both(server, "u", fresh, 3)
    assert cached == vec0 and cached[0][0] == turn


async def test_its_own_writes_are_never_taken_for_another_process(sqlite_pair: Pair) -> None:
    server, _ = sqlite_pair
    before = loads(server)
    vec = unit(np.random.default_rng(5))
    (mine,) = await server.add_turns("u-s1", "u", [NewTurn(60, "user", "my own narwhal")], [vec])
    assert [i for i, _ in await server.fts_search("u", '"narwhal"', 5)][:1] == [mine]
    cached, _ = await both(server, "u", vec, 1)
    assert cached[0][0] == mine
    assert server.follower.applied == 0 and loads(server) == before


async def test_a_rolled_back_write_does_not_hide_the_next_writers_change(sqlite_pair: Pair) -> None:
    """SQLite hands a rolled-back write's sequence numbers to the next writer: the server
    must not take the other process's row for its own."""
    server, other = sqlite_pair
    before = loads(server)
    top = await server.read(lambda c: c.execute("SELECT max(seq) FROM changes").fetchone()[0])
    await server.get_or_create_session("x", "x-s0")

    def fails(c: Connection) -> None:
        queries.insert_turns(c, "x-s0", "x", [NewTurn(0, "user", "never kept")], None, 1.0)
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        await server.write(fails)
    await other.get_or_create_session("u", "u-new")
    await other.add_turns("u-new", "u", [NewTurn(0, "user", "an octopus in a jar")])
    reused = await server.read(
        lambda c: c.execute("SELECT min(seq) FROM changes WHERE seq > ?", (top,)).fetchone()[0]
    )
    assert reused == top + 1  # the number the rolled-back write had taken
    assert await contents(server, await server.fts_search("u", '"octopus"', 5)) == [
        "an octopus in a jar"
    ]
    assert loads(server) == before


async def test_a_process_behind_the_pruned_log_starts_again(sqlite_pair: Pair) -> None:
    server, other = sqlite_pair
    await other.get_or_create_session("u", "u-new")
    await other.add_turns("u-new", "u", [NewTurn(0, "user", "a heron on one leg")])
    await other.write(lambda c: c.execute("DELETE FROM changes"))  # as if pruned unread
    await other.add_turns("u-new", "u", [NewTurn(1, "assistant", "and a stork beside it")])
    found = await server.fts_search("u", '"heron" OR "stork"', 5)
    assert server.follower.cleared == 1  # nothing held trusted: loaded again
    assert sorted(await contents(server, found)) == ["a heron on one leg", "and a stork beside it"]
    await terms_held(server, "u")
    await check_all(server, "u")


async def test_a_process_more_than_a_batch_behind_starts_again(
    sqlite_pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, other = sqlite_pair
    monkeypatch.setattr(changes, "BATCH", 3)
    await other.get_or_create_session("u", "u-new")
    await other.add_turns("u-new", "u", [NewTurn(i, "user", f"crab number {i}") for i in range(5)])
    found = await server.fts_search("u", '"crab"', 10)
    assert server.follower.cleared == 1 and len(found) == 5
    await terms_held(server, "u")
    await check_all(server, "u")


async def test_the_log_keeps_its_newest_rows_and_only_ids(tmp_path: Path) -> None:
    conn = connect(tmp_path / "memory.db")
    try:
        migrate(conn)
        add = "INSERT INTO changes(seq, user_id, turn_id, kind) VALUES (?, 'u', 1, 'indexed')"
        for seq in range(1, 11):
            conn.execute(add, (seq,))
        conn.execute(add, (CHANGES_KEEP + 1023,))  # not a pruning row
        assert conn.execute("SELECT count(*) FROM changes").fetchone()[0] == 11
        conn.execute(add, (CHANGES_KEEP + 1024,))  # prunes every row up to 1024
        kept = [r[0] for r in conn.execute("SELECT seq FROM changes ORDER BY seq")]
        assert kept == [CHANGES_KEEP + 1023, CHANGES_KEEP + 1024]
        columns = [r[1] for r in conn.execute("PRAGMA table_info(changes)")]
        assert columns == ["seq", "user_id", "turn_id", "kind", "session_id"]  # ids: no text
    finally:
        conn.close()


async def test_a_vector_already_held_is_not_taken_for_a_replaced_one(pair: Pair) -> None:
    """A load may read a vector the log then names again (or the log names one this process
    applied): the same vector again is skipped, the user stays held; another one drops it."""
    server, _ = pair
    before = loads(server)
    (turn,) = sorted(await session_ids(server, "u-s2"))[:1]
    await server.read(lambda c: server.vectors.append_stored(c, [(turn, "u")]))
    assert server.vectors.get("u") is not None and loads(server) == before
    await server.write(
        lambda c: c.execute(
            "UPDATE turn_vec SET embedding = ? WHERE turn_id = ?",
            (unit(np.random.default_rng(1)).tobytes(), turn),
        )
    )
    await server.read(lambda c: server.vectors.append_stored(c, [(turn, "u")]))
    assert server.vectors.get("u") is None  # stale: dropped, loaded again on demand


async def test_what_another_process_deletes_is_told_with_its_sessions(sqlite_pair: Pair) -> None:
    """A forget elsewhere reaches ``on_deleted`` (the server's views of those turns go too:
    tests/proxy/test_workers.py), on the usual path and on the path of a process too far behind
    (the log still names them), and as "anything" once the log no longer has them."""
    server, other = sqlite_pair
    told: list[Any] = []
    server.follower.on_deleted = told.append
    gone = await session_ids(server, "u-s1")
    assert await other.delete_session("u-s1", user_id="u")
    await server.fts_search("u", '"lake"', 5)
    assert told == [{"u": ({"u-s1"}, gone)}]
    gone = await session_ids(server, "u-s2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(changes, "BATCH", 3)
        assert await other.delete_session("u-s2", user_id="u")
        await server.fts_search("u", '"lake"', 5)
    assert server.follower.cleared == 1 and told[-1] == {"u": ({"u-s2"}, gone)}
    assert await other.delete_session("u-s0", user_id="u")
    await other.write(lambda c: c.execute("DELETE FROM changes"))  # pruned unread
    await other.get_or_create_session("u", "u-later")
    await other.add_turns("u-later", "u", [NewTurn(0, "user", "after the prune")])
    await server.fts_search("u", '"lake"', 5)
    assert told[-1] is None  # the rows are gone: every view goes


async def test_caches_stay_exact_while_both_processes_write_and_one_loads(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both processes archive at once (turns with vectors, 20 transactions each) while the
    server searches without pause and, at the start, loads the user again on its loader
    thread, slowly: afterwards its terms rank exactly as the reference over FTS5's rows, its
    vectors answer exactly as vec0, and every turn of both is found."""
    from proxy.store.caches import term_cache, term_index

    server, other = pair
    monkeypatch.setattr(term_cache, "LOAD_NOW_ROWS", 0)  # loads go to the loader thread
    monkeypatch.setattr(term_index, "LOAD_CHUNK", 4)  # and take a while
    server.terms.drop("u")
    server.vectors.drop("u")
    rng = np.random.default_rng(21)
    await other.get_or_create_session("u", "u-other")
    await server.get_or_create_session("u", "u-mine")
    probe = unit(rng)
    written = False

    async def write(st: Store, session: str, word: str) -> None:
        for k in range(20):
            turns = [NewTurn(2 * k + j, "user", f"{word} {k}-{j} by the lake") for j in (0, 1)]
            await st.add_turns(session, "u", turns, [unit(rng), unit(rng)])

    async def search() -> None:
        while not written:
            await server.fts_search("u", '"lake" OR "heron"', 10)
            await server.vec_search("u", probe, 10, mode="exact")

    async def both_write() -> None:
        nonlocal written
        await asyncio.gather(write(other, "u-other", "heron"), write(server, "u-mine", "egret"))
        written = True

    await asyncio.gather(search(), both_write())
    await terms_held(server, "u")
    await vectors_held(server, "u")
    await check_all(server, "u")
    for _ in range(5):
        cached, vec0 = await both(server, "u", unit(rng), 20)
        assert cached == vec0
    found = await contents(server, await server.fts_search("u", '"heron" OR "egret"', 200))
    assert len(found) == 80
    index = server.terms._users["u"]
    assert len(index.held) == index.n == len(set(index.ids[: index.n].tolist()))


# -- the PostgreSQL log (proxy/store/postgres/follow.py)
# ---------------------------------------------


@pytest_asyncio.fixture
async def pg_pair(pg_server: Any) -> AsyncIterator[Pair]:
    """Two processes on one PostgreSQL database."""
    from tests.store.conftest import new_database

    async for both_ in _pair(new_database(pg_server)):
        yield both_


async def test_pg_a_turn_another_process_writes_is_found_after_follow_then_forgotten(
    pg_pair: Pair,
) -> None:
    server, other = pg_pair
    before = loads(server)
    vec = unit(np.random.default_rng(12))
    await other.get_or_create_session("u", "u-new")
    (new,) = await other.add_turns("u-new", "u", [NewTurn(0, "user", "a manatee grazing")], [vec])
    assert await server.follow() >= 2  # its full-text row and its vector, read from the log
    assert server.terms.held("u") and server.vectors.get("u") is not None
    assert [i for i, _ in await server.fts_search("u", '"manatee"', 5)] == [new]
    cached, vec0 = await both(server, "u", vec, 3)
    assert cached == vec0 and cached[0][0] == new
    assert loads(server) == before  # appended: nothing loaded again
    await check_all(server, "u")
    await other.write(lambda c: c.execute("DELETE FROM turns WHERE id = ?", (new,)))
    await server.follow()
    assert not server.terms.held("u") and server.vectors.get("u") is None  # dropped
    assert await server.fts_search("u", '"manatee"', 5) == []
    assert new not in {i for i, _ in await server.vec_search("u", vec, 5)}


async def test_pg_a_transaction_committing_after_a_later_one_is_not_skipped(
    pg_pair: Pair,
) -> None:
    """Two writers: the first takes the lower log sequence (and turn id) and commits last.
    Reading "past the last seq seen" would skip it; the follower reads by transaction."""
    from proxy.store import backend

    server, other = pg_pair
    for session in ("u-first", "u-second"):
        await other.get_or_create_session("u", session)
    first = backend.open_connection(server.target)
    second = backend.open_connection(server.target)
    try:
        now = time.time()
        first.execute("BEGIN")
        ((early, _),) = queries.insert_turns(
            first, "u-first", "u", [NewTurn(0, "user", "a dugong, written first")], None, now
        )
        second.execute("BEGIN")
        ((late, _),) = queries.insert_turns(
            second, "u-second", "u", [NewTurn(0, "user", "a dugong, committed first")], None, now
        )
        assert early < late
        second.execute("COMMIT")
        await server.follow()
        assert [i for i, _ in await server.fts_search("u", '"dugong"', 5)] == [late]
        first.execute("COMMIT")
        await server.follow()
        assert sorted(i for i, _ in await server.fts_search("u", '"dugong"', 5)) == [early, late]
        assert server.terms.held("u")
        await check_all(server, "u")
    finally:
        first.close()
        second.close()
