"""Compatibility names: checkpoint I/O lives in :mod:`lmforge.checkpoint` (below the trainer);
these re-exports keep ``lmforge.train.checkpoint`` imports working."""

from __future__ import annotations

from lmforge.checkpoint.io import (
    CHECKPOINT_FORMAT,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_for_inference,
    load_model_state,
    load_optimizer_state,
    prune_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
    save_model_state,
    save_optimizer_state,
    split_tied,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_for_inference",
    "load_model_state",
    "load_optimizer_state",
    "prune_checkpoints",
    "read_trainer_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_model_state",
    "save_optimizer_state",
    "split_tied",
]
