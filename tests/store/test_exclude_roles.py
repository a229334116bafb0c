"""Leaving roles out of a search (recall leaves tool outputs out): inside the SQL, so the turns
left out take no candidate places and ``k`` stays full."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from proxy.config import RetrievalSettings
from proxy.search.embedder import HashEmbedder
from proxy.search.retrieval import Retriever
from proxy.store import NewTurn, Store
from proxy.store.sqlite.migrations import EMBED_DIM

pytestmark = pytest.mark.asyncio

TOOL_ROLES = ["tool", "function"]


@pytest_asyncio.fixture
async def retriever(store_target: str | Path) -> AsyncIterator[Retriever]:
    embedder = HashEmbedder()
    async with Store(store_target) as store:
        await store.get_or_create_session("u", "s")
        texts = [
            *(("tool", "beagle puppy beagle puppy kennel listing") for _ in range(6)),
            ("function", "beagle puppy beagle puppy price list"),
            ("user", "we adopted a beagle puppy"),
            ("assistant", "a beagle is a fine dog"),
        ]
        turns = [NewTurn(i, role, text) for i, (role, text) in enumerate(texts)]
        vectors = await embedder.embed_passages([t for _, t in texts])
        await store.add_turns("s", "u", turns, vectors)
        yield Retriever(store, embedder, RetrievalSettings(candidates=2))
    await embedder.aclose()


@pytest.mark.parametrize("mode", ["hybrid", "fts", "vec"])
async def test_roles_left_out_take_no_candidate_places(retriever: Retriever, mode: str) -> None:
    hits = await retriever.search("u", "beagle puppy", 2, mode=mode, exclude_roles=TOOL_ROLES)
    # Seven tool outputs match better; filtering after two candidates a path would leave none.
    assert len(hits) == 2 and {h.turn.role for h in hits} == {"user", "assistant"}
    everything = await retriever.search("u", "beagle puppy", 9, mode=mode)
    assert {"tool", "function"} <= {h.turn.role for h in everything}  # the default: all roles


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v)).astype(np.float32)


@pytest.mark.parametrize("vec_mode", ["exact", "quantized"])
async def test_vector_search_asks_for_more_rows_until_k_others(
    store_target: str | Path, vec_mode: str
) -> None:
    rng = np.random.default_rng(7)
    query = unit(rng.standard_normal(EMBED_DIM))
    # 300 tool outputs right by the query (more than the quantised plan's first 100), then 3
    # user turns further off.
    near = [unit(query + 0.05 * rng.standard_normal(EMBED_DIM)) for _ in range(300)]
    far = [unit(query + 0.6 * rng.standard_normal(EMBED_DIM)) for _ in range(3)]
    async with Store(store_target, vec_mode=vec_mode) as store:  # type: ignore[arg-type]
        await store.get_or_create_session("u", "s")
        turns = [NewTurn(i, "tool", f"output {i}") for i in range(300)]
        turns += [NewTurn(300 + i, "user", f"note {i}") for i in range(3)]
        ids = await store.add_turns("s", "u", turns, [*near, *far])
        hits = await store.vec_search("u", query, 3, exclude_roles=TOOL_ROLES)
        assert sorted(i for i, _ in hits) == sorted(ids[300:])
        assert [d for _, d in hits] == sorted(d for _, d in hits)
        plain = await store.vec_search("u", query, 3)
        assert all(i in ids[:300] for i, _ in plain)
        fts = await store.fts_search("u", '"output" OR "note"', 5, exclude_roles=TOOL_ROLES)
        assert sorted(i for i, _ in fts) == sorted(ids[300:])
