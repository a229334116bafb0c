"""Whether the configured embedding model can serve a database's vectors.

:func:`usable_embedder` loads the model (:func:`proxy.search.loading.load_embedder`) and makes
sure the database's vectors are its own (:meth:`proxy.store.store.Store.ensure_embedding_model`:
a database with no vector yet takes the model, and its dimension). It raises
:class:`~proxy.search.loading.ModelUnavailable` or :class:`VectorsMismatch`, each with a message
that says what to do; ``engram serve`` refuses to start on either (unless
``embedder.on_unusable = "fts-only"``), the other commands go on without vectors.
"""

from __future__ import annotations

from proxy.config import EmbedderSettings
from proxy.search.embedder import Embedder
from proxy.search.loading import ModelUnavailable, load_embedder
from proxy.store.store import Store
from proxy.store.vectable import VectorState, vector_state

__all__ = ["ModelUnavailable", "VectorsMismatch", "mismatch_message", "usable_embedder"]

REINDEX = "engram reindex"


class VectorsMismatch(RuntimeError):
    """The database's vectors were made by another model than the configured one."""


async def usable_embedder(
    store: Store, cfg: EmbedderSettings, *, threads: int | None = None
) -> Embedder:
    """The configured embedder, loaded, whose model is the one of the database's vectors."""
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
