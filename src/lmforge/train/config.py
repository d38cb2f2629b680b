"""The training branches of a run config: ``[train]`` (optimisation, loop) and ``[data]`` (inputs)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Token-shard inputs for pretraining."""

    train: tuple[str, ...] = ()
    "training token shards (.bin files from `lmforge tokenizer encode`, folders or globs)"
    val: tuple[str, ...] = ()
    "validation token shards (sequential windows)"
    weights: tuple[float, ...] = ()
    "mixing weight per training source (empty = proportional to size)"
    tokenizer: str = ""
    "tokenizer folder (copied into checkpoints; needed for bits per byte and sampling)"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loop settings."""

    out_dir: str = "runs/train"
    "folder for checkpoints, metrics and the resolved config"
    device: str = "auto"
    "cpu, cuda, cuda:N or auto"
    seed: int = 0
    "random seed"
    batch_size: int = 8
    "sequences per micro-batch (per process)"
    grad_accum: int = 1
    "micro-batches accumulated per optimizer step"
    context_length: int = 0
    "training sequence length (0 = the model's context_length)"
    max_steps: int = 1000
    "optimizer steps"
    max_minutes: float = 0.0
    "stop early after this much wall time (0 = no limit)"
    lr: float = 3e-4
    "peak learning rate"
    min_lr: float = 3e-5
    "final learning rate"
    warmup_steps: int = 100
    "linear warm-up steps"
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    "learning-rate schedule"
    decay_fraction: float = 0.2
    "wsd: fraction of steps spent decaying"
    beta1: float = 0.9
    "AdamW β1"
    beta2: float = 0.95
    "AdamW β2"
    eps: float = 1e-8
    "AdamW ε"
    weight_decay: float = 0.1
    "AdamW decoupled weight decay"
    grad_clip: float = 1.0
    "clip the global gradient norm to this (0 = off)"
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    "autocast dtype for compute; master weights and optimizer state stay fp32"
    master_weights: Literal["auto", "on", "off"] = "auto"
    "on: the model's matmul weights are bf16 copies of fp32 master weights that AdamW updates and rewrites each step (same results as bf16 autocast over fp32 weights, without its per-step weight and gradient casts; checkpoints hold the fp32 masters); needs precision=bf16, one process and grad_accum=1. auto = on where those hold on CUDA. GPT-2-small on an H200: 56.3 vs 56.6 ms/step"
    compile: bool = False
    "torch.compile the model"
    adamw: Literal["auto", "foreach", "compiled", "triton"] = "auto"
    "AdamW update path: foreach (torch multi-tensor ops), compiled (the update through torch.compile), triton (lmforge's one-launch multi-tensor kernel: CUDA, fp32 state, one process; capturable by cuda_graph); auto = triton on one CUDA process with Triton installed, else compiled when compile is on with CUDA, else foreach"
    cuda_graph: bool = False
    "replay the whole step (forward, backward, clip, AdamW) as one CUDA graph after 3 warm-up steps (one CUDA process; ignored elsewhere)"
    activation_checkpointing: bool = False
    "recompute each block's activations in backward"
    loss: Literal["reference", "fused", "auto"] = "reference"
    "loss path: reference (logits + cross-entropy) or fused linear + cross-entropy"
    loss_chunk_rows: int = 0
    "fused loss: rows of logits per chunk (0 = Liger's rule: a chunk about the hidden states' size). Larger chunks hold chunk × vocab logits and run faster: GPT-2-small on an H200, 8192 rows: 62.7 ms/step at 12.77 GiB vs 63.4 ms at 15.03 GiB for the reference loss"
    z_loss: float = 0.0
    "z-loss coefficient on log Z² (0 = off)"
    eval_every: int = 200
    "validate every N steps (0 = only at the end)"
    eval_batches: int = 20
    "validation batches per evaluation"
    log_every: int = 10
    "write a metrics line every N steps"
    save_every: int = 500
    "checkpoint every N steps (0 = only at the end)"
    save_every_minutes: float = 30.0
    "also checkpoint when this many minutes passed since the last one (0 = off); SIGINT and SIGTERM save one too"
    keep_last: int = 3
    "checkpoints kept"
    resume: bool = True
    "resume from the latest checkpoint in out_dir when one exists"
    spike_factor: float = 0.0
    "skip a step whose loss exceeds this × the running mean (0 = off)"
    max_bad_steps: int = 5
    "stop after this many consecutive skipped (NaN/inf/spike) steps"
    tensorboard: bool = False
    "also log to TensorBoard"
    wandb: str = ""
    "Weights & Biases project name (empty = off)"
    peak_tflops: float = 989.0
    "device peak dense TFLOP/s that MFU is measured against (H200 bf16: 989)"
    progress: bool = True
    "show a live progress bar on stderr"
    plot: bool = True
    "write loss_curve.png at the end"
    allow_config_change: bool = False
    "resume even though the checkpoint was written under a different config (the differing keys are logged); off: such a resume stops and names them"

    def __post_init__(self) -> None:
        pos = ("batch_size", "grad_accum", "max_steps", "log_every", "keep_last")
        nonneg = (
            "eval_every",
            "save_every",
            "save_every_minutes",
            "max_minutes",
            "eval_batches",
            "min_lr",
            "warmup_steps",
            "weight_decay",
        )
        check([
            (self.lr > 0, f"train.lr must be positive, got {self.lr}"),
            *[(getattr(self, k) > 0, f"train.{k} must be positive, got {getattr(self, k)}")
              for k in pos],
            *[(getattr(self, k) >= 0, f"train.{k} must be 0 or more, got {getattr(self, k)}")
              for k in nonneg],
            (self.min_lr <= self.lr,
             f"train.min_lr ({self.min_lr}) must not exceed train.lr ({self.lr})"),
            (0 <= self.beta1 < 1, f"train.beta1 must lie in [0, 1), got {self.beta1}"),
            (0 <= self.beta2 < 1, f"train.beta2 must lie in [0, 1), got {self.beta2}"),
            (self.eps > 0, f"train.eps must be positive, got {self.eps}"),
            (self.context_length >= 0,
             f"train.context_length must be 0 (the model's) or more, got {self.context_length}"),
            (self.grad_clip >= 0, f"train.grad_clip must be 0 (off) or more, got {self.grad_clip}"),
            (0 <= self.decay_fraction <= 1,
             f"train.decay_fraction must lie in [0, 1], got {self.decay_fraction}"),
            (self.precision != "fp16",
             "train.precision=fp16 needs loss scaling, which is not implemented; use bf16"),
        ])  # fmt: skip


def check(checks: list[tuple[bool, str]]) -> None:
    """Raise the message of the first failed ``(ok, message)``: a config branch's
    ``__post_init__`` checks (lmforge.utils.config turns the ValueError into one line)."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
