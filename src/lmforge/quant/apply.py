"""Swapping a model's linears for quantized ones, from outside the model.

:class:`QuantSpec` names a format; :func:`quantize_model` replaces every matching bias-free
linear (``lmforge.model.Linear`` or ``nn.Linear``) by the round-to-nearest quantized module of
:mod:`lmforge.quant.formats`, in place, like the parallel wrappers replace modules. Embeddings
are never linears here; the LM head is skipped by default (its outputs are the logits, the most
sensitive matmul, and when tied it is the embedding). Calibrated methods
(:mod:`lmforge.quant.calibrate`) build the modules themselves and use :func:`replace_linears`.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from lmforge.quant.formats import Fp8Linear, Int4Linear, Int8Linear, QuantLinear, fp8_scales
from lmforge.utils.errors import LmforgeError

__all__ = [
    "QuantSpec",
    "find_linears",
    "quantize_linear",
    "quantize_model",
    "replace_linears",
]

FORMATS = ("int8", "int4", "fp8")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """Which weight format the linears get and which linears are left alone."""

    format: str = "int4"
    "int8 (symmetric, per channel or per group), int4 (group-wise, two per byte) or fp8 (e4m3)"
    group_size: int | None = 128
    "inputs per scale; None = one scale per output channel (int8/int4 only)"
    symmetric: bool = False
    "int4: symmetric codes (q−8)·s instead of q·s + offset"
    fp8_per_channel: bool = True
    "fp8: one scale per output channel (else one per tensor)"
    fp8_activations: str = "dynamic"
    "fp8: dynamic = W8A8 with per-token activation scales, none = weight-only"
    fp8_scale_search: int = 0
    "fp8 round to nearest: steps of a per-channel scale search on the weight MSE (0: absmax/448)"
    skip: tuple[str, ...] = ("lm_head",)
    "module names (fnmatch patterns; a pattern also covers the module's children) left unquantized"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise LmforgeError(f"unknown quantization format {self.format!r} (int8, int4, fp8)")
        if self.group_size is not None and self.group_size <= 0:
            raise LmforgeError(f"group size must be positive, got {self.group_size}")
        if self.format == "int4" and self.group_size is not None and self.group_size % 2:
            raise LmforgeError(f"int4 group size must be even, got {self.group_size}")
        if self.fp8_scale_search < 0:
            raise LmforgeError(f"fp8 scale search steps must be >= 0, got {self.fp8_scale_search}")
        if self.fp8_activations not in ("dynamic", "none"):
            raise LmforgeError(
                f"fp8 activations must be dynamic or none, got {self.fp8_activations!r}"
            )

    @property
    def bits(self) -> int:
        """Bits per weight code."""
        return 4 if self.format == "int4" else 8

    def group_for(self, d_in: int) -> int:
        """The group size for a linear with ``d_in`` inputs (None = d_in)."""
        return d_in if self.group_size is None else self.group_size


def _is_linear(m: nn.Module) -> bool:
    from lmforge.model.layers import Linear

    if type(m) is Linear:
        return True
    return type(m) is nn.Linear and m.bias is None


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) or name.startswith(p + ".") for p in skip)


def find_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> dict[str, nn.Module]:
    """Name -> module for every plain bias-free linear of ``model`` not matched by ``skip``."""
    return {
        name: m for name, m in model.named_modules() if _is_linear(m) and not _skipped(name, skip)
    }


def check_spec(model: nn.Module, spec: QuantSpec) -> None:
    """One :class:`LmforgeError` line unless ``spec`` fits every linear it would quantize
    (a group must divide each width)."""
    for name, m in find_linears(model, spec.skip).items():
        d_in = m.weight.shape[1]
        g = spec.group_for(d_in)
        if spec.format != "fp8" and d_in % g:
            raise LmforgeError(f"group size {g} does not divide the width {d_in} of {name}")


def quantize_linear(weight: torch.Tensor, spec: QuantSpec) -> QuantLinear:
    """Round-to-nearest module for ``weight`` (d_out, d_in) in ``spec``'s format."""
    d_in = weight.shape[1]
    if spec.format == "int8":
        return Int8Linear.from_float(weight, spec.group_for(d_in))
    if spec.format == "int4":
        return Int4Linear.from_float(weight, spec.group_for(d_in), spec.symmetric)
    scales = None
    if spec.fp8_scale_search:
        scales = fp8_scales(weight, spec.fp8_per_channel, spec.fp8_scale_search)
    return Fp8Linear.from_float(weight, spec.fp8_per_channel, spec.fp8_activations, scales)


def replace_linears(model: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """Put each ``modules[name]`` in place of the submodule called ``name``; returns ``model``."""
    for name, new in modules.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        weight = getattr(old, "weight", None)
        setattr(parent, attr, new if weight is None else new.to(weight.device))
    return model


@torch.no_grad()
def quantize_model(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """Replace the linears of ``model`` (those ``spec.skip`` leaves out excepted) by
    round-to-nearest quantized modules, in place; returns ``model``."""
    check_spec(model, spec)
    new = {
        name: quantize_linear(m.weight, spec) for name, m in find_linears(model, spec.skip).items()
    }
    return replace_linears(model, new)
