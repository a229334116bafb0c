"""What memory costs a chat request under load: ``engram serve`` in front of a fake upstream.

    .venv/bin/python -m bench.memory_load [--turns 10000] [--pairs 300] [--seconds 20]
                                          [--concurrency 1,4,16] [--json out.json]

``N`` turns synthesised from LoCoMo (``bench.common.synthetic_records``, real MiniLM vectors from
the embedding cache in ``--cache-dir``) are stored for one user; the database is built once per
``N`` and kept in the cache folder (a copy is served, so archiving never changes the cached one).
``python -m proxy serve`` runs with its default settings in front of ``python -m
testing.fake_upstream``. Every request is a new chat: a system message and one user message, a
LoCoMo question (numbered, so no two texts repeat and no cache answers them).

(a) c=1 latency: pairs of requests, ``X-Engram-Memory: read-only`` (recall, nothing archived) and
    ``off``, alternating which goes first; the added latency is read-only's percentile minus off's.
    Then the same with memory fully ``on`` (recall and archiving) against ``off``.
(b) Closed-loop throughput: ``c`` clients each sending its next request as soon as the last one
    is answered, for ``--seconds`` per cell, with memory read-only, on and off; the server's CPU
    time per request (its process, every thread, from ``/proc``).

``--backend postgres``: the same database copied into PostgreSQL (:mod:`bench.backends`: a
server started for the run; ``engram migrate --from sqlite:PATH --to URL`` where that command
exists, else the same records imported through the Store API with the cached vectors, then
``VACUUM ANALYZE``, as autovacuum would soon after), each run serving a copy of it (``CREATE
DATABASE ... TEMPLATE``), ``engram serve`` pointed at it by ``ENGRAM_MEMORY_BACKEND`` and
``ENGRAM_MEMORY_POSTGRES_URL``. PostgreSQL's CPU (its backends') is reported per request beside
Engram's.

Beside both: the query embedding's own time on this machine (``FastEmbedEmbedder.embed_queries``,
one ONNX thread, one question at a time, in this process before the server starts), and each
figure's ratio to it (issue 26: memory should cost about one embedding, whatever the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from bench.backends import (
    BACKENDS,
    copy_from_sqlite,
    create_database,
    pg_cpu_seconds,
    pg_server,
    serve_env,
)
from bench.common import (
    DEFAULT_CACHE,
    DEFAULT_LOCOMO,
    DiskCachedEmbedder,
    import_turns,
    load_locomo,
    machine,
    machine_lines,
    pct,
    synthetic_records,
)
from bench.retrieval import serving
from proxy.search.embedder import DEFAULT_MODEL, FastEmbedEmbedder
from proxy.store import Store
from testing.postgres import PostgresServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

USER = "bench"
ADDED_TARGETS = {10_000: (15.0, 25.0), 100_000: (30.0, None)}  # turns -> (p50, p95) ms added
THROUGHPUT_TARGET = 150.0  # req/s at c=16, memory on
WARMUP = 20


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system, every thread) process ``pid`` has used; 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def query_embedding(texts: list[str], n: int = 200) -> dict[str, float]:
    """The query embedding alone: ``embed_queries([question])`` with one ONNX thread and no
    cache, ``n`` LoCoMo questions after 20 of warm-up; wall p50 / p95 and CPU per query (this
    process, every thread) in ms."""
    emb = FastEmbedEmbedder(DEFAULT_MODEL, threads=1, lru_size=0)
    try:
        await emb.load()
        wall: list[float] = []
        cpu = 0.0
        for i, text in enumerate(texts[: n + 20]):
            c0, t0 = time.process_time(), time.perf_counter()
            await emb.embed_queries([f"{text} (e{i})"])
            if i >= 20:
                wall.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
    finally:
        await emb.aclose()
    return {"p50": pct(wall, 50), "p95": pct(wall, 95), "cpu": cpu * 1000 / max(1, len(wall))}


# ---- the database ------------------------------------------------------------------------


async def cached_db(n: int, cache_dir: Path, convs: Any) -> Path:
    """A database holding ``n`` turns of :data:`USER`, built once and kept in ``cache_dir``."""
    model = DEFAULT_MODEL.rsplit("/", 1)[-1]  # a database per model: its vectors are the model's
    path = cache_dir / f"memory_load-{n}-{model}.db"
    if path.is_file():
        return path
    cached = DiskCachedEmbedder(FastEmbedEmbedder(DEFAULT_MODEL, threads=2), cache_dir)
    tmp = path.with_suffix(".building.db")
    for p in tmp.parent.glob(tmp.name + "*"):
        p.unlink()
    t0 = time.perf_counter()
    try:
        async with Store(tmp) as store:
            await fill(store, cached, convs, n)
            await store.write(
                lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)"), transaction=False
            )
    finally:
        await cached.aclose()
    tmp.replace(path)
    print(f"built {n} turns in {time.perf_counter() - t0:.0f} s: {path}", file=sys.stderr)
    return path


async def fill(store: Store, embedder: DiskCachedEmbedder, convs: Any, n: int) -> None:
    """Store :data:`USER`'s ``n`` synthetic turns (vectors from the embedder's cache)."""
    await store.ensure_embedding_model(embedder.name)
    await import_turns(store, embedder, synthetic_records(convs, n, USER), batch=2048)


async def postgres_source(
    server: PostgresServer, source: Path, n: int, cache_dir: Path, convs: Any
) -> dict[str, Any]:
    """Database ``source`` on ``server`` holding what the SQLite file ``source`` holds, then
    vacuumed and analysed; how it was copied and the seconds it took."""
    url = create_database(server, "source")

    async def through_store(target: str) -> None:
        cached = DiskCachedEmbedder(FastEmbedEmbedder(DEFAULT_MODEL, threads=2), cache_dir)
        try:
            async with Store(target) as store:
                await fill(store, cached, convs, n)
        finally:
            await cached.aclose()

    how, seconds = await copy_from_sqlite(source, url, through_store)
    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        row = conn.execute("SELECT count(*) FROM turns WHERE user_id = %s", (USER,)).fetchone()
    if row is None or row[0] != n:
        raise RuntimeError(f"PostgreSQL holds {row and row[0]} turns of {USER}, not {n}")
    print(f"copied {n} turns into PostgreSQL ({how}) in {seconds:.0f} s", file=sys.stderr)
    return {
        "how": how,
        "seconds": round(seconds, 1),
        "vacuum_s": round(time.perf_counter() - t0, 1),
    }


# ---- requests ----------------------------------------------------------------------------


def body(question: str) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": question},
        ],
        "max_tokens": 32,
    }


async def chat(http: aiohttp.ClientSession, url: str, mode: str, question: str) -> float:
    headers = {"X-Engram-User": USER, "X-Engram-Memory": mode}
    t0 = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body(question), headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"chat answered {r.status}")
    return time.perf_counter() - t0


class Questions:
    """LoCoMo questions, each numbered so no text is ever sent twice."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.i = 0

    def next(self) -> str:
        self.i += 1
        return f"{self.texts[self.i % len(self.texts)]} ({self.i})"


async def paired(
    http: aiohttp.ClientSession,
    url: str,
    qs: Questions,
    mode: str,
    pairs: int,
    pid: int | None = None,
    db_cpu: Callable[[], float] = lambda: 0.0,
) -> dict[str, Any]:
    """``mode`` against ``off``, one request at a time, alternating which goes first;
    ``db_cpu``: the database server's CPU seconds so far (PostgreSQL's)."""
    times: dict[str, list[float]] = {mode: [], "off": []}
    start_load = load()
    cpu0 = db0 = 0.0
    for i in range(pairs + WARMUP):
        q = qs.next()
        order = (mode, "off") if i % 2 == 0 else ("off", mode)
        if i == WARMUP:
            cpu0, db0 = cpu_seconds(pid), db_cpu()
        for m in order:
            seconds = await chat(http, url, m, q)
            if i >= WARMUP:
                times[m].append(seconds)
    cpu = cpu_seconds(pid) - cpu0
    db = db_cpu() - db0
    on, off = times[mode], times["off"]
    return {
        "mode": mode,
        "pairs": pairs,
        "p50": pct(on, 50),
        "p95": pct(on, 95),
        "off_p50": pct(off, 50),
        "off_p95": pct(off, 95),
        "added_p50": pct(on, 50) - pct(off, 50),
        "added_p95": pct(on, 95) - pct(off, 95),
        "cpu_per_pair": cpu * 1000 / max(1, pairs),  # ms, the mode's request and off's
        "db_cpu_per_pair": db * 1000 / max(1, pairs),
        "load": f"{start_load} -> {load()}",
    }


async def closed_loop(
    http: aiohttp.ClientSession,
    url: str,
    qs: Questions,
    mode: str,
    c: int,
    seconds: float,
    pid: int | None = None,
    db_cpu: Callable[[], float] = lambda: 0.0,
) -> dict[str, Any]:
    """``c`` clients, each sending its next request when the last is answered; ``db_cpu``:
    the database server's CPU seconds so far."""
    times: list[float] = []
    errors = 0
    warm_until = time.perf_counter() + min(2.0, seconds / 5)
    stop = warm_until + seconds
    start_load = load()
    cpu_at: list[float] = []
    db_at: list[float] = []

    async def client() -> None:
        nonlocal errors
        while (now := time.perf_counter()) < stop:
            try:
                took = await chat(http, url, mode, qs.next())
            except (RuntimeError, aiohttp.ClientError):
                errors += 1
                continue
            if now >= warm_until:
                times.append(took)

    async def meter() -> None:  # the server's CPU over the measured seconds
        await asyncio.sleep(max(0.0, warm_until - time.perf_counter()))
        cpu_at.append(cpu_seconds(pid))
        db_at.append(db_cpu())
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        cpu_at.append(cpu_seconds(pid))
        db_at.append(db_cpu())

    await asyncio.gather(meter(), *(client() for _ in range(c)))
    return {
        "mode": mode,
        "c": c,
        "requests": len(times),
        "req_s": len(times) / seconds,
        "p50": pct(times, 50),
        "p95": pct(times, 95),
        "errors": errors,
        "cpu_per_request": (cpu_at[1] - cpu_at[0]) * 1000 / max(1, len(times)),  # ms
        "db_cpu_per_request": (db_at[1] - db_at[0]) * 1000 / max(1, len(times)),
        "load": f"{start_load} -> {load()}",
    }


# ---- report ------------------------------------------------------------------------------


def report(out: dict[str, Any]) -> str:
    n = out["turns"]
    t50, t95 = ADDED_TARGETS.get(n, (None, None))
    warm = f" after {out['warmup_seconds']:g} s of warm-up" if out.get("warmup_seconds") else ""
    e = out.get("embedding") or {}
    e50, ecpu = e.get("p50", float("nan")), e.get("cpu", float("nan"))
    lines = [
        f"Query embedding alone (embed_queries, 1 ONNX thread, one question): p50 {e50:.1f} ms, "
        f"p95 {e.get('p95', float('nan')):.1f} ms, CPU {ecpu:.1f} ms a query (load "
        f"{e.get('load', '-')})",
        "",
        f"Backend: {out.get('backend', 'sqlite')}"
        + (f" (copied through {c['how']} in {c['seconds']:g} s)" if (c := out.get("copy")) else ""),
        "",
        f"(a) c=1, a new chat per question, {n:,} turns stored for the user{warm}",
        "",
    ]
    lines.append("| memory | pairs | p50 | p95 | off p50 / p95 | added p50 | added p95 | "
                 "query embedding p50 | added p50 / embedding | target | pass/fail | "
                 "load 1/5/15 (start -> end) |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in out["latency"]:
        goal = f"≤ {t50:g} / {t95:g} ms" if t95 else (f"p50 ≤ {t50:g} ms" if t50 else "-")
        ok = None
        if t50 is not None and row["mode"] == "read-only":
            ok = row["added_p50"] <= t50 and (t95 is None or row["added_p95"] <= t95)
        lines.append(
            f"| {row['mode']} | {row['pairs']} | {row['p50']:.1f} ms | {row['p95']:.1f} ms | "
            f"{row['off_p50']:.1f} / {row['off_p95']:.1f} ms | {row['added_p50']:+.1f} ms | "
            f"{row['added_p95']:+.1f} ms | {e50:.1f} ms | {row['added_p50'] / e50:.2f}x | "
            f"{goal if row['mode'] == 'read-only' else '-'} | "
            f"{ {True: 'PASS', False: 'FAIL', None: '-'}[ok] } | {row['load']} |"
        )
    if out["throughput"]:
        lines += ["", f"(b) closed loop, {out['seconds']:g} s per cell", ""]
        lines.append("| memory | clients | req/s | p50 | p95 | errors | CPU / request | "
                     "CPU / embedding CPU | target | pass/fail | "
                     "load 1/5/15 (start -> end) |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in out["throughput"]:
            judged = row["c"] == 16 and row["mode"] != "off"
            goal = f"≥ {THROUGHPUT_TARGET:g} req/s" if judged else "-"
            verdict = ("PASS" if row["req_s"] >= THROUGHPUT_TARGET else "FAIL") if judged else "-"
            cpu, db = row.get("cpu_per_request", float("nan")), row.get("db_cpu_per_request", 0.0)
            shown = (
                f"{cpu:.1f} + PG {db:.1f} ms"
                if out.get("backend") == "postgres"
                else f"{cpu:.1f} ms"
            )
            lines.append(
                f"| {row['mode']} | {row['c']} | {row['req_s']:.0f} | {row['p50']:.1f} ms | "
                f"{row['p95']:.1f} ms | {row['errors']} | {shown} | {(cpu + db) / ecpu:.2f}x | "
                f"{goal} | {verdict} | {row['load']} |"
            )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    convs, questions_all, _ = load_locomo(args.data)
    texts = [q.question for q in questions_all]
    random.Random(1).shuffle(texts)
    qs = Questions(texts)
    source = await cached_db(args.turns, args.cache_dir, convs)
    out: dict[str, Any] = {
        "machine": machine(),
        "turns": args.turns,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "backend": args.backend,
        "latency": [],
        "throughput": [],
    }
    if args.embedding:
        start = load()
        out["embedding"] = await query_embedding(texts)
        out["embedding"]["load"] = f"{start} -> {load()}"
        print(f"query embedding alone: {out['embedding']['p50']:.1f} ms p50", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(pg_server()) if args.backend == "postgres" else None
        if server is not None:
            out["copy"] = await postgres_source(server, source, args.turns, args.cache_dir, convs)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="engram-load-")))
        db = Path(tmp) / "load.db"
        target: str | Path = db
        if server is None:
            shutil.copyfile(source, db)
        else:
            target = create_database(server, "load", template="source")
        await measure(args, out, qs, db, serve_env(target), lambda: pg_cpu_seconds(server))
    return out


async def measure(
    args: argparse.Namespace,
    out: dict[str, Any],
    qs: Questions,
    db: Path,
    env: dict[str, str],
    db_cpu: Callable[[], float],
) -> None:
    """Serve ``db`` (or what ``env`` points at) and take the latency pairs and the closed
    loops into ``out``."""
    log_path = db.parent / "serve.log"
    pids: list[int] = []
    try:
        async with (
            serving(db, log_path, extra_env=env, pids=pids) as url,
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=120),
                connector=aiohttp.TCPConnector(limit=0),
            ) as http,
        ):
            warm_until = time.perf_counter() + args.warmup_seconds
            while time.perf_counter() < warm_until:  # the server's caches load meanwhile
                await chat(http, url, "read-only", qs.next())
            for mode in args.latency_modes:
                row = await paired(http, url, qs, mode, args.pairs, pids[0], db_cpu)
                out["latency"].append(row)
                print(f"c=1 {mode}: {row['added_p50']:+.1f} ms p50", file=sys.stderr)
            for c in args.concurrency:
                for mode in args.throughput_modes:
                    row = await closed_loop(http, url, qs, mode, c, args.seconds, pids[0], db_cpu)
                    out["throughput"].append(row)
                    print(f"c={c} {mode}: {row['req_s']:.0f} req/s", file=sys.stderr)
    except Exception:
        sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--turns", type=int, default=10_000, help="stored turns of the user")
    parser.add_argument("--pairs", type=int, default=300, help="c=1 pairs per mode")
    parser.add_argument("--seconds", type=float, default=20.0, help="per throughput cell")
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop clients, by comma")
    parser.add_argument("--latency-modes", default="read-only,on", help="c=1 modes against off")
    parser.add_argument("--throughput-modes", default="read-only,on,off")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=0.0,
        help="read-only requests for this long before measuring (a large user's caches load)",
    )
    parser.add_argument(
        "--no-embedding",
        dest="embedding",
        action="store_false",
        help="skip timing the query embedding alone",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="vectors and DBs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--backend", choices=BACKENDS, default="sqlite", help="the memory store's backend"
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.latency_modes = [m for m in args.latency_modes.split(",") if m]
    args.throughput_modes = [m for m in args.throughput_modes.split(",") if m]
    if not args.data.is_file():
        parser.error(f"no LoCoMo data at {args.data} (see --data)")
    out = asyncio.run(run(args))
    print("\n".join(machine_lines(out["machine"])))
    print(report(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
