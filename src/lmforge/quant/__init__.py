"""Quantized weights: formats, calibration (RTN, AWQ, GPTQ, SmoothQuant), checkpoints, GGUF.

This is the public API of ``lmforge.quant``. Formats are applied from outside the model:
:func:`quantize_model` (round to nearest) or :func:`quantize_calibrated` (rtn, awq, gptq,
smoothquant on calibration tokens) swaps its bias-free linears for the modules of
:mod:`lmforge.quant.formats` (:class:`Int8Linear`, :class:`Int4Linear`, :class:`Fp8Linear`);
the model's code is unchanged. :func:`save_quantized` / :func:`load_quantized` write and read a
quantized checkpoint folder (layout in :mod:`lmforge.quant.checkpoint`);
:func:`import_gguf_quantized` / :func:`load_gguf_quantized` map a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors onto these formats
without a float copy. :func:`prepare_qat` / :func:`convert_qat`: quantization-aware training
(fake-quantized linears, straight-through gradients) in any Trainer objective. CLI: ``lmforge quantize`` (``--help`` for examples).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.quant.apply import QuantSpec, find_linears, quantize_model, replace_linears
    from lmforge.quant.calib import calibration_tokens
    from lmforge.quant.calibrate import CalibOptions, quantize_calibrated
    from lmforge.quant.checkpoint import is_quantized_checkpoint, load_quantized, save_quantized
    from lmforge.quant.formats import Fp8Linear, Int4Linear, Int8Linear, QuantLinear
    from lmforge.quant.gguf import import_gguf_quantized, load_gguf_quantized
    from lmforge.quant.qat import FakeQuantLinear, convert_qat, prepare_qat

__all__ = [
    "CalibOptions",
    "FakeQuantLinear",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantLinear",
    "QuantSpec",
    "calibration_tokens",
    "convert_qat",
    "find_linears",
    "import_gguf_quantized",
    "is_quantized_checkpoint",
    "load_gguf_quantized",
    "load_quantized",
    "prepare_qat",
    "quantize_calibrated",
    "quantize_model",
    "replace_linears",
    "save_quantized",
]

_EXPORTS = {
    "CalibOptions": "calibrate",
    "FakeQuantLinear": "qat",
    "convert_qat": "qat",
    "prepare_qat": "qat",
    "Fp8Linear": "formats",
    "Int4Linear": "formats",
    "Int8Linear": "formats",
    "QuantLinear": "formats",
    "QuantSpec": "apply",
    "calibration_tokens": "calib",
    "find_linears": "apply",
    "import_gguf_quantized": "gguf",
    "load_gguf_quantized": "gguf",
    "is_quantized_checkpoint": "checkpoint",
    "load_quantized": "checkpoint",
    "quantize_calibrated": "calibrate",
    "quantize_model": "apply",
    "replace_linears": "apply",
    "save_quantized": "checkpoint",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
