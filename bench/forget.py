"""What forgetting that forgets costs (issue 12, row 8), on a database of --turns turns.

    .venv/bin/python -m bench.forget [--turns 100000] [--db base.db] [--json out.json]

The database holds sessions of 100 turns (Zipf-worded texts of about 50 words, synthetic vectors),
built through the Store and reused when --db names one that exists. On copies of it:

(w) ``secure_delete`` on the writes of a chat turn: the archive commit (two turns, as the pipeline
    writes them), then the deferred full-text indexing (deletes and re-inserts the neighbours'
    FTS rows) and the vectors, each one ``Store.write``; blocks of 50 turns alternate OFF and ON
    on one database, so drift and load hit both alike. Then deleting one 100-turn session, OFF
    against ON.
(f) Forgetting one session and the scrub after it (FTS merge steps, incremental vacuum, WAL
    checkpoint); meanwhile a chat turn's writes every 20 ms, its archive commits timed against
    the same with no scrub running; and the same FTS rewrite as one ``optimize``.
(v) The one-time ``VACUUM`` that gives a database made before migration 9
    ``auto_vacuum = INCREMENTAL``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.common import machine, machine_lines
from proxy.store import NewTurn, Store, indexing, queries
from proxy.store.sqlite.db import Connection, connect
from proxy.store.sqlite.scrub import checkpoint, ensure_incremental_vacuum, fts_optimize

PER_SESSION = 100
BLOCK = 50
DIM = 384
Matrix = npt.NDArray[np.float32]


def make_vectors(n: int, rng: np.random.Generator) -> Matrix:
    """``n`` unit vectors shaped like sentence embeddings: a shared direction, topics, noise."""
    mean = rng.normal(size=DIM)
    topics = rng.normal(size=(256, DIM))
    x = 0.5 * mean / np.linalg.norm(mean) + topics[rng.integers(0, 256, n)] / np.sqrt(DIM)
    x = (x + rng.normal(size=(n, DIM)) / np.sqrt(DIM) * 0.8).astype(np.float32)
    out: Matrix = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def make_texts(n: int, rng: np.random.Generator) -> list[str]:
    """``n`` texts of 25 Zipf-distributed words from a vocabulary of 20,000."""
    vocab = [f"w{i}" for i in range(20_000)]
    ranks = np.minimum(rng.zipf(1.3, size=(n, 25)) - 1, len(vocab) - 1)
    return [" ".join(vocab[r] for r in row) for row in ranks]


def ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {
        "n": len(values),
        "p50": q[49] * 1000,
        "p95": q[94] * 1000,
        "p99": q[98] * 1000,
        "max": max(values) * 1000,
    }


async def build(path: Path, turns: int) -> float:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    async with Store(path) as store:
        for s in range(turns // PER_SESSION):
            sid = f"s{s}"
            await store.get_or_create_session("u", sid)
            texts = [
                f"{a} {b}"
                for a, b in zip(
                    make_texts(PER_SESSION, rng),
                    make_texts(PER_SESSION, rng),
                    strict=True,
                )
            ]
            vecs = make_vectors(PER_SESSION, rng)
            rows = [
                NewTurn(i, "user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)
            ]
            await store.add_turns(sid, "u", rows, list(vecs))
        await store.write(fts_optimize)  # an aged index: one big segment
        await store.write(checkpoint, transaction=False)
    return time.perf_counter() - t0


async def secure_delete(store: Store, mode: str) -> None:
    def job(c: Connection) -> None:
        c.execute(f"PRAGMA secure_delete = {mode}")

    await store.write(job, transaction=False)


def copy(base: Path, tmp: Path, name: str) -> Path:
    out = tmp / name
    shutil.copy(base, out)
    return out


class ChatWrites:
    """A chat turn's writes, as the pipeline and the indexer make them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.rng = np.random.default_rng(1)
        self.n = 0

    async def turn(self) -> tuple[float, float]:
        """(archive commit, indexing) seconds for one new two-turn exchange; the indexing waits
        while a scrub merges the index, as the indexer does."""
        ids, commit = await self.commit()
        t1 = time.perf_counter()
        await self.index(ids)
        return commit, time.perf_counter() - t1

    async def commit(self) -> tuple[list[int], float]:
        """Archive a new two-turn exchange (as the pipeline's commit); its ids and seconds."""
        self.n += 1
        sid, now = f"chat{self.n // 20}", time.time()
        texts = make_texts(2, self.rng)

        def commit(c: Connection) -> list[int]:
            queries.get_or_create_session(
                c, "u", sid, parent_id=None, agent=None, fingerprint=None, indexed=None, now=now
            )
            first = queries.next_position(c, sid)
            rows = [NewTurn(first + i, "user", t) for i, t in enumerate(texts)]
            done = queries.insert_turns(c, sid, "u", rows, None, now, fts_pending=True)
            return [i for i, _ in done]

        t0 = time.perf_counter()
        ids = await self.store.write(commit)
        return ids, time.perf_counter() - t0

    async def index(self, ids: list[int]) -> None:
        """What the indexer does after a commit: the FTS rows (not while a scrub merges), then
        the vectors."""
        vecs = make_vectors(len(ids), self.rng)
        await self.store.scrubber.fts_writable()
        await self.store.write(lambda c: indexing.index_deferred(c, ids))
        items = [(i, v, f"h{i}") for i, v in zip(ids, vecs, strict=True)]
        await self.store.write(lambda c: indexing.set_vectors(c, items))


async def part_w(base: Path, tmp: Path, turns: int) -> dict[str, Any]:
    path = copy(base, tmp, "w.db")
    out: dict[str, Any] = {}
    async with Store(path) as store:
        writes = ChatWrites(store)
        times: dict[str, dict[str, list[float]]] = {
            mode: {"commit": [], "index": []} for mode in ("OFF", "ON")
        }
        for block in range(2 * turns // BLOCK):
            mode = ("OFF", "ON")[block % 2]
            await secure_delete(store, mode)
            for _ in range(BLOCK):
                commit, index = await writes.turn()
                times[mode]["commit"].append(commit)
                times[mode]["index"].append(index)
        out["chat"] = {m: {k: ms(v) for k, v in t.items()} for m, t in times.items()}
        deletes: dict[str, list[float]] = {"OFF": [], "ON": []}
        for i in range(20):
            mode = ("OFF", "ON")[i % 2]
            await secure_delete(store, mode)
            t0 = time.perf_counter()
            assert await store.delete_session(f"s{i}")
            deletes[mode].append(time.perf_counter() - t0)
        out["delete_session"] = {m: ms(v) for m, v in deletes.items()}
    return out


async def part_f(base: Path, tmp: Path, turns: int) -> dict[str, Any]:
    middle = turns // PER_SESSION // 2
    path = copy(base, tmp, "f.db")
    out: dict[str, Any] = {}
    async with Store(path) as store:
        writes = ChatWrites(store)
        idle = [(await writes.turn())[0] for _ in range(100)]
        t0 = time.perf_counter()
        assert await store.delete_session(f"s{middle}")
        out["delete_s"] = time.perf_counter() - t0
        # The scrub (Store.scrubber, as the CLI and the API run it), with a chat turn's writes
        # every 20 ms beside it: the archive commit (what a client waits for) is timed; the
        # indexing after it waits for the scrub's FTS merge, as the indexer does.
        busy: list[float] = []
        done = asyncio.Event()
        indexing_tasks: list[asyncio.Task[None]] = []

        async def chat() -> None:
            while not done.is_set():
                ids, took = await writes.commit()
                busy.append(took)
                indexing_tasks.append(asyncio.create_task(writes.index(ids)))
                await asyncio.sleep(0.02)

        runner = asyncio.create_task(chat())
        t0 = time.perf_counter()
        report = await store.scrubber.scrub()
        out["scrub_s"] = time.perf_counter() - t0
        assert report is not None
        out["scrub"] = dataclasses.asdict(report)
        done.set()
        await runner
        await asyncio.gather(*indexing_tasks)
        out["commits_idle"] = ms(idle)
        out["commits_during_scrub"] = ms(busy)
        # For comparison: the same rewrite as one 'optimize' (what the merge steps split up).
        assert await store.delete_session(f"s{middle + 1}")
        t0 = time.perf_counter()
        await store.write(fts_optimize)
        out["one_optimize_s"] = time.perf_counter() - t0
    return out


def part_v(base: Path, tmp: Path) -> dict[str, Any]:
    path = copy(base, tmp, "v.db")
    conn = connect(path)
    try:
        conn.execute("PRAGMA auto_vacuum = NONE")
        conn.execute("VACUUM")  # as a database made before migration 9 (untimed)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        size = path.stat().st_size
        t0 = time.perf_counter()
        assert ensure_incremental_vacuum(conn)
        took = time.perf_counter() - t0
    finally:
        conn.close()
    return {"vacuum_s": took, "db_mb": size / 2**20}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine(), "turns": args.turns}
    with tempfile.TemporaryDirectory(prefix="engram-bench-forget-") as name:
        tmp = Path(name)
        base = args.db or tmp / "base.db"
        if not base.exists():
            out["build_s"] = await build(base, args.turns)
        out["db_mb"] = base.stat().st_size / 2**20
        if "w" in args.parts:
            out["w"] = await part_w(base, tmp, args.chat_turns)
        if "f" in args.parts:
            out["f"] = await part_f(base, tmp, args.turns)
        if "v" in args.parts:
            out["v"] = part_v(base, tmp)
    return out


def report(out: dict[str, Any]) -> list[str]:
    lines = [
        *machine_lines(out["machine"]),
        f"Database: {out['turns']} turns, {out['db_mb']:.0f} MB",
    ]
    if "w" in out:
        lines += [
            "",
            "(w) a chat turn's writes, secure_delete OFF vs ON (ms)",
            "| write | mode | n | p50 | p95 | p99 |",
            "|---|---|---|---|---|---|",
        ]
        for kind in ("commit", "index"):
            for mode in ("OFF", "ON"):
                s = out["w"]["chat"][mode][kind]
                lines.append(
                    f"| {kind} | {mode} | {s['n']} | {s['p50']:.3f} | {s['p95']:.3f} |"
                    f" {s['p99']:.3f} |"
                )
        for mode in ("OFF", "ON"):
            s = out["w"]["delete_session"][mode]
            lines.append(f"| delete a 100-turn session | {mode} | {s['n']} | {s['p50']:.1f} | "
                         f"{s['p95']:.1f} | {s['p99']:.1f} |")  # fmt: skip
    if "f" in out:
        f, sc = out["f"], out["f"]["scrub"]
        how = "one optimize after them (they did not converge)" if sc["optimized_at_once"] else ""
        lines += [
            "",
            "(f) forgetting one 100-turn session",
            f"- delete transaction: {f['delete_s'] * 1000:.1f} ms",
            f"- scrub: {f['scrub_s']:.2f} s: {sc['merge_steps']} FTS merge steps {how}, "
            f"free pages left {sc['free_pages_left']}, log emptied: {sc['checkpointed']}",
            f"- the same rewrite as one 'optimize' transaction: {f['one_optimize_s']:.2f} s",
        ]
        for label, key in (("idle", "commits_idle"), ("during the scrub", "commits_during_scrub")):
            s = f[key]
            lines.append(
                f"- a chat turn's archive commit, {label}: p50 {s['p50']:.1f} ms, "
                f"p95 {s['p95']:.1f} ms, max {s['max']:.1f} ms (n={s['n']})"
            )
    if "v" in out:
        v = out["v"]
        lines += [
            "",
            f"(v) one-time VACUUM of a {v['db_mb']:.0f} MB database: {v['vacuum_s']:.1f} s",
        ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--db", type=Path, help="build here, or reuse if it exists")
    parser.add_argument("--parts", default="wfv")
    parser.add_argument("--chat-turns", type=int, default=1000, help="(w) per mode")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = asyncio.run(run(args))
    print("\n".join(report(out)))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
