"""Training-step throughput of the shipped configuration against a nanoGPT-style peer, on one GPU.

lmforge: ``configs/gpt2-small-train.toml`` as shipped (its [model] and [train]: the resolved
fast path — packed RoPE, Triton SwiGLU gate, bf16 residual stream, fused linear + cross-entropy
in 8192-row chunks, Triton AdamW with bf16 master weights, the sync-free step captured as one
CUDA graph, torch.compile), driven as ``Trainer.run`` drives it (``launch_step`` this step,
``finish_step`` the previous one), on random tokens. The embedding is tied by default so both
models have the same parameters (``--untied`` keeps the preset's untied head). ``--set KEY=VALUE``
changes the lmforge row's config (dotted keys, as ``lmforge train`` takes them) for an A/B.

peer (measured in the same run): GPT-2 as nanoGPT writes it (nn.Linear/LayerNorm/GELU MLP,
learned positions, ``F.scaled_dot_product_attention``, tied embedding), torch.compile,
``torch.optim.AdamW(fused=True)``, same batch, same clipping, the loss read on the host every
10th step (nanoGPT's log interval). Both do the same matmul FLOPs per token (SwiGLU 3·D·F with
F = 8/3·D equals GELU's 2·D·4D); MFU = tokens/s · FLOPs/token / 989 TFLOP/s, FLOPs from
``lmforge.model.accounting``.

Correctness first (AdamW vs torch, cross_entropy vs F.cross_entropy on the device); then warm-up
steps (compilation, graph capture), CUDA events around each step with no host sync between
them, medians; peak memory of the timed steps (of the capture step for a graph: replays allocate
nothing). The table comes last, with the ratios against the peer.

    PYTHONPATH=src python benchmarks/train.py
    PYTHONPATH=src python benchmarks/train.py --set train.cuda_graph=false --profile 15
    PYTHONPATH=src python benchmarks/train.py --results /tmp/RESULTS-train.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

PEAK_TFLOPS = 989.0
REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt2-small-train.toml"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=str(CONFIG), help="the lmforge run config measured")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a key of the lmforge config (e.g. train.cuda_graph=false); repeatable",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=0, help="sequences per step (0 = config's)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (0 = config's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps (compilation, capture)")
    p.add_argument("--untied", action="store_true", help="keep the preset's untied LM head")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--peer-first", action="store_true", help="measure the peer before lmforge")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="top-K kernels per model")
    p.add_argument("--results", help="append the table to this markdown file")
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
    fwd = torch.compile(model)
    g = torch.Generator(device="cpu").manual_seed(1)
    count = [0]

    def step() -> None:
        x = torch.randint(0, vocab, (args.batch_size, args.seq + 1), generator=g)
        x = x.pin_memory().to(args.device, non_blocking=True) if cuda else x
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16):
            loss = fwd(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        count[0] += 1
        if count[0] % 10 == 0:  # nanoGPT reads the loss every log_interval (10) steps
            loss.item()

    n_params = sum(p.numel() for p in params)
    out = _time(step, argparse.Namespace(**vars(args), label="peer")) | {"params": n_params}
    model = fwd = opt = params = groups = None  # free before the next row
    _release()
    return out


# ----------------------------------------------------------------------------- lmforge


def _random_shards(folder: Path, vocab: int, n_tokens: int) -> Path:
    import numpy as np

    from lmforge.train.data import write_shard

    rng = np.random.default_rng(0)
    return write_shard(folder / "random.bin", rng.integers(0, vocab, n_tokens), vocab)


def _lmforge_cfg(args: argparse.Namespace, out_dir: str, shard: Path):
    from lmforge.config import load_run_config
    from lmforge.train import DataConfig

    cfg = load_run_config(args.config, args.set)
    model = dataclasses.replace(
        cfg.model,
        context_length=max(cfg.model.context_length, args.seq),
        tie_embeddings=cfg.model.tie_embeddings or not args.untied,
    )
    train = dataclasses.replace(
        cfg.train, out_dir=out_dir, device=args.device, batch_size=args.batch_size,
        context_length=args.seq, max_steps=10**6, resume=False, progress=False, plot=False,
        eval_every=0, save_every=0,
    )  # fmt: skip
    return dataclasses.replace(cfg, model=model, train=train, data=DataConfig(train=(str(shard),)))


def _bench_lmforge(args: argparse.Namespace, tmp: Path) -> dict:
    import torch

    from lmforge.train import Trainer

    shard = _random_shards(tmp, 50304, 4_000_000)
    trainer = Trainer(_lmforge_cfg(args, str(tmp / "run"), shard))
    stepper = trainer.stepper
    graph = stepper.cuda_graph and args.device.startswith("cuda")
    pending: list = []

    def step() -> None:
        # As Trainer.run does it: launch this step, then read the previous one's loss and norm.
        if graph and stepper.graph is None and stepper._graph_warmups == 3:
            # The capture step: replays allocate nothing, so the peak is the capture's (the
            # eager warm-up's cached blocks were released before it).
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        launched = trainer.launch_step()
        if pending:
            trainer.finish_step(pending.pop())
        pending.append(launched)

    print(f"lmforge fast path: {trainer.fast.summary()}", file=sys.stderr)
    out = _time(step, argparse.Namespace(**vars(args), label="lmforge", keep_peak=graph))
    trainer.finish_step(pending.pop())
    out["params"] = sum(p.numel() for p in trainer.model.parameters())
    out["flops_per_token"] = trainer.plan.flops_per_token
    out["fast_path"] = trainer.fast.summary()
    trainer = stepper = None  # compiled-code caches can hold the module alive
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

    _check_correctness(args.device)
    results: dict[str, dict] = {}

    def run_lmforge() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            results["lmforge"] = _bench_lmforge(args, Path(tmp))

    def run_peer() -> None:
        if not args.no_peer:
            r = _bench_peer(args, 50304)
            r["flops_per_token"] = flops_per_token(load_preset("gpt2-small"), args.seq)
            results["peer"] = r

    for part in (run_peer, run_lmforge) if args.peer_first else (run_lmforge, run_peer):
        part()
    mine, peer = results["lmforge"], results.get("peer")
    overrides = ", ".join(args.set) or "none"
    head = (
        f"{Path(args.config).relative_to(REPO) if Path(args.config).is_relative_to(REPO) else args.config}"
        f" (overrides: {overrides}; {'untied' if args.untied else 'tied'} embeddings), batch "
        f"{args.batch_size} × {args.seq}, bf16; {_device_name(args.device)}"
        f"{'; peer measured first' if args.peer_first else ''}\n\nlmforge fast path: "
        f"{mine['fast_path']}\n\n"
    )
    lines = [
        "| model | params | step (ms, median) | tokens/s | MFU | peak memory (GiB) |"
        " vs peer (tokens/s, memory) |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {
        "lmforge": "lmforge (shipped config)",
        "peer": "peer (nanoGPT-style, torch AdamW fused)",
    }
    for key, r in results.items():
        mfu = r["tokens_per_s"] * r["flops_per_token"] / (PEAK_TFLOPS * 1e12)
        vs = ""
        if key == "lmforge" and peer is not None:
            vs = (f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}×, "
                  f"{r['peak_gib'] / peer['peak_gib']:.3f}×")  # fmt: skip
        lines.append(
            f"| {names[key]} | {r['params'] / 1e6:.1f}M | {1e3 * r['step_s']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * mfu:.1f}% | {r['peak_gib']:.2f} | {vs} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> int:
    args = _parse()
    import torch

    from lmforge.config import load_run_config
    from lmforge.utils.errors import LmforgeError

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("benchmarks/train.py needs a CUDA GPU (--device cpu only for a smoke run)",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        cfg = load_run_config(args.config, args.set)
    except LmforgeError as e:
        print(f"benchmarks/train.py: {e}", file=sys.stderr)
        return 2
    args.batch_size = args.batch_size or cfg.train.batch_size
    args.seq = args.seq or cfg.train.context_length or cfg.model.context_length
    device_name = _device_name(args.device)
    table = _throughput(args)
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
