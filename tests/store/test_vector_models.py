"""Every vector records the model that made it (``turns.embed_model``, ``embed_models``): on each
path that writes one (chat archiving and its indexer, memory items, import), and for the
vectors a database held before migration 11; ``turn_vec`` takes its model's dimension."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from proxy.background.items import add_item
from proxy.cli.importer import import_records
from proxy.services import SERVICES
from proxy.store import NewTurn, Store
from proxy.store.sqlite import db, migrations
from proxy.store.vectable import table_dim, vector_state
from testing.fake_upstream import FakeUpstream
from testing.harness import settle, start_engram


def _models(conn: Any) -> list[tuple[str | None, int]]:
    """(model name, vectors) over the turns that have a vector."""
    rows = conn.execute(
        "SELECT e.name, count(*) FROM turns t LEFT JOIN embed_models e ON e.id = t.embed_model"
        " WHERE t.embed_hash IS NOT NULL GROUP BY 1"
    ).fetchall()
    return [(r[0], int(r[1])) for r in rows]


@pytest.mark.asyncio
async def test_each_path_that_writes_a_vector_records_its_model(fake: FakeUpstream) -> None:
    engram = await start_engram(fake.url)  # the hash embedder: "hash-384"
    try:
        async with aiohttp.ClientSession() as http:
            for text in ("I keep bees on the roof", "The honey is dark this year"):
                async with http.post(
                    engram.url + "/v1/chat/completions",
                    headers={"X-Engram-User": "alice"},
                    json={"model": "m", "messages": [{"role": "user", "content": text}]},
                ) as r:
                    assert r.status == 200
        await settle(engram)
        services = engram.app[SERVICES]
        store, memory = services.store, services.memory
        assert store is not None and memory is not None
        session = (await store.list_sessions("alice"))[0]
        await add_item(store, memory.embedder, session.id, "alice", "fact", "alice", "keeps bees")
        recs = [{"user": "bob", "session": "b", "role": "user", "content": "I sail"}]
        await import_records(store, memory.embedder, enumerate(recs, 1), 8)
        models = await store.read(_models)
        assert models == [("hash-384", models[0][1])] and models[0][1] >= 5
        state = await store.read(vector_state)
        assert state.model == "hash-384" and state.vectors == models[0][1]
    finally:
        await engram.close()


def test_migration_11_gives_existing_vectors_the_recorded_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = db.connect(tmp_path / "v10.db")
    try:
        with monkeypatch.context() as m:
            m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:10])
            migrations.migrate(c)
        c.execute("INSERT INTO meta(key, value) VALUES ('embedding_model', 'old-model')")
        c.execute("INSERT INTO users(id, created_at) VALUES ('u', 0)")
        c.execute(
            "INSERT INTO sessions(id, user_id, created_at, last_seen) VALUES ('s', 'u', 0, 0)"
        )
        for p, embed_hash in enumerate(["h0", "h1", None]):
            c.execute(
                "INSERT INTO turns(session_id, user_id, position, role, content, timestamp,"
                " content_hash, embed_hash) VALUES ('s', 'u', ?, 'user', ?, 0, ?, ?)",
                (p, f"t{p}", f"c{p}", embed_hash),
            )
        assert migrations.migrate(c)[0] == 11
        assert _models(c) == [("old-model", 2)]
        assert c.execute("SELECT name, dim FROM embed_models").fetchall() == [("old-model", 384)]
    finally:
        c.close()


@pytest.mark.asyncio
async def test_a_first_model_of_another_dimension_takes_an_empty_table(tmp_path: Path) -> None:
    async with Store(tmp_path / "e.db") as store:
        assert store.vec_dim == 384
        assert await store.ensure_embedding_model("big", 1024)
        assert store.vec_dim == 1024 and await store.read(table_dim) == 1024
        await store.get_or_create_session("u", "s")
        vec = np.zeros(1024, np.float32)
        vec[3] = 1.0
        (tid,) = await store.add_turns("s", "u", [NewTurn(0, "user", "x")], [vec])
        assert [i for i, _ in await store.vec_search("u", vec, 3)] == [tid]
        # Now it holds a vector: another model (or dimension) no longer takes it over.
        assert not await store.ensure_embedding_model("other", 1024)
        assert not await store.ensure_embedding_model("big", 384)
        assert await store.read(_models) == [("big", 1)]
