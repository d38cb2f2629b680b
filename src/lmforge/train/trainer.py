"""The pretraining loop: data → strategy.forward_backward → clip → AdamW, with eval, logs, checkpoints.

The model is built single-device, then wrapped from outside in one fixed order:

    1. activation checkpointing (each block's ``forward`` recomputed in backward; names unchanged)
    2. ``torch.compile`` (``module.compile()`` in place, so parameter names stay unchanged)
    3. the parallelism :class:`~lmforge.parallel.Strategy` (``Strategy(model)`` on one process,
       ``lmforge.parallel.build_strategy`` under torchrun)

One step: ``grad_accum`` micro-batches through ``strategy.forward_backward`` (bf16 autocast over
fp32 master weights and fp32 AdamW state), global-norm clipping, then the update. With
``train.master_weights`` (auto: one CUDA process, bf16, no accumulation) the model's matmul
weights are themselves bf16, copies AdamW writes from fp32 masters it keeps
(:func:`bf16_weight_copies`): the same numbers as autocast casting fp32 weights, without the
cast kernels; checkpoints hold the fp32 masters. A NaN/inf loss
or norm, or a loss above ``spike_factor × running mean``, skips the update (logged);
``max_bad_steps`` consecutive skips stop the run with a clear message and the last good
checkpoint untouched.

On one CUDA process the step never waits for the GPU: the skip decision, the running mean and the
update are computed on the device (``AdamW.step_if``), the step's loss and norm travel to pinned
host memory behind a CUDA event, and the loop reads them one step later, while the GPU already
runs the next step. (A host sync per step leaves the GPU idle while the host prepares the next
batch and launches the next forward: ~6 ms of a 65 ms GPT-2-small step on an H200.) Steps after
which the loop must look at the model (eval, save, time limit, the last step) are read at once.
Distributed strategies keep the synchronous step: one host read of loss and norm per step.
There, clipping is folded into the update: the norm is computed, and AdamW scales each gradient by
the clip factor as it reads it (one pass less over the gradients). ``train.cuda_graph`` goes one
step further: after three eager warm-up steps the whole step (forward, backward, norm, gated
update, running mean, record) is captured once as a CUDA graph and replayed, with the batch
copied into fixed input buffers and the learning rate written into AdamW's device
hyperparameters before each replay; the GPU then runs the step without per-kernel launch gaps.

Exact resume: a checkpoint holds weights, optimizer state (gathered under ZeRO-1; one file per
rank under FSDP/TP/PP, which must resume with the same layout), every data-parallel replica's
sampler state, the RNG states and the spike statistics; on resume ``metrics.jsonl`` is cut back
to the checkpoint's step, so the logged loss curve continues exactly as if never interrupted.
With ``train.matmul`` tuned it also records which GEMM kernel each problem chose, and a resumed
run uses the same ones (on the same GPU and cuBLAS) rather than timing them again.
Simplification: a skipped step still consumes its data and advances the iteration/schedule.
Exercised by ``lmforge train --config configs/tiny.toml`` and ``pytest tests/test_train_e2e.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from lmforge.model.mup import lr_multipliers
from lmforge.train.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    load_optimizer_state,
    prune_checkpoints,
    read_trainer_state,
    save_checkpoint,
    save_optimizer_state,
)
from lmforge.train.data import (
    MixtureSampler,
    TokenShard,
    _to_device,
    bits_per_byte,
    bytes_per_token,
    eval_batches,
    open_source,
)
from lmforge.train.loss import cross_entropy
from lmforge.train.optim import AdamW, grad_norm_and_clip_coef
from lmforge.train.plan import TrainingPlan, training_plan
from lmforge.train.schedule import lr_at
from lmforge.utils.config import config_to_dict, save_config
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text
from lmforge.utils.runtime import Runtime, resolve_device

if TYPE_CHECKING:
    from lmforge.config import RunConfig
    from lmforge.parallel import Strategy


# ----------------------------------------------------------------------------- outside wrappers


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(cls):  # type: ignore[misc, valid-type]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return super().forward(*args, **kwargs)
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)

    Checkpointed.__name__ = Checkpointed.__qualname__ = f"Checkpointed{cls.__name__}"
    return Checkpointed


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block of ``model.layers`` in backward instead of storing its activations.

    Each block's class is swapped for a subclass whose ``forward`` runs under
    ``torch.utils.checkpoint`` (non-reentrant), so module and parameter names do not change and
    checkpoints stay interchangeable. Returns ``model`` (modified in place).
    """
    for block in model.layers:
        block.__class__ = _checkpointed_class(type(block))
    return model


def _param_groups(
    params: list[nn.Parameter], weight_decay: float, lr_mults: list[float] | None = None
) -> list[dict[str, Any]]:
    # Matrices (projections, embeddings) decay; gains (norm weights) do not. muP's per-parameter
    # LR multipliers (lr_mults, one per param) split groups further; launch_step applies lr_mult.
    mults = lr_mults or [1.0] * len(params)
    groups = []
    for decay in (True, False):
        for m in sorted({m for p, m in zip(params, mults) if (p.ndim >= 2) == decay}):
            ps = [p for p, pm in zip(params, mults) if (p.ndim >= 2) == decay and pm == m]
            groups.append({"params": ps, "weight_decay": weight_decay if decay else 0.0})
            if m != 1.0:
                groups[-1]["lr_mult"] = m
    return groups


def _resolve(forced: str | None, blockers: list[str], auto_wants: bool) -> bool:
    """An on/auto setting resolved. ``forced`` (e.g. "train.matmul=tuned") needs every blocker
    cleared, else one error line naming them; auto (None) is on where nothing blocks and
    ``auto_wants``."""
    if forced is not None:
        if blockers:
            raise LmforgeError(f"{forced} needs " + " and ".join(blockers))
        return True
    return not blockers and auto_wants


def _tuned_choices() -> dict[str, dict]:
    from lmforge.kernels import _cublaslt

    return _cublaslt.choices()


def _set_tuned_matmul(model: torch.nn.Module, on: bool) -> None:
    """Route the model's Linear GEMMs (and the fused loss's) through the tuned GEMM op, or back
    to torch's matmul."""
    from lmforge.kernels import matmul
    from lmforge.model.layers import Linear

    matmul.TUNED = on
    for m in model.modules():
        if isinstance(m, Linear):
            m.matmul = matmul.linear if on else None


def bf16_weight_copies(model: nn.Module) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Turn the matmul weights of ``model`` into bf16 copies of fp32 master weights, in place.

    Every :class:`~lmforge.model.layers.Linear` weight (not one tied to the token embedding)
    becomes a bf16 Parameter (same object, same name); its fp32 values move to a master tensor
    the optimizer updates (``AdamW(copies=…)``), rewriting the copy each step. Under bf16
    autocast the forward and backward are then exactly those of fp32 weights — autocast would
    round each weight to bf16 for its matmul, and its weight gradient comes out of the matmul
    in bf16 — without the per-step cast kernels: ~170 fewer kernels a GPT-2-small step.
    Embeddings and norm gains stay fp32. Returns ``{name: (copy parameter, fp32 master)}``.
    """
    from lmforge.model.layers import Linear

    linear = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    embeddings = getattr(model, "token_embeddings", None)
    if embeddings is not None:
        linear.discard(id(embeddings.weight))  # tied LM head: the embedding stays fp32
    out: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if id(p) in linear and p.dtype == torch.float32:
            master = p.detach().clone()
            p.data = p.data.to(torch.bfloat16)
            out[name] = (p, master)
    return out


def _auto_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device)


# ----------------------------------------------------------------------------- RNG state


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ----------------------------------------------------------------------------- logging


class _Loggers:
    """metrics.jsonl always; TensorBoard and W&B only when asked for (imported then)."""

    def __init__(self, out_dir: Path, tensorboard: bool, wandb_project: str, config: dict) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = None
        self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise LmforgeError(
                    "train.tensorboard=true needs the tensorboard package (pip install tensorboard)"
                ) from None
            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise LmforgeError(
                    "train.wandb is set but the wandb package is missing (pip install wandb)"
                ) from None
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(out_dir))

    def log(self, record: dict[str, Any]) -> None:
        # One line per record, flushed, so a killed run loses at most the line being written.
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = int(record.get("step", 0))
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (a torn last line from a killed run is skipped)."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _truncate_metrics(path: Path, iteration: int) -> None:
    # A killed run may have logged steps after its last checkpoint; the resumed run redoes them.
    records = [r for r in read_metrics(path) if int(r.get("step", 0)) <= iteration]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def plot_loss_curve(metrics: list[dict[str, Any]], path: str | Path) -> None:
    """Write train (and validation) loss against step to a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in metrics if r.get("event") == "train"]
    val = [(r["step"], r["val_loss"]) for r in metrics if r.get("event") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the trainer


@dataclasses.dataclass
class _Pending:
    """A launched step whose loss and norm may still be on their way to the host."""

    iteration: int  # the trainer's iteration after this step
    lr: float
    values: torch.Tensor  # (loss, norm, ok, running mean before, running mean after, good before)
    event: Any = None  # torch.cuda.Event recorded after the copy (CUDA only)
    reason: str | None = None  # the host's skip reason (synchronous steps only)


_GRAPH_WARMUP_STEPS = 3


@dataclasses.dataclass
class _StepGraph:
    """A captured training step: replaying ``graph`` reads ``inputs`` and writes ``values``."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[tuple[torch.Tensor, torch.Tensor]]  # fixed (x, y) buffers per micro-batch
    values: torch.Tensor  # the step's record, as _gated_update returns it


class Trainer:
    """One training run from a :class:`~lmforge.config.RunConfig`.

    Uses only the ``model``, ``train``, ``data`` and ``parallel`` branches. ``Trainer(cfg,
    runtime).run()`` returns the final metrics; construction builds the model, strategy,
    optimizer and data and restores the latest checkpoint when ``train.resume`` is on.
    """

    def __init__(
        self, cfg: RunConfig, runtime: Runtime | None = None, callbacks: Sequence[Callable] = ()
    ) -> None:
        self.run_config = cfg
        # cb(trainer, step, metrics) on rank 0 after each good step; keys added are logged.
        self.callbacks = list(callbacks)
        self.mcfg, self.tcfg, self.dcfg, self.pcfg = cfg.model, cfg.train, cfg.data, cfg.parallel
        tc = self.tcfg
        if runtime is None:
            runtime = Runtime(device=_auto_device(tc.device), seed=tc.seed)
        self.runtime = runtime
        self.device = runtime.device
        self.device_type = torch.device(self.device).type
        self.T = tc.context_length or self.mcfg.context_length
        self._validate()
        # Data first: a missing shard or a vocabulary mismatch fails before a big model is built.
        sources = [open_source(src, self.mcfg.vocab_size) for src in self.dcfg.train]
        self.val_shards: list[TokenShard] = [
            s for src in self.dcfg.val for s in open_source(src, self.mcfg.vocab_size)
        ]
        self.val_bytes_per_token = bytes_per_token(self.val_shards) if self.val_shards else None

        from lmforge.model import TransformerLM

        torch.manual_seed(tc.seed)  # same initial weights on every rank and every rerun
        model = TransformerLM(self.mcfg, device=self.device)
        self.model = model
        # name -> (bf16 parameter, fp32 master) under train.master_weights
        self.masters = bf16_weight_copies(model) if self._pick_master_weights() else {}
        self.tuned_matmul = self._pick_matmul()
        _set_tuned_matmul(model, self.tuned_matmul)  # also resets a previous trainer's switch
        if tc.activation_checkpointing:
            apply_activation_checkpointing(model)
        self._ce: Callable[..., torch.Tensor] = cross_entropy
        self._fused_loss: Callable[..., torch.Tensor] = _fused_model_loss
        self._model_loss: Callable[..., torch.Tensor] | None = None
        if tc.compile:
            mode = tc.compile_mode
            model.compile(mode=mode)
            self._ce = torch.compile(cross_entropy, mode=mode)
            # Forward and loss in one graph: the (B, T, V) logits and their fp32 upcast stay inside
            # it (fused by the compiler) instead of being materialised between two graphs.
            self._model_loss = torch.compile(_model_loss, mode=mode)
            # Likewise hidden states + fused loss: the kernels are custom ops the compiler traces,
            # so model and LM-head loss are one graph (the fused loss is single-process only).
            self._fused_loss = torch.compile(_fused_model_loss, mode=mode)
        self.fused = self._pick_fused_loss()
        self.strategy = self._build_strategy(model)
        self.is_main = self.strategy.is_main
        adamw = self._pick_adamw()
        # Master weights: the optimizer updates the fp32 masters in place of the model's bf16
        # weights, reads the gradients from those, and writes them back.
        to_master = {id(p): m for p, m in self.masters.values()}
        mup_mults = lr_multipliers(model)  # {} unless model.mup
        self.optimizer = self.strategy.make_optimizer(
            lambda ps: AdamW(
                _param_groups(
                    [to_master.get(id(p), p) for p in ps],
                    tc.weight_decay,
                    [mup_mults.get(id(p), 1.0) for p in ps],
                ),
                lr=tc.lr,
                betas=(tc.beta1, tc.beta2),
                eps=tc.eps,
                weight_decay=tc.weight_decay,
                compiled=adamw == "compiled",
                fused=adamw == "triton",
                copies={m: p for p, m in self.masters.values()},
            )
        )
        # The sync-free step (see the module docstring) on one CUDA process with lmforge's AdamW.
        # (On a CPU nothing runs ahead of the host, and the gated update's per-tensor
        # where(...) costs more than the foreach update; tests switch it on to compare.)
        # With master weights always: clipping then scales the bf16 gradients inside the update
        # (in fp32), never in place.
        self.deferred = (
            self.strategy.world_size == 1
            and isinstance(self.optimizer, AdamW)
            and (self.device_type == "cuda" or bool(self.masters))
        )
        self._dev_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # (ema, good) on device
        # One plain process: clipping can go into the update, and the step can be captured.
        from lmforge.parallel import Strategy

        self._single_process = type(self.strategy) is Strategy
        self._graph: _StepGraph | None = None
        self._graph_warmups = 0  # eager steps run on the capture stream so far
        self._graph_off = False  # a capture failed: eager steps from then on
        self._graph_stream: torch.cuda.Stream | None = None
        # Data parallelism decides tokens per step and which windows a rank draws; tp/pp ranks
        # of one replica must see the same batch (distributed strategies expose dp_size, mesh).
        dp_size = int(getattr(self.strategy, "dp_size", self.strategy.world_size))
        dp_rank = int(getattr(self.strategy, "dp_rank", self.strategy.rank))
        self.plan: TrainingPlan = training_plan(self.mcfg, tc, dp_size)

        self.dp_rank = dp_rank
        seed = tc.seed + 1_000_003 * dp_rank  # each replica draws its own windows
        self.sampler_sources = sources
        self.sampler = MixtureSampler(
            sources, self.T, self.dcfg.weights, seed=seed, vocab_size=self.mcfg.vocab_size
        )

        self.out_dir = Path(tc.out_dir)
        self.iteration = 0
        self.bad_steps = 0
        self.loss_ema: float | None = None
        self.good_steps = 0
        self.resumed_from: Path | None = None
        latest = latest_checkpoint(self.out_dir)
        if latest is not None:
            if not tc.resume:
                raise LmforgeError(
                    f"train.out_dir {self.out_dir} already holds checkpoints (latest {latest.name}); "
                    "use a new train.out_dir or train.resume=true"
                )
            self._restore(latest)

    # -- setup helpers

    def _validate(self) -> None:
        tc, mc = self.tcfg, self.mcfg
        if not self.dcfg.train:
            raise LmforgeError(
                "data.train is empty: give token shards, e.g. --data.train='[\"shards/train.bin\"]'"
            )
        if self.T > mc.context_length:
            raise LmforgeError(
                f"train.context_length {self.T} exceeds model.context_length {mc.context_length}"
            )
        for key in ("batch_size", "grad_accum", "max_steps"):
            if getattr(tc, key) <= 0:
                raise LmforgeError(f"train.{key} must be positive, got {getattr(tc, key)}")
        if tc.precision == "fp16":
            raise LmforgeError(
                "train.precision=fp16 needs loss scaling, which is not implemented; use bf16"
            )
        if tc.loss == "fused" and mc.logit_soft_cap is not None:
            raise LmforgeError(
                "train.loss=fused cannot apply model.logit_soft_cap (the fused kernel never forms "
                "the logits); use train.loss=reference or unset the soft-cap"
            )

    def _pick_adamw(self) -> str:
        # train.adamw resolved: the Triton update needs CUDA, Triton and one process (sharded
        # strategies hand the optimizer shards or DTensors); auto falls back as documented.
        tc = self.tcfg
        if tc.adamw not in ("auto", "foreach", "compiled", "triton"):
            raise LmforgeError(
                f"train.adamw must be auto, foreach, compiled or triton, got {tc.adamw!r}"
            )
        from lmforge.kernels import triton_available

        usable = self.device_type == "cuda" and triton_available()
        if tc.adamw == "triton" and not (usable and self.runtime.world_size == 1):
            raise LmforgeError(
                "train.adamw=triton needs one CUDA process with the 'triton' package; "
                "use train.adamw=auto"
            )
        if tc.adamw != "auto":
            return tc.adamw
        if usable and self.runtime.world_size == 1:
            return "triton"
        # With compile on a GPU the update is compiled too (one fused kernel a tensor).
        return "compiled" if tc.compile and self.device_type == "cuda" else "foreach"

    def _pick_master_weights(self) -> bool:
        # train.master_weights resolved: bf16 matmul weights with fp32 masters need bf16
        # autocast, one plain process, and no accumulation (bf16 gradients would be summed in
        # bf16 across micro-batches).
        tc = self.tcfg
        if tc.master_weights not in ("auto", "on", "off"):
            raise LmforgeError(
                f"train.master_weights must be auto, on or off, got {tc.master_weights!r}"
            )
        if tc.master_weights == "off":
            return False
        blockers = []
        if tc.precision != "bf16":
            blockers.append(f"train.precision=bf16 (got {tc.precision})")
        if self.runtime.world_size > 1:
            blockers.append("one process (sharded strategies keep their own fp32 weights)")
        if tc.grad_accum != 1:
            blockers.append(
                f"train.grad_accum=1 (got {tc.grad_accum}: bf16 gradients would be summed in bf16)"
            )
        forced = "train.master_weights=on" if tc.master_weights == "on" else None
        return _resolve(forced, blockers, self.device_type == "cuda")

    def _pick_matmul(self) -> bool:
        # train.matmul resolved: the tuned GEMMs need CUDA (cuBLASLt) and one plain process
        # (sharded strategies hand the layers DTensors or wrap them).
        tc = self.tcfg
        if tc.matmul not in ("auto", "torch", "tuned"):
            raise LmforgeError(f"train.matmul must be auto, torch or tuned, got {tc.matmul!r}")
        if tc.matmul == "torch":
            return False
        blockers = []
        if self.device_type != "cuda":
            blockers.append(f"a CUDA device (got {self.device})")
        if self.runtime.world_size > 1:
            blockers.append("one process")
        if not blockers:
            from lmforge.kernels import _cublaslt

            if not _cublaslt.available():
                blockers.append("cuBLASLt (not found in this process)")
        # auto: only for a captured step. Eager, each tuned GEMM costs the host a Python custom
        # op and a ctypes call, and the GPT-2-small step on an H200 came out slower (55.6 vs
        # 55.3 ms/step); replayed from a CUDA graph it costs nothing (benchmarks/RESULTS.md,
        # ninth session).
        return _resolve("train.matmul=tuned" if tc.matmul == "tuned" else None, blockers,
                        tc.cuda_graph)  # fmt: skip

    def _pick_fused_loss(self) -> Callable[..., torch.Tensor] | None:
        tc = self.tcfg
        if tc.loss_chunk_rows < 0:
            raise LmforgeError(f"train.loss_chunk_rows must be 0 or more, got {tc.loss_chunk_rows}")
        if tc.loss == "reference" or (tc.loss == "auto" and self.mcfg.logit_soft_cap is not None):
            return None
        if self.runtime.world_size > 1:
            # The fused loss reads lm_head.weight directly, outside the wrapped model's forward,
            # which distributed wrappers (DDP hooks, FSDP/TP shards) do not see.
            if tc.loss == "fused":
                raise LmforgeError(
                    "train.loss=fused is single-process only for now; use train.loss=reference"
                )
            return None
        try:
            from lmforge.kernels import fused_linear_cross_entropy
        except ImportError:
            if tc.loss == "fused":
                raise LmforgeError(
                    "train.loss=fused but lmforge.kernels.fused_linear_cross_entropy is unavailable"
                ) from None
            return None
        if tc.loss == "auto" and self.device_type != "cuda":
            return None
        return fused_linear_cross_entropy

    def _build_strategy(self, model: nn.Module) -> Strategy:
        from lmforge.parallel import Strategy

        if self.runtime.world_size > 1:
            try:
                from lmforge.parallel import build_strategy
            except ImportError:
                raise LmforgeError(
                    "distributed launch (WORLD_SIZE>1) but lmforge.parallel.build_strategy is unavailable"
                ) from None
            return build_strategy(model, self.pcfg, self.runtime)
        return Strategy(model)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.tcfg.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=torch.bfloat16)

    def loss_fn(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of one micro-batch x (B, T), y (B, T) (the strategy's LossFn)."""
        with self._autocast():
            if self.fused is not None:
                return self._fused_loss(
                    self.model, self.fused, x, y, self.tcfg.z_loss, self.tcfg.loss_chunk_rows
                )
            if self._model_loss is not None and self.strategy.world_size == 1:
                return self._model_loss(model, x, y, self.tcfg.z_loss)
            logits = model(x)  # (B, T, V)
            return self._ce(logits, y, z_loss=self.tcfg.z_loss)

    # -- checkpoints

    def _sampler_states(self) -> dict[str, Any]:
        # Every data-parallel replica has its own data position; all go into the checkpoint.
        mine = (self.dp_rank, self.sampler.state_dict())
        if self.strategy.world_size == 1 or not torch.distributed.is_initialized():
            return {str(mine[0]): mine[1]}
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        return {str(r): st for r, st in gathered}

    def _trainer_state(self, samplers: dict[str, Any]) -> dict[str, Any]:
        return {
            "schedule": {
                "name": self.tcfg.schedule,
                "lr": self.current_lr,
                "max_steps": self.tcfg.max_steps,
            },
            "samplers": samplers,
            "rng": _rng_state(),
            "bad_steps": self.bad_steps,
            "loss_ema": self.loss_ema,
            "good_steps": self.good_steps,
            "tuned_gemms": _tuned_choices() if self.tuned_matmul else {},
        }

    def _restore(self, ckpt: Path) -> None:
        meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
        saved_ranks = int(meta.get("optimizer_ranks", 1))
        per_rank = self._optimizer_is_per_rank()
        want = self.strategy.world_size if per_rank else 1
        if saved_ranks != want:
            raise LmforgeError(
                f"checkpoint {ckpt} holds {saved_ranks} optimizer state(s) but this parallel "
                f"layout needs {want}; resume with the layout that wrote it"
            )
        rank = self.strategy.rank
        own = per_rank and rank > 0
        it = load_checkpoint(
            ckpt,
            None,
            None if own else self.optimizer,
            load_model=self._load_model_state,
        )
        if own:
            load_optimizer_state(ckpt / f"optimizer-rank{rank:05d}.safetensors", self.optimizer)
        state = read_trainer_state(ckpt)
        samplers = state.get("samplers", {})
        if str(self.dp_rank) in samplers:
            self.sampler.load_state_dict(samplers[str(self.dp_rank)])
        else:
            # A replica the checkpoint did not have (more data-parallel ranks than before):
            # a fresh stream, seeded by rank and step, so replicas still differ.
            self.sampler = MixtureSampler(
                self.sampler_sources,
                self.T,
                self.dcfg.weights,
                seed=self.tcfg.seed + 1_000_003 * self.dp_rank + it,
                vocab_size=self.mcfg.vocab_size,
            )
        _set_rng_state(state["rng"])
        if self.tuned_matmul and state.get("tuned_gemms"):
            from lmforge.kernels import _cublaslt

            _cublaslt.preset_choices(state["tuned_gemms"])  # the same kernels, the same bits
        self._dev_stats = None  # rebuilt from the restored host values at the next step
        self.bad_steps = int(state.get("bad_steps", 0))
        self.loss_ema = state.get("loss_ema")
        self.good_steps = int(state.get("good_steps", 0))
        self.iteration = it
        self.resumed_from = ckpt

    def _load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        # The checkpoint's fp32 weights go to the masters as they are, and rounded to the copies.
        self.strategy.load_full_state_dict(state)
        with torch.no_grad():
            for name, (copy, master) in self.masters.items():
                master.copy_(state[name])
                copy.copy_(master)

    def _optimizer_is_per_rank(self) -> bool:
        # Single process, DDP and ZeRO-1 (whose state_dict gathers) have one optimizer state;
        # FSDP, tensor and pipeline parallelism keep a different local state on every rank.
        if self.strategy.world_size == 1:
            return False
        return bool(getattr(self.strategy, "per_rank_optimizer_state", True))

    def save(self, val_loss: float | None = None) -> Path:
        """Checkpoint the current state to ``out_dir/checkpoints/step_…`` and prune old ones.

        Every rank must call it (the gathers are collectives). With a per-rank optimizer state
        (FSDP, TP, PP) rank r > 0 writes ``optimizer-rank{r}.safetensors`` into a staging folder
        that rank 0 moves into the checkpoint before the atomic rename.
        """
        state = self.strategy.full_state_dict()  # a collective in sharded strategies: every rank
        for name, (_, master) in self.masters.items():
            state[name] = master  # the fp32 weights, not their bf16 copies
        samplers = self._sampler_states()  # also a collective
        opt_state = self.optimizer.state_dict()  # gathered (a collective) under ZeRO-1
        path = checkpoint_path(self.out_dir, self.iteration)
        per_rank = self._optimizer_is_per_rank()
        staging = path.parent / f".staging-{path.name}"
        if per_rank:
            rank = self.strategy.rank
            if rank > 0:
                staging.mkdir(parents=True, exist_ok=True)
                save_optimizer_state(staging / f"optimizer-rank{rank:05d}.safetensors", opt_state)
            self.strategy.barrier()
        if self.is_main:
            save_checkpoint(
                path,
                state,
                opt_state,
                self.iteration,
                trainer_state=self._trainer_state(samplers),
                config=self.run_config,
                tokenizer_dir=self.dcfg.tokenizer or None,
                meta={
                    "val_loss": val_loss,
                    "tokens": self.iteration * self.plan.tokens_per_step,
                    "optimizer_ranks": self.strategy.world_size if per_rank else 1,
                },
                extra_dir=staging if per_rank else None,
            )
            prune_checkpoints(self.out_dir, self.tcfg.keep_last)
        self.strategy.barrier()
        return path

    # -- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss, perplexity and bits per byte over fixed sequential windows."""
        if not self.val_shards:
            return {}
        model = self.strategy.model
        model.eval()
        total = 0.0
        count = 0
        for x_np, y_np in eval_batches(
            self.val_shards, self.tcfg.batch_size, self.T, self.tcfg.eval_batches
        ):
            x, y = _to_device(x_np, self.device), _to_device(y_np, self.device)
            loss = self.loss_fn(model, x, y)
            n = y.numel()
            total += float(loss) * n
            count += n
        model.train()
        if count == 0:
            return {}
        val = total / count
        out = {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
        if self.val_bytes_per_token:
            out["val_bpb"] = bits_per_byte(val, self.val_bytes_per_token)
        return out

    # -- the loop

    def _bad_reason(self, loss: float, norm: float) -> str | None:
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if not math.isfinite(norm):
            return f"non-finite gradient norm {norm}"
        f = self.tcfg.spike_factor
        if (
            f > 0
            and self.loss_ema is not None
            and self.good_steps >= 10
            and loss > f * self.loss_ema
        ):
            return f"loss spike {loss:.4f} > {f} × running mean {self.loss_ema:.4f}"
        return None

    def _time_is_up(self, mine: bool) -> bool:
        # Every rank must stop at the same step, or the next collective hangs.
        if self.strategy.world_size == 1 or not torch.distributed.is_initialized():
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def train_step(self) -> tuple[float, float, str | None]:
        """One optimizer step (or a skipped one); returns (loss, grad norm, skip reason).

        Waits for the step to finish; :meth:`run` instead reads each step one step late
        (:meth:`launch_step` the next, then :meth:`finish_step` the previous).
        """
        return self.finish_step(self.launch_step())

    def launch_step(self) -> _Pending:
        """Launch one step without waiting for it; :meth:`finish_step` reads its result."""
        tc = self.tcfg
        self.current_lr = lr_at(
            self.iteration,
            tc.schedule,
            tc.lr,
            tc.min_lr,
            tc.warmup_steps,
            tc.max_steps,
            tc.decay_fraction,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr * group.get("lr_mult", 1.0)
        micro = [self.sampler.next_batch(tc.batch_size, self.device) for _ in range(tc.grad_accum)]
        if self._graph_wanted():
            values, reason = self._graph_step(micro), None
        else:
            values, reason = self._step_body(micro)
        self.iteration += 1
        pending = _Pending(self.iteration, self.current_lr, values, reason=reason)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            pending.values = host.copy_(values, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def _step_body(
        self, micro: list[tuple[torch.Tensor, torch.Tensor]], capturing: bool = False
    ) -> tuple[torch.Tensor, str | None]:
        # Forward/backward, clip and update of one step; (record, host skip reason). Everything
        # here is also what a CUDA graph captures, so no host reads on the deferred path.
        tc = self.tcfg
        loss = self.strategy.forward_backward(micro, self.loss_fn)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf
        reason = None
        if self.deferred:
            scale = None
            if self._single_process:  # plain gradients: clip inside the update
                norm, scale = grad_norm_and_clip_coef(self.model.parameters(), max_norm)
            else:
                norm = self.strategy.clip_grad_norm(max_norm)
            values = self._gated_update(
                loss.float(), norm.float().to(loss.device), scale, refresh=not capturing
            )
        else:
            norm = self.strategy.clip_grad_norm(max_norm)
            # The one host sync of a step: loss and norm decide whether the update is applied.
            values = torch.stack([loss.float(), norm.float().to(loss.device)])
            reason = self._bad_reason(*values.tolist())
            if reason is None:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return values, reason

    # -- CUDA graph of the whole step

    def _graph_wanted(self) -> bool:
        return (
            self.tcfg.cuda_graph
            and not self._graph_off
            and self.deferred
            and self.device_type == "cuda"
            and self._single_process
        )

    def _graph_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One step through the captured graph (capturing it first, after the warm-up steps)."""
        g = self._graph
        if g is None:
            stream = self._graph_stream
            if stream is None:
                stream = self._graph_stream = torch.cuda.Stream(device=self.device)
            cur = torch.cuda.current_stream(self.device)
            stream.wait_stream(cur)
            if self._graph_warmups < _GRAPH_WARMUP_STEPS:
                # Warm-up on the capture stream: compilation, autotuning, lazy library set-up and
                # optimizer state all happen here, outside the capture.
                with torch.cuda.stream(stream):
                    values, _ = self._step_body(micro)
                cur.wait_stream(stream)
                self._graph_warmups += 1
                return values
            static = [(x.clone(), y.clone()) for x, y in micro]
            self.optimizer.load_hyperparameters()
            cur.synchronize()
            # The graph gets its own memory pool: hand the eager warm-up's cached blocks back
            # first, so the footprint is one step's working set, not two.
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=stream):
                    values, _ = self._step_body(static, capturing=True)
            except Exception as e:  # e.g. an op that cannot be captured: stay eager
                self._graph_off = True
                self.optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                print(
                    f"lmforge train: CUDA graph capture failed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); continuing without it",
                    file=sys.stderr,
                )
                return self._step_body(micro)[0]
            g = self._graph = _StepGraph(graph, static, values)
        for (sx, sy), (x, y) in zip(g.inputs, micro):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        self.optimizer.load_hyperparameters()
        g.graph.replay()
        return g.values

    def _gated_update(
        self,
        loss: torch.Tensor,
        norm: torch.Tensor,
        grad_scale: torch.Tensor | None = None,
        refresh: bool = True,
    ) -> torch.Tensor:
        """Decide on the device whether the step is good, update only then; return the record
        (loss, norm, ok, mean before, mean after, good steps before) as a device tensor.
        The running statistics are updated in place (a captured graph keeps their addresses)."""
        if self._dev_stats is None:  # from the host mirrors (fresh run or resumed checkpoint)
            ema = math.nan if self.loss_ema is None else self.loss_ema
            self._dev_stats = (
                torch.tensor(ema, dtype=torch.float32, device=loss.device),
                torch.tensor(float(self.good_steps), dtype=torch.float32, device=loss.device),
            )
        ema, good = self._dev_stats
        ok = torch.isfinite(loss) & torch.isfinite(norm)
        f = self.tcfg.spike_factor
        if f > 0:  # NaN mean (no good step yet) compares False: no spike
            ok = ok & ~((good >= 10) & (loss > f * ema))
        self.optimizer.step_if(ok, grad_scale=grad_scale, refresh=refresh)
        new_ema = torch.where(
            ok, torch.where(torch.isnan(ema), loss, 0.95 * ema + 0.05 * loss), ema
        )
        record = torch.stack([loss, norm, ok.float(), ema, new_ema, good])
        ema.copy_(new_ema)
        good.add_(ok.float())
        return record

    def finish_step(self, pending: _Pending) -> tuple[float, float, str | None]:
        """Wait for a launched step's record; update the host counters; (loss, norm, reason).

        Launched steps must be finished in order (the counters are updated step by step).
        """
        if pending.event is not None:
            pending.event.synchronize()
        vals = pending.values.tolist()
        loss_v, norm_v = vals[0], vals[1]
        if not self.deferred:
            reason = pending.reason  # decided in launch_step, before the counters below move
            if reason is None:
                self.loss_ema = (
                    loss_v if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * loss_v
                )
        else:
            ok, ema_before, ema_after, good_before = vals[2:]
            reason = None
            if not ok:  # the device's decision, explained with the same rules
                saved = self.loss_ema, self.good_steps
                self.loss_ema = None if math.isnan(ema_before) else ema_before
                self.good_steps = int(good_before)
                reason = self._bad_reason(loss_v, norm_v) or "skipped on the device"
                self.loss_ema, self.good_steps = saved
            # The device's fp32 mean, exactly: a resume starts the device from this value.
            self.loss_ema = None if math.isnan(ema_after) else ema_after
        if reason is None:
            self.bad_steps = 0
            self.good_steps += 1
        else:
            self.bad_steps += 1
        return loss_v, norm_v, reason

    def run(self) -> dict[str, Any]:
        """Train until ``max_steps`` or ``max_minutes``; final eval, checkpoint and plot."""
        from tqdm import tqdm

        tc, plan = self.tcfg, self.plan
        self.current_lr = 0.0
        loggers = None
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.run_config, self.out_dir / "config.toml")
            if self.resumed_from is not None:
                _truncate_metrics(self.out_dir / "metrics.jsonl", self.iteration)
            else:  # a fresh run: nothing from an earlier attempt that never checkpointed
                atomic_write_text(self.out_dir / "metrics.jsonl", "")
            loggers = _Loggers(
                self.out_dir, tc.tensorboard, tc.wandb, config_to_dict(self.run_config)
            )
            plan_rec = {
                "event": "plan",
                "step": self.iteration,
                **{k: v for k, v in vars(plan).items()},
            }
            if self.resumed_from is not None:
                plan_rec["resumed_from"] = str(self.resumed_from)
            loggers.log(plan_rec)
            print(
                f"lmforge train: {plan.n_params / 1e6:.2f}M params, {plan.tokens_per_step} tokens/step, "
                f"{plan.max_steps} steps = {plan.total_tokens / 1e6:.2f}M tokens, "
                f"{plan.flops_per_step:.3g} FLOPs/step, device {self.device}"
                + (f", resumed from {self.resumed_from}" if self.resumed_from else ""),
                file=sys.stderr,
            )
        bar = tqdm(
            total=tc.max_steps,
            initial=self.iteration,
            desc="train",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not (tc.progress and self.is_main),
        )
        start = time.monotonic()
        last_t, last_it = start, self.iteration
        last_eval: dict[str, float] = {}
        last_loss = float("nan")
        stopped = "max_steps"

        tuning: str | None = None  # the tuned GEMMs' summary before this run's first step
        if self.tuned_matmul:
            from lmforge.kernels import _cublaslt

            tuning = _cublaslt.summary()

        def report(p: _Pending) -> None:
            # Host side of a finished step: skip handling and logs (reads its record).
            nonlocal last_t, last_it, last_loss, tuning
            loss_v, norm_v, reason = self.finish_step(p)
            it = p.iteration
            if reason is not None:
                if loggers:
                    loggers.log(
                        {
                            "event": "skip",
                            "step": it,
                            "loss": loss_v,
                            "grad_norm": norm_v,
                            "reason": reason,
                        }
                    )
                if self.is_main:
                    bar.write(f"step {it}: skipped ({reason})", file=sys.stderr)
                if self.bad_steps >= tc.max_bad_steps:
                    latest = latest_checkpoint(self.out_dir)
                    raise LmforgeError(
                        f"stopped at step {it} after {self.bad_steps} consecutive bad steps "
                        f"(last: {reason}); last good checkpoint: {latest or 'none'}"
                    )
            else:
                last_loss = loss_v
            extra: dict[str, Any] = {}
            if reason is None and self.is_main:
                for cb in self.callbacks:
                    cb(self, it, extra)
            if extra and loggers and not (it % tc.log_every == 0 or it == tc.max_steps):
                loggers.log({"event": "callbacks", "step": it, **extra})
            if tuning is not None and self.is_main:  # the first step tuned the GEMMs
                from lmforge.kernels import _cublaslt

                line = _cublaslt.summary()
                if line and line != tuning:
                    bar.write(f"lmforge train: {line}", file=sys.stderr)
                tuning = None
            if it % tc.log_every == 0 or it == tc.max_steps:
                now = time.monotonic()
                dt = max(now - last_t, 1e-9)
                tok_s = (it - last_it) * plan.tokens_per_step / dt
                mfu = tok_s * plan.flops_per_token / (tc.peak_tflops * 1e12)
                last_t, last_it = now, it
                rec = {
                    "event": "train",
                    "step": it,
                    "loss": loss_v,
                    "lr": p.lr,
                    "grad_norm": norm_v,
                    "tokens": it * plan.tokens_per_step,
                    "tokens_per_s": tok_s,
                    "mfu": mfu,
                    "elapsed_s": now - start,
                    **extra,
                }
                if loggers:
                    loggers.log(rec)
                bar.set_postfix(
                    loss=f"{loss_v:.4f}", tok_s=f"{tok_s:,.0f}", mfu=f"{100 * mfu:.1f}%"
                )

        pending: _Pending | None = None
        try:
            while self.iteration < tc.max_steps:
                launched = self.launch_step()
                it = self.iteration
                bar.update(1)
                if tc.max_minutes and it - bar.initial == 20:
                    # A time-limited run: size the bar (and its ETA) to the steps the budget allows.
                    per_step = (time.monotonic() - start) / 20
                    budget = int(60 * tc.max_minutes / max(per_step, 1e-9))
                    bar.total = min(tc.max_steps, bar.initial + budget)
                    bar.refresh()
                if pending is not None:
                    report(pending)  # the previous step, read while this one runs
                    pending = None
                eval_due = bool(tc.eval_every) and it % tc.eval_every == 0 and it < tc.max_steps
                save_due = bool(tc.save_every) and it % tc.save_every == 0 and it < tc.max_steps
                time_up = bool(tc.max_minutes) and self._time_is_up(
                    time.monotonic() - start > 60 * tc.max_minutes
                )
                if not self.deferred or eval_due or save_due or time_up or it == tc.max_steps:
                    report(launched)  # the loop looks at the model after this step: read it now
                else:
                    pending = launched
                if eval_due:
                    last_eval = self.evaluate()
                    if last_eval and loggers:
                        loggers.log({"event": "eval", "step": it, **last_eval})
                if save_due:
                    self.save(last_eval.get("val_loss"))
                if time_up:
                    stopped = "max_minutes"
                    break
            if pending is not None:
                report(pending)
            bar.close()
            final = self.evaluate()
            if final and loggers:
                loggers.log({"event": "eval", "step": self.iteration, **final})
            # Saved even if a periodic save just wrote this step: the final one records val_loss.
            ckpt = self.save(final.get("val_loss"))
            elapsed = time.monotonic() - start
            result: dict[str, Any] = {
                "iteration": self.iteration,
                "stopped": stopped,
                "train_loss": last_loss,
                **final,
                "tokens": self.iteration * plan.tokens_per_step,
                "tokens_seen": self.iteration * plan.tokens_per_step,
                "elapsed_s": elapsed,
                "checkpoint": str(ckpt),
            }
            if loggers:
                loggers.log({"event": "final", "step": self.iteration, **result})
                if tc.plot:
                    plot_loss_curve(read_metrics(loggers.path), self.out_dir / "loss_curve.png")
            return result
        finally:
            bar.close()
            if loggers:
                loggers.close()


def _model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, z_loss: float) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y``; compiled as one graph by the trainer."""
    return cross_entropy(model(x), y, z_loss=z_loss)  # logits (B, T, V) never leave the graph


def _fused_model_loss(
    model: nn.Module,
    fused: Callable[..., torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    z_loss: float,
    chunk_rows: int = 0,
) -> torch.Tensor:
    """Mean fused linear + cross-entropy of ``model``'s hidden states against ``y``; compiled as
    one graph by the trainer. ``fused``: ``lmforge.kernels.fused_linear_cross_entropy``;
    ``chunk_rows`` 0 = its default chunk."""
    h = model.forward_hidden(x)  # (B, T, D)
    D = h.shape[-1]
    return fused(
        h.reshape(-1, D),  # (B·T, D)
        model.lm_head.weight,  # (V, D)
        y.reshape(-1),  # (B·T,)
        ignore_index=-100,
        z_loss=z_loss,
        chunk_rows=chunk_rows or None,
        check_targets=False,  # the sampler checked every id against the vocabulary
    )


def train(
    cfg: RunConfig, runtime: Runtime | None = None, callbacks: Sequence[Callable] = ()
) -> dict[str, Any]:
    """Run one training job from a RunConfig; returns the final metrics (see :class:`Trainer`).

    Exercised by ``lmforge train --config configs/tiny.toml`` and by ``lmforge demo``.
    """
    return Trainer(cfg, runtime, callbacks).run()
