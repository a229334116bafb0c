"""Scored fusion over columns (what a search builds) against the same over Candidate objects:
the same features, order, scores and ranks; results made only as they are read."""

from __future__ import annotations

import itertools
import random

import numpy as np

from proxy.config import RetrievalSettings
from proxy.search.scoring import (
    Candidate,
    Columns,
    feature_matrix,
    scored_fusion,
    scored_order,
)

WORDS = ["beagle", "Lisbon", "yesterday", "last week", "in May 2023", "the sofa", "Caroline"]


def candidates(rng: random.Random, n: int) -> tuple[list[Candidate], dict[str, list[int]]]:
    ids = rng.sample(range(1, 10 * n + 10), n)
    out = []
    for i in ids:
        bm25 = None if rng.random() < 0.4 else -rng.uniform(0.1, 12)
        cosine = None if bm25 is not None and rng.random() < 0.2 else rng.uniform(-0.2, 0.9)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
        out.append(
            Candidate(
                i,
                f"s{rng.randint(0, 4)}",
                rng.randint(0, 30),
                rng.choice([None, "Caroline", "Mel", "user"]),
                len(text),
                bm25,
                cosine,
                text,
                rng.choice([None, 1_684_000_000.0 + rng.randint(0, 10_000_000)]),
            )
        )
    fts = sorted((c for c in out if c.bm25 is not None), key=lambda c: (c.bm25, c.id))
    vec = sorted(
        (c for c in out if c.cosine is not None and rng.random() < 0.8),
        key=lambda c: (-(c.cosine or 0.0), c.id),
    )
    return out, {"fts": [c.id for c in fts], "vec": [c.id for c in vec]}


def test_columns_give_what_candidates_give() -> None:
    rng = random.Random(26)
    weights = RetrievalSettings().score_weights()
    queries = ["When did Caroline go to Lisbon?", "what about the beagle", "May 2023 trip"]
    for n, query in itertools.product((1, 2, 7, 40, 120), queries):
        cands, ranks = candidates(rng, n)
        cols = Columns.of(cands)
        assert cols.candidates() == cands
        now = 1_700_000_000.0
        a = feature_matrix(cands, query, ranks["vec"], now)
        b = feature_matrix(cols, query, ranks["vec"], now)
        assert np.array_equal(a, b)
        listed = scored_fusion(cands, query, ranks, weights, now)
        assert list(scored_order(cols, query, ranks, weights, now)) == listed
        assert scored_fusion(cols, query, ranks, weights, now) == listed


def test_results_are_made_as_they_are_read() -> None:
    cands, ranks = candidates(random.Random(3), 50)
    weights = RetrievalSettings().score_weights()
    order = scored_order(Columns.of(cands), "the beagle", ranks, weights)
    first = list(itertools.islice(order, 5))
    assert first == scored_fusion(cands, "the beagle", ranks, weights)[:5]
    assert list(scored_order([], "x", ranks, weights)) == []
