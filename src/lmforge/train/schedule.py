"""Learning-rate schedules as pure functions of the iteration number (the trainer calls
:func:`lr_at` each step). Exercised by ``pytest tests/test_train_schedule.py``.
"""

from __future__ import annotations

import math


def cosine_schedule(
    it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int
) -> float:
    """Linear warm-up (``max_lr · it / warmup_iters``, 0 at step 0), then half a cosine from
    ``max_lr`` down to ``min_lr`` until ``cosine_cycle_iters`` (an absolute iteration, not a
    length), then constant ``min_lr``."""
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it <= cosine_cycle_iters:
        span = cosine_cycle_iters - warmup_iters
        if span <= 0:
            return max_lr if it == warmup_iters else min_lr
        progress = (it - warmup_iters) / span
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
    return min_lr


def wsd_schedule(
    it: int, max_lr: float, min_lr: float, warmup_iters: int, total_iters: int, decay_iters: int
) -> float:
    """Warmup-stable-decay: linear warm-up, ``max_lr`` until ``total_iters − decay_iters``, then
    a straight line reaching ``min_lr`` at ``total_iters``; ``min_lr`` afterwards.
    Simplification: linear decay (MiniCPM also tried exponential and 1−√ shapes)."""
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    decay_start = max(total_iters - decay_iters, warmup_iters)
    if it < decay_start:
        return max_lr
    if it >= total_iters:
        return min_lr
    progress = (it - decay_start) / max(total_iters - decay_start, 1)
    return max_lr + progress * (min_lr - max_lr)


def constant_schedule(it: int, max_lr: float, warmup_iters: int) -> float:
    """Linear warm-up to ``max_lr``, then constant."""
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    return max_lr


def lr_at(
    it: int,
    schedule: str,
    max_lr: float,
    min_lr: float,
    warmup_iters: int,
    total_iters: int,
    decay_fraction: float = 0.2,
) -> float:
    """The learning rate of iteration ``it`` for the schedule named in ``train.schedule``."""
    if schedule == "cosine":
        return cosine_schedule(it, max_lr, min_lr, warmup_iters, total_iters)
    if schedule == "wsd":
        decay = round(decay_fraction * total_iters)
        return wsd_schedule(it, max_lr, min_lr, warmup_iters, total_iters, decay)
    if schedule == "constant":
        return constant_schedule(it, max_lr, warmup_iters)
    raise ValueError(f"unknown schedule {schedule!r} (expected cosine, wsd or constant)")
