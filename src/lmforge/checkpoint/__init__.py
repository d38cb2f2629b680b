"""Checkpoint I/O below the trainer: a model's weights, optimizer state, trainer state, config and
tokenizer in one folder written atomically (:mod:`lmforge.checkpoint.io`), and loading one for
inference. ``lmforge.train``, ``lmforge.posttrain`` and the inference and tool packages read
and write checkpoints through this package, so none of them needs the trainer to load a model.
"""

from __future__ import annotations

from lmforge.utils.lazy import lazy_exports

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
    "write_folder_atomically",
]

_EXPORTS = {name: "io" for name in __all__}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
