"""The exact KNN over vectors held in memory (proxy/store/caches/vec_cache.py): the same rows,
distances
and order as vec0's exact plan, with every filter, and still so after each kind of write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from proxy.store import NewTurn, Store
from proxy.store.caches.warm import cache_split
from proxy.store.sqlite import search_sql as search
from proxy.store.sqlite.migrations import EMBED_DIM
from proxy.vectors import Vector

pytestmark = pytest.mark.asyncio

ROLES = ("user", "assistant", "tool")


def unit(rng: np.random.Generator) -> Vector:
    v = rng.standard_normal(EMBED_DIM).astype(np.float32)
    return (v / np.linalg.norm(v)).astype(np.float32)


async def held(store: Store, user: str) -> None:
    """Search until the user's vectors are held (the first search starts the load)."""
    probe = np.ones(EMBED_DIM, np.float32) / np.sqrt(EMBED_DIM)
    for _ in range(500):
        if store.vectors.get(user) is not None:
            return
        await store.vec_search(user, probe.astype(np.float32), 1)
        await asyncio.sleep(0.01)
    raise AssertionError(f"{user}'s vectors were never loaded")


async def both(store: Store, user: str, q: Vector, limit: int, **kw: Any) -> tuple[Any, Any]:
    """(the store's answer, which comes from the cache, vec0's exact answer). On PostgreSQL
    pgvector's distances are doubles of float32 sums in its own order, the cache's sqlite-vec's
    float32 ones: the database's answer carries the cache's distance where the two are within
    1e-6 of each other (the ids and the order must be the same)."""
    assert store.vectors.get(user) is not None
    cached = await store.vec_search(user, q, limit, mode="exact", **kw)
    vec0 = await store.read(
        lambda c: search.vec_search(
            c,
            user,
            q,
            limit,
            session_ids=kw.get("session_ids"),
            exclude_ids=kw.get("exclude_ids", ()),
            quantized=False,
            exclude_sessions=kw.get("exclude_sessions", ()),
            exclude_roles=kw.get("exclude_roles", ()),
        )
    )
    if store.pg:
        return cached, _close_to(vec0, cached)
    return cached, vec0


def _close_to(hits: list[tuple[int, float]], like: list[tuple[int, float]]) -> Any:
    """``hits`` with the distances of ``like`` where the same turn is within 1e-6 of it."""
    return [
        (i, d2 if j == i and abs(d - d2) <= 1e-6 else d)
        for (i, d), (j, d2) in zip(hits, [*like, *[(None, 0.0)] * len(hits)], strict=False)
    ]


@pytest_asyncio.fixture
async def store(store_target: str | Path) -> AsyncIterator[Store]:
    rng = np.random.default_rng(7)
    async with Store(store_target, vec_mode="exact") as st:
        for user in ("u", "other"):
            for s in range(6):
                sid = f"{user}-s{s}"
                await st.get_or_create_session(user, sid, indexed=s != 5)  # s5: unindexed
                turns = [NewTurn(i, ROLES[(i + s) % 3], f"turn {i} of {sid}") for i in range(30)]
                await st.add_turns(sid, user, turns, [unit(rng) for _ in turns])
        await held(st, "u")
        yield st


async def test_same_rows_distances_and_order_as_vec0_with_every_filter(store: Store) -> None:
    rng = np.random.default_rng(1)
    cases: list[dict[str, Any]] = [
        {},
        {"exclude_roles": ["tool"]},
        {"session_ids": ["u-s1", "u-s5"]},
        {"exclude_sessions": ["u-s0", "u-s2"]},
        {"exclude_ids": [1, 2, 3, 40]},
        {"exclude_roles": ["tool", "assistant"], "exclude_sessions": ["u-s3"]},
    ]
    for kw in cases:
        for limit in (1, 10, 50, 500):
            q = unit(rng)
            cached, vec0 = await both(store, "u", q, limit, **kw)
            assert cached == vec0, kw  # ids, distances (bit for bit) and order
            assert cached
    assert store.vectors.loads == 1


async def test_inserts_are_appended_and_found(store: Store) -> None:
    rng = np.random.default_rng(2)
    v = unit(rng)
    (new_id,) = await store.add_turns("u-s0", "u", [NewTurn(30, "user", "fresh")], [v])
    found, vec0 = await both(store, "u", v, 5)
    assert found == vec0 and found[0][0] == new_id
    # a turn archived without a vector, then given one (the indexer's path)
    (late_id,) = await store.add_turns("u-s1", "u", [NewTurn(30, "user", "late")])
    w = unit(rng)
    assert await store.set_vectors([(late_id, w, "h")]) == 1
    found, vec0 = await both(store, "u", w, 5)
    assert found == vec0 and found[0][0] == late_id
    assert store.vectors.loads == 1  # appended, never loaded again


async def test_deletes_and_indexed_flips_are_seen(store: Store) -> None:
    rng = np.random.default_rng(3)
    gone = await store.add_turns("u-s2", "u", [NewTurn(30, "user", "bye")], [v := unit(rng)])
    await store.write(lambda c: c.execute("DELETE FROM turns WHERE id = ?", (gone[0],)))
    await held(store, "u")
    found, vec0 = await both(store, "u", v, 5)
    assert found == vec0 and gone[0] not in [i for i, _ in found]

    q = unit(rng)
    before = await store.vec_search("u", q, 500, session_ids=["u-s4"])
    await store.set_session_indexed("u-s4", False)
    await held(store, "u")
    found, vec0 = await both(store, "u", q, 500)
    assert found == vec0 and not {i for i, _ in before} & {i for i, _ in found}

    assert await store.delete_session("u-s3")
    await held(store, "u")
    found, vec0 = await both(store, "u", q, 500)
    assert found == vec0


async def test_a_replaced_vector_drops_the_user_then_reloads(store: Store) -> None:
    rng = np.random.default_rng(4)
    (turn_id,) = await store.add_turns("u-s0", "u", [NewTurn(31, "user", "x")], [unit(rng)])
    await store.vec_search("u", unit(rng), 5)
    w = unit(rng)
    assert await store.set_vectors([(turn_id, w, "h2")]) == 1
    assert store.vectors.get("u") is None  # replaced in place: no longer trusted
    await held(store, "u")
    found, vec0 = await both(store, "u", w, 3)
    assert found == vec0 and found[0] == (turn_id, pytest.approx(0.0, abs=1e-6))


async def test_other_users_rows_never_come_back(store: Store) -> None:
    await held(store, "other")
    rng = np.random.default_rng(5)
    q = unit(rng)
    mine = {i for i, _ in await store.vec_search("u", q, 1000)}
    theirs = {i for i, _ in await store.vec_search("other", q, 1000)}
    assert mine and theirs and not mine & theirs


async def test_turn_vectors_from_memory_match_the_database(store: Store) -> None:
    from proxy.store.indexing import turn_vectors

    ids = list(range(1, 400, 7))
    held_now = store.vectors.vectors("u", ids)
    assert held_now is not None
    read = await store.read(lambda c: turn_vectors(c, ids, "u"))
    assert held_now.keys() == read.keys() and len(read) > 10
    for i, v in read.items():
        assert np.array_equal(held_now[i], v)
    assert (await store.turn_vectors("u", ids)).keys() == read.keys()
    theirs = await store.read(lambda c: turn_vectors(c, ids, "other"))
    assert theirs and not theirs.keys() & read.keys()


async def test_auto_serves_a_large_user_exactly_from_memory(store_target: str | Path) -> None:
    """Above ``quantized_above`` turns, ``auto`` answers from the vectors held in memory (the
    exact plan, vec0's exact rows and order) once they are loaded, not by the bit vectors."""
    rng = np.random.default_rng(3)
    async with Store(store_target, quantized_above=50) as store:
        await store.get_or_create_session("u", "s")
        turns = [NewTurn(i, "user", f"turn {i}") for i in range(200)]
        await store.add_turns("s", "u", turns, [unit(rng) for _ in turns])
        await held(store, "u")
        for _ in range(5):
            q = unit(rng)
            auto, exact = await both(store, "u", q, 20)
            assert await store.vec_search("u", q, 20) == exact == auto


async def test_a_user_too_large_to_hold_is_never_loaded(store_target: str | Path) -> None:
    """A user whose vectors would not fit in the cache's bytes is searched by vec0 (quantised
    above ``quantized_above``) and never loaded: loading it would only evict it again."""
    rng = np.random.default_rng(4)
    async with Store(store_target, quantized_above=50) as store:
        store.vectors.max_bytes = 100 * EMBED_DIM * 4  # room for far fewer than 200 vectors
        await store.get_or_create_session("u", "s")
        turns = [NewTurn(i, "user", f"turn {i}") for i in range(200)]
        vecs = [unit(rng) for _ in turns]
        ids = await store.add_turns("s", "u", turns, vecs)
        for _ in range(3):
            assert (await store.vec_search("u", vecs[7], 1))[0][0] == ids[7]
            await asyncio.sleep(0.05)
        assert store.vectors.loads == 0 and store.vectors.get("u") is None


async def test_vec_memory_zero_keeps_every_search_in_vec0(store_target: str | Path) -> None:
    """``Store(vec_memory=0)`` (``[memory] cache_mb = 0``): vec0 answers, nothing is loaded."""
    rng = np.random.default_rng(5)
    async with Store(store_target, vec_memory=0) as store:
        await store.get_or_create_session("u", "s")
        turns = [NewTurn(i, "user", f"turn {i}") for i in range(40)]
        vecs = [unit(rng) for _ in turns]
        ids = await store.add_turns("s", "u", turns, vecs)
        for i in range(20):
            assert (await store.vec_search("u", vecs[i], 1))[0][0] == ids[i]
            await asyncio.sleep(0.01)
        assert store.vectors.loads == 0 and store.vectors.get("u") is None


async def test_cache_mb_is_shared_a_third_to_terms() -> None:
    assert cache_split(384) == (128 << 20, 256 << 20)  # the defaults of both caches
    assert cache_split(0) == (0, 0)
    fts, vec = cache_split(1000)
    assert fts + vec == 1000 << 20 and vec == 2 * fts + (1000 << 20) % 3
