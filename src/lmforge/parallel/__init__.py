"""Parallelism applied from outside the single-device model: DDP, ZeRO, FSDP, TP, PP."""

from lmforge.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
