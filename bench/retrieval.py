"""Retrieval latency, ingest speed and the cost of memory on a chat request, at scale.

    .venv/bin/python -m bench.retrieval [--quick] [--json out.json]

(a) One hybrid search through :meth:`proxy.search.retrieval.Retriever.search` (the chat pipeline's
    call: query embedding with the real MiniLM included, k = ``[retrieval] top_k``), p50/p95
    over LoCoMo's questions, in a user namespace of 10k and of 100k stored turns (one database,
    both namespaces), with the exact and the bit-quantised vector plan; plus what the quantised
    plan costs in recall against the exact one, and where the time goes.
(b) Ingest: fresh turns per second through the import path (:func:`proxy.cli.importer.
    import_records`, real embeddings), with 1 and 2 ONNX threads, and its split between the
    model and the database.
(c) A chat request through ``python -m proxy serve`` (fake upstream) with memory on, against
    10k stored turns of the user, versus the same with ``X-Engram-Memory: off``.

The archive is synthesised from LoCoMo's turns (cycled, each later cycle joined to words of
another turn so every text differs; see ``bench.common.synthetic_records``). Its embeddings are
computed once and cached in ``--cache-dir`` (the first full run spends about 10 minutes on a
2-core machine in the model; later runs seconds). LoCoMo is read in place, never copied.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import (
    DEFAULT_CACHE,
    DEFAULT_LOCOMO,
    ROOT,
    DiskCachedEmbedder,
    import_turns,
    load_locomo,
    machine,
    machine_lines,
    pct,
    synthetic_records,
)
from proxy.config import RetrievalSettings
from proxy.search.embedder import DEFAULT_MODEL, FastEmbedEmbedder
from proxy.search.fts_query import match_of, query_words
from proxy.search.retrieval import Retriever
from proxy.store import Store
from proxy.store.sqlite.search_sql import QUANTIZED_ABOVE

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TARGETS = {  # (size, percentile) -> ms
    (10_000, 50): 10.0,
    (100_000, 50): 30.0,
    (100_000, 95): 60.0,
}
INGEST_TARGET = 200.0  # turns/s
CHAT_TARGET = 15.0  # ms added at p50


def fresh_embedder(threads: int) -> FastEmbedEmbedder:
    """The real model with no LRU, so every query pays for its embedding."""
    return FastEmbedEmbedder(DEFAULT_MODEL, threads=threads, lru_size=0)


# ---- (a) search latency ------------------------------------------------------------------


async def build(path: Path, n: int, cached: DiskCachedEmbedder, convs: Any) -> float:
    """Add a namespace of ``n`` turns (vectors from the cache) through the import path."""
    async with Store(path) as store:
        await store.ensure_embedding_model(cached.name)
        t0 = time.perf_counter()
        await import_turns(store, cached, synthetic_records(convs, n, f"u{n}"), batch=2048)
        seconds = time.perf_counter() - t0
    cached.save()
    return seconds


async def search_latency(
    path: Path,
    user: str,
    vec_mode: str,
    questions: list[str],
    threads: int,
    settings: RetrievalSettings,
) -> dict[str, Any]:
    """p50/p95 of Retriever.search, and of its parts timed alone."""
    embedder = fresh_embedder(threads)
    await embedder.load()
    try:
        async with Store(path, vec_mode=vec_mode) as store:  # type: ignore[arg-type]
            retriever = Retriever(store, embedder, settings)
            for q in questions[:20]:  # warm caches, threads, the plan choice
                await retriever.search(user, q + " warm", settings.top_k)
            total, cpu, embed, fts, vec = [], [], [], [], []
            n = max(settings.candidates, settings.top_k)
            load = os.getloadavg()[0]
            for q in questions:
                c0, t0 = time.process_time(), time.perf_counter()
                await retriever.search(user, q, settings.top_k)
                total.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)  # every thread of this process
            for q in questions:  # the parts, one at a time
                t0 = time.perf_counter()
                (qv,) = await embedder.embed_queries([q])
                t1 = time.perf_counter()
                match = match_of(await retriever._uncommon(user, query_words(q)))
                if match is not None:
                    await store.fts_search(user, match, n)
                t2 = time.perf_counter()
                await store.vec_search(user, qv, n)
                t3 = time.perf_counter()
                embed.append(t1 - t0)
                fts.append(t2 - t1)
                vec.append(t3 - t2)
    finally:
        await embedder.aclose()
    return {
        "p50": pct(total, 50),
        "p95": pct(total, 95),
        "cpu_p50": pct(cpu, 50),
        "load": load,
        "embed_p50": pct(embed, 50),
        "fts_p50": pct(fts, 50),
        "fts_p95": pct(fts, 95),
        "vec_p50": pct(vec, 50),
        "vec_p95": pct(vec, 95),
        "queries": len(questions),
    }


async def quantised_recall(
    path: Path,
    user: str,
    questions: list[str],
    cached: DiskCachedEmbedder,
    settings: RetrievalSettings,
) -> dict[str, float]:
    """How much of the exact plan's results the quantised plan returns."""
    vec10: list[float] = []
    vec_n: list[float] = []
    hybrid: list[float] = []
    n = settings.candidates
    k = settings.top_k
    async with Store(path, vec_mode="exact") as exact, Store(path, vec_mode="quantized") as quant:
        r_exact = Retriever(exact, cached, settings)
        r_quant = Retriever(quant, cached, settings)
        for q in questions:
            (qv,) = await cached.embed_queries([q])
            e = [i for i, _ in await exact.vec_search(user, qv, n)]
            a = [i for i, _ in await quant.vec_search(user, qv, n)]
            vec10.append(len(set(e[:10]) & set(a[:10])) / max(1, len(e[:10])))
            vec_n.append(len(set(e) & set(a)) / max(1, len(e)))
            he = [h.turn.id for h in await r_exact.search(user, q, k)]
            hq = [h.turn.id for h in await r_quant.search(user, q, k)]
            hybrid.append(len(set(he) & set(hq)) / max(1, len(he)))
    return {
        "vec_recall_at_10": sum(vec10) / len(vec10),
        f"vec_recall_at_{n}": sum(vec_n) / len(vec_n),
        f"hybrid_top{k}_overlap": sum(hybrid) / len(hybrid),
    }


# ---- (b) ingest --------------------------------------------------------------------------


async def ingest(path: Path, convs: Any, n: int, threads: int, batch: int) -> dict[str, Any]:
    """Fresh turns (never embedded before) through the import path with the real model."""
    nonce = f"{time.time_ns():x}"
    records = synthetic_records(convs, n, f"ingest{threads}")
    for r in records:  # a word no cache has seen: every text is embedded for real
        r["content"] += f" ({nonce})"
    embedder = fresh_embedder(threads)
    await embedder.load()
    timed = _TimedEmbedder(embedder)
    load = os.getloadavg()[0]
    try:
        async with Store(path) as store:
            c0, t0 = time.process_time(), time.perf_counter()
            via = await import_turns(store, timed, records, batch=batch)
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - c0
    finally:
        await embedder.aclose()
    return {
        "turns": n,
        "threads": threads,
        "seconds": seconds,
        "turns_per_s": n / seconds,
        "embedding_share": timed.seconds / seconds,
        "cpu_ms_per_turn": cpu / n * 1000,
        "via": via,
        "load": load,
    }


class _TimedEmbedder:
    """Adds up the time spent in the model."""

    def __init__(self, inner: FastEmbedEmbedder) -> None:
        self.inner = inner
        self.seconds = 0.0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dim(self) -> int:
        return self.inner.dim

    async def load(self) -> None:
        await self.inner.load()

    async def embed_queries(self, texts: Sequence[str]) -> list[Any]:
        return await self.inner.embed_queries(texts)

    async def embed_passages(self, texts: Sequence[str]) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return await self.inner.embed_passages(texts)
        finally:
            self.seconds += time.perf_counter() - t0

    async def aclose(self) -> None:
        await self.inner.aclose()


# ---- (c) a chat request with memory ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()


@contextlib.asynccontextmanager
async def serving(
    db: Path,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
    pids: list[int] | None = None,
    extra_args: Sequence[str] = (),
) -> AsyncIterator[str]:
    """``python -m proxy serve`` on ``db`` in front of ``python -m testing.fake_upstream``, both
    subprocesses; yields Engram's URL once it answers its health check. ``pids``: Engram's
    process id is appended there (to read its CPU time). ``extra_args``: more ``serve`` flags
    (``--workers 2``)."""
    procs: list[asyncio.subprocess.Process] = []
    env = {**os.environ, "ENGRAM_SERVER_LOG_LEVEL": "warning", **(extra_env or {})}
    with log_path.open("wb") as log:
        try:
            fake = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "testing.fake_upstream", "--host", "127.0.0.1", "--port", "0",
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=log,
            )  # fmt: skip
            procs.append(fake)
            assert fake.stdout is not None
            line = await asyncio.wait_for(fake.stdout.readline(), 30)
            if not line.startswith(b"listening on "):
                raise RuntimeError(f"fake upstream did not start: {line!r}")
            upstream = line.decode().split()[-1]
            port = _free_port()
            engram = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", "serve", "--upstream", upstream,
                "--host", "127.0.0.1", "--port", str(port), "--db", str(db), *extra_args,
                cwd=ROOT, stdout=log, stderr=log, env=env,
            )  # fmt: skip
            procs.append(engram)
            if pids is not None:
                pids.append(engram.pid)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                deadline = time.monotonic() + 120
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(f"{url}/engram/health") as resp:
                            if resp.status == 200:
                                break
                    if time.monotonic() > deadline or engram.returncode is not None:
                        raise RuntimeError(f"Engram did not start; see {log_path}")
                    await asyncio.sleep(0.2)
            yield url
        finally:
            for proc in reversed(procs):
                await _stop(proc)


async def chat_latency(
    db: Path, questions: list[str], n: int, gap_s: float, log_path: Path
) -> dict[str, Any]:
    """Paired chat requests, memory on (fresh message each) and off, alternating."""
    async with (
        serving(db, log_path) as url,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        load = os.getloadavg()[0]
        on: list[float] = []
        off: list[float] = []
        injected = 0
        for i in range(n + 20):
            q = questions[i % len(questions)] + f" ({i})"
            pair = [("on", q), ("off", q)]
            for mode, text in pair if i % 2 == 0 else reversed(pair):
                seconds, memories = await _chat(http, url, mode, text)
                if i >= 20:  # the first 20 warm up
                    (on if mode == "on" else off).append(seconds)
                    injected += memories if mode == "on" else 0
                await asyncio.sleep(gap_s)
    return {
        "requests": n,
        "on_p50": pct(on, 50),
        "on_p95": pct(on, 95),
        "off_p50": pct(off, 50),
        "off_p95": pct(off, 95),
        "added_p50": pct(on, 50) - pct(off, 50),
        "added_p95": pct(on, 95) - pct(off, 95),
        "memories_per_request": injected / max(1, len(on)),
        "gap_ms": gap_s * 1000,
        "load": load,
    }


async def _chat(http: aiohttp.ClientSession, url: str, mode: str, text: str) -> tuple[float, int]:
    headers = {"X-Engram-User": "bench", "X-Engram-Memory": mode}
    body = {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 32,
    }
    t0 = time.perf_counter()
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"chat answered {resp.status}")
        memories = int(resp.headers.get("X-Engram-Memories", "0").split(";")[0])
    return time.perf_counter() - t0, memories


# ---- report ------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "-"}[ok]


def report(out: dict[str, Any]) -> str:
    lines = ["Search latency (hybrid, Retriever.search, query embedding included)", ""]
    lines.append(
        "| namespace (of DB turns) | vector plan | p50 | p95 | target | pass/fail | "
        "CPU p50 | embed p50 | FTS5 p50 / p95 | vec p50 / p95 | load |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in out["latency"]:
        size = row["size"]
        goals = [f"p{p} ≤ {ms:g} ms" for (s, p), ms in TARGETS.items() if s == size]
        oks = [row[f"p{p}"] <= ms for (s, p), ms in TARGETS.items() if s == size]
        ok = all(oks) if oks and row["default_plan"] else None
        plan = row["mode"] + (" (default)" if row["default_plan"] else "")
        lines.append(
            f"| {size:,} of {row['db_turns']:,} | {plan} | "
            f"{row['p50']:.1f} ms | {row['p95']:.1f} ms | {', '.join(goals) or '-'} | "
            f"{verdict(ok)} | {row['cpu_p50']:.1f} ms | {row['embed_p50']:.1f} ms | "
            f"{row['fts_p50']:.1f} / {row['fts_p95']:.1f} ms | "
            f"{row['vec_p50']:.1f} / {row['vec_p95']:.1f} ms | {row['load']:.1f} |"
        )
    lines += ["", "Quantised vector plan against exact (same queries)", ""]
    lines.append("| namespace | vec recall@10 | vec recall@candidates | hybrid top-k overlap |")
    lines.append("|---|---|---|---|")
    for row in out["quantised"]:
        vals = list(row["recall"].values())
        lines.append(f"| {row['size']:,} turns | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines += ["", "Ingest through the import path (fresh texts, real embeddings)", ""]
    lines.append(
        "| ONNX threads | turns | turns/s | in the model | CPU per turn | target | pass/fail "
        "| load |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for row in out["ingest"]:
        lines.append(
            f"| {row['threads']} | {row['turns']} | {row['turns_per_s']:.0f} | "
            f"{row['embedding_share'] * 100:.0f}% | {row['cpu_ms_per_turn']:.1f} ms | "
            f"≥ {INGEST_TARGET:g} turns/s | {verdict(row['turns_per_s'] >= INGEST_TARGET)} | "
            f"{row['load']:.1f} |"
        )
    chat = out.get("chat")
    if chat:
        lines += [
            "",
            f"Chat request, 10k stored turns, memory on vs off ({chat['requests']} pairs, "
            f"{chat['gap_ms']:.0f} ms between requests, "
            f"{chat['memories_per_request']:.1f} memories injected per request, load "
            f"{chat['load']:.1f})",
            "",
            "| | memory off | memory on | added | target | pass/fail |",
            "|---|---|---|---|---|---|",
            f"| p50 | {chat['off_p50']:.1f} ms | {chat['on_p50']:.1f} ms | "
            f"{chat['added_p50']:+.1f} ms | ≤ {CHAT_TARGET:g} ms | "
            f"{verdict(chat['added_p50'] <= CHAT_TARGET)} |",
            f"| p95 | {chat['off_p95']:.1f} ms | {chat['on_p95']:.1f} ms | "
            f"{chat['added_p95']:+.1f} ms | - | - |",
        ]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    convs, questions_all, _ = load_locomo(args.data)
    questions = [q.question for q in questions_all]
    random.Random(1).shuffle(questions)
    questions = questions[: args.queries]
    sizes = [10_000] if args.quick else [10_000, 100_000]
    settings = RetrievalSettings()
    out: dict[str, Any] = {
        "machine": machine(),
        "settings": dataclasses.asdict(settings),
        "queries": len(questions),
        "latency": [],
        "quantised": [],
        "ingest": [],
        "build_seconds": {},
    }
    cached = DiskCachedEmbedder(FastEmbedEmbedder(DEFAULT_MODEL, threads=2), args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="engram-bench-") as tmp:
        db = Path(tmp) / "bench.db"
        stored = 0
        for size in sizes:  # the 10k namespace is measured alone, the 100k one beside it
            seconds = await build(db, size, cached, convs)
            stored += size
            out["build_seconds"][f"u{size}"] = seconds
            print(f"stored {size} turns in {seconds:.0f} s", file=sys.stderr)
            auto = "quantized" if size > QUANTIZED_ABOVE else "exact"
            for mode in ("exact", "quantized"):
                row = await search_latency(db, f"u{size}", mode, questions, 1, settings)
                row.update(size=size, db_turns=stored, mode=mode, default_plan=mode == auto)
                out["latency"].append(row)
                print(f"latency {size} {mode}: {row['p50']:.1f} ms", file=sys.stderr)
            recall = await quantised_recall(
                db, f"u{size}", questions[: args.recall_queries], cached, settings
            )
            out["quantised"].append({"size": size, "recall": recall})
        for threads in (1, 2):
            row = await ingest(db, convs, args.ingest_turns, threads, batch=256)
            out["ingest"].append(row)
            print(f"ingest {threads} threads: {row['turns_per_s']:.0f}/s", file=sys.stderr)
        if not args.no_chat:
            chat_db = Path(tmp) / "chat.db"
            async with Store(chat_db) as store:
                await store.ensure_embedding_model(cached.name)
                await import_turns(store, cached, synthetic_records(convs, 10_000, "bench"), 2048)
            out["chat"] = await chat_latency(
                chat_db, questions, args.chat_requests, args.gap_ms / 1000, Path(tmp) / "serve.log"
            )
    await cached.aclose()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--quick", action="store_true", help="10k only, fewer requests")
    parser.add_argument("--queries", type=int, default=600, help="timed searches per cell")
    parser.add_argument("--recall-queries", type=int, default=300)
    parser.add_argument("--ingest-turns", type=int, default=2000)
    parser.add_argument("--chat-requests", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=100.0, help="pause between requests")
    parser.add_argument("--no-chat", action="store_true", help="skip (c)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="embedding cache")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.queries, args.recall_queries = 200, 100
        args.ingest_turns, args.chat_requests = 500, 100
    if not args.data.is_file():
        parser.error(f"no LoCoMo data at {args.data} (see --data)")
    out = asyncio.run(run(args))
    print("\n".join(machine_lines(out["machine"])))
    s = out["settings"]
    print(
        f"Settings: top_k {s['top_k']}, candidates {s['candidates']}, rrf_k {s['rrf_k']:g}, "
        f"weights fts {s['fts_weight']:g} / vec {s['vec_weight']:g}; {out['queries']} "
        "LoCoMo questions per latency cell; embedder threads 1 (the default) for searches.\n"
    )
    print(report(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
