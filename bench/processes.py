"""What several ``engram serve`` processes on ONE SQLite file would buy (issue 25, ``--workers``).

    .venv/bin/python -m bench.processes [--processes 1,2] [--clients 16] [--seconds 15]
                                        [--modes read-only,on] [--rounds 2]

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import DEFAULT_CACHE, DEFAULT_LOCOMO, load_locomo, machine, machine_lines, pct
from bench.memory_load import Questions, cached_db, chat, cpu_seconds, load
from bench.retrieval import serving


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
) -> dict[str, Any]:
    """``clients`` closed-loop clients over ``urls`` (client i on url i mod N); ``workers``:
    the processes behind the one url of ``--layout workers``."""
    times: list[list[float]] = [[] for _ in urls]
    errors = 0
    warm_until = time.perf_counter() + min(2.0, seconds / 5)
    stop = warm_until + seconds
    start_load = load()
    cpu: list[float] = []

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
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        cpu.append(sum(tree_cpu(p) for p in pids))

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
        "load": f"{start_load} -> {load()}",
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    convs, questions, _ = load_locomo(args.data)
    texts = [q.question for q in questions]
    random.Random(1).shuffle(texts)
    qs = Questions(texts)
    source = await cached_db(args.turns, args.cache_dir, convs)
    rows: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for n in args.processes:
            with tempfile.TemporaryDirectory(prefix="engram-procs-") as tmp:
                db = Path(tmp) / "load.db"
                shutil.copyfile(source, db)
                pids: list[int] = []
                async with contextlib.AsyncExitStack() as stack:
                    if args.layout == "workers":
                        flags = ["--workers", str(n)]
                        log_path = Path(tmp) / "serve.log"
                        serve = serving(db, log_path, pids=pids, extra_args=flags)
                        urls = [await stack.enter_async_context(serve)]
                    else:
                        urls = [
                            await stack.enter_async_context(
                                serving(db, Path(tmp) / f"serve-{i}.log", pids=pids)
                            )
                            for i in range(n)
                        ]
                    workers = n if args.layout == "workers" else 0
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
                        row = await cell(
                            http, urls, pids, qs, mode, args.clients, args.seconds, workers
                        )
                        rows.append(row)
                        print(f"{n} process(es), {mode}: {row['req_s']:.1f} req/s", flush=True)
    return rows


def report(rows: list[dict[str, Any]], seconds: float) -> str:
    lines = [
        f"closed loop, {seconds:g} s per cell, 10,000 turns stored, a new chat per question",
        "",
        "| processes | layout | memory | clients | req/s | p50 | p95 | errors | CPU / request | "
        "load 1/5/15 (start -> end) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['processes']} | {r['layout']} | {r['mode']} | {r['clients']} | "
            f"{r['req_s']:.1f} | "
            f"{r['p50']:.0f} ms | {r['p95']:.0f} ms | {r['errors']} | "
            f"{r['cpu_per_request']:.1f} ms | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--turns", type=int, default=10_000, help="stored turns of the user")
    parser.add_argument("--processes", default="1,2", help="processes per cell, by comma")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients in all")
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
    args = parser.parse_args()
    args.processes = [int(n) for n in args.processes.split(",") if n]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.data.is_file():
        parser.error(f"no LoCoMo data at {args.data} (see --data)")
    rows = asyncio.run(run(args))
    print("\n".join(machine_lines(machine())))
    print(report(rows, args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
