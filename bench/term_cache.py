"""FTS5's BM25 against the same ranking in memory (``proxy.store.term_cache``), in process.

    .venv/bin/python -m bench.term_cache [--turns 10000] [--questions 300]

The database is ``bench.memory_load``'s (``N`` LoCoMo-synthesised turns of one user, built once
and kept in the cache folder). Over LoCoMo questions (the words a search sends: stop words out,
``proxy.search.fts_query``), each timed alone on one thread: FTS5's ``bm25()`` query for the
best 50 (``proxy.store.search.fts_search``, as the store runs it when the user is not held) and
:meth:`TermIndex.rank` for the same 50. Also: how long loading the user takes, the memory it
holds, and how often the two agree on the top 10 (they differ on purpose: per-user statistics,
and FTS5's totals still count rows it deleted; see the module docstring).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import numpy as np

from bench.common import DEFAULT_CACHE, DEFAULT_LOCOMO, load_locomo, machine, machine_lines, pct
from bench.memory_load import USER, cached_db
from proxy.search.fts_query import match_of, query_words
from proxy.store import search
from proxy.store.db import connect
from proxy.store.term_cache import TermCache
from proxy.store.term_index import terms_of


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_LOCOMO)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--turns", type=int, default=10_000)
    p.add_argument("--questions", type=int, default=300)
    args = p.parse_args()
    convs, questions, _ = load_locomo(args.data)
    db = asyncio.run(cached_db(args.turns, args.cache_dir, convs))
    texts = [q.question for q in questions]
    random.Random(3).shuffle(texts)
    matches = [m for m in (match_of(query_words(t)) for t in texts[: args.questions]) if m]
    conn = connect(db, readonly=True)
    cache = TermCache()
    t0 = time.perf_counter()
    cache.load(conn, USER)
    load_s = time.perf_counter() - t0
    index = cache._users[USER]
    keep = np.ones(index.n, np.bool_)
    fts5: list[float] = []
    memory: list[float] = []
    agree: list[float] = []
    for match in matches:
        t1 = time.perf_counter()
        a = search.fts_search(conn, USER, match, 50, session_ids=None, exclude_ids=())
        t2 = time.perf_counter()
        terms = terms_of(match)
        assert terms is not None
        b = index.rank(terms, search.FTS_WEIGHTS, keep, 50)
        t3 = time.perf_counter()
        fts5.append(t2 - t1)
        memory.append(t3 - t2)
        top = {i for i, _ in a[:10]}
        agree.append(len(top & {i for i, _ in b[:10]}) / max(1, len(top)))
    conn.close()
    print("\n".join(machine_lines(machine())))
    print(f"{args.turns:,} turns of one user, {len(matches)} LoCoMo questions, best 50 each\n")
    print("| ranking | p50 | p95 |\n|---|---|---|")
    print(f"| FTS5 bm25() | {pct(fts5, 50):.2f} ms | {pct(fts5, 95):.2f} ms |")
    print(f"| in memory (terms_of + rank) | {pct(memory, 50):.2f} ms | {pct(memory, 95):.2f} ms |")
    print(
        f"\nload {load_s:.2f} s, {index.nbytes / 1e6:.1f} MB held; "
        f"top 10 shared with FTS5's: {float(np.mean(agree)):.3f} on average"
    )


if __name__ == "__main__":
    main()
