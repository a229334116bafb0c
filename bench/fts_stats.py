"""What per-user FTS statistics cost: the common-word cut-off and the FTS5 path, per user, in
one database shared by a big and a small namespace.

    .venv/bin/python -m bench.fts_stats [--db PATH] [--sizes 100000 10000] [--queries 300]

The database holds LoCoMo-synthesised namespaces (``bench.common.synthetic_records``; no
vectors: only the FTS5 path is measured) of the given sizes, plus a tiny one of 60 turns on other
topics. For each namespace it times, over LoCoMo's questions: the cut-off's look-up
(``Retriever._uncommon``: which words to leave out), the FTS5 search with the words kept, and
the two together; and it counts the words left out. Run it on two trees (``PYTHONPATH``) to
compare them; the database can be reused (``--db``) since it does not depend on the tree's code
beyond the schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_LOCOMO, import_turns, load_locomo, machine, pct, synthetic_records
from proxy.config import RetrievalSettings
from proxy.search.fts_query import STOP_WORDS, match_of, query_words
from proxy.search.retrieval import Retriever
from proxy.store import Store

TINY = [
    "I repaired the sailing boat's rudder with marine epoxy yesterday.",
    "My sister Caroline teaches pottery at the community centre on Tuesdays.",
    "The harbour master said the spring tides come early this year.",
    "We planned a trip to see the northern lights in Tromso.",
    "Caroline asked whether the kiln can reach cone six.",
]


async def build(path: Path, sizes: list[int], data: Path) -> None:
    convs, _, _ = load_locomo(data)
    async with Store(path) as store:
        for n in sizes:
            await import_turns(store, None, synthetic_records(convs, n, f"u{n}"), batch=4096)
        tiny = [
            {"user": "tiny", "session": f"t{i // 10}", "role": "user", "content": TINY[i % 5]}
            for i in range(60)
        ]
        await import_turns(store, None, tiny, batch=256)


async def uncommon(retriever: Retriever, user: str, words: list[str]) -> list[str]:
    """The cut-off's words, on this tree (per user) or on one from before it was per user."""
    try:
        return await retriever._uncommon(user, words)
    except TypeError:  # before: the share of every user's turns
        return await retriever._uncommon(words)  # type: ignore[call-arg,arg-type]


async def measure(path: Path, users: list[str], questions: list[str]) -> dict[str, Any]:
    settings = RetrievalSettings()
    out: dict[str, Any] = {}
    async with Store(path) as store:
        retriever = Retriever(store, None, settings)
        n = max(settings.candidates, settings.top_k)
        for user in users:
            for q in questions[:20]:  # warm caches and the plan choice
                await retriever.search(user, q, settings.top_k, mode="fts")
            cut, fts, both, dropped = [], [], [], 0
            for q in questions:
                words = query_words(q, stop_words=STOP_WORDS)
                t0 = time.perf_counter()
                kept = await uncommon(retriever, user, words)
                t1 = time.perf_counter()
                match = match_of(kept)
                if match is not None:
                    await store.fts_search(user, match, n)
                t2 = time.perf_counter()
                cut.append(t1 - t0)
                fts.append(t2 - t1)
                both.append(t2 - t0)
                dropped += len(words) - len(kept)
            out[user] = {
                "cutoff_ms": {"p50": pct(cut, 50), "p95": pct(cut, 95)},
                "fts_ms": {"p50": pct(fts, 50), "p95": pct(fts, 95)},
                "total_ms": {
                    "p50": pct(both, 50),
                    "p95": pct(both, 95),
                    "mean": 1e3 * statistics.fmean(both),
                },
                "words_dropped_per_query": dropped / len(questions),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=Path("/tmp/engram-fts-stats.db"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 10_000])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.db.exists():
        t0 = time.perf_counter()
        asyncio.run(build(args.db, args.sizes, args.data))
        print(f"built {args.db} in {time.perf_counter() - t0:.0f} s")
    _, qs, _ = load_locomo(args.data)
    questions = [q.question for q in qs][: args.queries]
    users = [*(f"u{n}" for n in args.sizes), "tiny"]
    result = {"machine": machine(), "results": asyncio.run(measure(args.db, users, questions))}
    for user, r in result["results"].items():
        print(
            f"{user:>8}: cut-off {r['cutoff_ms']['p50']:.2f} / {r['cutoff_ms']['p95']:.2f} ms, "
            f"FTS5 {r['fts_ms']['p50']:.2f} / {r['fts_ms']['p95']:.2f} ms, "
            f"both {r['total_ms']['p50']:.2f} / {r['total_ms']['p95']:.2f} ms (p50 / p95), "
            f"{r['words_dropped_per_query']:.2f} words dropped per query"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
