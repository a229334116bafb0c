"""Time the embedder: model load, one query, passages in batches, and one query while the
passages are being embedded (what ``limits.recall_deadline`` must allow for).

.venv/bin/python -m bench.embedder [--model NAME_OR_DIR] [--threads N] [--memory-load load.json]

With ``--memory-load`` (a ``python -m bench.memory_load --json`` result) the query embedding's
time is printed beside the latency memory added there, and the ratio of the two (issue 26:
memory should cost about one embedding on any CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from proxy.search.embedder import DEFAULT_MODEL, DEFAULT_THREADS, FastEmbedEmbedder

SUBJECTS = ["my sister", "the new manager", "our neighbour", "a friend from school", "Grandpa"]
VERBS = ["adopted", "painted", "fixed", "sold", "photographed", "wrote about"]
OBJECTS = ["a rescue dog", "the old boat", "a sunrise over the lake", "the kitchen sink"]


def sentences(n: int) -> list[str]:
    out = []
    for i in range(n):
        s, v, o = (SUBJECTS[i % 5], VERBS[(i // 5) % 6], OBJECTS[(i // 30) % 4])
        out.append(f"Last {['Monday', 'week', 'summer'][i % 3]} {s} {v} {o} (note {i}).")
    return out


def against_load(load: dict[str, Any], query_ms: float) -> str:
    """The memory_load result's added latencies beside the query embedding's time here."""
    lines = [f"memory_load ({load['turns']:,} turns): added latency, one query {query_ms:.1f} ms"]
    for row in load.get("latency", []):
        lines.append(
            f"  c=1 {row['mode']}: +{row['added_p50']:.1f} / +{row['added_p95']:.1f} ms p50 / p95, "
            f"{row['added_p50'] / query_ms:.2f}x the query embedding"
        )
    for row in load.get("throughput", []):
        if row.get("cpu_per_request") is not None and row["mode"] != "off":
            lines.append(
                f"  c={row['c']} {row['mode']}: {row['req_s']:.0f} req/s, CPU "
                f"{row['cpu_per_request']:.1f} ms a request"
            )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passages", type=int, default=640)
    parser.add_argument("--memory-load", type=Path, help="a bench.memory_load --json result")
    args = parser.parse_args()
    emb = FastEmbedEmbedder(args.model, threads=args.threads, batch_size=args.batch, lru_size=0)
    try:
        t0 = time.perf_counter()
        await emb.load()
        print(f"load: {time.perf_counter() - t0:.2f} s ({emb.name}, dim {emb.dim})")
        latencies, cpu = [], 0.0
        for i, text in enumerate(sentences(210)):
            c0, t0 = time.process_time(), time.perf_counter()
            await emb.embed_queries([text])
            if i >= 10:
                latencies.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
        latencies = sorted(latencies)
        p50 = statistics.median(latencies) * 1000
        print(
            f"one query: p50 {p50:.1f} ms, "
            f"p90 {latencies[int(len(latencies) * 0.9)] * 1000:.1f} ms, "
            f"CPU {cpu * 1000 / len(latencies):.1f} ms a query "
            f"(load {'/'.join(f'{x:.2f}' for x in os.getloadavg())})"
        )
        if args.memory_load:
            print(against_load(json.loads(args.memory_load.read_text()), p50))
        texts = sentences(args.passages)
        t0 = time.perf_counter()
        batch = asyncio.create_task(emb.embed_passages(texts))
        beside = []  # queries while the passages are embedded (their own lane since issue 12)
        for i, text in enumerate(sentences(args.passages + 200)[args.passages :]):
            await asyncio.sleep(0.05)
            if batch.done() or i >= 200:
                break
            q0 = time.perf_counter()
            await emb.embed_queries([f"query {i}: {text}"])
            beside.append(time.perf_counter() - q0)
        await batch
        took = time.perf_counter() - t0
        print(
            f"{len(texts)} passages in batches of {args.batch}: "
            f"{took * 1000 / len(texts):.2f} ms per passage"
        )
        if beside:
            beside.sort()
            print(
                f"one query beside them ({len(beside)}): p50 "
                f"{statistics.median(beside) * 1000:.1f} ms, "
                f"p95 {beside[int(len(beside) * 0.95)] * 1000:.1f} ms, "
                f"max {beside[-1] * 1000:.1f} ms"
            )
    finally:
        await emb.aclose()


if __name__ == "__main__":
    asyncio.run(main())
