"""Quantized weights: formats, calibration (RTN, AWQ, GPTQ, SmoothQuant), checkpoints, GGUF.

This is the public API of ``lmforge.quant``. Formats are applied from outside the model:
:func:`quantize_model` (or a calibrated method) swaps its bias-free linears for modules of
:mod:`lmforge.quant.formats`; the model's code is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.quant.apply import QuantSpec, find_linears, quantize_model, replace_linears
    from lmforge.quant.formats import Fp8Linear, Int4Linear, Int8Linear, QuantLinear

__all__ = [
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantLinear",
    "QuantSpec",
    "find_linears",
    "quantize_model",
    "replace_linears",
]

_EXPORTS = {
    "Fp8Linear": "formats",
    "Int4Linear": "formats",
    "Int8Linear": "formats",
    "QuantLinear": "formats",
    "QuantSpec": "apply",
    "find_linears": "apply",
    "quantize_model": "apply",
    "replace_linears": "apply",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
