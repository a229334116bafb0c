"""Whether the configured embedding model can serve a database's vectors.

:func:`usable_embedder` loads the model (:func:`proxy.search.loading.load_embedder`) and makes
sure the database's vectors are its own (:meth:`proxy.store.store.Store.ensure_embedding_model`:
a database with no vector yet takes the model, and its dimension). It raises
:class:`~proxy.search.loading.ModelUnavailable` or :class:`VectorsMismatch`, each with a message
that says what to do; ``engram serve`` refuses to start on either (unless
``embedder.on_unusable = "fts-only"``), the other commands go on without vectors.

An upgrade is not a mismatch: while ``embedder.model`` is the default and the database's vectors
were made by the previous default (the same MiniLM in float32), that model serves the database,
and a log line says ``engram reindex`` moves it to the faster one.
"""

from __future__ import annotations

import dataclasses
import logging

from proxy.config import EmbedderSettings
from proxy.search.embedder import DEFAULT_MODEL, PREVIOUS_DEFAULT, Embedder
from proxy.search.loading import ModelUnavailable, load_embedder
from proxy.store.store import Store
from proxy.store.vectable import VectorState, vector_state

__all__ = ["ModelUnavailable", "VectorsMismatch", "mismatch_message", "usable_embedder"]

REINDEX = "engram reindex"

log = logging.getLogger("engram.embedder")


class VectorsMismatch(RuntimeError):
    """The database's vectors were made by another model than the configured one."""


async def usable_embedder(
    store: Store, cfg: EmbedderSettings, *, threads: int | None = None
) -> Embedder:
    """The configured embedder, loaded, whose model is the one of the database's vectors."""
    if cfg.model == DEFAULT_MODEL:
        state = await store.read(vector_state)
        if state.model == PREVIOUS_DEFAULT:  # an upgrade, not a mismatch: one model loaded
            cfg = dataclasses.replace(cfg, model=PREVIOUS_DEFAULT)
            log.warning(
                "the vectors of %s were made by the previous default model %s, which keeps "
                "serving it; `%s` re-embeds its %d turns with %s (twice as fast per text)",
                store.path,
                PREVIOUS_DEFAULT,
                REINDEX,
                state.turns,
                DEFAULT_MODEL,
            )
    embedder = await load_embedder(cfg, threads=threads)
    if await store.ensure_embedding_model(embedder.name, embedder.dim):
        return embedder
    await embedder.aclose()
    state = await store.read(vector_state)
    raise VectorsMismatch(mismatch_message(state, embedder.name, embedder.dim, str(store.path)))


def mismatch_message(state: VectorState, model: str, dim: int, db: str) -> str:
    """What is wrong and what to run, naming both models and the turns to re-embed."""
    made_by = repr(state.model) if state.model else "a model the database did not record"
    text = (
        f"the database {db} holds vectors made by {made_by} ({state.dim}-d) for "
        f"{state.vectors} turns, but embedder.model is {model!r} ({dim}-d); one model's query "
        f"vectors find nothing meaningful among another's. Run `{REINDEX}` (with the same --db "
        f"and --config) to re-embed the {state.turns} turns with {model!r}"
    )
    if state.build_model == model and state.built:
        text += f" (it continues where the last run stopped: {state.built} done)"
    if state.model:
        text += f", or set embedder.model back to the model that made them ({state.model!r})"
    return text + "."
