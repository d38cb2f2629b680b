"""Per-input-channel scale migration: AWQ's search (and the folding SmoothQuant shares).

Both methods rewrite ``y = x Wᵀ`` as ``y = (x / s)(W · diag s)ᵀ`` — the same function — for a
per-input-channel s, and then quantize ``W · diag s``:

- AWQ (Lin et al. 2023) protects the weights that meet large activations: with ``a`` the mean
  |x| per input channel on calibration text, it searches ``s = a^α`` (normalised by
  sqrt(max·min)) over a grid of α in [0, 1] for the smallest output error of the quantized group
  ``‖(x / s) Q(W diag s)ᵀ − x Wᵀ‖²`` on sampled calibration rows (α = 0 is plain RTN, so the
  search never does worse on those rows). The weight clipping search of the paper is not done.
- SmoothQuant (Xiao et al. 2022, :mod:`lmforge.quant.smoothquant`) picks
  ``s = max|x|^α / max|W|^(1−α)`` to move activation outliers into the weights before W8A8.

Where ``1/s`` goes (:func:`scale_groups` for lmforge's pre-norm block): into the RMSNorm before
q/k/v and before w1/w3 (its gain is divided by s), into the rows of w3 before w2 (w2's input is
silu(w1 x) ⊙ w3 x, linear in w3's rows); elsewhere (the attention output projection, whose
input comes out of the attention mix) it stays with the module as ``input_scale``, divided out
of x at run time. Exercised by ``pytest tests/test_quant_calib.py``.

Shape legend: R sampled calibration rows, K input width, N output width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from lmforge.quant.apply import QuantSpec, quantize_linear
from lmforge.quant.formats import QuantLinear

__all__ = [
    "ActStats",
    "ScaleGroup",
    "apply_scales",
    "awq_scales",
    "least_error_scale",
    "scale_groups",
]


@dataclasses.dataclass
class ScaleGroup:
    """Linears that read one input, and the module its per-channel scale folds into."""

    linears: list[str]
    "names (relative to the block) of the linears sharing the input"
    fold_into: str | None
    "an RMSNorm (gain divided by s) or a linear (rows divided by s); None = keep as input_scale"


def scale_groups(block: nn.Module, names: list[str]) -> list[ScaleGroup]:
    """The groups of the linears ``names`` of one block (lmforge's pre-norm layout where it is
    recognised; any other linear is a group of its own with no fold)."""
    groups: list[ScaleGroup] = []
    present = set(names)
    layout = [
        (["attn.q_proj", "attn.k_proj", "attn.v_proj"], "ln1"),
        (["ffn.w1", "ffn.w3"], "ln2"),
        (["ffn.w2"], "ffn.w3"),
    ]
    for linears, fold in layout:
        if not set(linears) <= present:
            continue
        ok = _foldable(block, fold, linears[0])
        groups.append(ScaleGroup(linears, fold if ok else None))
        present -= set(linears)
    groups.extend(ScaleGroup([n], None) for n in names if n in present)
    return groups


def _foldable(block: nn.Module, fold: str, first: str) -> bool:
    try:
        target = block.get_submodule(fold)
    except AttributeError:
        return False
    d_in = block.get_submodule(first).weight.shape[1]
    w = getattr(target, "weight", None)
    if not isinstance(w, torch.Tensor):
        return False
    if w.dim() == 1:  # a norm's gain
        return w.shape[0] == d_in
    # a linear whose output rows feed this input (w3 before w2) and that is not quantized yet
    return w.dim() == 2 and w.shape[0] == d_in and not isinstance(target, QuantLinear)


class ActStats:
    """Per-channel |x| statistics and a row sample of one group's input."""

    def __init__(self, max_rows: int = 4096, calls: int = 16, seed: int = 0) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.abs_max: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.max_rows = max_rows
        self.per_call = -(-max_rows // max(calls, 1))  # rows sampled from each add()
        self.seen = 0
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        """Account for input rows x (R, K)."""
        xf = x.float()
        a = xf.abs()
        s, m = a.sum(0), a.amax(0)  # (K,)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.abs_max = m if self.abs_max is None else torch.maximum(self.abs_max, m)
        self.count += x.shape[0]
        # about max_rows rows over the expected number of calls, the same share from each
        take = min(x.shape[0], self.per_call)
        idx = torch.randperm(x.shape[0], generator=self.gen)[:take]
        self.rows.append(xf[idx.to(x.device)].cpu())
        self.seen += 1

    @property
    def mean_abs(self) -> torch.Tensor:
        """Mean |x| per input channel (K,)."""
        assert self.abs_sum is not None
        return self.abs_sum / self.count

    def sample(self) -> torch.Tensor:
        """Up to ``max_rows`` sampled rows (R, K) float32 on the CPU."""
        rows = torch.cat(self.rows)
        if rows.shape[0] > self.max_rows:
            idx = torch.randperm(rows.shape[0], generator=self.gen)[: self.max_rows]
            rows = rows[idx]
        return rows


@torch.no_grad()
def awq_scales(
    weights: list[torch.Tensor], stats: ActStats, spec: QuantSpec, grid: int = 20
) -> torch.Tensor:
    """The per-input-channel scale s (K,) of one group: α in {0, 1/grid, …, 1} minimising the
    group's output error after quantizing W·diag s (round to nearest in ``spec``'s format)."""
    a = stats.mean_abs.cpu().clamp_min(1e-8)  # (K,)
    cands = []
    for i in range(grid + 1):
        s = a.pow(i / grid)
        cands.append(s / (s.max() * s.min()).sqrt())
    return least_error_scale(weights, stats.sample(), cands, spec)


def least_error_scale(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    candidates: list[torch.Tensor],
    spec: QuantSpec,
    round_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The candidate s (K,) whose migrated group ``(x / s) Q(W diag s)ᵀ`` is closest (squared
    error summed over the group's linears) to ``x Wᵀ`` on rows x (R, K); ``round_rows`` rounds
    the scaled activations as the module will (W8A8), or None (weight-only)."""
    ws = [w.detach().float().cpu() for w in weights]
    want = [x @ w.t() for w in ws]  # (R, N) each
    best, best_s = float("inf"), candidates[0]
    for s in candidates:
        sc = s.cpu()
        xs = x / sc  # (R, K)
        if round_rows is not None:
            xs = round_rows(xs)
        err = 0.0
        for w, y in zip(ws, want, strict=True):
            wq = quantize_linear(w * sc, spec).dequantize()  # (N, K)
            err += (xs @ wq.t() - y).pow(2).sum().item()
        if err < best:
            best, best_s = err, s
    return best_s


@torch.no_grad()
def apply_scales(block: nn.Module, group: ScaleGroup, s: torch.Tensor) -> torch.Tensor | None:
    """Multiply the group's weight columns by s and fold 1/s into ``group.fold_into``; returns
    s when it could not be folded (the caller gives it to the quantized modules as input_scale)."""
    for name in group.linears:
        w = block.get_submodule(name).weight
        w.mul_(s.to(w.device, w.dtype)[None, :])
    if group.fold_into is None:
        return s
    target = block.get_submodule(group.fold_into).weight
    if target.dim() == 1:
        target.div_(s.to(target.device, target.dtype))
    else:
        target.div_(s.to(target.device, target.dtype)[:, None])
    return None
