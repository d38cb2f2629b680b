"""Parallelism applied from outside the single-device model: DDP, ZeRO, FSDP, TP, PP.

This is the public API of ``lmforge.parallel``. The trainer only uses :class:`Strategy` and
:func:`build_strategy`; the wrappers also work on their own in a script launched by torchrun.
The cost model behind ``lmforge plan`` lives in :mod:`lmforge.parallel.planner`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.parallel.config import ParallelConfig
    from lmforge.parallel.ddp import DDP
    from lmforge.parallel.fsdp import FSDP
    from lmforge.parallel.hierarchical import HierarchicalGroups, hierarchical_all_reduce
    from lmforge.parallel.pipeline import PipelineRunner, PipelineStage
    from lmforge.parallel.strategies import (
        DDPStrategy,
        FSDPStrategy,
        PipelineStrategy,
        ZeRO1Strategy,
        build_strategy,
    )
    from lmforge.parallel.strategy import LossFn, OptimizerFactory, Strategy
    from lmforge.parallel.tensor import apply_tensor_parallel
    from lmforge.parallel.zero import ShardedOptimizer

__all__ = [
    "DDP",
    "FSDP",
    "DDPStrategy",
    "FSDPStrategy",
    "HierarchicalGroups",
    "LossFn",
    "OptimizerFactory",
    "ParallelConfig",
    "PipelineRunner",
    "PipelineStage",
    "PipelineStrategy",
    "ShardedOptimizer",
    "Strategy",
    "ZeRO1Strategy",
    "apply_tensor_parallel",
    "build_strategy",
    "hierarchical_all_reduce",
]

_EXPORTS = {
    "DDP": "ddp",
    "DDPStrategy": "strategies",
    "FSDP": "fsdp",
    "FSDPStrategy": "strategies",
    "HierarchicalGroups": "hierarchical",
    "LossFn": "strategy",
    "OptimizerFactory": "strategy",
    "ParallelConfig": "config",
    "PipelineRunner": "pipeline",
    "PipelineStage": "pipeline",
    "PipelineStrategy": "strategies",
    "ShardedOptimizer": "zero",
    "Strategy": "strategy",
    "ZeRO1Strategy": "strategies",
    "apply_tensor_parallel": "tensor",
    "build_strategy": "strategies",
    "hierarchical_all_reduce": "hierarchical",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
