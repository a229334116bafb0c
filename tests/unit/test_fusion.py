"""RRF and MMR against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from proxy.search.fusion import Fused, mmr, rrf


def test_rrf_two_paths_k60() -> None:
    fused = rrf({"fts": ["a", "b", "c"], "vec": ["b", "d", "a"]})
    # b: 1/62 + 1/61, a: 1/61 + 1/63, d: 1/62, c: 1/63
    assert [f.id for f in fused] == ["b", "a", "d", "c"]
    assert fused[0].score == pytest.approx(0.0325224749, abs=1e-9)
    assert fused[1].score == pytest.approx(0.0322664585, abs=1e-9)
    assert fused[2].score == pytest.approx(1 / 62)
    assert fused[3].score == pytest.approx(1 / 63)
    assert fused[0].ranks == {"fts": 2, "vec": 1}
    assert fused[1].ranks == {"fts": 1, "vec": 3}
    assert fused[2].ranks == {"fts": None, "vec": 2}
    assert fused[3].ranks == {"fts": 3, "vec": None}
    ident, score, ranks = fused[0]  # a plain tuple too
    assert (ident, ranks) == ("b", {"fts": 2, "vec": 1}) and isinstance(fused[0], Fused)
    assert score == fused[0].score


def test_rrf_weights() -> None:
    fused = rrf({"fts": ["a", "b", "c"], "vec": ["b", "d", "a"]}, weights={"fts": 2.0, "vec": 0.5})
    # a: 2/61 + .5/63 = .0407234; b: 2/62 + .5/61 = .0404548; c: 2/63; d: .5/62
    assert [f.id for f in fused] == ["a", "b", "c", "d"]
    assert fused[0].score == pytest.approx(2 / 61 + 0.5 / 63)
    assert fused[3].score == pytest.approx(0.5 / 62)


def test_rrf_missing_weight_is_one_and_zero_weight_keeps_ranks() -> None:
    fused = rrf({"fts": ["a"], "vec": ["b"]}, weights={"fts": 0.0})
    assert [(f.id, f.score) for f in fused] == [("b", pytest.approx(1 / 61)), ("a", 0.0)]
    assert fused[1].ranks == {"fts": 1, "vec": None}


def test_rrf_ties_duplicates_and_k() -> None:
    tied = rrf({"fts": ["x"], "vec": ["y"]})
    assert [f.id for f in tied] == ["x", "y"] and tied[0].score == tied[1].score
    dup = rrf({"fts": ["a", "a", "b"]})
    assert dup[0].ranks == {"fts": 1} and dup[1].ranks == {"fts": 3}
    assert dup[0].score == pytest.approx(1 / 61)
    assert rrf({"p": [7]}, k=0)[0].score == 1.0
    assert rrf({}) == [] and rrf({"fts": [], "vec": []}) == []
    with pytest.raises(ValueError):
        rrf({"p": [1]}, k=-1)


def _v(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


# q = (1, 0); A = q (sim 1), B at cos 0.9, C at cos 0.6 on the other side.
# A·B = 0.9, A·C = 0.6, B·C = 0.54 - 0.8·0.43589 = 0.19129
Q = _v(1.0, 0.0)
VECS = {"A": _v(1.0, 0.0), "B": _v(0.9, math.sqrt(1 - 0.81)), "C": _v(0.6, -0.8)}


def test_mmr_relevance_heavy() -> None:
    # λ=.7: A (.7) first; then B .63-.3·.9=.36 beats C .42-.3·.6=.24
    assert mmr(["C", "B", "A"], Q, VECS, lam=0.7, top_k=3) == ["A", "B", "C"]


def test_mmr_diversity_heavy() -> None:
    # λ=.3: A (.3) first; then C .18-.7·.6=-.24 beats B .27-.7·.9=-.36
    assert mmr(["C", "B", "A"], Q, VECS, lam=0.3, top_k=3) == ["A", "C", "B"]


def test_mmr_limits_and_edges() -> None:
    assert mmr(["A", "B", "C"], Q, VECS, lam=0.3, top_k=2) == ["A", "C"]
    assert mmr(["A", "A", "B"], Q, VECS, lam=1.0, top_k=5) == ["A", "B"]
    assert mmr([], Q, VECS) == [] and mmr(["A"], Q, VECS, top_k=0) == []
    # λ=1: pure relevance order; unnormalised vectors are normalised first
    assert mmr(["C", "B", "A"], Q * 5, {k: v * 3 for k, v in VECS.items()}, lam=1.0) == [
        "A",
        "B",
        "C",
    ]
    with pytest.raises(ValueError):
        mmr(["A"], Q, VECS, lam=1.5)


def test_mmr_with_given_relevance_and_missing_vectors() -> None:
    rel = {"A": 0.2, "B": 1.0, "C": 0.5, "D": 0.9}
    # λ=1 ignores similarity: pure relevance order, D has no vector but has relevance
    assert mmr(["A", "B", "C", "D"], Q, VECS, lam=1.0, relevance=rel) == ["B", "D", "C", "A"]
    # λ=.5: B (.5); D .45 - 0 (no vector, no redundancy); then C .25-.5·.19129=.1544
    # beats A .1-.5·.9=-.35
    assert mmr(["A", "B", "C", "D"], Q, VECS, lam=0.5, relevance=rel) == ["B", "D", "C", "A"]
    # without relevance, a vector-less candidate has relevance 0
    assert mmr(["D", "A"], Q, VECS, lam=1.0) == ["A", "D"]
