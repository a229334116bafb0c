"""Migrations on a blank database, the schema they leave, and the triggers that keep indexes
in step with ``turns``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.store import indexing
from proxy.store.sqlite import db, fts_sql, migrations
from proxy.store.sqlite.db import Connection
from proxy.vectors import to_blob


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[Connection]:
    c = db.connect(tmp_path / "memory.db")
    migrations.migrate(c)
    yield c
    c.close()


def _objects(conn: Connection, kind: str) -> set[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = ?", (kind,))
    return {r[0] for r in rows}


def _columns(conn: Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]


def test_blank_database_gets_every_migration(tmp_path: Path) -> None:
    c = db.connect(tmp_path / "blank.db")
    try:
        assert migrations.applied_versions(c) == []
        applied = migrations.migrate(c)
        assert applied == [v for v, _ in migrations.MIGRATIONS]
        assert migrations.applied_versions(c) == applied
        rows = c.execute("SELECT version, applied_at FROM schema_migrations").fetchall()
        assert all(isinstance(at, float) and at > 1.6e9 for _, at in rows)
        assert migrations.migrate(c) == []  # idempotent
    finally:
        c.close()


def test_schema_tables_indexes_and_triggers(conn: Connection) -> None:
    tables = _objects(conn, "table")
    assert {
        "schema_migrations",
        "meta",
        "users",
        "sessions",
        "turns",
        "turns_fts",
        "turn_vec",
        "summaries",
    } <= tables
    assert _columns(conn, "summaries") == [
        "session_id",
        "content",
        "upto",
        "tokens",
        "model",
        "updated_at",
    ]
    assert _columns(conn, "users") == ["id", "created_at"]
    assert _columns(conn, "sessions") == [
        "id",
        "user_id",
        "parent_id",
        "level",
        "agent",
        "created_at",
        "last_seen",
        "fingerprint",
        "indexed",
        "completed_at",
        "name",
    ]
    assert _columns(conn, "turns") == [
        "id",
        "session_id",
        "user_id",
        "position",
        "role",
        "speaker",
        "content",
        "tool_calls",
        "tool_call_id",
        "timestamp",
        "token_count",
        "content_hash",
        "embed_hash",
        "incomplete",
        "source_session",
        "fts_pending",
        "api",
        "embed_model",
        "scaffold",
        "recall",
        "source_turn",
        "said_hash",
    ]
    assert _columns(conn, "embed_models") == ["id", "name", "dim"]
    assert _columns(conn, "scaffolds") == [
        "user_id",
        "hash",
        "kind",
        "content",
        "created_at",
        "last_seen",
    ]
    assert _columns(conn, "scaffold_sessions") == ["user_id", "hash", "session_id"]
    assert _columns(conn, "paragraph_sightings") == ["user_id", "hash", "session_id"]
    assert _objects(conn, "trigger") == {
        "turns_ai",
        "turns_au",
        "turns_ad",
        "sessions_ad_items",
        "users_ad_slots",
        "users_ad_slot_sessions",
        "users_ad_scaffolds",
        "changes_turn_inserted",
        "changes_turn_indexed",
        "changes_turn_updated",
        "changes_turn_deleted",
        "changes_session_indexed",
        "changes_pruned",
    }
    assert _columns(conn, "changes") == ["seq", "user_id", "turn_id", "kind", "session_id"]
    assert {"requests", "feedback", "consolidation_queue", "counters"} <= tables
    fks = {(r[2], r[3], r[6]) for r in conn.execute("PRAGMA foreign_key_list(requests)")}
    assert ("sessions", "session_id", "CASCADE") in fks and ("users", "user_id", "CASCADE") in fks
    fks = {(r[2], r[3], r[6]) for r in conn.execute("PRAGMA foreign_key_list(consolidation_queue)")}
    assert ("requests", "request_id", "CASCADE") in fks
    assert {
        "turns_user",
        "turns_user_hash",
        "turns_embed_hash",
        "turns_said",
        "sessions_user",
    } <= _objects(conn, "index")
    # turns is unique on (session_id, position); sessions and turns cascade from their parents.
    uniques = [
        [r[2] for r in conn.execute(f"PRAGMA index_info({idx[1]})")]
        for idx in conn.execute("PRAGMA index_list(turns)")
        if idx[2] == 1
    ]
    assert ["session_id", "position"] in uniques
    fks = {(r[2], r[3], r[6]) for r in conn.execute("PRAGMA foreign_key_list(turns)")}
    assert ("sessions", "session_id", "CASCADE") in fks
    assert ("users", "user_id", "CASCADE") in fks
    fks = {(r[2], r[3], r[6]) for r in conn.execute("PRAGMA foreign_key_list(sessions)")}
    assert ("sessions", "parent_id", "CASCADE") in fks


def test_fts5_is_contentless_with_the_configured_tokenizer(conn: Connection) -> None:
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'turns_fts'").fetchone()
    assert "fts5(" in sql.lower()
    assert "content = ''" in sql and "contentless_delete = 1" in sql
    assert f"tokenize = '{migrations.FTS_TOKENIZE}'" in sql
    assert _columns(conn, "turns_fts") == ["body", "ctx", "date"]
    # no second copy of the text: the index's own tables hold no content table
    assert "turns_fts_content" not in _objects(conn, "table")
    # its vocabulary: rows per term
    (vocab,) = conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'turns_fts_terms'"
    ).fetchone()
    assert "fts5vocab(turns_fts, row)" in vocab


def test_vec0_table_is_partitioned_by_user(conn: Connection) -> None:
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'turn_vec'").fetchone()
    compact = " ".join(sql.split()).lower()
    assert "using vec0(" in compact
    assert "turn_id integer primary key" in compact
    assert "user_id text partition key" in compact
    assert f"embedding float[{migrations.EMBED_DIM}] distance_metric=cosine" in compact
    assert f"embedding_bits bit[{migrations.EMBED_DIM}]" in compact


def test_pragmas(conn: Connection) -> None:
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == db.DEFAULT_BUSY_TIMEOUT_MS


def test_newer_database_is_refused(conn: Connection) -> None:
    conn.execute("INSERT INTO schema_migrations VALUES (999, 0)")
    with pytest.raises(RuntimeError, match="newer"):
        migrations.migrate(conn)


def test_failed_migration_rolls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(c: Connection) -> None:
        c.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("boom")

    latest = migrations.latest_version()
    monkeypatch.setattr(migrations, "MIGRATIONS", (*migrations.MIGRATIONS, (latest + 1, broken)))
    c = db.connect(tmp_path / "m.db")
    try:
        with pytest.raises(RuntimeError, match="boom"):
            migrations.migrate(c)
        assert migrations.applied_versions(c) == list(range(1, latest + 1))
        assert "half_done" not in _objects(c, "table")
        assert not c.in_transaction
    finally:
        c.close()


# -- triggers ---------------------------------------------------------------------------------


def _add_session(
    conn: Connection, session: str = "s1", user: str = "u1", parent: str | None = None
) -> None:
    conn.execute("INSERT OR IGNORE INTO users(id, created_at) VALUES (?, 0)", (user,))
    conn.execute(
        "INSERT INTO sessions(id, user_id, parent_id, created_at, last_seen)"
        " VALUES (?, ?, ?, 0, 0)",
        (session, user, parent),
    )


def _add_turn(
    conn: Connection,
    position: int,
    content: str,
    session: str = "s1",
    user: str = "u1",
    *,
    role: str = "user",
    speaker: str | None = "Ann",
    timestamp: float = 0.0,
) -> int:
    cur = conn.execute(
        "INSERT INTO turns(session_id, user_id, position, role, speaker, content, timestamp,"
        " content_hash) VALUES (?, ?, ?, ?, ?, ?, ?, 'h')",
        (session, user, position, role, speaker, content, timestamp),
    )
    assert cur.lastrowid is not None
    vec = np.zeros(migrations.EMBED_DIM, dtype=np.float32)
    vec[position % migrations.EMBED_DIM] = 1.0
    conn.execute(
        "INSERT INTO turn_vec(turn_id, user_id, embedding, embedding_bits, session_id, indexed)"
        " VALUES (?, ?, ?, vec_quantize_binary(?), ?, 1)",
        (cur.lastrowid, user, to_blob(vec), to_blob(vec), session),
    )
    return cur.lastrowid


def _fts(conn: Connection, query: str) -> list[int]:
    rows = conn.execute(
        "SELECT rowid FROM turns_fts WHERE turns_fts MATCH ? ORDER BY rowid", (query,)
    )
    return [r[0] for r in rows]


def _vec_ids(conn: Connection) -> list[int]:
    return sorted(r[0] for r in conn.execute("SELECT turn_id FROM turn_vec"))


def test_insert_trigger_indexes_content_and_speaker(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "We hiked the mountains")
    b = _add_turn(conn, 1, "Pottery class on Tuesday")
    assert _fts(conn, 'body : "hiking"') == [a]  # porter stemming
    assert _fts(conn, 'body : "pottery"') == [b]
    assert _fts(conn, '"pottery"') == [a, b]  # b's words are also in a's ctx column
    assert _fts(conn, 'body : "ann"') == [a, b]
    # the index is consistent
    conn.execute("INSERT INTO turns_fts(turns_fts, rank) VALUES ('integrity-check', 1)")


def test_update_trigger_reindexes(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "old words here")
    conn.execute("UPDATE turns SET content = 'fresh text' WHERE id = ?", (a,))
    assert _fts(conn, '"old"') == []
    assert _fts(conn, '"fresh"') == [a]
    conn.execute("UPDATE turns SET incomplete = 1 WHERE id = ?", (a,))  # not an indexed column
    assert _fts(conn, '"fresh"') == [a]
    conn.execute("INSERT INTO turns_fts(turns_fts, rank) VALUES ('integrity-check', 1)")


def test_delete_trigger_removes_fts_rows_and_vectors(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "first message")
    b = _add_turn(conn, 1, "second message")
    assert _vec_ids(conn) == [a, b]
    conn.execute("DELETE FROM turns WHERE id = ?", (a,))
    assert _fts(conn, '"message"') == [b]
    assert _vec_ids(conn) == [b]
    conn.execute("INSERT INTO turns_fts(turns_fts, rank) VALUES ('integrity-check', 1)")


def test_cascade_from_session_reaches_sub_sessions_fts_and_vectors(conn: Connection) -> None:
    _add_session(conn, "parent")
    _add_session(conn, "child", parent="parent")
    _add_session(conn, "grandchild", parent="child")
    _add_session(conn, "other")
    _add_turn(conn, 0, "parent words", "parent")
    _add_turn(conn, 0, "child words", "child")
    _add_turn(conn, 0, "grandchild words", "grandchild")
    keep = _add_turn(conn, 0, "other words", "other")
    conn.execute("DELETE FROM sessions WHERE id = 'parent'")
    assert [r[0] for r in conn.execute("SELECT id FROM sessions")] == ["other"]
    assert [r[0] for r in conn.execute("SELECT id FROM turns")] == [keep]
    assert _fts(conn, '"words"') == [keep]
    assert _vec_ids(conn) == [keep]


def test_cascade_from_user(conn: Connection) -> None:
    _add_session(conn, "s1", "u1")
    _add_session(conn, "s2", "u2")
    _add_turn(conn, 0, "mine", "s1", "u1")
    theirs = _add_turn(conn, 0, "theirs", "s2", "u2")
    conn.execute("DELETE FROM users WHERE id = 'u1'")
    assert [r[0] for r in conn.execute("SELECT id FROM turns")] == [theirs]
    assert _vec_ids(conn) == [theirs]


def test_slots_table_and_its_user_trigger(conn: Connection) -> None:
    assert _columns(conn, "slots") == [
        "user_id",
        "id",
        "tool",
        "description",
        "content",
        "tokens",
        "bytes",
        "created_at",
        "expires_at",
    ]
    assert "slots_expires" in _objects(conn, "index")
    conn.execute("INSERT INTO users(id, created_at) VALUES ('u1', 0)")
    for user in ("u1", "u2", "no-user-row"):  # a slot needs no users row
        conn.execute(
            "INSERT INTO slots(user_id, id, content, created_at, expires_at)"
            " VALUES (?, 'x', 'out', 0, 1)",
            (user,),
        )
    with pytest.raises(db.driver().IntegrityError):  # one slot per (user, id)
        conn.execute(
            "INSERT INTO slots(user_id, id, content, created_at, expires_at)"
            " VALUES ('u1', 'x', 'again', 0, 1)"
        )
    conn.execute("DELETE FROM users WHERE id = 'u1'")
    assert sorted(r[0] for r in conn.execute("SELECT user_id FROM slots")) == ["no-user-row", "u2"]


def test_migration_5_upgrades_a_version_4_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = db.connect(tmp_path / "v4.db")
    try:
        with monkeypatch.context() as m:
            m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:4])
            assert migrations.migrate(c) == [1, 2, 3, 4]
        assert "slots" not in _objects(c, "table")
        assert migrations.migrate(c) == list(range(5, migrations.latest_version() + 1))
        assert "slots" in _objects(c, "table")
    finally:
        c.close()


def test_deferred_index_gives_the_same_rows_as_the_trigger(tmp_path: Path) -> None:
    """Turns archived with fts_pending and indexed later, in any order, end with the full-text
    rows (bodies, neighbours' ctx) the insert trigger gives at once."""
    texts = [
        "the lighthouse keeper",
        "saffron and glacier",
        "a violin in the orchard",
        "comet over the harbour",
        "basalt cliffs",
        "the keeper's violin",
    ]
    queries_ = ["lighthouse", "ctx : violin", "body : keeper", "glacier OR basalt", "harbour"]

    def build(name: str, deferred: bool, order: list[int]) -> list[Any]:
        c = db.connect(tmp_path / name)
        migrations.migrate(c)
        _add_session(c)
        ids = []
        for pos, text in enumerate(texts):
            cur = c.execute(
                "INSERT INTO turns(session_id, user_id, position, role, content, timestamp,"
                " content_hash, fts_pending) VALUES ('s1', 'u1', ?, 'user', ?, 0, ?, ?)",
                (pos, text, f"h{pos}", int(deferred)),
            )
            ids.append(cur.lastrowid)
        if deferred:
            assert _fts(c, "lighthouse") == []  # archived, not indexed yet
            for i in order:  # the indexer may catch up in any order, in batches
                indexing.index_deferred(c, [ids[i], ids[i]])
            assert indexing.pending_index_ids(c, 10) == []
            assert indexing.index_deferred(c, ids) == 0  # nothing left to do
        _integrity_check(c)
        # Which rows each query finds, and each row's token count per column (body, ctx, date).
        # (BM25 scores depend on the delete history of a contentless-delete index, not only on
        # its rows, so they are not compared.)
        out: list[Any] = [_fts(c, q) for q in queries_]
        out.append(c.execute("SELECT id, sz FROM turns_fts_docsize ORDER BY id").fetchall())
        c.close()
        return out

    expected = build("trigger.db", False, [])
    assert all(expected)
    assert build("forward.db", True, list(range(len(texts)))) == expected
    assert build("shuffled.db", True, [3, 0, 5, 1, 4, 2]) == expected


def test_migration_6_indexes_the_turns_waiting_for_a_vector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = db.connect(tmp_path / "v5.db")
    try:
        with monkeypatch.context() as m:
            m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:5])
            assert migrations.migrate(c) == [1, 2, 3, 4, 5]
        _add_session(c)
        _add_turn(c, 0, "archived before the upgrade, never embedded")
        assert "turns_unembedded" not in _objects(c, "index")
        assert migrations.migrate(c) == list(range(6, migrations.latest_version() + 1))
        assert "turns_unembedded" in _objects(c, "index")
        plan = " ".join(
            str(r[-1])
            for r in c.execute(
                "EXPLAIN QUERY PLAN SELECT id FROM turns WHERE embed_hash IS NULL AND id > 0"
            )
        )
        assert "turns_unembedded" in plan
        (n,) = c.execute("SELECT count(*) FROM turns WHERE embed_hash IS NULL").fetchone()
        assert n == 1
    finally:
        c.close()


def _integrity_check(conn: Connection) -> None:
    conn.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")


def test_delete_removes_the_fts_row(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "unique aardvark")
    _add_turn(conn, 1, "something else")
    assert _fts(conn, "body : aardvark") == [a]
    conn.execute("DELETE FROM turns WHERE id = ?", (a,))
    assert _fts(conn, "aardvark") == []
    assert _fts(conn, "ctx : aardvark") == []  # nor is it anyone's neighbour any more
    (rows,) = conn.execute("SELECT count(*) FROM turns_fts_docsize").fetchone()
    assert rows == 1
    _integrity_check(conn)


def test_ctx_holds_two_neighbours_each_side(conn: Connection) -> None:
    _add_session(conn)
    _add_session(conn, "s2")
    ids = [_add_turn(conn, p, f"word{p}") for p in range(6)]
    _add_turn(conn, 6, "word3", "s2")  # another session: never a neighbour
    assert _fts(conn, "ctx : word3") == [ids[1], ids[2], ids[4], ids[5]]
    assert _fts(conn, "ctx : word0") == [ids[1], ids[2]]
    assert _fts(conn, "body : word3") == [ids[3], 7]
    _integrity_check(conn)


def test_ctx_of_neighbours_follows_inserts_and_deletes(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "alpha")
    b = _add_turn(conn, 1, "bravo")
    d = _add_turn(conn, 4, "delta")
    e = _add_turn(conn, 5, "echo")
    assert _fts(conn, "ctx : delta") == [a, b, e]  # positions may have gaps
    c = _add_turn(conn, 2, "charlie")  # lands between b and d: a, b, d, e see it
    assert _fts(conn, "ctx : charlie") == sorted([a, b, d, e])
    assert _fts(conn, "ctx : delta") == sorted([b, c, e])  # a's window moved on to b, c
    assert _fts(conn, "ctx : alpha") == [b, c]
    conn.execute("DELETE FROM turns WHERE id = ?", (c,))
    assert _fts(conn, "ctx : charlie") == []
    assert _fts(conn, "ctx : delta") == [a, b, e]
    assert _fts(conn, "ctx : alpha") == [b, d]
    _integrity_check(conn)


def test_system_turns_are_nobodys_neighbour(conn: Connection) -> None:
    _add_session(conn)
    sys_id = _add_turn(conn, 0, "you are helpful", role="system", speaker=None)
    a = _add_turn(conn, 1, "hello")
    b = _add_turn(conn, 2, "there")
    assert _fts(conn, "ctx : helpful") == []
    assert _fts(conn, "body : system") == [sys_id]  # the role stands in for a speaker
    assert _fts(conn, "ctx : hello") == [b]  # a system turn has no ctx either
    assert _fts(conn, "ctx : there") == [a]
    _integrity_check(conn)


def test_update_rewrites_the_turn_and_its_neighbours(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "first")
    b = _add_turn(conn, 1, "second")
    conn.execute("UPDATE turns SET content = 'changed', speaker = 'Bob' WHERE id = ?", (b,))
    assert _fts(conn, "ctx : second") == []
    assert _fts(conn, "ctx : changed") == [a]
    assert _fts(conn, "body : bob") == [b]
    _integrity_check(conn)


def test_date_column_names_the_utc_day(conn: Connection) -> None:
    _add_session(conn)
    a = _add_turn(conn, 0, "x", timestamp=1683556560.0)  # 2023-05-08 14:36 UTC, a Monday
    b = _add_turn(conn, 1, "y", timestamp=1704067199.0)  # 2023-12-31 23:59:59 UTC, a Sunday
    assert _fts(conn, 'date : "monday 8 may 2023"') == [a]
    assert _fts(conn, 'date : "sunday 31 december 2023"') == [b]
    assert _fts(conn, "date : 2023") == [a, b]


def _expected_index(conn: Connection) -> dict[tuple[int, str], list[str]]:
    """What turns_fts should hold, computed here in Python and tokenized by a plain FTS5 table."""
    rows = conn.execute(
        "SELECT id, session_id, position, role, speaker, content, timestamp FROM turns"
    ).fetchall()

    def body(r: tuple[Any, ...]) -> str:
        return f"{r[4] or r[3]}: {r[5]}"

    by_session: dict[str, list[tuple[Any, ...]]] = {}
    for r in sorted(rows, key=lambda r: r[2]):
        if r[3] != "system":
            by_session.setdefault(r[1], []).append(r)
    conn.execute(
        "CREATE VIRTUAL TABLE temp.ref USING fts5(body, ctx, date,"
        f" tokenize = '{migrations.FTS_TOKENIZE}')"
    )
    for r in rows:
        ctx = ""
        if r[3] != "system":
            ordered = by_session[r[1]]
            i = ordered.index(r)
            window = (
                ordered[max(0, i - fts_sql.CTX_TURNS) : i]
                + ordered[i + 1 : i + 1 + fts_sql.CTX_TURNS]
            )
            ctx = "\n".join(body(n)[: fts_sql.CTX_CHARS] for n in window)
        day = datetime.fromtimestamp(r[6], UTC)
        date = f"{day:%A} {day.day} {day:%B %Y}"
        conn.execute(
            "INSERT INTO temp.ref(rowid, body, ctx, date) VALUES (?, ?, ?, ?)",
            (r[0], body(r), ctx, date),
        )
    out = _index_terms(conn, "temp", "ref")
    conn.execute("DROP TABLE temp.ref")
    return out


def _index_terms(conn: Connection, schema: str, table: str) -> dict[tuple[int, str], list[str]]:
    conn.execute(f"CREATE VIRTUAL TABLE temp.vocab USING fts5vocab({schema}, {table}, instance)")
    out: dict[tuple[int, str], list[str]] = {}
    for term, doc, col, _ in conn.execute("SELECT * FROM temp.vocab"):
        out.setdefault((doc, col), []).append(term)
    conn.execute("DROP TABLE temp.vocab")
    return {key: sorted(terms) for key, terms in out.items()}


def test_index_matches_a_rebuild_after_random_edits(conn: Connection) -> None:
    rng = random.Random(7)
    words = ["apple", "bread", "cider", "dough", "eagle", "fable", "grape", "honey", "igloo"]
    for s in ("s1", "s2", "s3"):
        _add_session(conn, s)
    free = {s: list(range(12)) for s in ("s1", "s2", "s3")}
    for s in free:
        rng.shuffle(free[s])
    for step in range(60):
        op = rng.random()
        ids = [r[0] for r in conn.execute("SELECT id FROM turns")]
        if op < 0.6 or not ids:
            s = rng.choice([s for s in free if free[s]] or ["s1"])
            if not free[s]:
                continue
            _add_turn(
                conn,
                free[s].pop(),
                " ".join(rng.sample(words, 3)),
                s,
                role=rng.choice(["user", "assistant", "system", "tool"]),
                speaker=rng.choice(["Ann", "Bob", None, ""]),
                timestamp=1.6e9 + rng.randrange(10**8),
            )
        elif op < 0.8:
            victim = rng.choice(ids)
            s, pos = conn.execute(
                "SELECT session_id, position FROM turns WHERE id = ?", (victim,)
            ).fetchone()
            conn.execute("DELETE FROM turns WHERE id = ?", (victim,))
            free[s].append(pos)
        else:
            conn.execute(
                "UPDATE turns SET content = ?, role = ? WHERE id = ?",
                (" ".join(rng.sample(words, 2)), rng.choice(["user", "system"]), rng.choice(ids)),
            )
        if step % 10 == 9:
            assert _index_terms(conn, "main", "turns_fts") == _expected_index(conn)
            _integrity_check(conn)
    conn.execute("DELETE FROM sessions WHERE id = 's2'")
    assert _index_terms(conn, "main", "turns_fts") == _expected_index(conn)
    conn.execute("DELETE FROM users")
    assert _index_terms(conn, "main", "turns_fts") == {}
    (rows,) = conn.execute("SELECT count(*) FROM turns_fts_docsize").fetchone()
    assert rows == 0
    _integrity_check(conn)


def test_tool_calls_are_json_text(conn: Connection) -> None:
    _add_session(conn)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    conn.execute(
        "INSERT INTO turns(session_id, user_id, position, role, content, tool_calls, timestamp,"
        " content_hash) VALUES ('s1', 'u1', 0, 'assistant', '', ?, 0, 'h')",
        (json.dumps(calls),),
    )
    (stored,) = conn.execute("SELECT tool_calls FROM turns").fetchone()
    assert json.loads(stored) == calls
