"""What several ``engram serve`` processes on ONE SQLite file would buy (issue 25, ``--workers``).

    .venv/bin/python -m bench.processes [--processes 1,2] [--clients 16,32] [--seconds 15]
                                        [--modes read-only,on] [--rounds 2]
                                        [--backend sqlite|postgres] [--layout processes|workers]
                                        [--configs BACKEND:LAYOUT:N,...]

``N`` processes (each with its own fake upstream) serve a copy of ``bench.memory_load``'s
database of 10,000 stored turns; ``--clients`` closed-loop clients, split evenly over them, send
a new chat per LoCoMo question. Per cell: requests/s summed over the processes, the slowest
process's p50 and p95, errors, and the processes' CPU per request (every thread, from
``/proc``, over the measured seconds). Rounds alternate 1 and N processes so that the machine's
drift falls on both.

``--layout workers``: one ``engram serve --workers N`` instead (N processes on one port,
``SO_REUSEPORT``; the clients all on that port, CPU summed over the supervisor and its
workers). The processes keep their caches in step through the database's ``changes`` log
(``proxy/store/changes.py``) and share background jobs by lease.

``--backend postgres``: the processes are replicas on one PostgreSQL (:mod:`bench.backends`: a
server started for the run, the 10,000 turns copied into it once by ``bench.memory_load``'s
``postgres_source``, each cell's processes on a fresh copy of that database, ``CREATE DATABASE
... TEMPLATE``), PostgreSQL's CPU (its backends') per request reported beside the processes'.
``--configs``: the cells of a round, each ``BACKEND:LAYOUT:N`` (e.g. ``sqlite:processes:1,
sqlite:workers:2,postgres:processes:1,postgres:processes:2``), instead of ``--backend``,
``--layout`` and ``--processes``; a round runs them in order, every ``--clients`` count and
``--modes`` mode on the same processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.backends import (
    BACKENDS,
    create_database,
    drop_database,
    pg_cpu_seconds,
    pg_server,
    serve_env,
)
from bench.common import DEFAULT_CACHE, DEFAULT_LOCOMO, load_locomo, machine, machine_lines, pct
from bench.memory_load import Questions, cached_db, chat, cpu_seconds, load, postgres_source
from bench.retrieval import serving

LAYOUTS = ("processes", "workers")


@dataclass(frozen=True)
class Config:
    """One cell's servers: the backend, N processes on N ports or one ``--workers N``."""

    backend: str
    layout: str
    processes: int

    @classmethod
    def parse(cls, text: str) -> Config:
        """``BACKEND:LAYOUT:N``."""
        backend, layout, n = text.split(":")
        if backend not in BACKENDS or layout not in LAYOUTS or int(n) < 1:
            raise ValueError(f"not BACKEND:LAYOUT:N ({'|'.join(BACKENDS)}, {'|'.join(LAYOUTS)})")
        return cls(backend, layout, int(n))


def tree_cpu(pid: int) -> float:
    """CPU time of ``pid`` and of its children (a ``--workers`` supervisor's workers)."""
    total = cpu_seconds(pid)
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return total + sum(cpu_seconds(int(c)) for c in children)


async def cell(
    http: aiohttp.ClientSession,
    urls: list[str],
    pids: list[int],
    qs: Questions,
    mode: str,
    clients: int,
    seconds: float,
    workers: int = 0,
    db_cpu: Callable[[], float] = lambda: 0.0,
) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``urls`` (client i on url i mod N); ``workers``:
    the processes behind the one url of ``--layout workers``; ``db_cpu``: the database
    server's CPU seconds so far (PostgreSQL's)."""
    times: list[list[float]] = [[] for _ in urls]
    errors = 0
    warm_until = time.perf_counter() + min(2.0, seconds / 5)
    stop = warm_until + seconds
    start_load = load()
    cpu: list[float] = []
    db: list[float] = []

    async def client(i: int) -> None:
        nonlocal errors
        while (now := time.perf_counter()) < stop:
            try:
                took = await chat(http, urls[i % len(urls)], mode, qs.next())
            except (RuntimeError, aiohttp.ClientError):
                errors += 1
                continue
            if now >= warm_until:
                times[i % len(urls)].append(took)

    async def meter() -> None:
        await asyncio.sleep(max(0.0, warm_until - time.perf_counter()))
        cpu.append(sum(tree_cpu(p) for p in pids))
        db.append(db_cpu())
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        cpu.append(sum(tree_cpu(p) for p in pids))
        db.append(db_cpu())

    await asyncio.gather(meter(), *(client(i) for i in range(clients)))
    n = sum(len(t) for t in times)
    return {
        "processes": workers or len(urls),
        "layout": "workers" if workers else "processes",
        "mode": mode,
        "clients": clients,
        "req_s": n / seconds,
        "p50": max(pct(t, 50) for t in times),
        "p95": max(pct(t, 95) for t in times),
        "errors": errors,
        "cpu_per_request": (cpu[1] - cpu[0]) * 1000 / max(1, n),
        "db_cpu_per_request": (db[1] - db[0]) * 1000 / max(1, n),
        "cpu_busy": (cpu[1] - cpu[0] + db[1] - db[0]) / seconds,  # cores, of os.cpu_count()
        "load": f"{start_load} -> {load()}",
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    convs, questions, _ = load_locomo(args.data)
    texts = [q.question for q in questions]
    random.Random(1).shuffle(texts)
    qs = Questions(texts)
    source = await cached_db(args.turns, args.cache_dir, convs)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        server = None
        if any(c.backend == "postgres" for c in args.configs):
            server = stack.enter_context(pg_server())
            copy = await postgres_source(server, source, args.turns, args.cache_dir, convs)
            print(f"PostgreSQL loaded through {copy['how']} in {copy['seconds']} s", flush=True)
        cells = 0
        for _ in range(args.rounds):
            for config in args.configs:
                cells += 1
                with tempfile.TemporaryDirectory(prefix="engram-procs-") as tmp:
                    db = Path(tmp) / "load.db"
                    if config.backend == "sqlite":
                        shutil.copyfile(source, db)
                        rows += await serve_cells(args, config, qs, db, {}, lambda: 0.0)
                        continue
                    assert server is not None
                    name = f"cell{cells}"
                    env = serve_env(create_database(server, name, template="source"))
                    try:
                        rows += await serve_cells(
                            args, config, qs, db, env, lambda: pg_cpu_seconds(server)
                        )
                    finally:
                        drop_database(server, name)
    return rows


async def serve_cells(
    args: argparse.Namespace,
    config: Config,
    qs: Questions,
    db: Path,
    env: dict[str, str],
    db_cpu: Callable[[], float],
) -> list[dict[str, Any]]:
    """Start ``config``'s processes on ``db`` (or what ``env`` points at), warm them, and run a
    cell per ``--modes`` mode and ``--clients`` count."""
    rows: list[dict[str, Any]] = []
    n = config.processes
    pids: list[int] = []
    async with contextlib.AsyncExitStack() as stack:
        if config.layout == "workers":
            flags = ["--workers", str(n)]
            serve = serving(db, db.parent / "serve.log", env, pids=pids, extra_args=flags)
            urls = [await stack.enter_async_context(serve)]
        else:
            urls = [
                await stack.enter_async_context(
                    serving(db, db.parent / f"serve-{i}.log", env, pids=pids)
                )
                for i in range(n)
            ]
        workers = n if config.layout == "workers" else 0
        http = await stack.enter_async_context(
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=120),
                connector=aiohttp.TCPConnector(limit=0),
            )
        )
        warm_until = time.perf_counter() + args.warmup_seconds
        while time.perf_counter() < warm_until:  # every process loads its caches
            for url in urls:
                await chat(http, url, "read-only", qs.next())
        for mode in args.modes:
            for clients in args.clients:
                row = await cell(http, urls, pids, qs, mode, clients, args.seconds, workers, db_cpu)
                row["backend"] = config.backend
                rows.append(row)
                print(
                    f"{config.backend} {config.layout} {n}, {mode}, c={clients}: "
                    f"{row['req_s']:.1f} req/s",
                    flush=True,
                )
    return rows


def report(rows: list[dict[str, Any]], seconds: float, turns: int = 10_000) -> str:
    lines = [
        f"closed loop, {seconds:g} s per cell, {turns:,} turns stored, a new chat per question; "
        "CPU: Engram's processes + PostgreSQL's; busy: both, in cores",
        "",
        "| backend | processes | layout | memory | clients | req/s | p50 | p95 | errors | "
        "CPU / request | busy | load 1/5/15 (start -> end) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = f"{r['cpu_per_request']:.1f} ms"
        if r.get("backend") == "postgres":
            cpu = f"{r['cpu_per_request']:.1f} + {r['db_cpu_per_request']:.1f} ms"
        lines.append(
            f"| {r.get('backend', 'sqlite')} | {r['processes']} | {r['layout']} | {r['mode']} | "
            f"{r['clients']} | {r['req_s']:.1f} | "
            f"{r['p50']:.0f} ms | {r['p95']:.0f} ms | {r['errors']} | "
            f"{cpu} | {r.get('cpu_busy', float('nan')):.2f} | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--turns", type=int, default=10_000, help="stored turns of the user")
    parser.add_argument("--processes", default="1,2", help="processes per cell, by comma")
    parser.add_argument("--clients", default="16", help="closed-loop clients in all, by comma")
    parser.add_argument("--seconds", type=float, default=15.0, help="per cell")
    parser.add_argument("--modes", default="read-only,on", help="X-Engram-Memory per cell")
    parser.add_argument("--rounds", type=int, default=2, help="times over --processes")
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="vectors and DBs")
    parser.add_argument(
        "--layout",
        choices=("processes", "workers"),
        default="processes",
        help="N serve processes on their own ports, or one serve --workers N",
    )
    parser.add_argument("--backend", choices=BACKENDS, default="sqlite", help="the memory store")
    parser.add_argument(
        "--configs",
        help="the cells of a round, BACKEND:LAYOUT:N by comma (instead of --backend, --layout "
        "and --processes)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.processes = [int(n) for n in args.processes.split(",") if n]
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.modes = [m for m in args.modes.split(",") if m]
    try:
        args.configs = [Config.parse(c) for c in (args.configs or "").split(",") if c] or [
            Config(args.backend, args.layout, n) for n in args.processes
        ]
    except ValueError as exc:
        parser.error(f"--configs: {exc}")
    if not args.data.is_file():
        parser.error(f"no LoCoMo data at {args.data} (see --data)")
    start = machine()
    rows = asyncio.run(run(args))
    print("\n".join(machine_lines(start)))
    print(f"load at the end: {load()}")
    print(report(rows, args.seconds, args.turns))
    if args.json:
        args.json.write_text(json.dumps({"machine": start, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
