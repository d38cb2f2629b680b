"""The one Trainer and what it runs: objectives (pretraining's here, post-training's in
``lmforge.posttrain``), losses, optimizer, schedules, data loading and checkpoints. The public
API; everything else in ``lmforge.train`` is internal.
"""

# ruff: noqa: F401 (the imports for type checkers below are the names __all__ exports)

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

# name → defining module (relative, or in full), imported on first access
_EXPORTS = {
    name: module
    for module, names in {
        "config": "DataConfig TrainConfig",
        "data": "MixtureSampler TokenShard eval_batches get_batch open_shard",
        "fastpath": "FastPath FastPathRuntime resolve_fast_path",
        "loss": "cross_entropy",
        "objective": "LMObjective Objective",
        "optim": "AdamW build_optimizer clip_grad_norm",
        "plan": "TrainingPlan training_plan",
        "schedule": "constant_schedule cosine_schedule lr_at wsd_schedule",
        "trainer": "Trainer train",
        "wrap": "apply_activation_checkpointing bf16_weight_copies",
        "lmforge.checkpoint.io": "latest_checkpoint load_checkpoint load_for_inference "
        "save_checkpoint",
    }.items()
    for name in names.split()
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
