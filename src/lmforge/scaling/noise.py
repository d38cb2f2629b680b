"""The gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1), estimated during training as a trainer callback.

For a per-example gradient with mean G and covariance Σ, a batch of B examples has
E|G_B|² = |G|² + tr(Σ)/B. Two batch sizes B_small < B_big give unbiased estimates of both terms::

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and B_simple = tr(Σ)/|G|², the batch size around which larger batches stop buying proportionally
fewer steps (the critical batch size, up to the paper's B_crit ≈ B_noise refinement). The two
estimates are noisy, so (as the paper does) the callback averages each with an EMA before taking
the ratio. Batch sizes are counted in tokens. Exercised by ``pytest tests/test_scaling_noise.py``;
``lmforge scaling run --noise-scale-every N`` logs it.
"""

from __future__ import annotations

import math
from typing import Any


def noise_scale_terms(
    g_small_sq: float, g_big_sq: float, b_small: float, b_big: float
) -> tuple[float, float]:
    """Unbiased estimates (|G|², tr Σ) from squared gradient norms at two batch sizes."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small}, {b_big}")
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def b_simple(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> float:
    """B_simple = tr(Σ)/|G|² (NaN when the |G|² estimate is not positive)."""
    g2, trace = noise_scale_terms(g_small_sq, g_big_sq, b_small, b_big)
    return trace / g2 if g2 > 0 else math.nan


class NoiseScaleCallback:
    """Trainer callback: every ``every`` steps, ``micro`` gradients of one micro-batch each.

    Small batch = one micro-batch (``batch_size × T`` tokens), big batch = their mean
    (``micro`` times that). |G_small|² is the mean of the micro-batches' squared norms, |G_big|²
    the squared norm of their mean. Gradients come from ``torch.autograd.grad`` on the current
    weights, so the trainer's ``.grad`` and its data stream are untouched (the callback draws from
    its own sampler over the same sources). Logged keys: ``noise_scale`` (B_simple in tokens,
    from the EMAs), ``noise_grad_sq`` and ``noise_trace`` (the EMA'd |G|² and tr Σ).
    Simplification: on the deferred CUDA path the callback of step s runs after step s+1 was
    launched, so it sees those weights.
    """

    def __init__(
        self, every: int = 50, micro: int = 4, ema: float = 0.9, seed: int = 12345
    ) -> None:
        if every <= 0 or micro < 2 or not 0 <= ema < 1:
            raise ValueError("noise scale: every > 0, micro ≥ 2 and 0 ≤ ema < 1 are required")
        self.every, self.micro, self.ema, self.seed = every, micro, ema, seed
        self._sampler: Any = None
        self._g2: float | None = None
        self._trace: float | None = None

    def __call__(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if step % self.every:
            return
        import torch

        from lmforge.train.data import MixtureSampler

        if self._sampler is None:
            self._sampler = MixtureSampler(
                trainer.sampler_sources,
                trainer.T,
                trainer.dcfg.weights,
                seed=self.seed,
                vocab_size=trainer.mcfg.vocab_size,
            )
        model = trainer.model
        params = [p for p in model.parameters() if p.requires_grad]
        total: list[torch.Tensor] | None = None
        small_sq = 0.0
        for _ in range(self.micro):
            x, y = self._sampler.next_batch(trainer.tcfg.batch_size, trainer.device)
            with trainer._autocast():
                loss = trainer.loss_fn(model, x, y)
            grads = torch.autograd.grad(loss, params)
            small_sq += float(sum(g.float().pow(2).sum() for g in grads))
            if total is None:
                total = [g.float().clone() for g in grads]
            else:
                for t, g in zip(total, grads, strict=True):
                    t.add_(g.float())
        assert total is not None
        big_sq = float(sum((t / self.micro).pow(2).sum() for t in total))
        b = trainer.tcfg.batch_size * trainer.T
        g2, trace = noise_scale_terms(small_sq / self.micro, big_sq, b, b * self.micro)
        w = self.ema
        self._g2 = g2 if self._g2 is None else w * self._g2 + (1 - w) * g2
        self._trace = trace if self._trace is None else w * self._trace + (1 - w) * trace
        metrics["noise_grad_sq"] = self._g2
        metrics["noise_trace"] = self._trace
        metrics["noise_scale"] = self._trace / self._g2 if self._g2 > 0 else math.nan
