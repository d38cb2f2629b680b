"""Contrastive losses (CLIP's symmetric softmax, SigLIP's pairwise sigmoid), the cross-rank
feature gather they share, and retrieval recall@k.

Data parallel: each rank holds B of the N = W·B pairs. Features are gathered from every rank
(with gradient: the backward sums each rank's gradient for a shard back onto its owner), and each
rank scores only its own B rows against all N columns (open_clip's ``local_loss``). The mean over
ranks of these local losses is the full-batch loss, and after DDP averages the parameter
gradients each parameter receives exactly the full-batch gradient.

Pure functions; exercised by ``pytest tests/test_vision_losses.py`` (and ``-m dist`` for the
gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import distributed as dist

MAX_LOGIT_SCALE = 100.0  # CLIP clamps exp(logit_scale) at 100 so the temperature cannot collapse


class _GatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward all-reduces the full gradient and keeps this rank's
    slice (works on gloo, which lacks reduce_scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        world, rank = dist.get_world_size(), dist.get_rank()
        ctx.rank, ctx.rows = rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)  # (W·B, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def gather_features(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, C) local features -> ((W·B, C) features of all ranks in rank order, this rank's row
    offset). Without an initialised process group (or with one process): ``(x, 0)``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    return _GatherWithGrad.apply(x), dist.get_rank() * x.shape[0]


def clip_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor
) -> torch.Tensor:
    """CLIP's symmetric InfoNCE on unit-norm (B, C) features; ``logit_scale`` is the log of the
    inverse temperature (clamped at log 100). Image i's positive is text i, and vice versa:
    ``(CE(s·I Tᵀ, labels) + CE(s·T Iᵀ, labels)) / 2`` over this rank's rows."""
    scale = logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)
    all_images, offset = gather_features(image_features)  # (N, C)
    all_texts, _ = gather_features(text_features)  # (N, C)
    b = image_features.shape[0]
    labels = torch.arange(offset, offset + b, device=image_features.device)  # (B,)
    logits_per_image = scale * image_features @ all_texts.t()  # (B, N)
    logits_per_text = scale * text_features @ all_images.t()  # (B, N)
    return (
        F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)
    ) / 2


def siglip_loss(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
) -> torch.Tensor:
    """SigLIP (Zhai et al. 2023): ``-1/B Σᵢ Σⱼ log σ(zᵢⱼ (t·xᵢ·yⱼ + b))`` with zᵢⱼ = +1 on the
    diagonal and -1 elsewhere, t = exp(logit_scale). Each pair is an independent binary
    decision, so the loss needs no batch-wide softmax; this rank's B images against all N texts.
    """
    scale = logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)
    all_texts, offset = gather_features(text_features)  # (N, C)
    b, n = image_features.shape[0], all_texts.shape[0]
    logits = scale * image_features @ all_texts.t() + logit_bias  # (B, N)
    signs = -torch.ones(b, n, device=logits.device, dtype=logits.dtype)  # (B, N)
    rows = torch.arange(b, device=logits.device)
    signs[rows, rows + offset] = 1.0
    return -F.logsigmoid(signs * logits).sum() / b


def siglip_loss_reference(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
) -> torch.Tensor:
    """The SigLIP paper's formula as two plain loops (single process; the slow reference)."""
    t = logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)
    b = image_features.shape[0]
    total = image_features.new_zeros(())
    for i in range(b):
        for j in range(b):
            z = 1.0 if i == j else -1.0
            logit = t * torch.dot(image_features[i], text_features[j]) + logit_bias
            total = total - torch.log(torch.sigmoid(z * logit))
    return total / b


def retrieval_recall(
    image_features: torch.Tensor, text_features: torch.Tensor, ks: tuple[int, ...] = (1, 5)
) -> dict[str, float]:
    """Recall@k both ways for paired unit-norm (N, C) features: the fraction of images whose own
    caption ranks in the top k among all N captions (``i2t@k``), and of captions whose image does
    (``t2i@k``). Chance is k/N."""
    sim = image_features.float() @ text_features.float().t()  # (N, N)
    n = sim.shape[0]
    target = torch.arange(n, device=sim.device)
    # rank of the true match = number of candidates scoring strictly higher
    i2t_rank = (sim > sim[target, target][:, None]).sum(1)  # (N,)
    t2i_rank = (sim.t() > sim[target, target][:, None]).sum(1)  # (N,)
    out = {}
    for k in ks:
        out[f"i2t@{k}"] = (i2t_rank < k).float().mean().item()
        out[f"t2i@{k}"] = (t2i_rank < k).float().mean().item()
    return out
