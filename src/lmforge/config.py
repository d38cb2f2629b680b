"""The root of the configuration tree: one run = one ``RunConfig``.

Each stage receives only its own branch (``cfg.model``, ``cfg.train``, ``cfg.data``,
``cfg.parallel``; post-training's ``cfg.sft``, ``cfg.dpo``, ``cfg.rl``, ``cfg.distill``). A run is a TOML file under ``configs/`` plus dotted overrides
(``--train.lr=3e-4``); see :mod:`lmforge.utils.config` for the rules.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from lmforge.model.config import ModelConfig
from lmforge.parallel.config import ParallelConfig
from lmforge.train.config import DataConfig, TrainConfig
from lmforge.train.posttrain_config import DistillConfig, DPOConfig, RLConfig, SFTConfig
from lmforge.utils.config import load_config


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    "model shape and backends"
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    "optimisation and loop"
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    "token-shard inputs"
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    "distribution across processes"
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    "supervised fine-tuning (lmforge sft)"
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    "preference optimisation and reward models (lmforge dpo)"
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    "RL with verifiable rewards (lmforge rl)"
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    "distillation (lmforge distill)"


def load_run_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a run config from TOML (``None`` = all defaults) with dotted overrides applied."""
    return load_config(RunConfig, path, overrides)
