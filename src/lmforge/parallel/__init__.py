"""Parallelism applied from outside the single-device model: DDP, ZeRO, FSDP, TP, PP."""

from lmforge.parallel.config import ParallelConfig
from lmforge.parallel.strategy import LossFn, OptimizerFactory, Strategy

__all__ = ["LossFn", "OptimizerFactory", "ParallelConfig", "Strategy"]
