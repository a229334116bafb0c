"""How fast ``engram reindex`` re-embeds: LoCoMo turns stored with one model (the hash fake),
re-embedded with the default MiniLM on every core, through :func:`proxy.cli.reindex.reindex`.

    .venv/bin/python -m bench.reindex [--turns 5000] [--batch 256] [--embed-batch 32 64]
                                      [--orders length id] [--sessions 1 2] [--json out.json]

For each embedder batch size (texts per ONNX call), order of the turns and number of model
sessions (every core used: ``cores / sessions`` ONNX threads each), a fresh copy of the same
database is re-indexed and timed: the figure is turns per second of the whole run (reading,
embedding, writing the build table, the final swap), model load excluded. ``length`` is what
``engram reindex`` does (shortest texts first, so a batch pads least); ``id`` is the database's
order (each step of ``--batch`` turns still sorted within, as the embedder does). Without
``--sessions``, ``engram reindex``'s own layout (:func:`proxy.cli.reindex.session_layout`).
Texts repeated in LoCoMo are embedded once either way. The machine line and load average are
printed first; the load average again at the end (figures mean little above 1). Turns per
CPU-second (this process's user + system time, every thread) are printed beside: on a machine
others share they vary less than the wall-clock rate.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_LOCOMO, load_locomo, locomo_records, machine, machine_lines
from proxy.cli.importer import import_records
from proxy.cli.reindex import EMBED_BATCH, reindex, session_layout
from proxy.search.embedder import DEFAULT_MODEL, FastEmbedEmbedder, HashEmbedder
from proxy.store import Store, vectable


def records(path: Path, turns: int) -> list[dict[str, Any]]:
    convs, _, _ = load_locomo(path)
    out: list[dict[str, Any]] = []
    for conv in convs:
        out += locomo_records(conv)
    return out[:turns]


def cpu_seconds() -> float:
    """User and system CPU time of this process so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def remove(db: Path) -> None:
    for suffix in ("", "-wal", "-shm", ".lock"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)


async def prepare(db: Path, recs: list[dict[str, Any]]) -> None:
    old = HashEmbedder()
    async with Store(db) as store:
        await store.ensure_embedding_model(old.name, old.dim)
        report = await import_records(store, old, enumerate(recs, 1), 512)
        assert not report.errors
    await old.aclose()


async def timed(
    db: Path, sessions: int, threads: int, embed_batch: int, batch: int, order: str
) -> dict[str, Any]:
    embs = [
        FastEmbedEmbedder(DEFAULT_MODEL, threads=threads, batch_size=embed_batch, lru_size=0)
        for _ in range(sessions)
    ]
    for emb in embs:
        await emb.load()
    original = vectable._by_length
    if order == "id":  # the database's order instead of shortest first

        def by_id(conn: Any, where: str, args: Any) -> list[int]:
            return sorted(original(conn, where, args))

        vectable._by_length = by_id
    try:
        async with Store(db) as store:
            t0, cpu0 = time.perf_counter(), cpu_seconds()
            report = await reindex(store, embs[0], sessions=embs[1:], batch=batch)
            seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
            assert report.finished and report.way == "build"
    finally:
        vectable._by_length = original
        for emb in embs:
            await emb.aclose()
    return {
        "sessions": sessions,
        "threads": threads,
        "embed_batch": embed_batch,
        "batch": batch,
        "order": order,
        "turns": report.done,
        "embedded": report.embedded,
        "seconds": round(seconds, 2),
        "turns_per_s": round(report.done / seconds, 1),
        "cpu_seconds": round(cpu, 2),
        "turns_per_cpu_s": round(report.done / cpu, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    m = machine()
    for line in machine_lines(m):
        print(line)
    recs = records(args.data, args.turns)
    cores = os.cpu_count() or 1
    layouts = [(n, max(1, cores // n)) for n in args.sessions] or [session_layout(cores)]
    print(f"{len(recs)} LoCoMo turns stored with the hash model, re-embedded with {DEFAULT_MODEL}")
    print(f"{cores} cores; step {args.batch} turns")
    results = []
    with tempfile.TemporaryDirectory(prefix="engram-bench-reindex-") as tmp:
        base = Path(tmp) / "base.db"
        await prepare(base, recs)
        for (sessions, threads), embed_batch, order in itertools.product(
            layouts, args.embed_batch, args.orders
        ):
            db = Path(tmp) / f"run-{sessions}-{embed_batch}-{order}.db"
            await asyncio.to_thread(shutil.copyfile, base, db)
            r = await timed(db, sessions, threads, embed_batch, args.batch, order)
            results.append(r)
            print(
                f"{sessions} session(s) x {threads} thread(s), embed batch {embed_batch:>3}, "
                f"order {order:<6}: {r['turns_per_s']:>6.1f} turns/s ({r['turns']} turns, "
                f"{r['embedded']} embedded, {r['seconds']} s; {r['turns_per_cpu_s']} turns per "
                f"CPU-second; load {os.getloadavg()[0]:.2f})"
            )
            await asyncio.to_thread(remove, db)
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at the end: {' / '.join(str(x) for x in load)} (1/5/15 min)")
    return {"machine": m, "load_end": load, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--turns", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=256, help="turns per reindex step")
    parser.add_argument("--embed-batch", type=int, nargs="+", default=[EMBED_BATCH])
    parser.add_argument("--orders", nargs="+", default=["length"], choices=("length", "id"))
    parser.add_argument(
        "--sessions", type=int, nargs="*", default=[], help="model sessions (default: reindex's)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
