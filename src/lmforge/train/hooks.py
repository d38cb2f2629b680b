"""Callbacks the trainer adds for model features that act between optimizer steps.

A mixture-of-experts model (``model.moe``) moves its DeepSeek-V3 selection bias between steps
(on every rank, so data-parallel replicas keep equal biases) and logs its per-layer routing
statistics (expert load, dropped share, router entropy) with every train record.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lmforge.model import moe
from lmforge.model.config import ModelConfig


class _MoEBiasUpdate:
    """The auxiliary-loss-free bias step after each optimizer step (every rank)."""

    all_ranks = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        moe.update_expert_bias(self.model)


class _MoEMetrics:
    """Per-layer routing statistics of the step's last forward into the train record (on log
    steps: reading them is a host sync)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        tc = trainer.tcfg
        if step % tc.log_every == 0 or step == tc.max_steps:  # a host read: log steps only
            metrics.update(moe.moe_metrics(self.model))


def model_callbacks(mcfg: ModelConfig, model: nn.Module) -> list[Any]:
    """The callbacks ``mcfg`` needs on ``model`` (none for a dense model). Refuses a non-causal
    MoE routing unless ``model.moe.allow_noncausal`` (one line naming the probe)."""
    moe.check_causal_routing(mcfg)
    if not mcfg.moe.enabled:
        return []
    out: list[Any] = [_MoEMetrics(model)]
    if mcfg.moe.bias_update_rate > 0:
        out.insert(0, _MoEBiasUpdate(model))
    return out
