"""``engram reindex``: a database made with one model, re-embedded with another, searches as a
fresh import with that model does (the real MiniLM); an interrupted run continues to the same
end; a model of another dimension works after it; every vector records its model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from proxy.cli.importer import import_records
from proxy.cli.reindex import ReindexReport, reindex
from proxy.config import RetrievalSettings
from proxy.search.embedder import DEFAULT_MODEL, Embedder, FastEmbedEmbedder, HashEmbedder
from proxy.search.retrieval import Retriever
from proxy.store import NewTurn, Store
from proxy.store.vectable import vector_state

TOPICS = [
    ("Alice", "I adopted a grey cat named Miso from the shelter last spring"),
    ("Bob", "My sister moved to Lisbon and works as a marine biologist"),
    ("Alice", "We hiked up to the glacier lake and camped under the stars"),
    ("Bob", "The bakery on the corner sells sourdough with walnuts and figs"),
    ("Alice", "I started learning the cello; my teacher is very patient"),
    ("Bob", "Our team lost the football final on penalties again"),
    ("Alice", "The dentist said I need a crown on my back molar"),
    ("Bob", "I am saving money to buy a second-hand electric car"),
    ("Alice", "My grandmother taught me to knit scarves in winter"),
    ("Bob", "We painted the kitchen a pale green colour last weekend"),
    ("Alice", "The job interview at the architecture firm went well"),
    ("Bob", "I read a novel about a lighthouse keeper in Norway"),
    ("Alice", "Our flight to Tokyo was delayed by six hours"),
    ("Bob", "I volunteer at the food bank every Thursday evening"),
    ("Alice", "The tomatoes in my balcony garden finally turned red"),
    ("Bob", "My laptop fan is noisy since I dropped it"),
    ("Alice", "We adopted a puppy, a small beagle called Pepper"),
    ("Bob", "I ran my first half marathon in under two hours"),
    ("Alice", "The wedding will be in a vineyard near Porto"),
    ("Bob", "I keep forgetting to water the orchids on my desk"),
]
QUERIES = [
    "what pet does Alice have",
    "where does Bob's sister live",
    "musical instrument lessons",
    "running race time",
    "travel delays at the airport",
    "home renovation",
]


def records(users: Sequence[str] = ("u1", "u2")) -> list[dict[str, Any]]:
    """Import records: the topics (and a reply to each, some texts repeated) per user."""
    out: list[dict[str, Any]] = []
    for u, user in enumerate(users):
        for i, (speaker, text) in enumerate(TOPICS):
            session = f"{user}-s{i // 5}"
            out.append(
                {
                    "user": user,
                    "session": session,
                    "role": "user",
                    "speaker": speaker,
                    "content": text if u == 0 else f"{text}, said {user}",
                    "timestamp": 1_700_000_000 + 3600 * i,
                }
            )
            out.append(
                {
                    "user": user,
                    "session": session,
                    "role": "assistant",
                    "content": "That sounds lovely."
                    if i % 3
                    else f"Tell me more about {text[:20]}",
                    "timestamp": 1_700_000_000 + 3600 * i + 60,
                }
            )
    return out  # fmt: skip


async def import_with(db: Path, embedder: Embedder, recs: list[dict[str, Any]]) -> None:
    async with Store(db) as store:
        assert await store.ensure_embedding_model(embedder.name, embedder.dim)
        await import_records(store, embedder, enumerate(recs, 1), 16)


async def results(db: Path, embedder: Embedder, users: Sequence[str] = ("u1", "u2")) -> Any:
    """Every query's (turn id, score) lists per user, in modes vec and hybrid."""
    out = {}
    async with Store(db) as store:
        retriever = Retriever(store, embedder, RetrievalSettings())
        for user in users:
            for mode in ("vec", "hybrid"):
                for q in QUERIES:
                    hits = await retriever.search(user, q, 8, mode=mode)
                    out[(user, mode, q)] = [h.turn.id for h in hits]
    return out


def vectors(db: Path) -> dict[int, tuple[str, bytes]]:
    """turn id -> (embed_hash, vector bytes) as stored (read through Engram's driver)."""
    from proxy.store.sqlite.db import connect

    conn = connect(db)
    try:
        rows = conn.execute(
            "SELECT t.id, t.embed_hash, v.embedding FROM turns t"
            " JOIN turn_vec v ON v.turn_id = t.id"
        ).fetchall()
        return {int(i): (str(h), bytes(b)) for i, h, b in rows}
    finally:
        conn.close()


def models_of_vectors(db: Path) -> set[str | None]:
    from proxy.store.sqlite.db import connect

    conn = connect(db)
    try:
        rows = conn.execute(
            "SELECT DISTINCT e.name FROM turns t LEFT JOIN embed_models e ON e.id = t.embed_model"
            " WHERE t.embed_hash IS NOT NULL"
        )
        return {r[0] for r in rows}
    finally:
        conn.close()


@pytest_asyncio.fixture
async def minilm() -> AsyncIterator[FastEmbedEmbedder]:
    e = FastEmbedEmbedder(DEFAULT_MODEL)
    await e.load()
    yield e
    await e.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("old_dim", [384, 768])
async def test_reindexed_database_searches_as_a_fresh_import(
    tmp_path: Path, minilm: FastEmbedEmbedder, old_dim: int
) -> None:
    """The issue's test: made with another model ("hash", of the same or another dimension),
    re-indexed with MiniLM, the database returns what a fresh MiniLM import returns."""
    recs = records()
    old = HashEmbedder(old_dim)
    await import_with(tmp_path / "old.db", old, recs)
    await import_with(tmp_path / "fresh.db", minilm, recs)
    before = await results(tmp_path / "old.db", old)
    async with Store(tmp_path / "old.db") as store:
        assert not await store.ensure_embedding_model(minilm.name, minilm.dim)
        report = await reindex(store, minilm, batch=7)
        assert report.way == "build" and report.finished and report.done == len(recs)
        assert report.embedded < report.done  # repeated replies were copied, not embedded
        assert store.vec_dim == 384
        state = await store.read(vector_state)
        assert (state.model, state.dim, state.vectors, state.build_model) == (
            minilm.name,
            384,
            len(recs),
            None,
        )
    again = await results(tmp_path / "old.db", minilm)
    fresh = await results(tmp_path / "fresh.db", minilm)
    assert again == fresh
    assert again != before  # the vectors did change
    assert models_of_vectors(tmp_path / "old.db") == {minilm.name}
    assert vectors(tmp_path / "old.db").keys() == vectors(tmp_path / "fresh.db").keys()
    await old.aclose()


@pytest.mark.asyncio
async def test_interrupted_reindex_continues_to_the_same_end(tmp_path: Path) -> None:
    """Stopped after some batches (``limit``), the old vectors still serve the old model; run
    again, it ends byte-identical to one uninterrupted run."""
    recs = records()
    old, new = HashEmbedder(384), HashEmbedder(256)
    for name in ("stopped.db", "whole.db"):
        await import_with(tmp_path / name, old, recs)
    async with Store(tmp_path / "whole.db") as store:  # in one go, three model sessions at once
        more = [HashEmbedder(256), HashEmbedder(256)]
        assert (await reindex(store, new, sessions=more, batch=5)).finished
        with pytest.raises(ValueError, match="same model"):
            await reindex(store, new, sessions=[old])
    old_results = await results(tmp_path / "stopped.db", old)
    async with Store(tmp_path / "stopped.db") as store:
        first = await reindex(store, new, batch=8, limit=30)
        assert (first.done, first.finished, first.total) == (30, False, len(recs))
        state = await store.read(vector_state)
        assert (state.model, state.dim, state.build_model, state.built) == (
            "hash-384",
            384,
            "hash-256",
            30,
        )
    # Meanwhile search is the old model's, unbroken.
    assert await results(tmp_path / "stopped.db", old) == old_results
    async with Store(tmp_path / "stopped.db") as store:
        second = await reindex(store, new, batch=8, limit=len(recs) - 30)  # exactly the rest
        assert second.kept == 30 and second.done == len(recs) - 30 and second.finished
    assert vectors(tmp_path / "stopped.db") == vectors(tmp_path / "whole.db")
    assert await results(tmp_path / "stopped.db", new) == await results(tmp_path / "whole.db", new)


@pytest.mark.asyncio
async def test_a_model_of_another_dimension_works_after_reindex(tmp_path: Path) -> None:
    db = tmp_path / "e.db"
    old, new = HashEmbedder(384), HashEmbedder(768)
    await import_with(db, old, records(["u1"]))
    async with Store(db) as store:
        report: ReindexReport = await reindex(store, new)
        assert report.finished and store.vec_dim == 768
    async with Store(db) as store:  # read again at open
        assert store.vec_dim == 768
        assert await store.ensure_embedding_model(new.name, 768)
        hits = await Retriever(store, new, RetrievalSettings()).search(
            "u1", "cat Miso", 5, mode="vec"
        )
        assert hits and "Miso" in hits[0].turn.content
        # New turns take the new dimension; a vector of the old one is refused.
        (vec,) = await new.embed_passages(["assistant: a new turn"])
        await store.add_turns("u1-s0", "u1", [NewTurn(100, "assistant", "a new turn")], [vec])
        with pytest.raises(ValueError, match="768 dimensions"):
            await store.add_turns(
                "u1-s0", "u1", [NewTurn(101, "user", "x")], [np.ones(384, np.float32)]
            )
        with pytest.raises(ValueError, match="768 dimensions"):
            await store.vec_search("u1", np.ones(384, np.float32), 3)
    assert models_of_vectors(db) == {"hash-768"}
    # And back again to the default dimension.
    async with Store(db) as store:
        assert (await reindex(store, old)).finished and store.vec_dim == 384
    await old.aclose()
    await new.aclose()


@pytest.mark.asyncio
async def test_fill_in_place_when_the_model_is_the_tables(tmp_path: Path) -> None:
    """Turns without a vector (archived while the embedder was down) get one of the table's
    model in place; a second run has nothing to do."""
    db = tmp_path / "e.db"
    emb = HashEmbedder(384)
    async with Store(db) as store:
        assert await store.ensure_embedding_model(emb.name, 384)
        recs = records()
        await import_records(store, None, enumerate(recs[:40], 1), 16)  # u1's: no vectors
        await import_records(store, emb, enumerate(recs[40:], 1), 16)
        report = await reindex(store, emb)
        assert (report.way, report.total, report.finished) == ("fill", 40, True)
        # u1's replies are u2's (copied, as are its repeats); its 20 own texts are embedded.
        assert report.embedded == 20
        assert (await reindex(store, emb)).way == "none"
    assert len(vectors(db)) == 80 and models_of_vectors(db) == {"hash-384"}


# --- the command, as a process -------------------------------------------------------------


def _env(model: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    return {**env, "ENGRAM_EMBEDDER_MODEL": model, "HF_HUB_OFFLINE": "1", **extra}


def _engram(
    db: Path, *args: str, model: str = "hash", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args, "--db", str(db)],
        capture_output=True, text=True, env=_env(model), timeout=timeout,
    )  # fmt: skip


def _build_rows(db: Path) -> int:
    from proxy.store.sqlite.db import connect

    conn = connect(db, readonly=True)
    try:
        row = conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'turn_vec_build'"
        ).fetchone()
        if not row[0]:
            return 0
        return int(conn.execute("SELECT count(*) FROM turn_vec_build").fetchone()[0])
    finally:
        conn.close()


def test_reindex_killed_then_run_again(tmp_path: Path) -> None:
    """SIGKILL in the middle leaves the old vectors serving; the next run finishes the job, and
    the result equals a fresh import with the new model."""
    many = [
        {"user": "u", "session": f"s{i // 50}", "role": "user", "content": f"{i}: {t}"}
        for i, t in enumerate(text for _ in range(75) for _, text in TOPICS)
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in many))
    db, fresh = tmp_path / "e.db", tmp_path / "fresh.db"
    assert _engram(db, "import", str(src)).returncode == 0
    assert _engram(fresh, "import", str(src), model="hash-96").returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "reindex", "--db", str(db), "--batch", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env("hash-96"),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while _build_rows(db) < 100 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stopped_at = _build_rows(db)
    assert 0 < stopped_at < 1500, "the run was not caught in the middle"
    # The old model's vectors serve meanwhile; the new model is refused by search until then.
    out = _engram(db, "search", "grey cat shelter", "--user", "u", "--mode", "vec", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["results"]
    out = _engram(db, "search", "grey cat", "--user", "u", "--mode", "vec", model="hash-96")
    assert "engram reindex" in out.stderr
    done = _engram(db, "reindex")
    # With the old model there is nothing to do, and the new model's work is kept.
    assert done.returncode == 0 and "nothing to re-embed" in done.stdout
    done = _engram(db, "reindex", model="hash-96")
    assert done.returncode == 0, done.stderr
    assert "every vector is now made by 'hash-96' (96-d)" in done.stdout
    assert f"{stopped_at} done by an earlier run are kept" in done.stderr
    assert vectors(db) == vectors(fresh)


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    db = tmp_path / "e.db"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert _engram(db, "import", str(src)).returncode == 0
    run = _engram(db, "reindex", "--batch", "10", "--limit", "20", model="hash-64")
    assert run.returncode == 0, run.stderr
    assert "stopped at --limit" in run.stdout and "re-embedded 20 turns" in run.stdout
    assert "\r" not in run.stderr and "re-embedding 80 turns with 'hash-64' (64-d)" in run.stderr
    help_text = _engram(db, "reindex", "--help").stdout
    assert "continues where it stopped" in help_text and "--limit N" in help_text


def test_reindex_refuses_beside_a_server_and_they_beside_it(tmp_path: Path) -> None:
    from proxy.store.sqlite.lock import DatabaseBusy, DatabaseLock

    db = tmp_path / "e.db"
    assert _engram(db, "import", str(_write(tmp_path))).returncode == 0
    with DatabaseLock(db) as server:  # what `engram serve` holds while it runs
        server.acquire(exclusive=False)
        run = _engram(db, "reindex", model="hash-64")
        assert run.returncode == 1 and "an Engram server is using" in run.stderr
        with pytest.raises(DatabaseBusy):
            DatabaseLock(db).acquire(exclusive=True)
        other = DatabaseLock(db)
        other.acquire(exclusive=False)  # servers share it
        other.release()
    with DatabaseLock(db) as running_reindex:
        running_reindex.acquire(exclusive=True)
        with pytest.raises(DatabaseBusy):
            DatabaseLock(db).acquire(exclusive=False)
        # An import would write the old model's vectors beside the new ones: it waits its turn.
        run = _engram(db, "import", str(_write(tmp_path)), model="hash-64")
        assert run.returncode == 1 and "`engram reindex` is re-embedding" in run.stderr


def _write(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records(["u1"])))
    return src
