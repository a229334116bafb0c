"""Forgetting in the store (issue 12, row 8): what a session's delete takes with it, the slots
only it used, the scrub after deletes, secure_delete, and the one-time VACUUM that gives older
databases ``auto_vacuum = INCREMENTAL``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from proxy.store import NewTurn, SessionNotFound, Store, indexing, queries
from proxy.store.dialect import is_pg
from proxy.store.feedback import RecordedRequest, add_feedback, insert_request
from proxy.store.forget import forget_session, link_slots, purge_links
from proxy.store.items import insert_item
from proxy.store.postgres.scrub import STATISTICS
from proxy.store.slots import SlotRow, upsert_slots
from proxy.store.sqlite import db, migrations
from proxy.store.sqlite import scrub as scrub_module
from proxy.store.sqlite.scrub import (
    AUTO_VACUUM_INCREMENTAL,
    Scrubber,
    auto_vacuum_mode,
    checkpoint,
    ensure_incremental_vacuum,
    free_pages,
    fts_optimize,
    fts_segments,
)
from proxy.store.summaries import Summary, get_summary, put_summary
from testing.postgres import PostgresServer
from tests.store.conftest import new_database

FORGETTING = 9
"""The migration that brings slot_sessions and sessions_ad_items."""


def count(conn: db.Connection, sql: str, *args: object) -> int:
    return int(conn.execute(sql, args).fetchone()[0])


def fts_words(conn: db.Connection, *words: str) -> int:
    """How many full-text rows hold any of ``words`` (in their text or their context): FTS5's
    ``MATCH``; on PostgreSQL, whose English ``tsvector`` leaves out stop words such as "a", the
    indexed text searched for them as words."""
    if not is_pg(conn):
        return count(
            conn, "SELECT count(*) FROM turns_fts WHERE turns_fts MATCH ?", " OR ".join(words)
        )
    pattern = r"\m(" + "|".join(words) + r")\M"
    return count(conn, "SELECT count(*) FROM turns_fts WHERE (body || ' ' || ctx) ~* ?", pattern)


@pytest.mark.asyncio
async def test_forgetting_a_session_takes_everything_derived_from_it(
    store_target: str | Path,
) -> None:
    async with Store(store_target) as store:
        for sid, parent in (("a", None), ("a-kid", "a"), ("b", None), ("facts~u", None)):
            await store.get_or_create_session("u", sid, parent_id=parent)
        for sid in ("a", "a-kid", "b"):
            await store.add_turns(sid, "u", [NewTurn(0, "user", f"words of {sid}")])
        now = time.time()

        def setup(c: db.Connection) -> None:
            # a hand-back of a-kid into a; facts from a (traceable) and from nowhere
            insert_item(c, "a", "u", NewTurn(-1, "summary", "kid found it"), None, "a-kid")
            insert_item(c, "facts~u", "u", NewTurn(-1, "fact", "from a"), None, "a")
            insert_item(c, "facts~u", "u", NewTurn(-1, "fact", "from b"), None, "b")
            insert_item(c, "facts~u", "u", NewTurn(-1, "fact", "untraced"), None, None)
            put_summary(c, Summary("a", "summary of a", 1, 3, now), None)
            request = RecordedRequest("r1", "u", "a-kid", None, "what the kid asked", [], now)
            insert_request(c, request)
            add_feedback(c, request, False, "api", "bad", now)
            rows = [SlotRow(s, "read_file", f"output {s}", 1, "") for s in ("only-a", "shared")]
            upsert_slots(c, "u", [*rows, SlotRow("only-b", "t", "x", 1, "")], now, 60)
            link_slots(c, "u", "a-kid", ["only-a", "shared"], now + 60)
            link_slots(c, "u", "b", ["shared", "only-b"], now + 60)

        await store.write(setup)
        gone = await store.write(lambda c: forget_session(c, "a", "someone-else"))
        assert gone is None  # another user's session is not touched
        gone = await store.write(lambda c: forget_session(c, "a", "u"))
        assert gone is not None
        assert gone.sessions == ("a", "a-kid") and gone.user_id == "u"
        assert gone.turns == 3  # a's message and hand-back, the kid's message
        assert gone.slot_ids == ("only-a",)  # "shared" is still b's

        def left(c: db.Connection) -> dict[str, object]:
            return {
                "sessions": sorted(r[0] for r in c.execute("SELECT id FROM sessions")),
                "facts": sorted(
                    r[0] for r in c.execute("SELECT content FROM turns WHERE role = 'fact'")
                ),
                "items in a": count(c, "SELECT count(*) FROM turns WHERE source_session = 'a-kid'"),
                "summary": get_summary(c, "a"),
                "requests": count(c, "SELECT count(*) FROM requests"),
                "feedback": count(c, "SELECT count(*) FROM feedback"),
                "slots": sorted(r[0] for r in c.execute("SELECT id FROM slots")),
                "links": sorted(c.execute("SELECT session_id, slot_id FROM slot_sessions")),
                "vectors or fts of a": fts_words(c, "kid", "a"),
            }

        assert await store.read(left) == {
            "sessions": ["b", "facts~u"],
            "facts": ["from b", "untraced"],
            "items in a": 0,
            "summary": None,
            "requests": 0,
            "feedback": 0,
            "slots": ["only-b", "shared"],
            "links": [("b", "only-b"), ("b", "shared")],
            "vectors or fts of a": 0,
        }
        assert await store.delete_session("b") is True  # the Store's own path forgets the same
        assert await store.read(lambda c: [r[0] for r in c.execute("SELECT id FROM slots")]) == []
        assert await store.write(lambda c: purge_links(c, time.time())) == 0


@pytest.mark.asyncio
async def test_links_expire(store_target: str | Path) -> None:
    async with Store(store_target) as store:
        await store.write(lambda c: link_slots(c, "u", "s", ["x", "y"], 100.0))
        await store.write(lambda c: link_slots(c, "u", "s", ["x"], 50.0))  # never shortened
        assert await store.write(lambda c: purge_links(c, 99.0)) == 0
        assert await store.write(lambda c: purge_links(c, 100.0)) == 2


@pytest.mark.asyncio
async def test_connections_delete_securely_and_scrub_empties_the_log(tmp_path: Path) -> None:
    async with Store(tmp_path / "m.db") as store:
        assert await store.read(lambda c: c.execute("PRAGMA secure_delete").fetchone()[0]) == 1
        assert await store.write(lambda c: c.execute("PRAGMA secure_delete").fetchone()[0]) == 1
        assert await store.read(auto_vacuum_mode) == AUTO_VACUUM_INCREMENTAL  # a new database
        await store.get_or_create_session("u", "s")
        text = "lorem ipsum dolor " * 400
        await store.add_turns("s", "u", [NewTurn(i, "user", f"{i} {text}") for i in range(300)])
        size = (tmp_path / "m.db").stat().st_size + (tmp_path / "m.db-wal").stat().st_size
        assert await store.delete_session("s")
        assert await store.read(free_pages) > 0
        report = await store.scrubber.scrub()
        assert report is not None and report.checkpointed and report.free_pages_left == 0
        assert (tmp_path / "m.db-wal").stat().st_size == 0
        assert (tmp_path / "m.db").stat().st_size < size / 4  # the pages went back


@pytest.mark.asyncio
async def test_deletes_asking_while_a_scrub_runs_share_the_next_one(
    store_target: str | Path,
) -> None:
    """SQLite's scrub (FTS merge, vacuum, checkpoint), PostgreSQL's (VACUUM FULL)."""
    async with Store(store_target) as store:
        scrubber = Scrubber(store)
        results = await asyncio.gather(*(scrubber.scrub() for _ in range(10)))
        assert scrubber.runs <= 2 and sum(r is not None for r in results) == scrubber.runs
        assert await scrubber.scrub() is not None  # a later delete gets a run of its own


def test_an_older_database_is_vacuumed_once_for_incremental_vacuum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "v6.db"
    c = db.connect(path)
    try:
        c.execute("PRAGMA auto_vacuum = NONE")  # as every database made before migration 9
        older = [v for v, _ in migrations.MIGRATIONS if v < FORGETTING]
        with monkeypatch.context() as m:
            m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[: len(older)])
            m.setattr(migrations, "ensure_incremental_vacuum", lambda conn: False)
            assert migrations.migrate(c) == older
        assert auto_vacuum_mode(c) == 0
        c.execute("INSERT INTO users(id, created_at) VALUES ('u', 0)")
        assert migrations.migrate(c)[0] == FORGETTING
        assert auto_vacuum_mode(c) == AUTO_VACUUM_INCREMENTAL
        assert c.execute("SELECT id FROM users").fetchall() == [("u",)]
        assert ensure_incremental_vacuum(c) is False  # once
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        c.close()


@pytest.mark.asyncio
async def test_nothing_made_from_a_forgotten_session_is_stored_afterwards(
    store_target: str | Path,
) -> None:
    """A hand-back or fact still being made when its source session is forgotten."""
    async with Store(store_target) as store:
        await store.get_or_create_session("u", "parent")
        await store.get_or_create_session("u", "kid", parent_id="parent")
        assert await store.delete_session("kid")
        with pytest.raises(SessionNotFound):
            await store.write(
                lambda c: insert_item(c, "parent", "u", NewTurn(-1, "summary", "late"), None, "kid")
            )
        assert await store.session_turns("parent", from_position=-10) == []


async def _aged_store_with_a_secret(path: Path) -> Store:
    """A store whose full-text index is one segment of 3,000 turns, one of them secret."""
    store = Store(path, readers=1)
    await store.open()
    await store.get_or_create_session("u", "big")
    await store.get_or_create_session("u", "secret")
    lines = [f"note {i} about w{i % 97} and w{i % 13}" for i in range(3000)]
    await store.add_turns("big", "u", [NewTurn(i, "user", t) for i, t in enumerate(lines)])
    await store.add_turns("secret", "u", [NewTurn(0, "user", "the zzqxvelmorant key")])
    await store.write(fts_optimize)
    return store


async def _chat_while(store: Store, scrub: asyncio.Task[object], gated: bool) -> int:
    """Archive a turn with a deferred FTS row every few ms and index it (as the indexer does,
    waiting for the scrub's merge when ``gated``) until ``scrub`` ends; how many."""
    n = 0
    while not scrub.done():
        done = await store.write(
            lambda c, n=n: queries.insert_turns(
                c, "big", "u", [NewTurn(5000 + n, "user", f"new {n}")], None, 0.0, fts_pending=True
            )
        )
        if gated:
            await store.scrubber.fts_writable()
        await store.write(lambda c, ids=[i for i, _ in done]: indexing.index_deferred(c, ids))
        n += 1
        await asyncio.sleep(0.002)
    return n


@pytest.mark.asyncio
@pytest.mark.parametrize("gated", [True, False])
async def test_the_fts_merge_ends_however_much_is_written_beside_it(
    tmp_path: Path, gated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FTS5 restarts a negative merge whenever a new segment appeared: with the indexer held
    (gated) the steps converge; without, they give way to one optimize. Either way the scrub
    ends, the index stays small, and the forgotten term leaves the file."""
    store = await _aged_store_with_a_secret(tmp_path / "m.db")
    monkeypatch.setattr(scrub_module, "MERGE_PAGES", 2)  # many small steps on a small index
    try:
        assert await store.delete_session("secret")
        scrub = asyncio.create_task(store.scrubber.scrub())
        writes = await _chat_while(store, scrub, gated)
        report = await scrub
        assert report is not None and writes > 0
        assert report.optimized_at_once is not gated
        assert await store.read(fts_segments) < 20
        await store.write(checkpoint, transaction=False)
        assert b"velmorant" not in (tmp_path / "m.db").read_bytes()
        (found,) = await store.read(
            lambda c: c.execute(
                "SELECT count(*) FROM turns_fts WHERE turns_fts MATCH 'body : new'"
            ).fetchone()
        )
        assert found == writes  # everything written beside it is indexed
    finally:
        await store.close()


SECRET = "the zzqxvelmorant key opens the blue door"
SECRET_BYTES = (SECRET.encode(), b"zzqxvelmor")  # the sentence, and its lexeme in the tsvector


def relation_files(url: str, data_dir: Path) -> list[Path]:
    """The files of every table, index and TOAST table of ``url``'s database (their forks and
    segments too), after a ``CHECKPOINT`` has written every dirty page out."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        rows = conn.execute(
            "SELECT relkind, pg_relation_filepath(oid) FROM pg_class"
            " WHERE pg_relation_filepath(oid) IS NOT NULL"
        ).fetchall()
    assert {kind for kind, _ in rows} >= {"r", "i", "t"}  # tables, indexes, TOAST tables
    files: list[Path] = []
    for _, relpath in rows:
        main = data_dir / relpath
        forks = [main, *main.parent.glob(f"{main.name}.*"), *main.parent.glob(f"{main.name}_*")]
        files += [f for f in forks if f.exists()]
    return files


def holding(files: list[Path]) -> dict[str, list[bytes]]:
    """Which files hold which of :data:`SECRET_BYTES`."""
    found: dict[str, list[bytes]] = {}
    for f in files:
        data = f.read_bytes()
        for needle in SECRET_BYTES:
            if needle in data:
                found.setdefault(f.name, []).append(needle)
    return found


async def _pg_store_with_a_secret(url: str) -> Store:
    """A PostgreSQL store with 600 turns and, last (the lowest tuple of its heap page, which
    plain VACUUM leaves where it is), the secret: as a turn, in a summary and a logged query."""
    store = Store(url, readers=1)
    await store.open()
    await store.get_or_create_session("u", "big")
    await store.get_or_create_session("u", "secret")
    lines = [f"note {i} about w{i % 97} and w{i % 13}" for i in range(600)]
    await store.add_turns("big", "u", [NewTurn(i, "user", t) for i, t in enumerate(lines)])

    def secrets(c: db.Connection) -> None:
        put_summary(c, Summary("secret", f"summary: {SECRET}", 1, 1, time.time()), None)
        insert_request(c, RecordedRequest("r1", "u", "secret", None, SECRET, [], time.time()))

    await store.write(secrets)
    await store.add_turns("secret", "u", [NewTurn(0, "user", SECRET)])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")  # as autovacuum would: samples of each column in pg_statistic
    return store


def sampled(url: str) -> list[tuple[str, str]]:
    """The columns whose statistics (histogram, most common values) hold the secret: they are
    compressed in pg_statistic's files, where :func:`holding` cannot see them."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tablename::text, attname::text FROM pg_stats WHERE concat("
            "histogram_bounds::text, most_common_vals::text) LIKE %s ORDER BY 1, 2",
            (f"%{SECRET_BYTES[1].decode()}%",),
        ).fetchall()
    return [(str(t), str(a)) for t, a in rows]


@pytest.mark.asyncio
async def test_a_forgotten_sentence_leaves_every_postgresql_relation_file(
    pg_server: PostgresServer,
) -> None:
    """Forget, scrub (VACUUM FULL of the store's tables), and the sentence is in no file of any
    table, index or TOAST table, nor in the planner's statistics; before forgetting, the same
    searches find it (the checks work)."""
    url = new_database(pg_server)
    store = await _pg_store_with_a_secret(url)
    try:
        before = holding(relation_files(url, pg_server.data_dir))
        assert len(before) >= 3  # turns, turns_fts, its GIN index (summaries, requests…)
        assert ("turns", "content") in sampled(url)
        assert await store.delete_session("secret")
        assert holding(relation_files(url, pg_server.data_dir))  # deleted, still in the files
        report = await store.scrubber.scrub()
        assert report is not None and not report.skipped
        tables = {"turns", "turns_fts", "summaries", "requests", "changes", STATISTICS}
        assert tables <= set(report.rewritten)
        assert holding(relation_files(url, pg_server.data_dir)) == {}
        assert sampled(url) == []
        assert await store.count_turns("big") == 600  # the rest is all there
        assert len(await store.fts_search("u", "w13", 10)) == 10
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_plain_vacuum_leaves_a_forgotten_sentence_in_the_files(
    pg_server: PostgresServer,
) -> None:
    """Why the scrub is VACUUM FULL: after a plain VACUUM the deleted tuple that was its page's
    last stays in the heap, and the GIN index keeps the lexeme."""
    url = new_database(pg_server)
    store = await _pg_store_with_a_secret(url)
    try:
        assert await store.delete_session("secret")
    finally:
        await store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM")
    assert holding(relation_files(url, pg_server.data_dir))
