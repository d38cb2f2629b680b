"""The post-training branches of the run config (``[sft]``, ``[dpo]``, ``[rl]``, ``[distill]``),
defined beside ``[train]`` in :mod:`lmforge.train.posttrain_config` so that the config tree's
root (:mod:`lmforge.config`) imports nothing above the core; re-exported here for the
post-training code that reads them."""

from __future__ import annotations

from lmforge.train.posttrain_config import (
    ALGORITHM_NAMES,
    DistillConfig,
    DPOConfig,
    RLConfig,
    SFTConfig,
)

__all__ = ["ALGORITHM_NAMES", "DPOConfig", "DistillConfig", "RLConfig", "SFTConfig"]
