"""Quantization-aware training: fake-quantized linears with straight-through gradients.

:func:`prepare_qat` swaps a model's linears (those :class:`~lmforge.quant.QuantSpec` selects, as
:func:`~lmforge.quant.quantize_model` would) for :class:`FakeQuantLinear`, from outside the model
like the quantized linears. The forward uses the weight rounded to the spec's format — exactly
the weights :func:`~lmforge.quant.apply.quantize_linear` would store (round-to-nearest, the
same scales) — and the backward passes the gradient to the float weight unchanged
(straight-through estimator: ŵ = w + stopgrad(q(w) − w)), so any :class:`lmforge.train.Trainer`
objective trains the float weights against their quantized forward. :func:`convert_qat` then
swaps each wrapper for the real quantized module of its trained weight.

Simplifications: weights only (fp8 W8A8's activation rounding is not simulated in training);
the scales are recomputed from the current weight every step (no learned scales, as in LSQ).
The parameter keeps its name (``...q_proj.weight``), so checkpoints of a QAT run load into the
plain model. Exercised by ``pytest tests/test_quant_qat.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.quant.apply import (
    QuantSpec,
    check_spec,
    find_linears,
    quantize_linear,
    replace_linears,
)
from lmforge.quant.formats import FP8_MAX, int4_codes, int4_params

__all__ = ["FakeQuantLinear", "convert_qat", "fake_quantize", "prepare_qat"]


def fake_quantize(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The weight (N, K) as ``quantize_linear(weight, spec).dequantize()`` returns it, computed
    without packing, in fp32 (no gradient: use :class:`FakeQuantLinear` for the STE)."""
    w = weight.detach().float()
    n, k = w.shape
    if spec.format == "fp8":
        amax = w.abs().amax(-1, keepdim=True) if spec.fp8_per_channel else w.abs().amax()
        s = (amax / FP8_MAX).clamp_min(1e-12)  # (N, 1) | ()
        return (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    g = spec.group_for(k)
    if spec.format == "int8":
        wg = w.reshape(n, k // g, g)  # (N, K/G, G)
        s = (wg.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-8).half().float()
        return (torch.round(wg / s).clamp(-127, 127) * s).reshape(n, k)  # (N, K)
    s, m = int4_params(w, g, spec.symmetric)  # fp16 (N, K/G)
    q = int4_codes(w, s, m, g).float().reshape(n, k // g, g)  # (N, K/G, G)
    sf = s.float()[..., None]  # (N, K/G, 1)
    wq = (q - 8.0) * sf if m is None else q * sf + m.float()[..., None]
    return wq.reshape(n, k)  # (N, K)


class _StraightThrough(torch.autograd.Function):
    """Forward: q(w) in w's dtype; backward: the gradient to w unchanged."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:  # type: ignore[override]
        return fake_quantize(weight, spec).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class FakeQuantLinear(nn.Module):
    """A bias-free linear whose forward uses its float ``weight`` rounded to ``spec``'s format."""

    def __init__(self, weight: nn.Parameter, spec: QuantSpec) -> None:
        super().__init__()
        self.weight = weight  # the original Parameter: the optimizer and checkpoints see it
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., d_out)."""
        w = _StraightThrough.apply(self.weight, self.spec)  # (N, K)
        return x @ w.to(x.dtype).t()

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"d_in={k}, d_out={n}, format={self.spec.format}, group={self.spec.group_size}"


def prepare_qat(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """Wrap ``model``'s linears (``spec.skip`` left alone) in :class:`FakeQuantLinear`, in
    place; returns ``model``. A group that does not divide a width is one error line."""
    check_spec(model, spec)
    wrapped = {
        n: FakeQuantLinear(m.weight, spec) for n, m in find_linears(model, spec.skip).items()
    }
    return replace_linears(model, wrapped)


@torch.no_grad()
def convert_qat(model: nn.Module) -> nn.Module:
    """Replace every :class:`FakeQuantLinear` by the quantized module of its weight, in place;
    returns ``model`` (its forward is then the QAT forward, through the quantized kernels)."""
    new = {
        name: quantize_linear(m.weight, m.spec)
        for name, m in model.named_modules()
        if isinstance(m, FakeQuantLinear)
    }
    return replace_linears(model, new)
