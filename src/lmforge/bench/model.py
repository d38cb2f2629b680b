"""``lmforge bench model``: step times, top kernels, memory by category and roofline for a preset.

Measures, for one preset on one device, the :class:`~lmforge.train.Trainer` that ``lmforge
train`` builds (``[train]`` defaults; fp32 on a CPU) on a shard of random tokens:
  * forward (no grad) and forward + backward of the Trainer's loss (autocast, reference or fused
    loss), and a full training step: the Trainer's own (batch draw, forward, backward, clipping,
    skip rule, its AdamW path, sync-free where ``lmforge train`` is), launched one step ahead of
    the read as its loop does — warmup calls, then medians (CUDA events on GPU);
  * a torch-profiler table of the top kernels by device time over two training steps, with NVTX
    ranges ``forward`` / ``forward_backward`` / ``train_step`` for Nsight Systems;
  * peak memory by category: parameters, gradients, optimizer state (with fp32 master weights,
    which the accounting counts there), and activations (the peak during forward + backward
    above what was allocated before), next to ``lmforge.model.accounting.memory_estimate``;
  * the roofline numbers: FLOPs per token from ``accounting.flops_per_token``, achieved TFLOP/s
    and MFU against the device peak (989 TFLOP/s dense bf16 for H100/H200; ``--peak-tflops``).
Simplification: one micro-batch per step (no accumulation). Runs on CPU too (fp32, wall-clock
timing) for smoke tests: ``lmforge bench model --preset tiny --device cpu --steps 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from lmforge.bench.timing import environment_line, markdown_table, time_ms

MIB = 1 << 20


def _nvtx(name: str, on: bool):
    return torch.cuda.nvtx.range(name) if on else contextlib.nullcontext()


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclasses.dataclass
class ModelBenchResult:
    """Everything ``bench model`` measured (times in ms, memory in bytes)."""

    preset: str
    device: str
    batch_size: int
    seq_len: int
    forward_ms: float
    forward_backward_ms: float
    step_ms: float
    tokens_per_s: float
    flops_per_token: float
    tflops: float
    mfu: float | None
    memory: dict[str, int]
    memory_estimate: dict[str, int]
    profile_table: str


def _trainer(cfg, batch_size: int, seq_len: int, device: str, loss: str, work: Path):
    """The Trainer ``lmforge train`` would build for ``cfg`` (``[train]`` defaults, fp32 on a
    CPU), reading a shard of random tokens written under ``work``."""
    import numpy as np

    from lmforge.config import RunConfig
    from lmforge.train import DataConfig, TrainConfig, Trainer
    from lmforge.train.data import write_shard

    tokens = np.random.default_rng(0).integers(
        0, cfg.vocab_size, max(64 * batch_size * seq_len, 1 << 16)
    )
    shard = write_shard(work / "random.bin", tokens, cfg.vocab_size)
    tc = TrainConfig(out_dir=str(work / "run"), device=device, batch_size=batch_size,
                     context_length=seq_len, loss=loss,
                     precision="bf16" if device.startswith("cuda") else "fp32",
                     eval_every=0, save_every=0, save_every_minutes=0.0, progress=False,
                     plot=False)  # fmt: skip
    run = RunConfig(model=cfg, train=tc, data=DataConfig(train=(str(shard),)))
    with contextlib.redirect_stderr(io.StringIO()):  # "no checkpoint in /tmp/...": noise here
        return Trainer(run)


def bench_model(
    preset: str,
    batch_size: int = 8,
    seq_len: int | None = None,
    steps: int = 10,
    warmup: int = 3,
    device: str = "cuda",
    attention: str | None = None,
    norm: str | None = None,
    loss: str = "reference",
    peak_tflops: float = 989.0,
    profile: bool = True,
    rope: str | None = None,
    residual_dtype: str | None = None,
    swiglu: str | None = None,
) -> ModelBenchResult:
    """Time and profile one preset; see the module docstring for what is measured."""
    from lmforge.model import accounting, load_preset

    cfg = load_preset(preset)
    pairs = (
        ("attention", attention),
        ("norm", norm),
        ("rope", rope),
        ("residual_dtype", residual_dtype),
        ("swiglu", swiglu),
    )
    changes = {k: v for k, v in pairs if v is not None}
    cfg = dataclasses.replace(cfg, **changes)
    t = seq_len or min(cfg.context_length, 1024)
    cuda = device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as work:
        trainer = _trainer(cfg, batch_size, t, device, loss, Path(work))
        x, y = trainer.objective.next_batch()  # (B, T) each

        def forward() -> None:
            with torch.no_grad(), _nvtx("forward", cuda):
                trainer.loss_fn(trainer.strategy.model, x, y)

        def forward_backward() -> None:
            with _nvtx("forward_backward", cuda):
                trainer.strategy.forward_backward([(x, y)], trainer.loss_fn)
            trainer.optimizer.zero_grad(set_to_none=True)

        pending: list = []

        def step() -> None:
            # As the Trainer's loop runs: launch this step, then read the one before.
            with _nvtx("train_step", cuda):
                launched = trainer.launch_step()
                if pending:
                    trainer.finish_step(pending.pop())
                pending.append(launched)

        dev = "cuda" if cuda else "cpu"
        fwd_ms = time_ms(forward, warmup=warmup, iters=steps, device=dev)
        fb_ms = time_ms(forward_backward, warmup=warmup, iters=steps, device=dev)
        step_ms = time_ms(step, warmup=warmup, iters=steps, device=dev)
        table = _profile_table(step, cuda) if profile else ""
        if pending:
            trainer.finish_step(pending.pop())
        memory = _memory_by_category(trainer, x, y, cuda)

    precision = "bf16" if cuda else "fp32"
    est = accounting.memory_estimate(
        cfg, batch_size, t, precision, master_weights=trainer.fast.master_weights
    )
    estimate = {
        "parameters": est.parameters,
        "gradients": est.gradients,
        "optimizer": est.optimizer,
        "activations": est.activations,
    }
    tokens = batch_size * t
    fpt = accounting.flops_per_token(cfg, t, backward=True)
    tflops = tokens * fpt / (step_ms * 1e-3) / 1e12
    return ModelBenchResult(
        preset=preset,
        device=device,
        batch_size=batch_size,
        seq_len=t,
        forward_ms=fwd_ms,
        forward_backward_ms=fb_ms,
        step_ms=step_ms,
        tokens_per_s=tokens / (step_ms * 1e-3),
        flops_per_token=fpt,
        tflops=tflops,
        mfu=tflops / peak_tflops if cuda else None,
        memory=memory,
        memory_estimate=estimate,
        profile_table=table,
    )


def _memory_by_category(trainer, x: torch.Tensor, y: torch.Tensor, cuda: bool) -> dict[str, int]:
    model, opt = trainer.model, trainer.optimizer
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    trainer.strategy.forward_backward([(x, y)], trainer.loss_fn)
    masters = [m for _, m in trainer.masters.values()]  # fp32 masters: optimizer-side weights
    memory = {
        "parameters": _tensor_bytes(model.parameters()),
        "gradients": _tensor_bytes(p.grad for p in model.parameters()),
        "optimizer": _tensor_bytes(v for s in opt.state.values() for v in s.values())
        + _tensor_bytes(masters),
    }
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        # Gradients are allocated during backward; what the peak holds beyond them is
        # activations (saved tensors, the logits, temporaries).
        memory["activations"] = max(0, peak - before - memory["gradients"])
        memory["peak_total"] = peak
    opt.zero_grad(set_to_none=True)
    return memory


def _profile_table(step: Callable[[], None], cuda: bool, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total") if cuda else ("cpu_time_total",):
        try:
            return averages.table(sort_by=key, row_limit=rows)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=rows)


def format_result(r: ModelBenchResult) -> str:
    """Markdown: times and roofline, memory by category against the estimate, top kernels."""
    mfu = "-" if r.mfu is None else f"{100 * r.mfu:.1f}%"
    times = markdown_table(
        ["preset", "B×T", "fwd ms", "fwd+bwd ms", "step ms", "tokens/s", "GFLOP/token",
         "TFLOP/s", "MFU"],
        [[r.preset, f"{r.batch_size}×{r.seq_len}", r.forward_ms, r.forward_backward_ms,
          r.step_ms, r.tokens_per_s, r.flops_per_token / 1e9, r.tflops, mfu]],
    )  # fmt: skip
    mem_rows = [
        [name, r.memory[name] / MIB if name in r.memory else "-", r.memory_estimate[name] / MIB]
        for name in ("parameters", "gradients", "optimizer", "activations")
    ]
    if "peak_total" in r.memory:
        total_est = sum(r.memory_estimate.values())
        mem_rows.append(["peak total", r.memory["peak_total"] / MIB, total_est / MIB])
    memory = markdown_table(["memory", "measured MiB", "accounting MiB"], mem_rows)
    parts = [environment_line(), "", times, "", memory]
    if r.profile_table:
        parts += ["", "Top kernels by device time (2 training steps):", "", "```",
                  r.profile_table.rstrip(), "```"]  # fmt: skip
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """Run :func:`bench_model` from parsed arguments and print the markdown report."""
    from lmforge.utils.errors import LmforgeError

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise LmforgeError(f"--device {args.device}: no CUDA GPU visible (use --device cpu)")
    for name in ("batch_size", "steps"):
        if getattr(args, name) <= 0:
            raise LmforgeError(f"--{name.replace('_', '-')} must be positive")
    result = bench_model(
        args.preset, args.batch_size, args.seq, args.steps, args.warmup, args.device,
        args.attention, args.norm, args.loss, args.peak_tflops, not args.no_profile,
        getattr(args, "rope", None), getattr(args, "residual", None),
        getattr(args, "swiglu", None),
    )  # fmt: skip
    print(format_result(result))
    if not math.isfinite(result.step_ms):
        return 1
    return 0
