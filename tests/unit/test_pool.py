"""EmbedderPool: several sessions of one model used as one (proxy/search/pool.py)."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.search.embedder import create_embedder
from proxy.search.pool import EmbedderPool


@pytest.mark.asyncio
async def test_a_pool_gives_each_text_its_own_vector_in_order() -> None:
    texts = [f"text number {i} " + "word " * (i % 7) for i in range(53)] + ["", "x"]
    alone = create_embedder("hash")
    pool = EmbedderPool([create_embedder("hash"), create_embedder("hash"), create_embedder("hash")])
    try:
        want = await alone.embed_passages(texts)
        got = await pool.embed_passages(texts)
        assert len(got) == len(texts)
        for a, b in zip(want, got, strict=True):
            assert np.array_equal(a, b)
        (one,) = await pool.embed_passages([texts[0]])  # one text: the first member
        assert np.array_equal(one, want[0])
        assert pool.name == alone.name and pool.dim == alone.dim
    finally:
        await alone.aclose()
        await pool.aclose()


def test_a_pool_is_of_one_model() -> None:
    with pytest.raises(ValueError, match="same model"):
        EmbedderPool([create_embedder("hash"), create_embedder("hash-768")])
    with pytest.raises(ValueError, match="at least one"):
        EmbedderPool([])
