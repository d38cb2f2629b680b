"""The ``[parallel]`` branch of a run config: how the single-device model is distributed."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Degrees and options of data, tensor, pipeline and expert parallelism."""

    dp: int = 0
    "data-parallel degree (0 = world_size / (tp·pp))"
    tp: int = 1
    "tensor-parallel degree"
    pp: int = 1
    "pipeline-parallel degree (stages)"
    ep: int = 1
    "expert-parallel degree: each MoE layer's experts sharded over groups of ep consecutive"
    " data-parallel ranks (1 = off; must divide the data-parallel degree and model.moe.n_experts)"
    fsdp: bool = False
    "shard parameters, gradients and optimizer state across the data-parallel group (ZeRO-3)"
    zero1: bool = False
    "shard only optimizer state (ZeRO-1); ignored with fsdp"
    bucket_size_mb: float = 25.0
    "DDP gradient bucket size"
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    "pipeline schedule"
    domain_size: int = 0
    "hierarchical all-reduce domain size (0 = flat)"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    "torch.distributed backend"
    fsdp_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    "dtype of FSDP's gathered weights (master shards and gradient reductions stay fp32)"
