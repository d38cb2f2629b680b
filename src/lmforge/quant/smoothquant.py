"""SmoothQuant's migration (Xiao et al. 2022) for W8A8: activation outliers moved into weights.

Per-token activation quantization suffers when a few input channels carry values 10-100× the
rest (every token's scale is set by them). For a group of linears reading one input, SmoothQuant
divides channel j of the input by

    s_j = max|x_j|^α / max_{linears, rows} |W_{·j}|^(1−α)        (α = 0.5 by default)

and multiplies the weights' column j by it, so both sides share the difficulty; the division
folds into the preceding RMSNorm or linear like AWQ's scales (:mod:`lmforge.quant.awq`). Then
the weights are quantized (fp8 W8A8 with dynamic per-token activation scales in lmforge).
Exercised by ``pytest tests/test_quant_calib.py``.
"""

from __future__ import annotations

import torch

from lmforge.quant.awq import ActStats

__all__ = ["smooth_scales"]


@torch.no_grad()
def smooth_scales(weights: list[torch.Tensor], stats: ActStats, alpha: float = 0.5) -> torch.Tensor:
    """The migration scale s (K,) of one group of linears sharing an input."""
    assert stats.abs_max is not None
    x_max = stats.abs_max.float().cpu().clamp_min(1e-5)  # (K,)
    w_max = torch.stack([w.detach().float().abs().amax(0).cpu() for w in weights]).amax(0)
    s = x_max.pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)  # (K,)
    return s.clamp_min(1e-5)
