"""``lmforge bench model``: step times, top kernels, memory by category and roofline for a preset.

Measures, for one preset on one device (random tokens, AdamW):
  * forward (no grad), forward + backward, and a full training step (forward, backward,
    optimizer step, zero_grad) — warmup calls, then medians (CUDA events on GPU);
  * a torch-profiler table of the top kernels by device time over two training steps, with NVTX
    ranges ``forward`` / ``backward`` / ``optimizer`` for Nsight Systems;
  * peak memory by category: parameters, gradients, optimizer state, and activations (the peak
    during forward + backward above what was allocated before), next to
    ``lmforge.model.accounting.memory_estimate``;
  * the roofline numbers: FLOPs per token from ``accounting.flops_per_token``, achieved TFLOP/s
    and MFU against the device peak (989 TFLOP/s dense bf16 for H100/H200; ``--peak-tflops``).
Simplification: the training step is written here (not the Trainer), without gradient clipping
or accumulation, so it isolates the model's own cost. Runs on CPU too (fp32, wall-clock timing)
for smoke tests: ``lmforge bench model --preset tiny --device cpu --steps 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

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
    from lmforge.model import TransformerLM, accounting, load_preset

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
    torch.manual_seed(0)
    model = TransformerLM(cfg, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randint(0, cfg.vocab_size, (batch_size, t), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch_size, t), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    fused = None
    if loss == "fused":
        from lmforge.kernels import fused_linear_cross_entropy as fused

    def loss_fn() -> torch.Tensor:
        with autocast:
            if fused is not None:
                h = model.forward_hidden(x)  # (B, T, D)
                return fused(h.reshape(-1, h.shape[-1]), model.lm_head.weight, y.reshape(-1))
            logits = model(x)  # (B, T, V)
            return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))

    def forward() -> None:
        with torch.no_grad(), _nvtx("forward", cuda):
            loss_fn()

    def forward_backward() -> None:
        with _nvtx("forward", cuda):
            value = loss_fn()
        with _nvtx("backward", cuda):
            value.backward()
        model.zero_grad(set_to_none=True)

    def step() -> None:
        with _nvtx("forward", cuda):
            value = loss_fn()
        with _nvtx("backward", cuda):
            value.backward()
        with _nvtx("optimizer", cuda):
            opt.step()
            opt.zero_grad(set_to_none=True)

    dev = "cuda" if cuda else "cpu"
    fwd_ms = time_ms(forward, warmup=warmup, iters=steps, device=dev)
    fb_ms = time_ms(forward_backward, warmup=warmup, iters=steps, device=dev)
    step_ms = time_ms(step, warmup=warmup, iters=steps, device=dev)

    memory = _memory_by_category(model, opt, loss_fn, cuda)
    precision = "bf16" if cuda else "fp32"
    est = accounting.memory_estimate(cfg, batch_size, t, precision)
    estimate = {
        "parameters": est.parameters,
        "gradients": est.gradients,
        "optimizer": est.optimizer,
        "activations": est.activations,
    }
    tokens = batch_size * t
    fpt = accounting.flops_per_token(cfg, t, backward=True)
    tflops = tokens * fpt / (step_ms * 1e-3) / 1e12
    table = _profile_table(step, cuda) if profile else ""
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


def _memory_by_category(model, opt, loss_fn: Callable[[], torch.Tensor], cuda: bool):
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    loss_fn().backward()
    memory = {
        "parameters": _tensor_bytes(model.parameters()),
        "gradients": _tensor_bytes(p.grad for p in model.parameters()),
        "optimizer": _tensor_bytes(v for s in opt.state.values() for v in s.values()),
    }
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        # Gradients are allocated during backward; what the peak holds beyond them is
        # activations (saved tensors, the logits, temporaries).
        memory["activations"] = max(0, peak - before - memory["gradients"])
        memory["peak_total"] = peak
    model.zero_grad(set_to_none=True)
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


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of the model benchmark (shared by the CLI)."""
    from lmforge.bench._args import add_model_args  # one declaration, shared with `lmforge bench`

    p = parser or argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lmforge.bench.model`` entry."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
