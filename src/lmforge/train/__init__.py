"""Pretraining: losses, optimizer, schedules, data loading, the trainer and checkpoints."""

from lmforge.train.config import DataConfig, TrainConfig

__all__ = ["DataConfig", "TrainConfig"]
