"""The default model changed (issue 14: the same MiniLM with int8 matrix products): a database
whose vectors the previous default made keeps being served by that model, with a log line naming
`engram reindex`, never refused and never mixed; after the reindex the new default serves it and
searches as a fresh import with it does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy.cli.doctor import vectors_check
from proxy.cli.reindex import reindex
from proxy.config import EmbedderSettings, load_settings
from proxy.search.embedder import DEFAULT_MODEL, PREVIOUS_DEFAULT, FastEmbedEmbedder, HashEmbedder
from proxy.search.model_check import VectorsMismatch, usable_embedder
from proxy.store import Store
from tests.cli.test_reindex import import_with, models_of_vectors, records, results


@pytest.mark.asyncio
async def test_a_database_of_the_previous_default_upgrades_by_reindex(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recs = records(("u1",))
    previous = FastEmbedEmbedder(PREVIOUS_DEFAULT)
    await import_with(tmp_path / "old.db", previous, recs)
    await previous.aclose()
    default = EmbedderSettings()
    assert default.model == DEFAULT_MODEL
    overrides = {"memory": {"db_path": str(tmp_path / "old.db")}}
    doctor = await vectors_check(load_settings(None, {}, overrides), (DEFAULT_MODEL, 384))
    assert doctor.ok is True and "engram reindex" in doctor.detail  # works; a hint
    async with Store(tmp_path / "old.db") as store:
        with caplog.at_level(logging.WARNING, logger="engram.embedder"):
            serving = await usable_embedder(store, default)
        try:
            assert serving.name == PREVIOUS_DEFAULT  # its own vectors' model, not a refusal
        finally:
            await serving.aclose()
        assert "engram reindex" in caplog.text and DEFAULT_MODEL in caplog.text
        fresh_model = FastEmbedEmbedder(DEFAULT_MODEL)
        report = await reindex(store, fresh_model, batch=5)
        assert report.finished and report.done == len(recs)
        serving = await usable_embedder(store, default)
        assert serving.name == DEFAULT_MODEL
        await serving.aclose()
    assert models_of_vectors(tmp_path / "old.db") == {DEFAULT_MODEL}
    await import_with(tmp_path / "fresh.db", fresh_model, recs)
    assert await results(tmp_path / "old.db", fresh_model, ("u1",)) == await results(
        tmp_path / "fresh.db", fresh_model, ("u1",)
    )
    await fresh_model.aclose()


@pytest.mark.asyncio
async def test_only_the_previous_default_is_carried_over(tmp_path: Path) -> None:
    """Vectors of any other model are still a mismatch under the default (no silent swap)."""
    old = HashEmbedder()
    await import_with(tmp_path / "h.db", old, records(("u1",)))
    async with Store(tmp_path / "h.db") as store:
        with pytest.raises(VectorsMismatch, match="engram reindex"):
            await usable_embedder(store, EmbedderSettings())
