"""The command line on PostgreSQL (``[memory] backend = "postgres"``): ``engram doctor``'s
checks of the server, pgvector and the schema, and the memory commands opening the database."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from proxy.cli.main import main, remote_refusal
from proxy.config import load_settings
from proxy.store import NewTurn, Store
from proxy.store.postgres.reindex_lock import PgReindexLock
from testing.fake_upstream import FakeUpstream
from testing.postgres import PostgresServer
from tests.cli.test_cli import LINES
from tests.pg import running_postgres
from tests.store.conftest import new_database

PASSWORD = "s3cret-pw-never-shown"


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    """This file's own server (one test stops and starts it)."""
    yield from running_postgres()


@pytest.fixture
def url(pg: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new database, configured as the memory store (with a password in its URL, which the
    server's trust login ignores); the hash embedder; no stray settings."""
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)
    target = new_database(pg).replace("postgres@", f"postgres:{PASSWORD}@")
    monkeypatch.setenv("ENGRAM_EMBEDDER_MODEL", "hash")
    monkeypatch.setenv("ENGRAM_MEMORY_BACKEND", "postgres")
    monkeypatch.setenv("ENGRAM_MEMORY_POSTGRES_URL", target)
    return target


async def migrated(url: str) -> None:
    async with Store(url) as store:
        await store.get_or_create_session("alice", "a1")
        await store.add_turns("a1", "alice", [NewTurn(0, "user", "my cat is called Miso")])


async def doctor(fake: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["doctor", "--upstream", fake.url])
    out = " ".join(capsys.readouterr().out.split())  # columns as single spaces
    assert PASSWORD not in out
    return code, out


@pytest.mark.asyncio
async def test_doctor_passes_on_a_migrated_database(
    url: str, fake: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    await migrated(url)
    code, out = await doctor(fake, capsys)
    assert code == 0, out
    assert "ok postgres postgresql://127.0.0.1:" in out and "PostgreSQL 18" in out
    assert re.search(r"ok pgvector vector 0\.8\.\d+ installed, distances compute", out), out
    assert "ok schema version 18 (this Engram's)" in out
    assert "ok database postgresql://127.0.0.1:" in out and "1 sessions, 1 turns" in out
    assert "ok vectors" in out and "FAIL" not in out and "sqlite-vec" not in out


@pytest.mark.asyncio
async def test_doctor_on_a_new_database_of_a_superuser_passes(
    url: str, fake: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await doctor(fake, capsys)
    assert code == 0, out
    assert re.search(
        r"ok pgvector vector 0\.8\.\d+ available, created by Engram's first start", out
    )
    assert "ok schema none yet: Engram's first start creates version 18" in out
    assert "skip database no schema yet" in out
    with psycopg.connect(url.replace(f":{PASSWORD}", "")) as conn:  # doctor created nothing
        assert conn.execute("SELECT to_regclass('turns')").fetchone() == (None,)


@pytest.mark.asyncio
async def test_doctor_fails_without_the_extension(
    url: str,
    pg: PostgresServer,
    fake: FakeUpstream,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A role that may not create the extension, on a database without it."""
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS plain")
        conn.execute("CREATE ROLE plain LOGIN")
    monkeypatch.setenv("ENGRAM_MEMORY_POSTGRES_URL", url.replace("postgres:", "plain:", 1))
    code, out = await doctor(fake, capsys)
    assert code == 1, out
    assert re.search(
        r"FAIL pgvector the vector extension is not installed in this database \(the server has "
        r"0\.8\.\d+\): a superuser runs CREATE EXTENSION vector in it",
        out,
    ), out


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("sql", "line"),
    [
        (
            "DELETE FROM schema_migrations WHERE version = 18",
            "FAIL schema version 17, behind this Engram's 18: `engram serve` migrates it at start",
        ),
        (
            "INSERT INTO schema_migrations VALUES (19, 0)",
            "FAIL schema version 19, newer than this Engram (knows up to 18): upgrade Engram",
        ),
    ],
    ids=["behind", "ahead"],
)
async def test_doctor_fails_on_a_schema_behind_or_ahead(
    url: str, sql: str, line: str, fake: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    await migrated(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql)
    code, out = await doctor(fake, capsys)
    assert code == 1, out
    assert line in out
    assert "skip database the schema or pgvector is not as this Engram needs" in out
    with psycopg.connect(url, autocommit=True) as conn:  # doctor migrated nothing
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations")]
    assert max(versions) == (17 if "behind" in line else 19)


@pytest.mark.asyncio
async def test_doctor_fails_on_a_stopped_server(
    url: str, pg: PostgresServer, fake: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    await migrated(url)
    pg.stop()
    try:
        code, out = await doctor(fake, capsys)
    finally:
        pg.start()
    assert code == 1, out
    assert f"FAIL postgres postgresql://127.0.0.1:{pg.port}/" in out and "no answer:" in out
    assert (
        "skip pgvector server not reached" in out and "skip database PostgreSQL not reached" in out
    )


def engram(*args: str) -> int:
    return main(list(args))


def test_memory_commands_on_postgresql(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """import, stats, sessions, search, export, forget, keys and reindex open the configured
    PostgreSQL database, not the SQLite file also configured; its password is never printed."""
    sqlite_file = tmp_path / "not-used.db"
    monkeypatch.setenv("ENGRAM_MEMORY_DB_PATH", str(sqlite_file))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert engram("import", str(src)) == 0
    assert "imported 5 turns (5 with vectors) from 8 lines; 2 new sessions" in out(capsys)
    assert engram("stats", "--json") == 0
    data = json.loads(out(capsys))
    assert data["turns"] == 5 and data["vectors"] == 5 and data["db"].startswith("postgresql://")
    assert engram("sessions", "--user", "bob", "--json") == 0
    rows = json.loads(out(capsys))["sessions"]
    assert [(r["id"], r["turns"]) for r in rows] == [("b1", 3)]
    assert engram("search", "cat Miso", "--user", "alice") == 0
    assert "I adopted a cat named Miso" in out(capsys)
    assert engram("export", "--user", "bob") == 0
    assert len(out(capsys).splitlines()) == 4  # the session and its three turns
    assert engram("forget", "a1") == 0
    said = capsys.readouterr()
    assert "deleted session 'a1' of user 'alice' (2 turns)" in said.out
    assert "warning" not in said.err  # the tables rewritten, no WAL warning (SQLite's)
    assert engram("keys", "create", "--user", "bob") == 0
    assert "created key" in out(capsys)
    assert engram("keys", "admin-token") == 0
    token = out(capsys).strip()
    assert engram("keys", "admin-token") == 0 and out(capsys).strip() == token  # kept in the db
    assert engram("reindex") == 0
    assert "nothing to re-embed" in out(capsys)
    assert not list(tmp_path.glob("not-used.db*"))  # no SQLite file (nor lock) was made


def test_reindex_refuses_while_engram_is_connected(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Servers hold no advisory lock: reindex refuses while any Engram connection is open on
    the database; an import refuses while reindex holds its lock."""
    asyncio.run(migrated(url))

    async def beside_a_store() -> int:
        async with Store(url) as store:
            await store.stats()  # its connections are open
            return await asyncio.to_thread(engram, "reindex")

    assert asyncio.run(beside_a_store()) == 1
    err = capsys.readouterr().err
    assert "engram: an Engram server is using postgresql://127.0.0.1:" in err
    assert "connections of an Engram server or command" in err and PASSWORD not in err
    lock = PgReindexLock(url)
    lock.acquire(exclusive=True)
    try:
        src = tmp_path / "in.jsonl"
        src.write_text(LINES[0] + "\n", encoding="utf-8")
        assert engram("import", str(src)) == 1
        assert "`engram reindex` is re-embedding" in capsys.readouterr().err
        assert engram("reindex") == 1  # one reindex at a time
    finally:
        lock.release()
    assert engram("reindex") == 0


def test_serve_counts_the_keys_in_postgresql(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A remote bind with accounts needs a key: serve counts them in the PostgreSQL database,
    not in a SQLite file beside the config."""
    asyncio.run(migrated(url))
    layer = {"server": {"host": "0.0.0.0", "allow_remote": True}, "auth": {"mode": "keys"}}
    settings = load_settings(None, dict(os.environ), layer)
    assert "the database holds no key yet" in str(remote_refusal(settings))
    assert engram("keys", "create", "--user", "bob") == 0
    assert remote_refusal(settings) is None
    assert not list(tmp_path.glob("*.db*"))


def out(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().out


def test_reindex_to_another_model_on_postgresql(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Vectors of the hash embedder, re-embedded with the default model (the real MiniLM) into a
    new table and swapped in; search and doctor agree afterwards."""
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert engram("import", str(src)) == 0
    monkeypatch.delenv("ENGRAM_EMBEDDER_MODEL")
    capsys.readouterr()
    assert engram("reindex") == 0
    assert "every vector is now made by 'engram/all-MiniLM-L6-v2-q8' (384-d)" in out(capsys)
    assert engram("search", "which pet", "--user", "alice", "--mode", "vec") == 0
    assert "Miso" in out(capsys)
