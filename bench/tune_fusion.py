"""Fit the scored fusion's weights on half of LoCoMo and check them on the other half.

    .venv/bin/python -m bench.tune_fusion [--json out.json] [--split 5] [--model M]

LoCoMo's ten conversations are imported into one database through Engram's own import path
(as ``bench.locomo`` does; the default embedder or ``--model``, vectors cached on disk).
Every question of categories 1-4 is asked once through
:meth:`proxy.search.retrieval.Retriever.search` in hybrid mode with scored fusion, keeping
what it scored (each path's candidates and their features,
:func:`proxy.search.scoring.features`). The weights are then fitted by coordinate ascent on
``R@10 + 0.5 R@5`` over the questions of the first ``--split`` conversations (the tuning half)
only, and every weight set is reported on both halves: RRF's ranking (the old default), the
weights of the current settings, and the fitted ones. Only the held-out half says how well a
weight set generalises; the settings' defaults were fitted this way on the tuning half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    CATEGORIES,
    DEFAULT_CACHE,
    DEFAULT_LOCOMO,
    DiskCachedEmbedder,
    LocomoQuestion,
    load_locomo,
    machine,
    machine_lines,
)
from bench.locomo import load
from proxy.config import RetrievalSettings
from proxy.search.embedder import DEFAULT_MODEL, Embedder, create_embedder
from proxy.search.fusion import rrf
from proxy.search.retrieval import Retriever, Scoring
from proxy.search.scoring import FEATURES, features
from proxy.store import Store

STEPS = (0.4, 0.2, 0.1, 0.05)


class Question:
    """One question's candidates: feature matrix, dia_ids, RRF order, evidence."""

    def __init__(self, q: LocomoQuestion, scored: Scoring, text: str, dia: dict[int, str]):
        cands = scored.candidates
        self.q = q
        self.x = np.array(features(cands, text, scored.rankings.get("vec", ())), dtype=np.float64)
        self.ids = [dia[c.id] for c in cands]
        s = RetrievalSettings()
        weights = {"fts": s.fts_weight, "vec": s.vec_weight}
        self.rrf = [dia[f.id] for f in rrf(scored.rankings, k=s.rrf_k, weights=weights)]

    def top(self, w: np.ndarray, k: int) -> list[str]:
        order = np.argsort(-(self.x @ w), kind="stable")
        return [self.ids[i] for i in order[:k]]


def recall(top: Sequence[str], evidence: set[str], k: int) -> float:
    return len(evidence & set(top[:k])) / len(evidence)


def report(tops: list[list[str]], qs: list[Question]) -> dict[str, float]:
    acc: dict[str, list[float]] = defaultdict(list)
    for top, q in zip(tops, qs, strict=True):
        for k in (5, 10):
            acc[f"R@{k}"].append(recall(top, q.q.evidence, k))
        acc[CATEGORIES[q.q.category]].append(recall(top, q.q.evidence, 10))
    return {name: float(np.mean(v)) for name, v in acc.items()} | {"n": float(len(qs))}


def objective(w: np.ndarray, qs: list[Question]) -> float:
    total = 0.0
    for q in qs:
        top = q.top(w, 10)
        total += recall(top, q.q.evidence, 10) + 0.5 * recall(top, q.q.evidence, 5)
    return total / len(qs)


def fit(qs: list[Question], start: np.ndarray, free: Sequence[int] | None = None) -> np.ndarray:
    """Coordinate ascent: move one weight (of ``free``, default all) by ± step while the
    objective improves."""
    w, best = start.copy(), objective(start, qs)
    for step in STEPS:
        improved = True
        while improved:
            improved = False
            for j in range(len(w)) if free is None else free:
                for d in (step, -step):
                    trial = w.copy()
                    trial[j] += d
                    value = objective(trial, qs)
                    if value > best + 1e-9:
                        w, best, improved = trial, value, True
    return w


def ablation(tune: list[Question], held: list[Question]) -> list[str]:
    """Weights refitted (from BM25 alone) with only some features: added in order, then all but
    one."""
    lines = ["| features | tuning R@5 | tuning R@10 | held-out R@5 | held-out R@10 |"]
    lines.append("|---|---|---|---|---|")
    sets = [("+".join(FEATURES[: i + 1]), FEATURES[: i + 1]) for i in range(len(FEATURES))]
    sets += [(f"all but {x}", tuple(f for f in FEATURES if f != x)) for x in FEATURES[1:]]
    for name, keep in sets:
        start = np.zeros(len(FEATURES))
        start[FEATURES.index("fts")] = 1.0
        w = fit(tune, start, [FEATURES.index(f) for f in keep])
        rt, rh = (report([q.top(w, 10) for q in g], g) for g in (tune, held))
        lines.append(
            f"| {name} | {rt['R@5']:.3f} | {rt['R@10']:.3f} | {rh['R@5']:.3f} | {rh['R@10']:.3f} |"
        )
    return lines


async def collect(
    args: argparse.Namespace, make_embedder: Callable[[], Embedder] | None = None
) -> list[Question]:
    convs, questions, _ = load_locomo(args.data)
    inner = make_embedder() if make_embedder else create_embedder(args.model, threads=args.threads)
    embedder = DiskCachedEmbedder(inner, args.cache_dir)
    out: list[Question] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            async with Store(Path(tmp) / "locomo.db") as store:
                dia, _, _, _ = await load(store, embedder, convs, "auto")
                retriever = Retriever(store, embedder, RetrievalSettings(fusion="scored"))
                for q in questions:
                    user = convs[q.conversation].sample_id
                    scored: list[Scoring] = []
                    await retriever.search(user, q.question, 20, scoring=scored)
                    if scored:
                        out.append(Question(q, scored[0], q.question, dia[user]))
    finally:
        await embedder.aclose()
    return out


def row(name: str, half: str, r: dict[str, float]) -> str:
    cats = " | ".join(f"{r.get(c, float('nan')):.3f}" for c in CATEGORIES.values())
    return f"| {name} | {half} ({r['n']:.0f}) | {r['R@5']:.3f} | {r['R@10']:.3f} | {cats} |"


def main(argv: list[str] | None = None, make_embedder: Callable[[], Embedder] | None = None) -> int:
    """``make_embedder``: an embedder other than ``--model``'s (a candidate model, compared
    through the same import, store and fusion)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_LOCOMO)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="embedding model (as [embedder] model takes it)"
    )
    p.add_argument("--split", type=int, default=5, help="conversations in the tuning half")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--ablate",
        action="store_true",
        help="also refit with the features added one at a time, and with each left out",
    )
    args = p.parse_args(argv)
    m = machine()
    qs = asyncio.run(collect(args, make_embedder))
    tune = [q for q in qs if q.q.conversation < args.split]
    held = [q for q in qs if q.q.conversation >= args.split]
    current = np.array([RetrievalSettings().score_weights()[f] for f in FEATURES])
    fitted = fit(tune, current)
    lines = [*machine_lines(m), ""]
    lines.append(f"Tuning half: conversations 0-{args.split - 1}; held-out: the rest.")
    lines.append("")
    head = "| weights | half (n) | R@5 | R@10 | " + " | ".join(CATEGORIES.values()) + " |"
    lines += [head, "|---|---|---|---|" + "---|" * len(CATEGORIES)]
    results: dict[str, Any] = {"machine": m, "features": list(FEATURES)}
    for name, w in (
        ("RRF (rrf_k 10, vec 0.3)", None),
        ("scored, settings", current),
        ("scored, fitted", fitted),
    ):
        for half, group in (("tuning", tune), ("held-out", held)):
            r = report([q.rrf if w is None else q.top(w, 10) for q in group], group)
            results[f"{name} / {half}"] = r
            lines.append(row(name, half, r))
    if args.ablate:
        lines += ["", *ablation(tune, held)]
    lines += ["", "Fitted on the tuning half (the settings' names):"]
    lines += [f"  score_{f} = {w:.2f}" for f, w in zip(FEATURES, fitted, strict=True)]
    results["fitted"] = dict(zip(FEATURES, fitted.tolist(), strict=True))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
