"""The one vector type that embedder, store and fusion share, and its few helpers (pure).

A vector is a 1-D, C-contiguous ``numpy.float32`` array. Embeddings from the embedder are
L2-normalised, so cosine similarity is a dot product; the helpers here do not assume it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

Vector: TypeAlias = npt.NDArray[np.float32]


def as_vector(values: Iterable[float] | npt.ArrayLike) -> Vector:
    """``values`` as a 1-D contiguous float32 array (no copy when it already is one)."""
    arr = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    if arr.ndim != 1:
        raise ValueError(f"a vector must be 1-D, got shape {arr.shape}")
    return arr


def normalize(vec: Vector) -> Vector:
    """``vec`` scaled to unit length (a zero vector is returned unchanged)."""
    norm = float(np.linalg.norm(vec))
    if norm == 0.0:
        return vec
    return (vec / norm).astype(np.float32, copy=False)


def cosine(a: Vector, b: Vector) -> float:
    """Cosine similarity in [-1, 1]; 0.0 when either vector is zero."""
    na = float(np.linalg.norm(a))
    nb = float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b)) / (na * nb)


def to_blob(vec: Vector) -> bytes:
    """The little-endian float32 bytes that sqlite-vec reads as a ``float[N]`` vector."""
    return as_vector(vec).astype("<f4", copy=False).tobytes()


def from_blob(blob: bytes) -> Vector:
    """The inverse of :func:`to_blob`."""
    return np.frombuffer(blob, dtype="<f4").astype(np.float32)
