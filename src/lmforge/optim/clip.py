"""Global-norm gradient clipping, below both ``lmforge.parallel`` and ``lmforge.train``.

The single-device strategy (``lmforge.parallel.Strategy.clip_grad_norm``) and the trainer's
clip-inside-the-update path both use these; they sit in their own package so that ``parallel``
never imports ``train`` (imports flow utils ← kernels ← model ← optim ← parallel ← train).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, foreach: bool = True
) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before.

    Matches ``torch.nn.utils.clip_grad_norm_`` (L2 only): the coefficient is
    ``max_norm / (norm + 1e-6)`` clamped to 1, applied without a host sync (no ``if`` on the norm).
    Parameters without a gradient are skipped; with none at all the norm is 0.
    Simplification: L2 norm only, no ``error_if_nonfinite``. Exercised by
    ``pytest tests/test_optim.py``.
    """
    total, by_device = _grad_norm(params, foreach)
    if not by_device:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (dev, _), gs in by_device.items():
        if foreach:
            torch._foreach_mul_(gs, coef.to(dev))
        else:
            for g in gs:
                g.mul_(coef.to(dev))
    return total


@torch.no_grad()
def grad_norm_and_clip_coef(
    params: Iterable[torch.Tensor], max_norm: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global L2 norm of the gradients and the factor :func:`clip_grad_norm` would scale them
    by, ``min(1, max_norm / (norm + 1e-6))``, without touching them: pass the factor to
    :meth:`AdamW.step_if` as ``grad_scale`` to clip inside the update."""
    total, _ = _grad_norm(params, True)
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _grad_norm(
    params: Iterable[torch.Tensor] | torch.Tensor, foreach: bool
) -> tuple[torch.Tensor, dict[tuple, list[torch.Tensor]]]:
    # Global L2 norm of the gradients (on the first gradient's device) and the gradients grouped
    # by (device, dtype); a zero norm and no groups when nothing has a gradient.
    if isinstance(params, torch.Tensor):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(()), {}
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device
    norms: list[torch.Tensor] = []
    for (_, dtype), gs in by_device.items():
        # Low-precision gradients (a bf16 model's) are summed in float32 and their norms kept
        # in float32; float32 and float64 gradients as they are.
        acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else None
        if foreach:
            norms.extend(n.to(device) for n in torch._foreach_norm(gs, 2.0, dtype=acc))
        else:
            norms.extend(torch.linalg.vector_norm(g, 2.0, dtype=acc).to(device) for g in gs)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0), by_device
