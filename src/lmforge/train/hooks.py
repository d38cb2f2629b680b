"""Callbacks the trainer adds for model features that act between optimizer steps.

A mixture-of-experts model (``model.moe``) moves its DeepSeek-V3 selection bias between steps
(on every rank, so data-parallel replicas keep equal biases) and logs its per-layer routing
statistics (expert load, dropped share, router entropy) with every train record.

Both do their device work in ``after_launch(trainer)``, on every rank right after a step is
launched: the bias update (and its all-reduce) is queued behind that step's optimizer update,
"between steps" in stream order; the routing statistics are snapshotted (log steps only). Their
``__call__`` only reads the snapshot, so both are ``deferrable``: the sync-free loop may report
a step one step late instead of waiting for it (no host sync per MoE step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmforge.model import moe
from lmforge.model.config import ModelConfig


class _MoEBiasUpdate:
    """The auxiliary-loss-free bias step after each optimizer step (every rank, at launch)."""

    deferrable = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def after_launch(self, trainer: Any) -> None:
        # all-reduce only when distributed (not a single process inside a joined group)
        moe.update_expert_bias(self.model, distributed=trainer.strategy.world_size > 1)

    def __call__(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """Nothing left to do at report time (the update ran at launch)."""


class _MoEMetrics:
    """Per-layer routing statistics of a log step's last forward into its train record (copied
    on the device at launch, read to the host at report)."""

    deferrable = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._snap: dict[int, tuple[list[int], torch.Tensor]] = {}

    def _log_step(self, trainer: Any, step: int) -> bool:
        tc = trainer.tcfg
        return step % tc.log_every == 0 or step == tc.max_steps

    def after_launch(self, trainer: Any) -> None:
        step = trainer.iteration  # the launched step's number (the loop counts it at launch)
        for old in [k for k in self._snap if k < step - 1]:  # never reported (train_step calls)
            del self._snap[old]
        if not (trainer.is_main and self._log_step(trainer, step)):
            return
        layers = [m for m in moe.moe_layers(self.model) if m._stats_src is not None]
        if layers:  # a device copy: the next forward replaces the layers' stats
            stats = torch.stack([m._stats for m in layers])  # (L, 3)
            self._snap[step] = ([m.layer_idx for m in layers], stats)

    def __call__(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        snap = self._snap.pop(step, None)
        if snap is None:
            if self._log_step(trainer, step):  # a step launched by another path: read it now
                metrics.update(moe.moe_metrics(self.model))
            return
        idx, stats = snap
        for i, (ratio, dropped, ent) in zip(idx, stats.tolist()):  # the one host read
            metrics[f"moe/L{i}/load_max_mean"] = ratio
            metrics[f"moe/L{i}/dropped"] = dropped
            metrics[f"moe/L{i}/entropy"] = ent


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
