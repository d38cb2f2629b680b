"""Cross-entropy over logits, computed in fp32 with log-sum-exp so huge logits stay finite.

The fused linear + cross-entropy kernel (``lmforge.kernels.fused_linear_cross_entropy``) computes
the same value without materialising the (N, V) logits; this is its readable reference.

The gradient is written out by hand (``softmax(z) − onehot(target)``, scaled per row): autograd's
gradient of ``z.gather(target)`` is a scatter into a zero (N, V) float32 tensor torch.compile
cannot fuse away (GPT-2-small, batch 32 × 1024: 6.1 GiB of extra peak memory); the explicit form
fuses into one read of the logits and one write of their gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _CrossEntropy(torch.autograd.Function):
    """Σ_rows weight · (lse − z[target] + z_loss · lse²) over (N, V) logits, explicit backward."""

    @staticmethod
    def forward(ctx, logits, targets, weights, z_loss):  # type: ignore[override]
        z = logits.float()  # (N, V)
        # torch.logsumexp subtracts the row max internally (finite for ×1000 logits).
        lse = torch.logsumexp(z, dim=-1)  # (N,)
        picked = z.gather(1, targets.unsqueeze(1)).squeeze(1)  # (N,)
        per_token = lse - picked
        if z_loss:
            per_token = per_token + z_loss * lse.square()
        ctx.save_for_backward(logits, targets, weights, lse)
        ctx.z_loss = z_loss
        return (per_token * weights).sum()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, targets, weights, lse = ctx.saved_tensors
        # d/dz = softmax(z)·(1 + 2·z_loss·lse) − onehot(target), times weight·grad per row.
        # In-place on one fresh float32 buffer (eager keeps one (N, V) temporary; compiled, the
        # chain is functionalised and fused).
        g = logits.to(torch.float32, copy=True)  # (N, V)
        g.sub_(lse.unsqueeze(1)).exp_()
        if ctx.z_loss:
            g.mul_((1.0 + 2.0 * ctx.z_loss * lse).unsqueeze(1))
        # (torch < 2.13 does not report is_compiling() while AOTAutograd traces a backward on
        # fake/functional tensors, hence the type check.)
        if torch.compiler.is_compiling() or type(g) is not torch.Tensor:
            # Element-wise, so the compiler fuses it (a scatter would force a float32 buffer).
            cols = torch.arange(g.shape[1], device=g.device)  # (V,)
            g = torch.where(cols.unsqueeze(0) == targets.unsqueeze(1), g - 1.0, g)
        else:
            # Eager: touch only the N target entries, no (N, V) mask.
            g.scatter_add_(1, targets.unsqueeze(1), g.new_full((g.shape[0], 1), -1.0))
        g.mul_((grad * weights).unsqueeze(1))
        return g.to(logits.dtype), None, None, None


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``logits``, plus an optional z-loss.

    ``logits`` (..., V) in any float dtype, ``targets`` (...) int ids. Per token
    ``ℓ = logsumexp(z) − z[target]`` in fp32 (logits ×1000 stay finite); ``ignore_index``
    positions count neither in the sum nor in the mean. ``z_loss > 0`` adds
    ``z_loss · mean(logsumexp(z)²)`` (PaLM's stabiliser). The gradient has the logits' dtype.
    Simplification: mean reduction only; all targets ignored gives 0 (torch: NaN).
    Exercised by ``pytest tests/test_train_loss.py``.
    """
    V = logits.shape[-1]
    z = logits.reshape(-1, V)  # (N, V)
    t = targets.reshape(-1)  # (N,)
    valid = t != ignore_index  # (N,)
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    w = valid.to(torch.float32)
    w = w / w.sum().clamp_min(1.0)  # (N,): 1/count on counted positions, 0 elsewhere
    return _CrossEntropy.apply(z, safe_t, w, float(z_loss))


def _mtp_of(model: nn.Module) -> nn.Module | None:
    """The model's multi-token-prediction modules when they train (``model.mtp``, training
    mode: validation loss stays the main head's), else None."""
    mtp = getattr(model, "mtp", None)
    return mtp if mtp is not None and model.training else None


def _with_mtp(
    model: nn.Module,
    mtp: nn.Module,
    loss: torch.Tensor,
    h: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``loss + mtp_weight · mean_k CE_k`` (DeepSeek-V3's MTP objective, :func:`mtp_loss`) from
    the main model's hidden states h (B, T, D); ``ce(h_k (N, D), targets (N,))`` is the main
    loss's own head + cross-entropy (fused or not)."""
    from lmforge.model.mtp import mtp_loss

    weight = model.config.mtp_weight
    extra, _ = mtp_loss(
        mtp, h, x, y, model.token_embeddings, model.logits_from_hidden, weight, ce=ce
    )
    return loss + extra


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, z_loss: float) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y``; compiled as one graph by the trainer.
    A model with MTP modules (``model.mtp``) adds their loss in training mode."""
    mtp = _mtp_of(model)
    if mtp is None:
        return cross_entropy(model(x), y, z_loss=z_loss)  # logits (B, T, V) never leave the graph
    h = model.forward_hidden(x)  # (B, T, D): once, for the main head and the MTP modules
    loss = cross_entropy(model.logits_from_hidden(h), y, z_loss=z_loss)

    def ce(hk: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return cross_entropy(model.logits_from_hidden(hk), t)

    return _with_mtp(model, mtp, loss, h, x, y, ce)


def fused_model_loss(
    model: nn.Module,
    fused: Callable[..., torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    z_loss: float,
    chunk_rows: int = 0,
) -> torch.Tensor:
    """Mean fused linear + cross-entropy of ``model``'s hidden states against ``y``; compiled as
    one graph by the trainer. ``fused``: ``lmforge.kernels.fused_linear_cross_entropy``;
    ``chunk_rows`` 0 = its default chunk. A model with MTP modules (``model.mtp``) adds their
    loss in training mode, each depth through the same fused kernel (no (N, V) logits)."""
    h = model.forward_hidden(x)  # (B, T, D)
    D = h.shape[-1]
    loss = fused(
        h.reshape(-1, D),  # (B·T, D)
        model.lm_head.weight,  # (V, D)
        y.reshape(-1),  # (B·T,)
        ignore_index=-100,
        z_loss=z_loss,
        chunk_rows=chunk_rows or None,
        check_targets=False,  # the sampler checked every id against the vocabulary
    )
    mtp = _mtp_of(model)
    if mtp is None:
        return loss

    def ce(hk: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fused(hk, model.lm_head.weight, t, ignore_index=-100, chunk_rows=chunk_rows or None,
                     check_targets=False)  # fmt: skip

    return _with_mtp(model, mtp, loss, h, x, y, ce)
