"""SmoothQuant's migration (Xiao et al. 2022) for W8A8: activation outliers moved into weights.

Per-token activation quantization suffers when a few input channels carry values 10-100× the
rest (every token's scale is set by them). For a group of linears reading one input, SmoothQuant
divides channel j of the input by

    s_j = max|x_j|^α / max_{linears, rows} |W_{·j}|^(1−α)        (α = 0.5 by default)

and multiplies the weights' column j by it, so both sides share the difficulty; the division
folds into the preceding RMSNorm or linear like AWQ's scales (:mod:`lmforge.quant.awq`). Then
the weights are quantized (fp8 W8A8 with dynamic per-token activation scales in lmforge).
:func:`smooth_search` picks α per group instead (a grid over [0, 1], plus no migration at
all): the one with the smallest W8A8 output error ``‖Q(x / s) Q(W diag s)ᵀ − x Wᵀ‖²`` on sampled
calibration rows, activations rounded per row to e4m3 as the module will.
Exercised by ``pytest tests/test_quant_calib.py``.
"""

from __future__ import annotations

import torch

from lmforge.quant.apply import QuantSpec
from lmforge.quant.awq import ActStats, least_error_scale
from lmforge.quant.formats import fp8_quantize_rows

__all__ = ["smooth_scales", "smooth_search"]


@torch.no_grad()
def smooth_scales(weights: list[torch.Tensor], stats: ActStats, alpha: float = 0.5) -> torch.Tensor:
    """The migration scale s (K,) of one group of linears sharing an input."""
    assert stats.abs_max is not None
    x_max = stats.abs_max.float().cpu().clamp_min(1e-5)  # (K,)
    w_max = torch.stack([w.detach().float().abs().amax(0).cpu() for w in weights]).amax(0)
    s = x_max.pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)  # (K,)
    return s.clamp_min(1e-5)


@torch.no_grad()
def smooth_search(
    weights: list[torch.Tensor], stats: ActStats, spec: QuantSpec, grid: int = 10
) -> torch.Tensor:
    """The migration scale s (K,) of one group with α in {0, 1/grid, …, 1} (or s = 1) chosen
    for the smallest W8A8 output error on the sampled rows (weights rounded with absmax scales
    during the search, for speed)."""
    fast = QuantSpec("fp8", fp8_per_channel=spec.fp8_per_channel)
    cands = [torch.ones(stats.mean_abs.shape[0])]
    cands += [smooth_scales(weights, stats, i / grid) for i in range(grid + 1)]

    def round_rows(x: torch.Tensor) -> torch.Tensor:
        xq, sx = fp8_quantize_rows(x)
        return xq.float() * sx  # (R, K): per-row e4m3, as the module rounds its inputs

    return least_error_scale(weights, stats.sample(), cands, fast, round_rows)
