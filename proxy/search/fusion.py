"""Rank fusion and diversification for retrieval (pure functions, no I/O).

- :func:`rrf` — Reciprocal Rank Fusion: ``S(d) = Σ_m w_m / (k + rank_m(d))`` over the ranked
  lists of each retrieval path (ranks 1-based), k = 60 by default (Cormack et al., SIGIR 2009).
- :func:`mmr` — Maximal Marginal Relevance: greedily pick the candidate maximising
  ``λ·rel(d) - (1-λ)·max_{s ∈ selected} sim(d, s)``, where ``rel`` is the cosine to the query
  unless relevance scores are given.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from proxy.vectors import Vector

Id = TypeVar("Id", bound=Hashable)

DEFAULT_K = 60.0


class Fused(NamedTuple, Generic[Id]):
    """One fused result: its id, RRF score, and its 1-based rank in each path (None: absent)."""

    id: Id
    score: float
    ranks: dict[str, int | None]


def rrf(
    rankings: Mapping[str, Sequence[Id]],
    k: float = DEFAULT_K,
    weights: Mapping[str, float] | None = None,
) -> list[Fused[Id]]:
    """Fuse ranked lists (best first, one per path name) into one list, best first.

    A path missing from ``weights`` weighs 1.0. An id repeated within one list counts at its
    first (best) rank. Ties go to the better best rank in any path, then to the earlier one
    seen (paths in mapping order).
    """
    if k < 0:
        raise ValueError("k must be non-negative")
    paths = list(rankings)
    scores: dict[Id, float] = {}
    ranks: dict[Id, dict[str, int | None]] = {}
    for path in paths:
        weight = 1.0 if weights is None else weights.get(path, 1.0)
        for rank, item in enumerate(rankings[path], start=1):
            item_ranks = ranks.get(item)
            if item_ranks is None:
                item_ranks = ranks[item] = dict.fromkeys(paths)
                scores[item] = 0.0
            if item_ranks[path] is not None:
                continue
            item_ranks[path] = rank
            scores[item] += weight / (k + rank)
    order = {item: i for i, item in enumerate(ranks)}

    def best_rank(item: Id) -> int:
        return min(r for r in ranks[item].values() if r is not None)

    fused = sorted(ranks, key=lambda item: (-scores[item], best_rank(item), order[item]))
    return [Fused(item, scores[item], ranks[item]) for item in fused]


def mmr(
    candidates: Sequence[Id],
    query_vec: Vector,
    vectors: Mapping[Id, Vector],
    lam: float = 0.5,
    top_k: int = 10,
    relevance: Mapping[Id, float] | None = None,
) -> list[Id]:
    """Re-rank ``candidates`` for relevance and diversity; returns up to ``top_k`` ids.

    ``rel(d)`` is ``relevance[d]`` when given (e.g. RRF scores scaled to [0, 1]), else the
    cosine of ``vectors[d]`` to ``query_vec``. A candidate with no vector has no similarity to
    anything (and relevance 0 unless given). Ties keep candidate order. ``lam = 1`` is pure
    relevance order; ``lam = 0`` pure diversity.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError("lam must be in [0, 1]")
    unique = list(dict.fromkeys(candidates))
    if top_k <= 0 or not unique:
        return []
    q = _unit(query_vec)
    units = {c: _unit(vectors[c]) for c in unique if c in vectors}
    if relevance is not None:
        rel = {c: float(relevance.get(c, 0.0)) for c in unique}
    else:
        rel = {c: float(units[c] @ q) if c in units else 0.0 for c in unique}
    # max similarity of each remaining candidate to anything selected so far
    redundancy = dict.fromkeys(unique, 0.0)
    selected: list[Id] = []
    remaining = unique
    while remaining and len(selected) < top_k:
        best = max(
            range(len(remaining)),
            key=lambda i: (
                lam * rel[remaining[i]] - (1.0 - lam) * redundancy[remaining[i]],
                -i,
            ),
        )
        chosen = remaining.pop(best)
        selected.append(chosen)
        chosen_vec = units.get(chosen)
        if chosen_vec is None:
            continue
        for c in remaining:
            vec = units.get(c)
            if vec is not None:
                redundancy[c] = max(redundancy[c], float(vec @ chosen_vec))
    return selected


def _unit(vec: Vector) -> Vector:
    arr = np.asarray(vec, dtype=np.float32)
    norm = float(np.linalg.norm(arr))
    return arr / norm if norm > 0.0 else arr
