"""Training-step throughput of lmforge against a nanoGPT-style peer, on one GPU.

Throughput mode (default): GPT-2-small shape (12 layers, d_model 768, 12 heads, vocab 50304,
sequence 1024), batch 32, bf16 autocast, torch.compile, SDPA attention, random tokens.

* lmforge: the real trainer step as ``Trainer.run`` drives it (``launch_step``: data sampler →
  Strategy.forward_backward → clip_grad_norm → AdamW.step_if with the skip decision on the
  device; then ``finish_step`` reads the previous step's loss and norm) on ``TransformerLM``
  (RoPE, RMSNorm, SwiGLU); the embedding is tied by default so both models have the same
  parameters (``--untied`` for the preset as is).
* peer: GPT-2 written here as nanoGPT does it (nn.Linear/LayerNorm/GELU MLP, learned positions,
  ``F.scaled_dot_product_attention``, tied embedding), ``torch.optim.AdamW(fused=True)``,
  ``torch.compile``, same batch, same clipping, and nanoGPT's loop: the loss is read on the host
  every 10th step (its log interval), never otherwise.

Both do the same matmul FLOPs per token (SwiGLU 3·D·F with F = 8/3·D equals GELU's 2·D·4D);
MFU = tokens/s · FLOPs/token / 989 TFLOP/s, FLOPs from ``lmforge.model.accounting``.
Correctness is checked first on the device (AdamW vs torch, cross_entropy vs F.cross_entropy).
Timing: warm-up steps (compilation), then CUDA events around each step with no host sync in
between (the host runs ahead as in training), one sync at the end; medians reported.
``--profile K`` adds each model's top-K CUDA kernels and GPU time per step by kind.
``--graph off,on`` adds rows with ``train.cuda_graph`` (the whole step replayed as one CUDA graph
after 3 eager warm-up steps); their peak memory is the capture step's (replays allocate nothing),
the other rows' the timed steps'.

Real-data mode (``--real-data DIR``): trains ``configs/gpt2-small-train.toml`` on the token
shards in DIR (``*val*.bin`` = validation, the other ``.bin`` files = training) for
``--minutes`` minutes and reports the final validation loss and bits per byte; the run folder
holds ``loss_curve.png`` and ``metrics.jsonl``.

    PYTHONPATH=src python benchmarks/train.py
    PYTHONPATH=src python benchmarks/train.py --results benchmarks/RESULTS.md
    PYTHONPATH=src python benchmarks/train.py --real-data shards/ --minutes 10 --out runs/gpt2-real
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

PEAK_TFLOPS = 989.0
REPO = Path(__file__).resolve().parents[1]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (include compilation)")
    p.add_argument(
        "--attention",
        default="sdpa",
        help="lmforge attention backends to measure, comma-separated (sdpa, cudnn, flash, auto)",
    )
    p.add_argument(
        "--peer-attention",
        default="default",
        help="SDPA backend order for the peer, comma-separated (default, cudnn); one row each",
    )
    p.add_argument(
        "--norm",
        default="reference",
        help="lmforge RMSNorm backends to measure, comma-separated (reference, triton, auto)",
    )
    p.add_argument(
        "--rope",
        default=None,
        help="lmforge RoPE backends to measure, comma-separated (reference, triton, auto); "
        "default reference (real-data mode: the config's)",
    )
    p.add_argument(
        "--rope-kernel-config",
        help="launch of the Triton RoPE kernel for rope=triton rows: ELEMS,WARPS "
        "(rope_bench.py --best-out writes it)",
    )
    p.add_argument(
        "--residual",
        default="param",
        help="lmforge model.residual_dtype values, comma-separated (param = fp32 stream as the "
        "peer, autocast = bf16 stream)",
    )
    p.add_argument(
        "--adamw",
        default="auto",
        help="lmforge train.adamw values, comma-separated (auto, compiled, triton, foreach)",
    )
    p.add_argument(
        "--loss",
        default="reference,fused",
        help="lmforge loss paths to measure, comma-separated (reference, fused, auto)",
    )
    p.add_argument(
        "--loss-chunk",
        default="0",
        help="train.loss_chunk_rows values for the fused-loss rows, comma-separated (0 = default)",
    )
    p.add_argument(
        "--graph",
        default="off",
        help="lmforge train.cuda_graph settings to measure, comma-separated (off, on)",
    )
    p.add_argument(
        "--compile-mode",
        default="default",
        help="lmforge train.compile_mode settings, comma-separated "
        "(default, max-autotune-no-cudagraphs)",
    )
    p.add_argument(
        "--peer-compile-mode",
        default="default",
        help="torch.compile modes for the peer, comma-separated (one peer row each)",
    )
    p.add_argument(
        "--untied", action="store_true", help="untied LM head (the gpt2-small preset as is)"
    )
    p.add_argument(
        "--projections",
        default="separate",
        help="lmforge q/k/v and w1/w3 projections, comma-separated: separate (three and two "
        "GEMMs) or fused (one each, model.fused_projections=true)",
    )
    p.add_argument(
        "--swiglu",
        default=None,
        help="lmforge SwiGLU gate backends to measure, comma-separated (reference, triton, auto: "
        "w1 and w3 as one GEMM into lmforge's packed Triton gate); default reference "
        "(real-data mode: the config's)",
    )
    p.add_argument(
        "--master-weights",
        default="auto",
        help="lmforge train.master_weights values to measure, comma-separated (off: bf16 "
        "autocast over fp32 weights; on: bf16 matmul weights written by AdamW from fp32 "
        "masters; auto: the trainer's choice, on here)",
    )
    p.add_argument(
        "--combo",
        default="off",
        help="Inductor's combo kernels (independent small kernels launched as one) for the "
        "lmforge rows, comma-separated (off, on)",
    )
    p.add_argument(
        "--inductor",
        default="default",
        help="torch._inductor.config settings for the lmforge rows, one row per ';'-separated "
        "entry: 'default' or KEY=VALUE pairs joined by '+', e.g. "
        "'default;triton.enable_pdl=1;triton.mix_order_reduction_split_size=64'",
    )
    p.add_argument(
        "--blas",
        default="default",
        help="torch.backends.cuda.preferred_blas_library for the lmforge rows, comma-separated "
        "(default, cublas, cublaslt)",
    )
    p.add_argument(
        "--ce-programs",
        default="0",
        help="the fused loss's chunk kernel launch for the lmforge rows, comma-separated: 0 = "
        "one program a logit row, K = a persistent grid of K programs per SM",
    )
    p.add_argument(
        "--bf16-reduction",
        default="default",
        help="torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction for the lmforge "
        "rows, comma-separated (default, on, off): whether cuBLAS may reduce split-K partial "
        "sums in bf16, which changes the algorithms it picks",
    )
    p.add_argument(
        "--matmul",
        default="torch",
        help="lmforge train.matmul values to measure, comma-separated (torch, tuned: the fastest "
        "cuBLASLt candidate per GEMM problem, auto); tuned:heuristic or auto:heuristic tune over "
        "cuBLASLt's heuristic list only (lmforge.kernels._cublaslt.SEARCH), :wide also over the "
        "configurations around it (the default)",
    )
    p.add_argument(
        "--fused-projections",
        action="store_true",
        help="the same as --projections fused",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="K",
        help="after timing, profile 3 steps of each model and print its top K CUDA kernels",
    )
    p.add_argument(
        "--previous-rope",
        action="store_true",
        help="lmforge rows with RoPE written as before (halves + stack; rope_bench.py), for an A/B",
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--peer-first", action="store_true", help="measure the peer before lmforge")
    p.add_argument("--results", help="append the table to this markdown file")
    p.add_argument("--real-data", metavar="DIR", help="train on token shards in DIR instead")
    p.add_argument("--minutes", type=float, default=10.0, help="real-data training time")
    p.add_argument(
        "--real-steps",
        type=int,
        default=3000,
        help="real-data schedule length in steps (cosine decays to min_lr at this step)",
    )
    p.add_argument("--out", default="runs/gpt2-small-real", help="real-data run folder")
    p.add_argument("--device", default="cuda")
    return p.parse_args()


# ----------------------------------------------------------------------------- the peer (nanoGPT)


def _peer_model(vocab: int, seq: int, n_layer: int, n_head: int, d: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)  # 3 × (B, T, D)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, H, T, E)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, H, T, E)
            v = v.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, H, T, E)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, E)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, D)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(d), Attention()
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(
                nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.h = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight
            for m in self.modules():
                if isinstance(m, nn.Linear | nn.Embedding):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, D)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))  # (B, T, V)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    return GPT()


def _cudnn_first():
    """torch SDPA with cuDNN attention tried first (as lmforge's ``attention='cudnn'``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel([*order, SDPBackend.MATH], set_priority=True)


def _bench_peer(args: argparse.Namespace, vocab: int) -> dict:
    import torch

    torch.manual_seed(0)
    model = _peer_model(vocab, args.seq, 12, 12, 768).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    cuda = args.device.startswith("cuda")
    opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    mode = getattr(args, "peer_compile_mode", "default")
    fwd = model if args.no_compile else torch.compile(model, mode=mode)
    g = torch.Generator(device="cpu").manual_seed(1)
    count = [0]
    att = getattr(args, "peer_attention", "default")
    if att not in ("default", "cudnn"):
        raise SystemExit(f"--peer-attention: expected default or cudnn, got {att!r}")
    sdpa_order = _cudnn_first if att == "cudnn" else contextlib.nullcontext

    def step() -> None:
        x = torch.randint(0, vocab, (args.batch_size, args.seq + 1), generator=g)
        x = x.pin_memory().to(args.device, non_blocking=True) if cuda else x
        with sdpa_order(), torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16):
            loss = fwd(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        count[0] += 1
        if count[0] % 10 == 0:  # nanoGPT reads the loss every log_interval (10) steps
            loss.item()

    n_params = sum(p.numel() for p in params)
    label = f"peer {getattr(args, 'peer_compile_mode', 'default')} SDPA {att}"
    out = _time(step, argparse.Namespace(**vars(args), label=label)) | {"params": n_params}
    model = fwd = opt = params = groups = None  # free before the next row (see _bench_lmforge)
    _release()
    return out


# ----------------------------------------------------------------------------- lmforge


def _random_shards(folder: Path, vocab: int, n_tokens: int) -> Path:
    import numpy as np

    from lmforge.train.data import write_shard

    rng = np.random.default_rng(0)
    return write_shard(folder / "random.bin", rng.integers(0, vocab, n_tokens), vocab)


def _lmforge_cfg(args: argparse.Namespace, out_dir: str, shard: Path):
    import dataclasses

    from lmforge.config import RunConfig
    from lmforge.model import load_preset
    from lmforge.train import DataConfig, TrainConfig

    mcfg = dataclasses.replace(
        load_preset("gpt2-small"),
        attention=args.attention,
        norm=args.norm,
        rope=args.rope,
        swiglu=getattr(args, "swiglu", None) or "reference",
        residual_dtype=getattr(args, "residual", "param"),
        tie_embeddings=not args.untied,
        fused_projections=getattr(args, "projections", "separate") == "fused",
        context_length=args.seq,
    )
    graph = getattr(args, "graph", "off") == "on"
    tcfg = TrainConfig(
        out_dir=out_dir,
        device=args.device,
        batch_size=args.batch_size,
        context_length=args.seq,
        max_steps=10**6,
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=10,
        precision="bf16",
        compile=not args.no_compile,
        compile_mode=getattr(args, "compile_mode", "default"),
        loss=args.loss,
        loss_chunk_rows=int(getattr(args, "loss_chunk", 0) or 0),
        adamw=getattr(args, "adamw", "auto"),
        master_weights=getattr(args, "master_weights", "auto"),
        matmul=getattr(args, "matmul", "torch"),
        cuda_graph=graph,
        progress=False,
        plot=False,
        resume=False,
    )
    return RunConfig(model=mcfg, train=tcfg, data=DataConfig(train=(str(shard),)))


def _bench_lmforge(args: argparse.Namespace, tmp: Path) -> dict:

    if args.previous_rope:
        from lmforge.model.layers import RotaryEmbedding
        from rope_bench import _previous  # this folder is on sys.path when run as a script

        RotaryEmbedding.forward = _previous  # type: ignore[method-assign]

    shard = _random_shards(tmp, 50304, 4_000_000)
    with _lmforge_settings(args):
        return _bench_lmforge_row(args, tmp, shard)


@contextlib.contextmanager
def _lmforge_settings(args: argparse.Namespace):
    """Process-wide switches of one lmforge row (Inductor combo kernels, BLAS library), put
    back afterwards so that the next row and the peer run as they would alone."""
    import torch
    import torch._inductor.config as inductor_config

    combo = getattr(args, "combo", "off") == "on"
    blas = getattr(args, "blas", "default")
    reduction = getattr(args, "bf16_reduction", "default")
    from lmforge.kernels import _cross_entropy_triton as ce_kernels
    from lmforge.kernels import _cublaslt

    old_programs = ce_kernels.PROGRAMS_PER_SM
    ce_kernels.PROGRAMS_PER_SM = int(getattr(args, "ce_programs", 0) or 0)
    old_search = _cublaslt.SEARCH
    _cublaslt.SEARCH = getattr(args, "gemm_search", None) or old_search
    matmul = torch.backends.cuda.matmul
    old_reduction = matmul.allow_bf16_reduced_precision_reduction
    if reduction != "default":
        matmul.allow_bf16_reduced_precision_reduction = reduction == "on"
    patch = _inductor_settings(getattr(args, "inductor", "default"))
    old_combo = inductor_config.combo_kernels
    old_blas = torch.backends.cuda.preferred_blas_library() if blas != "default" else None
    inductor_config.combo_kernels = combo
    if blas != "default":
        torch.backends.cuda.preferred_blas_library(blas)
    try:
        with inductor_config.patch(patch):
            yield
    finally:
        ce_kernels.PROGRAMS_PER_SM = old_programs
        _cublaslt.SEARCH = old_search
        matmul.allow_bf16_reduced_precision_reduction = old_reduction
        inductor_config.combo_kernels = old_combo
        if old_blas is not None:
            torch.backends.cuda.preferred_blas_library(old_blas)


def _inductor_settings(entry: str) -> dict:
    """'default' → {}; 'a.b=1+c=x' → {'a.b': 1, 'c': 'x'} (ints, floats, else strings)."""
    out: dict = {}
    if entry.strip() in ("", "default"):
        return out
    for pair in entry.split("+"):
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--inductor: {pair!r} is not KEY=VALUE")
        value: object = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        out[key.strip()] = value
    return out


def _bench_lmforge_row(args: argparse.Namespace, tmp: Path, shard: Path) -> dict:
    import torch

    from lmforge.train import Trainer

    trainer = Trainer(_lmforge_cfg(args, str(tmp / "run"), shard))
    pending: list = []
    graph = trainer.tcfg.cuda_graph and args.device.startswith("cuda")

    def step() -> None:
        # As Trainer.run does it: launch this step, then read the previous one's loss and norm.
        if graph and trainer._graph is None and trainer._graph_warmups == 3:
            # The capture step: replays allocate nothing, so the peak is the capture's (the
            # eager warm-up's cached blocks were released before it).
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        launched = trainer.launch_step()
        if pending:
            trainer.finish_step(pending.pop())
        pending.append(launched)

    label = f"lmforge {args.loss}{' graph' if graph else ''} {trainer.tcfg.compile_mode}"
    out = _time(step, argparse.Namespace(**vars(args), label=label, keep_peak=graph))
    trainer.finish_step(pending.pop())
    out["params"] = sum(p.numel() for p in trainer.model.parameters())
    out["flops_per_token"] = trainer.plan.flops_per_token
    opt = trainer.optimizer
    out["adamw"] = "triton" if opt.fused else "compiled" if opt.compiled else "foreach"
    if trainer.tuned_matmul:
        from lmforge.kernels import _cublaslt

        print("tuned GEMMs:\n  " + "\n  ".join(_cublaslt.TUNING_LOG), file=sys.stderr)
    # Free everything before the next model: compiled-code caches can hold the module alive,
    # which would inflate the next row's peak memory.
    trainer = None
    _release()
    return out


def _release() -> None:
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- timing


def _time(step, args: argparse.Namespace) -> dict:
    import torch

    cuda = args.device.startswith("cuda")
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        if not getattr(args, "keep_peak", False):
            torch.cuda.reset_peak_memory_stats()
    times = []
    if cuda:
        # No host sync between steps (the host runs ahead, as in training); an event pair
        # around each step measures its span on the GPU's timeline.
        events = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:  # CPU smoke runs of this script (correctness of the code paths, not speed)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    print(  # each row as it finishes, in case a time limit cuts the run short
        f"{getattr(args, 'label', '')}: {1e3 * med:.1f} ms/step, "
        f"{args.batch_size * args.seq / med:,.0f} tok/s, peak {peak:.2f} GiB",
        file=sys.stderr,
    )
    if cuda and getattr(args, "profile", 0):
        try:
            print(_kernel_profile(step, args.profile, getattr(args, "label", "")), file=sys.stderr)
        except Exception as e:  # a profiler problem must not cost the timing rows
            print(f"profile failed: {type(e).__name__}: {e}", file=sys.stderr)
    return {
        "step_s": med,
        "tokens_per_s": args.batch_size * args.seq / med,
        "peak_gib": peak,
    }


def _kernel_profile(step, top: int, label: str, steps: int = 3) -> str:
    """Per-step CUDA time of the ``top`` heaviest kernels, totals by kind (GEMM, attention,
    Triton/inductor-generated, other), the GPU timeline's idle time (the step span minus the
    union of kernel, copy and memset intervals, with the largest gaps and the kernels around
    them) from a CUDA-only torch.profiler trace over ``steps`` steps; then GEMM time by operand
    shapes with achieved TFLOP/s from a second trace that records host ops and their shapes."""
    import json
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total
    ]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f).get("traceEvents", [])
    totals: dict[str, float] = {}
    for e in kernels:
        totals[_kernel_kind(e.key)] = (
            totals.get(_kernel_kind(e.key), 0.0) + e.self_device_time_total
        )
    lines = [
        f"profile ({label}): GPU ms per step by kind: "
        + ", ".join(f"{k} {v / steps / 1e3:.2f}" for k, v in sorted(totals.items()))
        + f"; total {sum(totals.values()) / steps / 1e3:.2f}",
        _timeline_gaps(events, steps),
        "| ms/step | calls/step | kind | kernel |",
        "|---|---|---|---|",
    ]
    for e in kernels[:top]:
        lines.append(
            f"| {e.self_device_time_total / steps / 1e3:.3f} | {e.count / steps:.0f} | "
            f"{_kernel_kind(e.key)} | {e.key[:90]} |"
        )
    lines.append(_gemm_shapes(step, steps))
    return "\n".join(lines)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "GEMM"
    if any(k in low for k in ("flash", "fmha", "attention", "_attn")):
        return "attention"
    if low.startswith(("triton", "_")) or "triton" in low:
        return "triton / inductor"
    return "other"


def _timeline_gaps(events: list, steps: int, top: int = 8) -> str:
    """Idle time of the GPU's timeline in a chrome trace: span of the device events minus the
    union of their intervals, per step, and the ``top`` largest gaps with their neighbours."""
    dev = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not dev:
        return "timeline: no device events in the trace"
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = dev[0]
    for start, end, name in dev[1:]:
        if start > cur_end:  # an idle gap between cur_name (ending) and name (starting)
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = max(e for _, e, _ in dev) - dev[0][0]
    idle = span - busy
    gaps.sort(reverse=True)
    small = sum(g for g, _, _ in gaps if g < 5.0)
    out = [
        f"timeline: span {span / steps / 1e3:.2f} ms/step, busy {busy / steps / 1e3:.2f}, "
        f"idle {idle / steps / 1e3:.2f} ({len(gaps) / steps:.0f} gaps/step; those under 5 µs "
        f"{small / steps / 1e3:.2f} ms/step); largest gaps (µs, after → before):"
    ]
    for g, a, b in gaps[:top]:
        out.append(f"  {g:8.1f}  {a[:60]} → {b[:60]}")
    # Small copies and memsets are launches too (each with its gap): what runs next to them.
    around: dict[str, int] = {}
    for i, (_, _, name) in enumerate(dev):
        if name.startswith(("Memset", "Memcpy")) and i + 1 < len(dev):
            key = f"{name[:22]} → {dev[i + 1][2][:60]}"
            around[key] = around.get(key, 0) + 1
    if around:
        out.append("memsets and copies per step, by the device event after them:")
        for key, n in sorted(around.items(), key=lambda kv: -kv[1])[:6]:
            out.append(f"  {n / steps:6.1f}  {key}")
    return "\n".join(out)


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


def _gemm_shapes(step, steps: int, top: int = 16) -> str:
    """GEMM device time per step grouped by op and operand shapes, with TFLOP/s (2·M·N·K)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows, others = [], []
    for e in p.key_averages(group_by_input_shape=True):
        if not e.device_time_total or not e.key.startswith("aten::"):
            continue
        if e.key not in _GEMM_OPS:
            if e.self_device_time_total:  # launched kernels itself (not through a child op)
                shp = " ".join("×".join(map(str, s)) or "()" for s in e.input_shapes if s)
                others.append((e.self_device_time_total / 1e3 / steps, e.count / steps, e.key,
                               shp[:70]))  # fmt: skip
            continue
        # Operands: mm/bmm/_scaled_mm (A, B, ...), addmm/baddbmm (C, A, B, ...); inductor
        # passes out= as a further input.
        first = 1 if e.key in ("aten::addmm", "aten::baddbmm") else 0
        shapes = [s for s in e.input_shapes[first : first + 2] if isinstance(s, list | tuple)]
        flops = 0.0
        if len(shapes) == 2 and len(shapes[0]) >= 2 and len(shapes[1]) >= 2:
            a, b = shapes
            batch = math.prod(a[:-2]) if len(a) > 2 else 1
            flops = 2.0 * batch * a[-2] * a[-1] * b[-1] * e.count
        ms = e.device_time_total / 1e3
        tflops = flops / (ms * 1e-3) / 1e12 if ms else 0.0
        rows.append((ms / steps, e.count / steps, e.key, shapes, tflops))
    rows.sort(key=lambda r: -r[0])
    total = sum(r[0] for r in rows)
    out = [
        f"GEMM ops by shape ({total:.2f} ms/step in all):",
        "| ms/step | calls/step | op | shapes | TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for ms, calls, key, shapes, tf in rows[:top]:
        shp = " @ ".join("×".join(str(d) for d in s) for s in shapes)
        out.append(f"| {ms:.3f} | {calls:.0f} | {key} | {shp} | {tf:.0f} |")
    others.sort(key=lambda r: -r[0])
    out += [
        "Other aten ops launching kernels of their own (not compiler-generated), by device time:",
        "| ms/step | calls/step | op | input shapes |",
        "|---|---|---|---|",
    ]
    out += [f"| {ms:.3f} | {calls:.1f} | {key} | {shp} |" for ms, calls, key, shp in others[:10]]
    return "\n".join(out)


def _check_correctness(device: str) -> None:
    import torch
    import torch.nn.functional as F

    from lmforge.train import AdamW, cross_entropy

    g = torch.Generator(device="cpu").manual_seed(0)
    ps = [torch.randn(s, generator=g).to(device).requires_grad_() for s in ((64, 32), (32,))]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    a = AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    b = torch.optim.AdamW(qs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(50):
        for p, q in zip(ps, qs):
            gr = torch.randn(p.shape, generator=g).to(device)
            p.grad, q.grad = gr, gr.clone()
        a.step()
        b.step()
    err = max((p - q).abs().max().item() for p, q in zip(ps, qs))
    assert err < 1e-6, f"AdamW differs from torch by {err}"
    logits = (100 * torch.randn(64, 50304, generator=g)).to(device, torch.bfloat16)
    t = torch.randint(0, 50304, (64,), generator=g).to(device)
    ce = (cross_entropy(logits, t) - F.cross_entropy(logits.float(), t)).abs().item()
    assert ce < 1e-4, f"cross_entropy differs from torch by {ce}"
    print(
        f"correctness: AdamW max |Δ| {err:.1e} after 50 steps, cross_entropy |Δ| {ce:.1e}",
        file=sys.stderr,
    )


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def _versions() -> str:
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "n/a"
    return f"torch {torch.__version__}, triton {tv}"


def _throughput(args: argparse.Namespace) -> str:
    from lmforge.model import load_preset
    from lmforge.model.accounting import flops_per_token
    from lmforge.utils.errors import LmforgeError

    _check_correctness(args.device)
    rows: list = []
    peers: list = []

    def run_lmforge() -> None:
        atts, norms, graphs, modes = (
            args.attention.split(","),
            args.norm.split(","),
            args.graph.split(","),
            args.compile_mode.split(","),
        )
        chunks, ropes = args.loss_chunk.split(","), (args.rope or "reference").split(",")
        resids, adamws = args.residual.split(","), args.adamw.split(",")
        reductions = args.bf16_reduction.split(",")
        ce_programs = args.ce_programs.split(",")
        matmuls = args.matmul.split(",")
        projs, combos, blases, gates, inductors, masters = (
            args.projections.split(","),
            args.combo.split(","),
            args.blas.split(","),
            (args.swiglu or "reference").split(","),
            args.inductor.split(";"),
            args.master_weights.split(","),
        )
        for (
            att, norm, rope, gate, loss, chunk, graph, mode, resid, adamw, proj, combo, blas, ind,
            master, reduction, ce_prog, mm,
        ) in itertools.product(
            atts, norms, ropes, gates, args.loss.split(","), chunks, graphs, modes, resids,
            adamws, projs, combos, blases, inductors, masters, reductions, ce_programs, matmuls,
        ):  # fmt: skip
            if loss == "reference" and chunk != chunks[0]:
                continue  # the chunk size only matters to the fused loss
            one = argparse.Namespace(
                **{
                    **vars(args),
                    "attention": att,
                    "loss": loss,
                    "loss_chunk": chunk,
                    "norm": norm,
                    "rope": rope,
                    "swiglu": gate,
                    "graph": graph,
                    "compile_mode": mode,
                    "residual": resid,
                    "adamw": adamw,
                    "projections": proj,
                    "combo": combo,
                    "blas": blas,
                    "inductor": ind,
                    "master_weights": master,
                    "bf16_reduction": reduction,
                    "ce_programs": ce_prog,
                    "matmul": mm.partition(":")[0],
                    "gemm_search": mm.partition(":")[2],
                }
            )
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    r = _bench_lmforge(one, Path(tmp))
            except LmforgeError as e:  # e.g. loss=fused without lmforge.kernels
                print(f"skipping the row (norm={norm}, loss={loss}, adamw={adamw}): {e}",
                      file=sys.stderr)  # fmt: skip
                continue
            opt = f" {r['adamw']}"
            label = f"loss={loss}" + (f", norm={norm}" if len(norms) > 1 else "")
            label += f", attention={att}" if len(atts) > 1 else ""
            label += f", rope={rope}" if len(ropes) > 1 or rope != "reference" else ""
            label += f", swiglu={gate}" if len(gates) > 1 or gate != "reference" else ""
            if loss != "reference" and (len(chunks) > 1 or chunk != "0"):
                label += f", chunk {chunk if chunk != '0' else 'default'}"
            label += f", CUDA graph {graph}" if len(graphs) > 1 or graph == "on" else ""
            label += f", mode {mode}" if len(modes) > 1 or mode != "default" else ""
            label += ", previous RoPE" if args.previous_rope else ""
            label += f", residual {resid}" if len(resids) > 1 or resid != "param" else ""
            label += f", {proj} projections" if len(projs) > 1 or proj != "separate" else ""
            label += f", combo kernels {combo}" if len(combos) > 1 or combo != "off" else ""
            label += f", BLAS {blas}" if len(blases) > 1 or blas != "default" else ""
            label += f", Inductor {ind}" if len(inductors) > 1 or ind != "default" else ""
            label += f", master weights {master}" if len(masters) > 1 or master != "auto" else ""
            if len(ce_programs) > 1 or ce_prog != "0":
                label += f", CE kernel {ce_prog + ' programs/SM' if ce_prog != '0' else 'one program a row'}"
            label += f", matmul {mm}" if len(matmuls) > 1 or mm != "torch" else ""
            if len(reductions) > 1 or reduction != "default":
                label += f", bf16 reduced-precision reduction {reduction}"
            rows.append((f"lmforge ({label}, own AdamW{opt})", r))

    def run_peers() -> None:
        peer_modes = [] if args.no_peer else args.peer_compile_mode.split(",")
        peer_atts = args.peer_attention.split(",")
        for mode, att in itertools.product(peer_modes, peer_atts):
            one = argparse.Namespace(
                **{**vars(args), "peer_compile_mode": mode, "peer_attention": att}
            )
            r = _bench_peer(one, 50304)
            # Same matmul shapes per token as lmforge (see the module docstring).
            r["flops_per_token"] = flops_per_token(load_preset("gpt2-small"), args.seq)
            extra = [f"mode {mode}"] if len(peer_modes) > 1 or mode != "default" else []
            extra += [f"SDPA {att}"] if len(peer_atts) > 1 or att != "default" else []
            peers.append(
                (f"peer (nanoGPT-style, torch AdamW fused{''.join(', ' + x for x in extra)})", r)
            )

    for part in (run_peers, run_lmforge) if args.peer_first else (run_lmforge, run_peers):
        part()
    peer = peers[0][1] if peers else None  # ratios are against the first peer row
    head = (
        f"GPT-2-small shape, batch {args.batch_size} × {args.seq}, bf16 autocast, "
        f"compile={not args.no_compile}, attention={args.attention}, norm={args.norm}, "
        f"rope={args.rope or 'reference'}, swiglu={args.swiglu or 'reference'}, "
        f"residual={args.residual}, "
        f"adamw={args.adamw}"
        f"{f' (Triton launch {args.rope_kernel_config})' if args.rope_kernel_config else ''}, "
        f"projections={args.projections}, master_weights={args.master_weights}, "
        f"{'untied' if args.untied else 'tied'} embeddings; {_device_name(args.device)}"
        f"{'; peer measured first' if args.peer_first else ''}\n\n"
    )
    lines = [
        "| model | params | step (ms, median) | tokens/s | MFU | peak memory (GiB) | vs peer (tokens/s, memory) |",
        "|---|---|---|---|---|---|---|",
    ]
    all_rows = rows + peers
    for name, r in all_rows:
        mfu = r["tokens_per_s"] * r["flops_per_token"] / (PEAK_TFLOPS * 1e12)
        vs = ""
        if peer is not None and all(r is not q for _, q in peers):
            vs = f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}×, {r['peak_gib'] / peer['peak_gib']:.3f}×"
        lines.append(
            f"| {name} | {r['params'] / 1e6:.1f}M | {1e3 * r['step_s']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * mfu:.1f}% | {r['peak_gib']:.2f} | {vs} |"
        )
    return head + "\n".join(lines) + "\n"


def _real_data(args: argparse.Namespace) -> str:
    import dataclasses

    from lmforge.config import load_run_config
    from lmforge.train import train
    from lmforge.train.data import expand_shards

    shards = expand_shards(args.real_data)
    val = tuple(str(p) for p in shards if "val" in p.name)
    tr = tuple(str(p) for p in shards if "val" not in p.name)
    if not tr or not val:
        raise SystemExit(f"{args.real_data}: need training .bin shards and *val*.bin shards")
    cfg = load_run_config(REPO / "configs" / "gpt2-small-train.toml")
    tok_dir = Path(args.real_data) / "tokenizer"
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model,
            attention=args.attention.split(",")[0],
            norm=args.norm.split(",")[0],
            rope=args.rope.split(",")[0] if args.rope else cfg.model.rope,
            swiglu=args.swiglu.split(",")[0] if args.swiglu else cfg.model.swiglu,
            residual_dtype=args.residual.split(",")[0],
        ),
        train=dataclasses.replace(
            cfg.train,
            out_dir=args.out,
            max_minutes=args.minutes,
            max_steps=args.real_steps,
            warmup_steps=max(1, args.real_steps // 20),
            device=args.device,
            resume=False,
            loss=args.loss.split(",")[0],
            adamw=args.adamw.split(",")[0],
            save_every=0,
        ),
        data=dataclasses.replace(
            cfg.data, train=tr, val=val, tokenizer=str(tok_dir) if tok_dir.is_dir() else ""
        ),
    )
    t0 = time.monotonic()
    res = train(cfg)
    bpb = res.get("val_bpb", math.nan)
    return (
        f"real data {args.real_data} (model.residual_dtype={cfg.model.residual_dtype}, "
        f"train.adamw={cfg.train.adamw}): {res['iteration']} steps, {res['tokens'] / 1e6:.1f}M tokens in "
        f"{(time.monotonic() - t0) / 60:.1f} min\n\n"
        "| final val loss | val perplexity | val bits/byte | loss curve |\n|---|---|---|---|\n"
        f"| {res.get('val_loss', math.nan):.4f} | {res.get('val_ppl', math.nan):.2f} | {bpb:.4f} | "
        f"{args.out}/loss_curve.png |\n"
    )


def main() -> int:
    args = _parse()
    if args.fused_projections:
        args.projections = "fused"
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "benchmarks/train.py needs a CUDA GPU (--device cpu only for a smoke run)",
            file=sys.stderr,
        )
        return 1
    if args.rope_kernel_config:
        from lmforge.kernels import _elementwise_triton as ew

        try:
            elems, warps = (int(v) for v in args.rope_kernel_config.split(","))
        except ValueError:
            print(f"--rope-kernel-config: want ELEMS,WARPS, got {args.rope_kernel_config!r}",
                  file=sys.stderr)  # fmt: skip
            return 2
        ew.ROPE_ELEMS, ew.ROPE_WARPS = elems, warps
    device_name = _device_name(args.device)
    table = _real_data(args) if args.real_data else _throughput(args)
    print(table)
    if args.results:
        entry = (
            f"\n## benchmarks/train.py — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
            f"Device: {device_name}; {_versions()}\n\n"
            f"Command: `PYTHONPATH=src python {' '.join(sys.argv)}`\n\n{table}"
        )
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(entry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
