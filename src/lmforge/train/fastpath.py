"""One resolved fast path: every ``auto`` of a run turned into what runs, in one pure function.

:func:`resolve_fast_path` maps the model and train configs and the :class:`FastPathRuntime` to a
:class:`FastPath`, the frozen record the trainer builds the model, optimizer and step from (no
other code decides a backend). An explicit setting the runtime cannot honour is refused with one
line naming what it needs; ``auto`` takes the measured-best path that is correct here.

What holds where (measured on an H200, GPT-2-small, batch 32×1024, compiled; RESULTS.md):

======================  ==============================  ====================================
part                    needs                           why it may not go further
======================  ==============================  ====================================
Triton AdamW            CUDA, Triton; single, DDP, FSDP  ZeRO-1/TP/PP hand the optimizer
                                                         wrapped or partial parameter sets
master weights (bf16)   bf16, grad_accum = 1; single,   bf16 gradients would be summed in
                        DDP, ZeRO-1                      bf16 across micro-batches; FSDP
                                                         keeps its own fp32 shards
fused linear + CE       no soft-cap; single, DDP,       it reads ``lm_head.weight`` outside
                        ZeRO-1                           the module call (FSDP gathers weights
                                                         in the module's hooks; TP/PP split it)
sync-free step          lmforge's AdamW (step_if), CUDA  a CPU never runs ahead of the host
                        or master weights; single, DDP,
                        FSDP
clip inside the update  replicated gradients: single,   a sharded norm needs its collective
                        DDP                              (FSDP clips through the strategy)
CUDA graph of the step  the sync-free step on one CUDA  DDP's bucket hooks and NCCL
                        process                          collectives are not captured (yet)
======================  ==============================  ====================================

Exercised by ``pytest tests/test_train_fastpath.py``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import torch

from lmforge.model.fastpath import resolve_backends
from lmforge.utils.errors import LmforgeError
from lmforge.utils.runtime import resolve_device

if TYPE_CHECKING:
    from lmforge.model.config import ModelConfig
    from lmforge.parallel.config import ParallelConfig
    from lmforge.train.config import TrainConfig

StrategyKind = Literal["single", "ddp", "zero1", "fsdp", "tp", "pp", "ep"]


@dataclasses.dataclass(frozen=True)
class FastPathRuntime:
    """What the resolver needs to know about where the run happens."""

    device_type: str = "cpu"
    "torch device type: cpu or cuda"
    world_size: int = 1
    "number of processes"
    strategy: StrategyKind = "single"
    "how the model is distributed (strategy_kind)"
    triton: bool = False
    "the 'triton' package is importable"


@dataclasses.dataclass(frozen=True)
class FastPath:
    """The resolved path of one run (concrete values only, no ``auto``)."""

    attention: str
    "model.attention: reference, sdpa or flash"
    norm: str
    "model.norm: reference or triton"
    rope: str
    "model.rope: reference, triton or packed"
    swiglu: str
    "model.swiglu: reference or triton"
    loss: Literal["reference", "fused"]
    "reference (logits + cross-entropy) or the fused linear + cross-entropy"
    adamw: Literal["foreach", "compiled", "triton"]
    "AdamW update path"
    master_weights: bool
    "bf16 matmul weights as copies of fp32 masters the optimizer keeps"
    sync_free: bool
    "the step never waits for the device (skip decision and update on the device)"
    clip_in_update: bool
    "clipping folded into the update (the optimizer scales gradients as it reads them)"
    cuda_graph: bool
    "the whole step captured as one CUDA graph after warm-up"
    compile: bool
    "torch.compile of model and loss"

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the resolved backends."""
        return dataclasses.replace(
            cfg, attention=self.attention, norm=self.norm, rope=self.rope, swiglu=self.swiglu
        )

    def summary(self) -> str:
        """One line for the log."""
        flags = {
            "master weights": self.master_weights,
            "sync-free step": self.sync_free,
            "clip in update": self.clip_in_update,
            "CUDA graph": self.cuda_graph,
            "compile": self.compile,
        }
        on = [name for name, flag in flags.items() if flag]
        return (
            f"attention {self.attention}, norm {self.norm}, rope {self.rope}, swiglu "
            f"{self.swiglu}, loss {self.loss}, adamw {self.adamw}"
            + (", " + ", ".join(on) if on else "")
        )


def strategy_kind(
    pcfg: ParallelConfig, world_size: int, process_group: bool = False
) -> StrategyKind:
    """The strategy :func:`lmforge.parallel.build_strategy` builds for this layout
    (``process_group``: a default group is already joined, see :func:`_group_joined`)."""
    if pcfg.ep != 1:  # expert parallelism: a bad layout stops here with one line
        from lmforge.parallel.ep import check_expert_layout

        check_expert_layout(pcfg, world_size)
        return "ep"
    if world_size <= 1 and not process_group:
        return "single"
    if pcfg.pp > 1:
        return "pp"
    if pcfg.tp > 1:
        return "tp"
    if pcfg.fsdp:
        return "fsdp"
    return "zero1" if pcfg.zero1 else "ddp"


def _choose(setting: str, name: str, blockers: list[str], auto_wants: bool) -> bool:
    # "on" needs every blocker cleared (else one line naming them); "auto" where none blocks
    if setting == "off":
        return False
    if setting == "on":
        if blockers:
            raise LmforgeError(f"{name} needs " + " and ".join(blockers))
        return True
    return not blockers and auto_wants


def resolve_fast_path(
    model_cfg: ModelConfig, train_cfg: TrainConfig, runtime: FastPathRuntime
) -> FastPath:
    """The measured-best correct path for this run; one clear error for impossible requests."""
    tc, rt = train_cfg, runtime
    cuda = rt.device_type == "cuda"
    kind = rt.strategy
    backends = resolve_backends(model_cfg, rt.device_type, cuda and rt.triton)

    # AdamW: the one-launch Triton kernel where the optimizer sees whole fp32 tensors.
    if tc.adamw not in ("auto", "foreach", "compiled", "triton"):
        raise LmforgeError(
            f"train.adamw must be auto, foreach, compiled or triton, got {tc.adamw!r}"
        )
    triton_adamw_ok = cuda and rt.triton and kind in ("single", "ddp", "fsdp", "ep")
    if tc.adamw == "triton" and not triton_adamw_ok:
        raise LmforgeError(
            "train.adamw=triton needs a CUDA device with the 'triton' package and a single, DDP "
            f"or FSDP strategy (got {rt.device_type}, {kind}); use train.adamw=auto"
        )
    if tc.adamw != "auto":
        adamw = tc.adamw
    elif triton_adamw_ok:
        adamw = "triton"
    else:  # with compile on a GPU the update is compiled too (one fused kernel a tensor)
        adamw = "compiled" if tc.compile and cuda else "foreach"

    # Master weights: bf16 copies the optimizer writes from fp32 masters.
    if tc.master_weights not in ("auto", "on", "off"):
        raise LmforgeError(
            f"train.master_weights must be auto, on or off, got {tc.master_weights!r}"
        )
    blockers = []
    if tc.precision != "bf16":
        blockers.append(f"train.precision=bf16 (got {tc.precision})")
    if kind not in ("single", "ddp", "zero1"):  # ep: its shards replace the expert weights
        blockers.append(f"a single, DDP or ZeRO-1 strategy (got {kind}: it keeps its own weights)")
    if tc.grad_accum != 1:
        blockers.append(
            f"train.grad_accum=1 (got {tc.grad_accum}: bf16 gradients would be summed in bf16)"
        )
    master = _choose(tc.master_weights, "train.master_weights=on", blockers, cuda)

    # Loss: fused linear + cross-entropy where the LM head's weight is whole and local.
    if tc.loss not in ("reference", "fused", "auto"):
        raise LmforgeError(f"train.loss must be reference, fused or auto, got {tc.loss!r}")
    if tc.loss_chunk_rows < 0:
        raise LmforgeError(f"train.loss_chunk_rows must be 0 or more, got {tc.loss_chunk_rows}")
    blockers = []
    if model_cfg.logit_soft_cap is not None:
        blockers.append("model.logit_soft_cap unset (the fused kernel never forms the logits)")
    if kind not in ("single", "ddp", "zero1", "ep"):
        blockers.append(f"a single, DDP or ZeRO-1 strategy (got {kind})")
    fused = _choose(
        {"fused": "on", "reference": "off"}.get(tc.loss, "auto"), "train.loss=fused", blockers, cuda
    )

    # Sync-free needs lmforge's AdamW (not ZeRO-1's wrapper, not TP/PP); on a CPU only master
    # weights (whose clipping must happen inside the update) turn it on.
    sync_free = kind in ("single", "ddp", "fsdp", "ep") and (cuda or master)
    clip_in_update = sync_free and kind in ("single", "ddp")
    graph = bool(tc.cuda_graph) and sync_free and cuda and kind == "single"
    return FastPath(
        attention=backends.attention,
        norm=backends.norm,
        rope=backends.rope,
        swiglu=backends.swiglu,
        loss="fused" if fused else "reference",
        adamw=adamw,  # type: ignore[arg-type]
        master_weights=master,
        sync_free=sync_free,
        clip_in_update=clip_in_update,
        cuda_graph=graph,
        compile=bool(tc.compile),
    )


# -- runtime facts the trainer reads once, beside the resolver that consumes them


def _auto_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device)


def _group_joined() -> bool:
    # a single-rank group joined before the trainer (one NCCL rank) makes even one process run
    # the distributed strategy; a larger group joined by a world_size-1 caller does not
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1


def _triton_installed() -> bool:
    from lmforge.kernels import triton_available

    return triton_available()
