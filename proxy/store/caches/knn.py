"""The exact KNN over a user's vectors in memory (:mod:`proxy.store.caches.vec_cache`): the rows,
distances and order vec0's exact plan returns, computed in numpy. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from proxy.store.caches.scope import Scoped, in_scope
from proxy.vectors import Vector, as_vector


class Matrix(Scoped, Protocol):
    """A user's vector rows: the first ``n`` of ``matrix`` (one vector a row) are live."""

    @property
    def n(self) -> int: ...
    @property
    def matrix(self) -> npt.NDArray[np.float32]: ...
    @property
    def norms(self) -> npt.NDArray[np.float32]: ...


def knn(
    rows: Matrix,
    vec: Vector,
    limit: int,
    *,
    session_ids: Sequence[str] | None,
    exclude_ids: Sequence[int],
    exclude_sessions: Sequence[str],
    exclude_roles: Sequence[str],
) -> list[tuple[int, float]]:
    """(turn id, cosine distance) nearest first, as vec0's exact KNN with the same filters."""
    n = rows.n
    if limit <= 0 or n == 0:
        return []
    q = as_vector(vec)
    if q.shape[0] != rows.matrix.shape[1]:
        raise ValueError(f"vectors must have {rows.matrix.shape[1]} dimensions")
    live = np.flatnonzero(
        in_scope(rows, n, session_ids, exclude_ids, exclude_sessions, exclude_roles)
    )
    if live.size == 0:
        return []
    # einsum, not BLAS: a threaded BLAS matrix-vector product measured 4-8 ms on a busy 2-core
    # machine, einsum's own loop 0.6 ms.
    # A few rows in scope (a sub-agent's session) are gathered first; otherwise every row's
    # product is taken and the live ones picked: gathering most of a 100,000-row matrix copied
    # it (87 ms), the whole product then the pick is 18 ms, with the same values.
    if live.size * GATHER_BELOW < n:
        dots = np.einsum("ij,j->i", rows.matrix[live], q)
    else:
        dots = np.einsum("ij,j->i", rows.matrix[:n], q)
        if live.size < n:
            dots = dots[live]
    with np.errstate(divide="ignore", invalid="ignore"):
        rough = 1.0 - dots / (rows.norms[live] * np.float32(np.sqrt(np.dot(q, q))))
    rough = np.nan_to_num(rough, nan=1.0, posinf=1.0, neginf=1.0)
    k = min(limit, live.size)
    if k < live.size:
        cut = np.partition(rough, k - 1)[k - 1]
        near = np.flatnonzero(rough <= cut + ROUGH_MARGIN)
    else:
        near = np.arange(live.size)
    exact = vec0_cosine_distance(rows.matrix[live[near]], q)
    ids = rows.ids[live[near]]
    order = np.lexsort((ids, exact))[:k]
    return [(int(ids[i]), float(exact[i])) for i in order]


GATHER_BELOW = 4
"""Rows in scope under 1/GATHER_BELOW of the user's: their product is taken on a copy of them."""
ROUGH_MARGIN = 1e-4
"""The fast product picks every row within this of the k-th distance; those are then measured
as vec0 measures (float32 sums in order), so the order and the distances are vec0's."""


def vec0_cosine_distance(
    matrix: npt.NDArray[np.float32], q: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """sqlite-vec's ``distance_cosine_float`` for each row: float32 sums of products taken in
    order, then ``1 - dot / (sqrt(|a|^2) * sqrt(|b|^2))`` in double, returned as float32."""
    if len(matrix) == 0:
        return np.zeros(0, np.float32)
    dot = np.cumsum(matrix * q, axis=1, dtype=np.float32)[:, -1].astype(np.float64)
    a = np.cumsum(matrix * matrix, axis=1, dtype=np.float32)[:, -1].astype(np.float64)
    b = float(np.cumsum(q * q, dtype=np.float32)[-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 1.0 - dot / (np.sqrt(a) * np.sqrt(b))
    result: npt.NDArray[np.float32] = out.astype(np.float32)
    return result
