"""Cache loads beside the readers, and the warm start (proxy/store/caches/warm.py): the users seen
last
are loaded into memory before they search; a long load never holds a reader thread."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from proxy.store import NewTurn, Store
from proxy.store.caches.warm import WARM_USERS, recent_users
from proxy.store.sqlite.migrations import EMBED_DIM

pytestmark = pytest.mark.asyncio


async def fill(st: Store, users: int) -> None:
    rng = np.random.default_rng(3)
    for u in range(users):
        user = f"user{u}"
        await st.get_or_create_session(user, f"{user}-s")  # sessions seen in this order
        turns = [NewTurn(i, "user", f"{user} talks about lakes {i}") for i in range(5)]
        vecs = [rng.standard_normal(EMBED_DIM).astype(np.float32) for _ in turns]
        await st.add_turns(f"{user}-s", user, turns, vecs)


async def test_preload_loads_the_users_seen_last_before_any_search(
    store_target: str | Path,
) -> None:
    async with Store(store_target) as st:
        await fill(st, WARM_USERS + 2)
        recent = await st.read(recent_users)
        assert [u for u, _ in recent] == [f"user{u}" for u in range(WARM_USERS + 1, 1, -1)]
        assert all(rows == 5 for _, rows in recent)
        assert await st.preload() == [u for u, _ in recent]
        for _ in range(300):
            if all(st.terms.held(u) and st.vectors.get(u) for u, _ in recent):
                break
            await asyncio.sleep(0.01)
        for u, _ in recent:
            assert st.terms.held(u) and st.vectors.get(u) is not None
        assert not st.terms.held("user0") and st.vectors.get("user0") is None
        assert st.terms.loads == WARM_USERS  # no search asked for any of them


async def test_a_long_background_load_never_holds_a_reader(store_target: str | Path) -> None:
    async with Store(store_target, readers=1) as st:
        await fill(st, 1)
        started, release = threading.Event(), threading.Event()

        def slow(_conn: object) -> None:
            started.set()
            release.wait(5)

        st._in_background(slow)
        assert await asyncio.to_thread(started.wait, 5)
        t0 = time.perf_counter()
        hits = await st.fts_search("user0", '"lakes"', 3)  # the one reader is free
        assert hits and time.perf_counter() - t0 < 2
        release.set()


async def test_closing_stops_a_load_in_flight(
    store_target: str | Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.store.caches import term_cache, term_index

    monkeypatch.setattr(term_cache, "LOAD_NOW_ROWS", 0)
    monkeypatch.setattr(term_index, "LOAD_CHUNK", 1)  # a slow load: one turn per statement
    async with Store(store_target) as st:
        await fill(st, 1)
        for s in range(40):
            turns = [NewTurn(i, "user", f"more about lakes {s} {i}") for i in range(20)]
            await st.add_turns("user0-s", "user0", [NewTurn(10 + s * 20 + i, "user", t.content)
                                                    for i, t in enumerate(turns)])  # fmt: skip
        await st.fts_search("user0", '"lakes"', 3)  # starts the load in the background
        for _ in range(200):
            if "user0" in st.terms._loading:
                break
            await asyncio.sleep(0.005)
        assert "user0" in st.terms._loading
        loading = time.perf_counter()
    closed = time.perf_counter() - loading
    assert not st.terms.held("user0")
    # the whole load takes ~0.3 s and more here; closing waited for one chunk, not for it
    assert closed < 0.25, closed
