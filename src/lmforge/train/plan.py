"""Derived quantities of a training run, from one pure function logged at start."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.model.config import ModelConfig
    from lmforge.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """What one run will do, derived from ``[model]``, ``[train]`` and the world size."""

    context_length: int
    "T: tokens per training sequence"
    micro_batch_size: int
    "sequences per micro-batch per process"
    grad_accum: int
    "micro-batches per optimizer step"
    world_size: int
    "data-parallel processes"
    tokens_per_step: int
    "tokens consumed by one optimizer step across all processes"
    max_steps: int
    "optimizer steps"
    total_tokens: int
    "tokens over the whole run"
    n_params: int
    "model parameters (tied weights counted once)"
    flops_per_token: float
    "training FLOPs per token (forward + backward)"
    flops_per_step: float
    "training FLOPs per optimizer step"
    total_flops: float
    "training FLOPs over the whole run"


def training_plan(
    model_cfg: ModelConfig, train_cfg: TrainConfig, world_size: int = 1
) -> TrainingPlan:
    """Tokens per step, total tokens, parameters and FLOPs of a run (FLOPs per token:
    ``lmforge.model.accounting.flops_per_token``, 6·N_matmul + 12·L·D·T, PaLM's MFU convention).
    ``world_size`` counts data-parallel replicas (simplification: tp/pp ranks are not separated).
    Exercised by ``pytest tests/test_train_plan.py``."""
    T = train_cfg.context_length or model_cfg.context_length
    tokens_per_step = train_cfg.batch_size * train_cfg.grad_accum * world_size * T
    from lmforge.model import accounting

    fpt = float(accounting.flops_per_token(model_cfg, T))
    n_params = int(accounting.parameter_count(model_cfg))
    return TrainingPlan(
        context_length=T,
        micro_batch_size=train_cfg.batch_size,
        grad_accum=train_cfg.grad_accum,
        world_size=world_size,
        tokens_per_step=tokens_per_step,
        max_steps=train_cfg.max_steps,
        total_tokens=tokens_per_step * train_cfg.max_steps,
        n_params=n_params,
        flops_per_token=fpt,
        flops_per_step=fpt * tokens_per_step,
        total_flops=fpt * tokens_per_step * train_cfg.max_steps,
    )


def objective_plan(model: Any, train_cfg: TrainConfig, world_size: int = 1) -> TrainingPlan:
    """The plan of a post-training objective's run: parameters and steps (its sequences vary in
    length, so tokens and FLOPs per step are not known up front and are given as 0)."""
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return TrainingPlan(
        context_length=0,
        micro_batch_size=train_cfg.batch_size,
        grad_accum=train_cfg.grad_accum,
        world_size=world_size,
        tokens_per_step=0,
        max_steps=train_cfg.max_steps,
        total_tokens=0,
        n_params=int(n_params),
        flops_per_token=0.0,
        flops_per_step=0.0,
        total_flops=0.0,
    )
