"""Measure the store's search paths at scale: vec0 KNN (exact and bit-quantised), FTS5, hybrid.

One database holds two user namespaces, "small" and "big" (sizes from --sizes), so the numbers
also show that a KNN scans only its own user's partition. Vectors are synthetic (with a strong
shared direction: a worst case for sign-bit quantisation, so read their recall as a floor) unless
--vectors names an .npy of real embeddings (rows are then mixed pairwise with noise to reach the
size); --query-vectors an .npy of real query embeddings. Texts are Zipf-distributed words (a
pessimistic case for FTS: common words match most rows) unless --texts names a file of real ones,
one per line, cycled to the size; --query-texts then gives the queries (line i goes with query
vector i).

    .venv/bin/python -m bench.store --sizes 10000 100000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from proxy.search.fts_query import to_match
from proxy.search.fusion import rrf
from proxy.store import NewTurn, Store

DIM = 384
Matrix = npt.NDArray[np.float32]


def _unit_rows(x: Matrix) -> Matrix:
    out: Matrix = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def make_vectors(n: int, rng: np.random.Generator, base: Matrix | None) -> Matrix:
    if base is None:
        # Anisotropic like sentence embeddings: a shared direction, topics, noise.
        mean = rng.normal(size=DIM)
        topics = rng.normal(size=(256, DIM))
        x = 0.5 * mean / np.linalg.norm(mean) + topics[rng.integers(0, 256, n)] / np.sqrt(DIM)
        x = x + rng.normal(size=(n, DIM)) / np.sqrt(DIM) * 0.8
        return _unit_rows(x.astype(np.float32))
    i = rng.integers(0, len(base), n)
    j = rng.integers(0, len(base), n)
    noise = rng.normal(size=(n, DIM)).astype(np.float32) / np.sqrt(DIM)
    return _unit_rows(base[i] + 0.5 * base[j] + 0.3 * noise)


def make_texts(n: int, rng: np.random.Generator, source: list[str] | None) -> list[str]:
    if source:
        return [source[i % len(source)] for i in range(n)]
    vocab = [f"w{i}" for i in range(20_000)]
    ranks = np.minimum(rng.zipf(1.3, size=(n, 25)) - 1, len(vocab) - 1)
    return [" ".join(vocab[r] for r in row) for row in ranks]


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1000


async def fill(store: Store, user: str, vectors: Matrix, texts: list[str]) -> float:
    await store.get_or_create_session(user, f"{user}-s")
    t0 = time.perf_counter()
    step = 2000
    for start in range(0, len(vectors), step):
        turns = [
            NewTurn(start + i, "user", texts[start + i])
            for i in range(min(step, len(vectors) - start))
        ]
        await store.add_turns(f"{user}-s", user, turns, list(vectors[start : start + len(turns)]))
    return time.perf_counter() - t0


async def bench_user(
    store: Store,
    user: str,
    queries: Matrix,
    query_texts: list[str] | None,
    texts: list[str],
    rng: np.random.Generator,
) -> None:
    exact_t: list[float] = []
    quant_t: list[float] = []
    fts_t: list[float] = []
    hybrid_t: list[float] = []
    recall: list[float] = []
    for n_query, q in enumerate(queries):
        t0 = time.perf_counter()
        exact = await store.vec_search(user, q, 10, mode="exact")
        exact_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        quant = await store.vec_search(user, q, 10, mode="quantized")
        quant_t.append(time.perf_counter() - t0)
        recall.append(len({i for i, _ in exact} & {i for i, _ in quant}) / 10)
        if query_texts:
            match = to_match(query_texts[n_query % len(query_texts)])
        else:
            match = to_match(" ".join(texts[int(rng.integers(0, len(texts)))].split()[:6]))
        if match is None:
            continue
        t0 = time.perf_counter()
        await store.fts_search(user, match, 20)
        fts_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fts_hits, vec_hits = await asyncio.gather(
            store.fts_search(user, match, 20), store.vec_search(user, q, 20)
        )
        rrf({"fts": [i for i, _ in fts_hits], "vec": [i for i, _ in vec_hits]})
        hybrid_t.append(time.perf_counter() - t0)
    n = len(texts)
    for name, values in [
        ("vec exact k=10", exact_t),
        ("vec quantised k=10", quant_t),
        ("fts k=20", fts_t),
        ("hybrid (auto)", hybrid_t),
    ]:
        print(
            f"  {user:>5} n={n:>7}  {name:<20} p50 {pct(values, 0.5):6.1f} ms"
            f"  p90 {pct(values, 0.9):6.1f} ms"
        )
    print(f"  {user:>5} n={n:>7}  quantised recall@10 vs exact: {statistics.mean(recall):.3f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs=2, default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--vectors", type=Path, help=".npy of real passage embeddings")
    parser.add_argument("--query-vectors", type=Path, help=".npy of real query embeddings")
    parser.add_argument("--texts", type=Path, help="file of real texts, one per line")
    parser.add_argument("--query-texts", type=Path, help="file of query texts, one per line")
    parser.add_argument("--db", type=Path, help="reuse or create this database file")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    base = np.load(args.vectors).astype(np.float32) if args.vectors else None
    source = args.texts.read_text().splitlines() if args.texts else None
    query_texts = args.query_texts.read_text().splitlines() if args.query_texts else None
    with tempfile.TemporaryDirectory() as tmp:
        path = args.db or Path(tmp) / "bench.db"
        fresh = not path.exists()
        async with Store(path) as store:
            data = {}
            for user, n in zip(("small", "big"), args.sizes, strict=True):
                vectors = make_vectors(n, rng, base)
                texts = make_texts(n, rng, source)
                data[user] = texts
                if fresh:
                    took = await fill(store, user, vectors, texts)
                    print(f"inserted {n} turns for {user!r} in {took:.1f} s")
            if args.query_vectors:
                queries = np.load(args.query_vectors).astype(np.float32)[: args.queries]
            else:
                queries = make_vectors(args.queries, rng, base)
            for user in ("small", "big"):
                await bench_user(store, user, queries, query_texts, data[user], rng)


if __name__ == "__main__":
    asyncio.run(main())
