"""The one Trainer and what it runs: objectives (pretraining's LM objective here; SFT, preference,
RL and distillation objectives in ``lmforge.posttrain``), losses, optimizer, schedules, data
loading and checkpoints.

This is the public API; everything else in ``lmforge.train`` is internal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        load_for_inference,
        save_checkpoint,
    )
    from lmforge.train.config import DataConfig, TrainConfig
    from lmforge.train.data import MixtureSampler, TokenShard, eval_batches, get_batch, open_shard
    from lmforge.train.fastpath import FastPath, FastPathRuntime, resolve_fast_path
    from lmforge.train.loss import cross_entropy
    from lmforge.train.objective import LMObjective, Objective
    from lmforge.train.optim import AdamW, build_optimizer, clip_grad_norm
    from lmforge.train.plan import TrainingPlan, training_plan
    from lmforge.train.schedule import constant_schedule, cosine_schedule, lr_at, wsd_schedule
    from lmforge.train.trainer import Trainer, train
    from lmforge.train.wrap import apply_activation_checkpointing, bf16_weight_copies

__all__ = [
    "AdamW",
    "DataConfig",
    "FastPath",
    "FastPathRuntime",
    "LMObjective",
    "MixtureSampler",
    "Objective",
    "TokenShard",
    "TrainConfig",
    "Trainer",
    "TrainingPlan",
    "apply_activation_checkpointing",
    "bf16_weight_copies",
    "build_optimizer",
    "clip_grad_norm",
    "constant_schedule",
    "cosine_schedule",
    "cross_entropy",
    "eval_batches",
    "get_batch",
    "latest_checkpoint",
    "load_checkpoint",
    "load_for_inference",
    "lr_at",
    "open_shard",
    "resolve_fast_path",
    "save_checkpoint",
    "train",
    "training_plan",
    "wsd_schedule",
]

_EXPORTS = {
    "AdamW": "optim",
    "DataConfig": "config",
    "FastPath": "fastpath",
    "FastPathRuntime": "fastpath",
    "LMObjective": "objective",
    "MixtureSampler": "data",
    "Objective": "objective",
    "TokenShard": "data",
    "TrainConfig": "config",
    "Trainer": "trainer",
    "TrainingPlan": "plan",
    "apply_activation_checkpointing": "wrap",
    "bf16_weight_copies": "wrap",
    "build_optimizer": "optim",
    "clip_grad_norm": "optim",
    "constant_schedule": "schedule",
    "cosine_schedule": "schedule",
    "cross_entropy": "loss",
    "eval_batches": "data",
    "get_batch": "data",
    "latest_checkpoint": "lmforge.checkpoint.io",
    "load_checkpoint": "lmforge.checkpoint.io",
    "load_for_inference": "lmforge.checkpoint.io",
    "lr_at": "schedule",
    "open_shard": "data",
    "resolve_fast_path": "fastpath",
    "save_checkpoint": "lmforge.checkpoint.io",
    "train": "trainer",
    "training_plan": "plan",
    "wsd_schedule": "schedule",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
