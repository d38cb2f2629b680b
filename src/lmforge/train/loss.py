"""Cross-entropy over logits, computed in fp32 with log-sum-exp so huge logits stay finite.

The fused linear + cross-entropy kernel (``lmforge.kernels.fused_linear_cross_entropy``) computes
the same value without materialising the (N, V) logits; this is its readable reference.
"""

from __future__ import annotations

import torch


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``logits``, plus an optional z-loss.

    ``logits`` (..., V) in any float dtype, ``targets`` (...) int ids. Per token:
    ``ℓ = logsumexp(z) − z[target]``, computed in fp32 after subtracting the row max, so logits
    scaled ×1000 give the same finite result as ``F.cross_entropy``. Positions whose target is
    ``ignore_index`` count neither in the sum nor in the mean. ``z_loss > 0`` adds
    ``z_loss · mean(logsumexp(z)²)`` over the same positions (PaLM's stabiliser, which keeps the
    softmax normaliser near 1). Simplification: mean reduction only; when every target is
    ignored the result is 0 (torch returns NaN). Exercised by ``pytest tests/test_train_loss.py``.
    """
    V = logits.shape[-1]
    z = logits.reshape(-1, V).float()  # (N, V)
    t = targets.reshape(-1)  # (N,)
    valid = t != ignore_index  # (N,)
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    # torch.logsumexp subtracts the row max internally (finite for ×1000 logits) and its backward
    # recomputes exp(z − lse) from z, so no (N, V) fp32 exp tensor is kept for backward.
    lse = torch.logsumexp(z, dim=-1)  # (N,)
    picked = z.gather(1, safe_t.unsqueeze(1)).squeeze(1)  # (N,)
    per_token = lse - picked
    if z_loss:
        per_token = per_token + z_loss * lse.square()
    w = valid.to(per_token.dtype)
    return (per_token * w).sum() / w.sum().clamp_min(1.0)
