"""MoE expert compute on the GPU: grouped GEMM vs one dense GEMM vs a Python loop; the whole MoE
layer (route, permute, grouped GEMMs, combine) forward+backward vs a dense SwiGLU of equal FLOPs;
optionally a GPT-2-small training step, MoE (same active compute) vs dense; and (``--balance``,
CPU-sized) expert load over training with no balancing, the Switch aux loss, and the
auxiliary-loss-free bias, on byte-level tinyshakespeare from ``../shared`` (plot + table); and
(``--curves``) validation loss at equal tokens, dense vs an MoE of the same active compute.

Shape (issue 25): GPT-2-small width D = 768, 64 experts, top-8, expert width 256, 32k tokens,
so the up-projection (w1|w3, one grouped GEMM) is 262,144×768 @ 768×512 spread over 64 groups.
Correctness first (the grouped GEMM and its backward against a float64 loop; the MoE layer's
grouped path against its reference loop on the same routing), then CUDA-event medians
(``lmforge.bench.timing.time_ms``), each row with its peer from the same run.

    PYTHONPATH=src python benchmarks/moe.py
    PYTHONPATH=src python benchmarks/moe.py --train            # + the training-step ratio
    PYTHONPATH=src python benchmarks/moe.py --train --profile  # + kernels of each layer and step
    PYTHONPATH=src python benchmarks/moe.py --device cpu --tokens 256 --d 64 --experts 8 --top-k 2 --width 32 --iters 2 --train --train-batch 2 --train-seq 64 --train-layers 2 --profile
    PYTHONPATH=src python benchmarks/moe.py --device cpu --tokens 512 --d 64 --experts 8 --width 32
    PYTHONPATH=src python benchmarks/moe.py --balance --device cpu --balance-out benchmarks/figures/moe_balance.png
    PYTHONPATH=src python benchmarks/moe.py --curves --device cpu --text ../shared/data/text/gutenberg
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install


def _shared() -> Path:
    """``../shared`` beside the checkout, else /work/shared (the worktrees' layout)."""
    here = Path(__file__).resolve().parents[2] / "shared"
    return here if here.is_dir() else Path("/work/shared")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--train", action="store_true", help="also time a GPT-2-small training step")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--train-seq", type=int, default=1024, help="sequence length of --train")
    p.add_argument("--train-layers", type=int, default=12, help="layers of the --train models")
    p.add_argument("--no-train-compile", action="store_true",
                   help="--train: the Trainer rows without torch.compile (default on CUDA: "
                        "compiled, as configs/gpt2-small-train.toml trains)")  # fmt: skip
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile the MoE layer and the dense SwiGLU fwd+bwd (top kernels of each) and,"
        " with --train, one training step of each model side by side (GPU busy vs step time,"
        " kernels per family)",
    )
    p.add_argument("--profile-top", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code paths only")
    p.add_argument("--balance", action="store_true", help="only the load-balance training runs")
    p.add_argument("--balance-steps", type=int, default=300)
    p.add_argument("--balance-out", default="moe_balance.png", help="PNG of max/mean load")
    p.add_argument("--curves", action="store_true", help="only dense vs MoE val-loss curves")
    p.add_argument("--curve-steps", type=int, default=600)
    p.add_argument("--curve-out", default="moe_curves.png", help="PNG of the val-loss curves")
    p.add_argument(
        "--text",
        default=str(_shared() / "data/text/tinyshakespeare"),
        help="folder or file of text for --balance and --curves (bytes are the tokens)",
    )
    return p.parse_args()


def main() -> None:
    args = _parse()
    import torch

    from lmforge.bench.timing import environment_line, markdown_table, time_ms
    from lmforge.model import ModelConfig
    from lmforge.model import moe as M
    from lmforge.model.layers import SwiGLU
    from lmforge.model.moe_config import MoEConfig

    dev = args.device
    if args.balance:
        _balance(args, dev)
        return
    if args.curves:
        _curves(args, dev)
        return
    cuda = dev == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    n, k, d, f, m = args.experts, args.top_k, args.d, args.width, args.tokens
    a = m * k
    print(environment_line() if cuda else f"device cpu, torch {torch.__version__}")
    print(f"shape: {m} tokens, D={d}, {n} experts, top-{k}, expert width {f}: A={a} rows")

    def tflops(flop: float, ms: float) -> float:
        return flop / (ms * 1e-3) / 1e12

    # -- correctness: grouped GEMM (fwd + both grads) against a float64 loop, ragged groups
    counts = torch.bincount(torch.randint(0, n, (4096,), device=dev), minlength=n)
    counts[1] = 0  # an empty group
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = int(counts.sum())
    xs = torch.randn(rows, d, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(n, 2 * f, d, device=dev, dtype=dt) / d**0.5).requires_grad_()
    use_grouped = M.grouped_mm_available(xs)
    y = M.grouped_mm(xs, w.transpose(1, 2), counts, offs)
    g = torch.randn_like(y)
    y.backward(g)
    x64 = xs.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    parts = torch.split(x64, counts.tolist())
    ref = torch.cat([p @ w64[e].t() for e, p in enumerate(parts)])
    ref.backward(g.double())
    for name, got, want in (
        ("y", y, ref),
        ("dx", xs.grad, x64.grad),
        ("dw", w.grad, w64.grad),
    ):
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        print(f"check grouped_mm {name}: max err / max |ref| = {err:.2e}")
        assert err < 2e-2, f"grouped_mm {name} is wrong ({err:.2e})"
    print(f"grouped path: {'torch._grouped_mm' if use_grouped else 'loop over segments'}")

    # -- correctness: MoE layer grouped vs reference, same routing, bf16 vs float64
    cfg_small = ModelConfig(
        d_model=d,
        n_heads=12 if d % 12 == 0 else 4,
        moe=MoEConfig(n_experts=n, top_k=k, expert_d_ff=f),
    )
    layer64 = M.MoEFFN(cfg_small).to(dev, torch.float64)
    x = torch.randn(2048, d, device=dev, dtype=torch.float64)
    r, _ = M.route(x @ layer64.router.weight.t(), cfg_small, layer64.expert_bias)
    want = M.experts_reference(x, layer64.w1, layer64.w2, layer64.w3, r)
    wb = [p.detach().to(dt) for p in (layer64.w1, layer64.w2, layer64.w3)]
    got = M.experts_grouped(x.to(dt), *wb, r._replace(weight=r.weight.float()))
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    print(f"check MoE layer grouped vs reference: max err / max |ref| = {err:.2e}")
    assert err < 3e-2

    # -- table 1: the up-projection GEMM, grouped vs dense vs loop
    rows_out = []
    for routing in ("balanced", "random router"):
        if routing == "balanced":
            cnt = torch.full((n,), a // n, device=dev, dtype=torch.long)
        else:
            logits = torch.randn(m, d, device=dev) @ (torch.randn(d, n, device=dev) / d**0.5)
            idx = logits.topk(k, dim=-1).indices
            cnt = torch.bincount(idx.reshape(-1), minlength=n)
        o = torch.cumsum(cnt, 0).to(torch.int32)
        X = torch.randn(a, d, device=dev, dtype=dt)
        W = torch.randn(n, 2 * f, d, device=dev, dtype=dt) / d**0.5
        Wt = W.transpose(1, 2)
        flop = 2.0 * a * d * 2 * f
        lst = cnt.tolist()

        def grouped(X=X, Wt=Wt, o=o, cnt=cnt) -> object:
            if use_grouped:
                return torch._grouped_mm(X, Wt, offs=o)
            return M.grouped_mm(X, Wt, cnt, o)

        def loop(X=X, Wt=Wt, lst=lst) -> object:
            return [p @ Wt[e] for e, p in enumerate(torch.split(X, lst))]

        Wd = Wt[0].contiguous()

        def dense(X=X, Wd=Wd) -> object:
            return X @ Wd

        t_g = time_ms(grouped, iters=args.iters, device=dev)
        t_d = time_ms(dense, iters=args.iters, device=dev)
        t_l = time_ms(loop, iters=args.iters, device=dev)
        load = cnt.max().item() / cnt.float().mean().item()
        for name, t in (("grouped GEMM", t_g), ("one dense GEMM", t_d), ("loop of matmuls", t_l)):
            rows_out.append(
                [routing, f"{load:.2f}", name, t, tflops(flop, t), t_d / t if t else 0.0]
            )
    print("\nUp-projection (w1|w3): A×D @ D×2F per expert group")
    print(
        markdown_table(
            ["groups", "max/mean load", "implementation", "ms", "TFLOP/s", "× dense speed"],
            rows_out,
        )
    )

    # -- table 2: whole MoE layer fwd+bwd vs dense SwiGLU of equal FLOPs
    from lmforge.model.transformer import _FFN

    cfg = ModelConfig(
        d_model=d,
        n_heads=12 if d % 12 == 0 else 4,
        moe=MoEConfig(n_experts=n, top_k=k, expert_d_ff=f, aux_loss_coef=0.01),
    )
    torch.manual_seed(0)
    moe_layer = M.MoEFFN(cfg).to(dev).train()
    ref_layer = M.MoEFFN(cfg).to(dev).train()
    ref_layer.backend = "reference"
    dense = SwiGLU(d, k * f).to(dev)
    # The dense peer with the same packed gate the MoE path uses (one w1|w3 GEMM + Triton gate).
    dense_cfg = ModelConfig(d_model=d, n_heads=cfg.n_heads, d_ff=k * f, swiglu="triton")
    dense_packed = _FFN(dense_cfg).to(dev)
    xin = torch.randn(m, d, device=dev, requires_grad=True)
    gout = torch.randn(m, d, device=dev)

    def step(mod: torch.nn.Module, with_aux: bool) -> None:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            out = mod(xin[None])[0]
            loss = (out.float() * gout).sum()
            if with_aux:
                loss = loss + M.aux_loss(mod)
        loss.backward()

    if cuda:
        print(
            f"host syncs in the MoE layer's fwd+bwd: {_host_syncs(lambda: step(moe_layer, True))}"
        )
    t_moe = time_ms(lambda: step(moe_layer, True), iters=args.iters, device=dev)
    t_dense = time_ms(lambda: step(dense, False), iters=args.iters, device=dev)
    t_packed = time_ms(lambda: step(dense_packed, False), iters=args.iters, device=dev)
    t_ref = time_ms(lambda: step(ref_layer, True), iters=max(3, args.iters // 4), device=dev)
    load = moe_layer._stats[0].item()
    f_moe = 6.0 * m * (3 * d * f * k + d * n)
    f_dense = 6.0 * m * 3 * d * k * f
    t_best = min(t_dense, t_packed)
    print(f"\nMoE layer forward+backward, {m} tokens (router max/mean load {load:.2f})")
    print(
        markdown_table(
            ["implementation", "ms", "TFLOP/s (model FLOPs)", "best dense time / this time"],
            [
                [
                    "dense SwiGLU (layers.SwiGLU), F = top_k·width",
                    t_dense,
                    tflops(f_dense, t_dense),
                    t_best / t_dense,
                ],
                [
                    "dense SwiGLU, packed w1|w3 + Triton gate",
                    t_packed,
                    tflops(f_dense, t_packed),
                    t_best / t_packed,
                ],
                ["MoE grouped (lmforge fast path)", t_moe, tflops(f_moe, t_moe), t_best / t_moe],
                ["MoE reference (loop over experts)", t_ref, tflops(f_moe, t_ref), t_best / t_ref],
            ],
        )
    )

    # The same layers as the Trainer runs them: train.master_weights makes the expert and Linear
    # weights bf16 (the router stays fp32: bf16_weight_copies, the Trainer's own rule) and every
    # step starts from fresh gradients, so the steps above pay fp32->bf16 weight casts,
    # bf16->fp32 gradient casts and fp32 gradient accumulation (.grad += ...) that a training
    # step does not.
    from lmforge.train.wrap import bf16_weight_copies

    def as_trained(mod: torch.nn.Module, src: torch.nn.Module) -> torch.nn.Module:
        mod.load_state_dict(src.state_dict())
        mod = mod.to(dev).train()
        if cuda:
            bf16_weight_copies(mod)
        return mod

    moe_tr = as_trained(M.MoEFFN(cfg), moe_layer)
    dense_tr = as_trained(_FFN(dense_cfg), dense_packed)

    def fresh_step(mod: torch.nn.Module, with_aux: bool) -> None:
        xin.grad = None
        for prm in mod.parameters():
            prm.grad = None
        step(mod, with_aux)

    t_moe_tr = time_ms(lambda: fresh_step(moe_tr, True), iters=args.iters, device=dev)
    t_dense_tr = time_ms(lambda: fresh_step(dense_tr, False), iters=args.iters, device=dev)
    print(
        "\nAs the Trainer runs them (bf16 weights, fp32 router, fresh gradients every step)\n"
        + markdown_table(
            ["implementation", "ms", "TFLOP/s (model FLOPs)", "dense time / this time"],
            [
                ["dense SwiGLU, packed w1|w3 + Triton gate", t_dense_tr,
                 tflops(f_dense, t_dense_tr), 1.0],
                ["MoE grouped (lmforge fast path)", t_moe_tr, tflops(f_moe, t_moe_tr),
                 t_dense_tr / t_moe_tr],
            ],
        )
    )  # fmt: skip
    floor_ms, floor_parts = _moe_floor_ms(m, d, n, k, f)
    print(
        f"floor of the MoE layer (GEMM FLOPs / 690 TFLOP/s + bytes moved / 4.3 TB/s): "
        f"{floor_ms:.3g} ms ({floor_parts}); measured / floor = {t_moe / floor_ms:.2f}"
    )
    if args.profile:
        _profile(
            {
                "MoE layer (grouped fast path)": lambda: step(moe_layer, True),
                "dense SwiGLU (packed)": lambda: step(dense_packed, False),
                "dense SwiGLU (layers.SwiGLU)": lambda: step(dense, False),
                "MoE layer as trained (bf16 weights, fresh grads)": lambda: fresh_step(
                    moe_tr, True
                ),
            },
            dev,
            args.profile_top,
        )

    if args.train:
        _train_ratio(args, dev)


def _host_syncs(fn) -> str:
    """Run fn once under ``torch.cuda.set_sync_debug_mode("error")``: 'none', or the first sync."""
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return f"FOUND: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def _moe_floor_ms(m: int, d: int, n: int, k: int, f: int) -> tuple[float, str]:
    """A lower bound for the MoE layer's fwd+bwd on an H200: the expert GEMMs' FLOPs at 690
    TFLOP/s (a dense bf16 GEMM's rate) plus the bytes the unavoidable data movement must touch at
    4.3 TB/s (HBM3e). Bytes counted (bf16 = 2 B): forward gather x -> xs (read M·D, write A·D),
    combine (read A·D, write fp32 M·D); backward: the combine's (read M·D + A·D, write A·D),
    the gather's (read A·D, write M·D); the gate fwd (read A·2F, write A·F) and bwd (read
    A·2F + A·F, write A·2F). The router (M·N) and the weights' casts are left out (small)."""
    a = m * k
    gemm_flop = 3 * (2.0 * a * d * 2 * f + 2.0 * a * f * d)  # fwd + 2 bwd GEMMs per projection
    b = 2.0
    moved = (
        (m * d + a * d) * b
        + (a * d * b + m * d * 4)  # gather, combine (fwd)
        + (m * d * 4 + 2 * a * d * b)
        + (a * d * b + m * d * b)  # combine, gather (bwd)
        + (a * 2 * f + a * f) * b
        + (a * 3 * f + a * 2 * f) * b  # gate fwd, bwd
    )
    t_gemm = gemm_flop / 690e12 * 1e3
    t_mem = moved / 4.3e12 * 1e3
    return t_gemm + t_mem, f"GEMMs {t_gemm:.3g} ms + {moved / 1e9:.3g} GB moved {t_mem:.3g} ms"


def _profile(fns: dict, dev: str, top: int) -> None:
    """torch.profiler over a few calls of each function: its top kernels (CUDA; on CPU the top
    operators) by self time — name, calls per step, µs per step, share of the step's total."""
    from lmforge.bench.timing import markdown_table

    cuda = dev == "cuda"
    for name, fn in fns.items():
        prof, steps = _profiled(fn, cuda)
        rows = _kernel_rows(prof, cuda, steps)
        total = sum(r[2] for r in rows) or 1.0
        table = [
            [key[:90], f"{cnt:g}", f"{us:.1f}", f"{100 * us / total:.1f} %"]
            for key, cnt, us in rows[:top]
        ]
        what = "CUDA kernels" if cuda else "CPU operators (self time)"
        print(f"\nProfile: {name} fwd+bwd, top {top} {what}, total {total / 1e3:.3f} ms/step")
        print(markdown_table(["kernel", "calls/step", "µs/step", "share"], table))


def _profiled(fn, cuda: bool, steps: int = 5) -> tuple[object, int]:
    """(torch.profiler result over ``steps`` calls of fn after 3 warm-up calls, steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(3):  # warm-up (autotuning, allocator)
        fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    return prof, steps


def _is_kernel(ev: object) -> bool:
    return str(getattr(ev, "device_type", "")).split(".")[-1] == "CUDA"


def _kernel_rows(prof: object, cuda: bool, steps: int) -> list[tuple[str, float, float]]:
    """(name, calls per step, self µs per step), largest first: CUDA kernels, or on CPU the
    operators' self time."""
    rows = []
    for ev in prof.key_averages():  # type: ignore[attr-defined]
        if cuda:
            if not _is_kernel(ev):
                continue
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = ev.self_cuda_time_total
        else:
            us = ev.self_cpu_time_total
        if us > 0:
            rows.append((ev.key, ev.count / steps, us / steps))
    rows.sort(key=lambda r: -r[2])
    return rows


# Kernel families, matched in order against a kernel's name (lower case).
_FAMILIES = (
    ("grouped GEMM", ("grouped", "group_gemm", "groupproblemshape", "ptrarray")),
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "aten::mm", "aten::bmm")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("Triton (lmforge)", ("triton", "_kernel")),
    ("sort / top-k", ("sort", "radix", "topk", "cub::")),
    ("index / scatter / gather", ("index", "scatter", "gather")),
    ("reduction", ("reduce", "softmax", "norm", "sum", "logsumexp")),
    ("copy / cast / elementwise", ("elementwise", "copy", "vectorized", "unrolled", "fill")),
)


def _family(name: str) -> str:
    low = name.lower()
    # Triton kernels (lmforge's own and Inductor's) carry bare names; ATen's are C++ templates
    # ("void at::native::elementwise_kernel<...>") or mangled ("_ZN7cutlass13device_kernel...":
    # torch._grouped_mm's CUTLASS kernels), which the Triton keys must not claim.
    cxx = "::" in name or name.startswith("_Z")
    if not cxx and (name.startswith("_") or low.startswith("triton")):
        if "adam" in low:
            return "optimizer"
        return "Triton (lmforge)" if name.startswith("_") else "Triton (Inductor)"
    for fam, keys in _FAMILIES:
        if fam == "Triton (lmforge)" and cxx:
            continue
        if any(k in low for k in keys):
            return fam
    return "other"


def _step_profiles(fns: dict, step_ms: dict, dev: str, top: int) -> None:
    """One training step of each model, side by side: step time (timed without the profiler),
    GPU busy time, kernels per step, time per kernel family, and each step's top kernels."""
    from lmforge.bench.timing import cuda_kernel_gaps, markdown_table

    cuda = dev == "cuda"
    per: dict[str, tuple[list, float]] = {}
    for name, fn in fns.items():
        prof, steps = _profiled(fn, cuda, steps=3)
        busy = cuda_kernel_gaps(prof)["busy"] / steps if cuda else 0.0  # µs per step
        per[name] = (_kernel_rows(prof, cuda, steps), busy)
    names = list(fns)
    what = "kernels" if cuda else "CPU operators"
    summary = []
    for name in names:
        rows, busy = per[name]
        launches = sum(r[1] for r in rows)
        busy_ms = busy / 1e3
        share = f"{100 * busy_ms / step_ms[name]:.0f} %" if cuda and step_ms[name] else "n/a"
        summary.append([name, step_ms[name], busy_ms if cuda else "n/a", share, f"{launches:g}"])
    print(f"\nOne training step, profiled ({what}; step ms timed without the profiler)")
    print(
        markdown_table(
            ["step", "ms/step", "GPU busy ms/step", "busy / step", f"{what}/step"], summary
        )
    )
    fams: dict[str, dict[str, float]] = {}
    for name in names:
        for key, _, us in per[name][0]:
            fams.setdefault(_family(key), {}).setdefault(name, 0.0)
            fams[_family(key)][name] += us / 1e3
    order = sorted(fams, key=lambda f: -max(fams[f].values()))
    print(f"\nTime per {what[:-1]} family, ms/step (self time)")
    print(
        markdown_table(
            ["family", *names], [[f, *[fams[f].get(n, 0.0) for n in names]] for f in order]
        )
    )
    for name in names:
        rows = per[name][0]
        total = sum(r[2] for r in rows) or 1.0
        table = [
            [key[:80], _family(key), f"{cnt:g}", f"{us:.1f}", f"{100 * us / total:.1f} %"]
            for key, cnt, us in rows[:top]
        ]
        print(f"\n{name}: top {top} {what}, {total / 1e3:.3f} ms/step of self time")
        print(markdown_table([what[:-1], "family", "calls/step", "µs/step", "share"], table))


def _train_ratio(args: argparse.Namespace, dev: str) -> None:
    """Tokens/s of a GPT-2-small step, dense vs MoE with the same active FFN (top-k · width =
    the dense d_ff): the eager loop (bf16 autocast, fused torch AdamW) and lmforge's Trainer step
    (its fast path: master weights, sync-free step, fused loss, Triton AdamW where they apply).
    With ``--profile``: each step's kernels side by side (:func:`_step_profiles`)."""
    import dataclasses
    import tempfile

    import torch

    from lmforge.bench.timing import markdown_table, time_ms
    from lmforge.model import ModelConfig, TransformerLM, accounting
    from lmforge.model import moe as M
    from lmforge.model.fastpath import resolve_backends
    from lmforge.model.moe_config import MoEConfig

    t = args.train_seq
    b = args.train_batch
    d = args.d
    shape = dict(
        d_model=d,
        n_layers=args.train_layers,
        n_heads=max(1, d // 64),
        d_ff=args.top_k * args.width,
        context_length=max(t, 16),
    )
    base = ModelConfig(**shape)
    moe_cfg = ModelConfig(
        **shape, moe=MoEConfig(n_experts=args.experts, top_k=args.top_k, expert_d_ff=args.width)
    )
    rows, times, fns = [], {}, {}
    compiled = dev == "cuda" and not args.no_train_compile
    trainer = "lmforge Trainer, compiled" if compiled else "lmforge Trainer"
    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    keep: list[object] = []  # the profiled steps' models stay alive until profiled
    for name, cfg in (("dense GPT-2 small", base), ("MoE, same active compute", moe_cfg)):
        # The dense peer gets the packed Triton gate the MoE experts use (where it runs).
        cfg = resolve_backends(dataclasses.replace(cfg, swiglu="auto"), dev)
        torch.manual_seed(0)
        model = TransformerLM(cfg, device=dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
        ids = torch.randint(0, cfg.vocab_size, (b, t + 1), device=dev)

        def step(model=model, opt=opt, ids=ids) -> torch.Tensor:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
                )
                aux = M.aux_loss(model)
                if aux is not None:
                    loss = loss + aux
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        if cfg.moe.enabled:  # correctness first: the grouped path against the reference loop
            _check_moe_model(model, ids[:, :-1], dev)
        loss0 = float(step())
        assert loss0 == loss0 and abs(loss0) < 1e4, f"{name}: first loss {loss0}"
        runs = [(f"{name} (eager loop)", step, model)]
        tr = _bench_trainer(cfg, tmp / name.split()[0], b, t, dev, compiled)
        if dev == "cuda":
            print(
                f"host syncs in one {name} step: eager loop {_host_syncs(step)}, "
                f"Trainer launch {_trainer_launch_syncs(tr)}"
            )
        runs.append((f"{name} ({trainer})", _trainer_step(tr), tr))
        for label, fn, owner in runs:
            ms = time_ms(fn, warmup=3, iters=8, device=dev)
            times[label] = ms
            rows.append(
                [
                    label,
                    f"{accounting.parameter_count(cfg) / 1e6:.0f}M",
                    f"{accounting.active_parameter_count(cfg) / 1e6:.0f}M",
                    ms,
                    b * t / (ms * 1e-3),
                ]
            )
            if args.profile:
                fns[label] = fn
                keep.append(owner)
        if not args.profile:
            del model, opt, tr
            if dev == "cuda":
                torch.cuda.empty_cache()
    eager = times["dense GPT-2 small (eager loop)"] / times["MoE, same active compute (eager loop)"]
    trained = (
        times[f"dense GPT-2 small ({trainer})"] / times[f"MoE, same active compute ({trainer})"]
    )
    print(
        f"\nTraining step, batch {b}×{t}, {args.train_layers} layers × {d}: MoE/dense tokens/s "
        f"= {eager:.3f} (eager loop), {trained:.3f} ({trainer})"
    )
    print(markdown_table(["model", "params", "active", "ms/step", "tokens/s"], rows))
    if args.profile:
        _step_profiles(fns, times, dev, args.profile_top)


def _check_moe_model(model: object, ids: object, dev: str) -> None:
    """The MoE model's logits, grouped fast path against the reference loop over experts (same
    weights and batch), in fp32 and under bf16 autocast: max error / max |ref|.

    What is asserted is exact in what it compares: the reference is fed the grouped run's
    routing in every layer (through ``expert_compute``), so both compute the same assignments.
    Left to route on its own, the reference sees bf16-rounded activations that differ slightly
    from the grouped path's, and near-ties among the top-k scores flip assignments; a flipped
    token's output changes by a whole expert's share, and attention spreads it to later layers
    (CPU, 12 layers × 192, 64 experts top-8, 512 tokens, 3 seeds: fp32 ≤ 8.2e-7 with 0 flips;
    bf16 5.7e-2 to 8.3e-2 with 103 to 165 flips of 6,144 token-layers, 5.0e-3 with the same
    routing). That free-running figure is printed with its flip count, not asserted."""
    import torch

    from lmforge.model import moe as M

    layers = list(M.moe_layers(model))  # type: ignore[arg-type]

    def run(backend: str, bf16: bool, replay: list | None = None) -> tuple[torch.Tensor, list]:
        for i, layer in enumerate(layers):
            layer.backend, layer.record_routing = backend, True
            if replay is not None:
                layer.expert_compute = lambda lay, x, r, ri=replay[i]: M._compute_reference(
                    lay, x, ri
                )
        try:
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
                out = model(ids).float()  # type: ignore[operator]
            return out, [layer.last_routing for layer in layers]
        finally:
            for layer in layers:
                layer.backend, layer.record_routing, layer.last_routing = "grouped", False, None
                layer.expert_compute = None

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    def flips(ra: list, rb: list) -> int:  # token-layers whose top-k expert set differs
        return sum(
            int((x.expert_idx.view(-1, x.top_k).sort(-1).values
                 != y.expert_idx.view(-1, y.top_k).sort(-1).values).any(-1).sum())
            for x, y in zip(ra, rb)
        )  # fmt: skip

    n_tok = ids.numel() * len(layers)  # type: ignore[attr-defined]
    for bf16, tol in ((False, 1e-4), (True, 3e-2)):
        name = "bf16 autocast" if bf16 else "fp32"
        got, routes = run("grouped", bf16)
        same = rel(got, run("reference", bf16, replay=routes)[0])
        want, own = run("reference", bf16)
        free = rel(got, want)
        print(
            f"check MoE model logits ({name}), grouped vs reference: same routing "
            f"{same:.2e} (asserted < {tol:.0e}); reference routing on its own {free:.2e}, "
            f"{flips(routes, own)} top-k flips in {n_tok} token-layers"
        )
        assert same < tol, f"the MoE model's grouped path disagrees with its reference ({name})"


def _bench_trainer(
    cfg: object, out: Path, b: int, t: int, dev: str, compile: bool = False
) -> object:
    """An lmforge Trainer on random tokens for ``cfg`` (bf16 on CUDA, fp32 on CPU; no eval, no
    logs, no checkpoints during the timing; ``compile``: train.compile)."""
    import numpy as np

    from lmforge.config import RunConfig
    from lmforge.train import DataConfig, TrainConfig, Trainer
    from lmforge.train.data import write_shard

    out.mkdir(parents=True, exist_ok=True)
    vocab = cfg.vocab_size  # type: ignore[attr-defined]
    tokens = np.random.default_rng(0).integers(0, vocab, max(200_000, 4 * b * (t + 1)))
    shard = write_shard(out / "train.bin", tokens, vocab)
    train = TrainConfig(
        out_dir=str(out / "run"),
        device=dev,
        precision="bf16" if dev == "cuda" else "fp32",
        batch_size=b,
        context_length=t,
        max_steps=10**6,
        log_every=10**6,
        eval_every=0,
        save_every=0,
        progress=False,
        plot=False,
        loss="auto",
        tensorboard=False,
        compile=compile,
    )
    return Trainer(RunConfig(model=cfg, train=train, data=DataConfig(train=(str(shard),))))


def _trainer_launch_syncs(tr: object, warmup: int = 3) -> str:
    """Launch one Trainer step, after ``warmup`` steps (compilation, lazy optimizer and loss
    state), under ``torch.cuda.set_sync_debug_mode("error")``: 'none', or the first sync and
    the innermost lmforge frames that called it (the step's record is read afterwards, outside
    the check)."""
    import traceback

    import torch

    for _ in range(warmup):
        tr.finish_step(tr.launch_step())  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    pending, found = None, "none"
    try:
        pending = tr.launch_step()  # type: ignore[attr-defined]
    except RuntimeError as e:
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_tb(e.__traceback__)
            if "lmforge" in f.filename
        ]
        found = f"FOUND: {str(e).splitlines()[0][:120]} at " + " <- ".join(frames[::-1][:4])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if pending is not None:
        tr.finish_step(pending)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    return found


def _trainer_step(tr: object):
    """The trainer loop's step: launch one, then read the previous one's record (one step late,
    as ``Trainer.run`` does when nothing forces a wait)."""
    pending: list[object] = []

    def step() -> None:
        launched = tr.launch_step()  # type: ignore[attr-defined]
        if pending:
            tr.finish_step(pending.pop())  # type: ignore[attr-defined]
        pending.append(launched)

    return step


def _byte_shards(text: str, tmp: Path, max_bytes: int) -> tuple[Path, Path]:
    """Train/val shards (95 % / 5 %) of the bytes of the text file(s) at ``text``."""
    import numpy as np

    from lmforge.train.data import write_shard
    from lmforge.utils.errors import LmforgeError

    src = Path(text)
    files = sorted(src.glob("*.txt")) if src.is_dir() else [src]
    if not files or not all(f.is_file() for f in files):
        raise LmforgeError(f"--text {src}: no text files found")
    raw = b""
    for f in files:
        raw += f.read_bytes()
        if len(raw) >= max_bytes:
            break
    data = np.frombuffer(raw[:max_bytes], dtype=np.uint8)
    cut = int(0.95 * data.size)
    return write_shard(tmp / "train.bin", data[:cut], 256), write_shard(
        tmp / "val.bin", data[cut:], 256
    )


def _train_run(
    model: object, shards: tuple[Path, Path], out: Path, dev: str, steps: int, eval_every: int
) -> tuple[dict, list[dict]]:
    """One Trainer run of ``model`` (a ModelConfig) on byte shards: (result, metrics records)."""
    from lmforge.config import RunConfig
    from lmforge.train import DataConfig, TrainConfig, Trainer
    from lmforge.train.trainer import read_metrics

    train_cfg = TrainConfig(
        out_dir=str(out),
        device=dev,
        precision="fp32" if dev == "cpu" else "bf16",
        batch_size=16,
        context_length=128,
        max_steps=steps,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=20,
        log_every=10,
        eval_every=eval_every,
        eval_batches=10,
        save_every=0,
        progress=False,
        plot=False,
    )
    data = DataConfig(train=(str(shards[0]),), val=(str(shards[1]),))
    result = Trainer(RunConfig(model=model, train=train_cfg, data=data)).run()
    return result, read_metrics(out / "metrics.jsonl")


def _plot(
    curves: dict[str, tuple[list[int], list[float]]], ylabel: str, title: str, path: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, label=name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def _balance(args: argparse.Namespace, dev: str) -> None:
    """Three short runs of one tiny MoE LM (byte tokens): max/mean expert load per logged step
    and the final validation loss, for no balancing / Switch aux loss / aux-free bias."""
    import shutil
    import tempfile

    from lmforge.bench.timing import markdown_table
    from lmforge.model import ModelConfig
    from lmforge.model.moe_config import MoEConfig

    tmp = Path(tempfile.mkdtemp(prefix="moe_balance_"))
    shards = _byte_shards(args.text, tmp, 1 << 26)
    moe = dict(n_experts=8, top_k=2, expert_d_ff=64, aux_loss_coef=0.0)
    variants = {
        "none": MoEConfig(**moe),
        "Switch aux loss 0.01": MoEConfig(**{**moe, "aux_loss_coef": 0.01}),
        "aux-free bias 0.01": MoEConfig(**moe, bias_update_rate=0.01),
    }
    curves: dict[str, tuple[list[int], list[float]]] = {}
    rows = []
    for name, mc in variants.items():
        model = ModelConfig(
            vocab_size=256, context_length=128, d_model=96, n_layers=2, n_heads=4, moe=mc
        )
        result, recs = _train_run(model, shards, tmp / name.split()[0], dev, args.balance_steps, 0)
        recs = [r for r in recs if r.get("event") == "train"]
        steps = [r["step"] for r in recs]
        loads = [max(v for k, v in r.items() if k.endswith("load_max_mean")) for r in recs]
        curves[name] = (steps, loads)
        late = loads[len(loads) // 2 :]
        rows.append([name, loads[0], sum(late) / len(late), max(late), result["val_loss"]])
    print(f"\nLoad balance, {args.balance_steps} steps × 16 × 128 byte tokens ({dev})")
    header = ["balancing", "max/mean load, first log", "mean of 2nd half", "max of 2nd half"]
    print(markdown_table([*header, "val loss (nats/byte)"], rows))
    _plot(curves, "max / mean expert load (worst layer)", "8 experts, top-2", args.balance_out)
    shutil.rmtree(tmp, ignore_errors=True)


def _curves(args: argparse.Namespace, dev: str) -> None:
    """Validation loss at equal tokens: a dense LM vs an MoE with the same active compute (8
    experts of width F/2, top-2, aux-free bias), byte-level text, CPU-sized."""
    import shutil
    import tempfile

    from lmforge.bench.timing import markdown_table
    from lmforge.model import ModelConfig, accounting
    from lmforge.model.moe_config import MoEConfig

    tmp = Path(tempfile.mkdtemp(prefix="moe_curves_"))
    shards = _byte_shards(args.text, tmp, 1 << 23)
    base = dict(vocab_size=256, context_length=128, d_model=96, n_layers=2, n_heads=4, d_ff=256)
    moe = MoEConfig(n_experts=8, top_k=2, expert_d_ff=128, aux_loss_coef=0.0, bias_update_rate=0.01)
    variants = {
        "dense, d_ff 256": ModelConfig(**base),
        "MoE 8 × 128, top-2": ModelConfig(**base, moe=moe),
    }
    curves: dict[str, tuple[list[int], list[float]]] = {}
    rows = []
    for name, model in variants.items():
        result, recs = _train_run(
            model, shards, tmp / name.split()[0].strip(","), dev, args.curve_steps, 50
        )
        evals = [r for r in recs if r.get("event") == "eval"]
        train = [r for r in recs if r.get("event") == "train"]
        curves[name] = ([r["step"] for r in evals], [r["val_loss"] for r in evals])
        tok_s = sorted(r["tokens_per_s"] for r in train[1:])[len(train[1:]) // 2]
        rows.append(
            [
                name,
                f"{accounting.parameter_count(model) / 1e6:.2f}M",
                f"{accounting.active_parameter_count(model) / 1e6:.2f}M",
                accounting.flops_per_token(model, 128) / 1e6,
                result["val_loss"],
                tok_s,
            ]
        )
    print(f"\nDense vs MoE at equal tokens: {args.curve_steps} steps × 16 × 128 bytes ({dev})")
    header = ["model", "params", "active", "MFLOP/token", "final val loss", "tokens/s (median)"]
    print(markdown_table(header, rows))
    _plot(curves, "validation loss (nats/byte)", "dense vs MoE, same active FLOPs", args.curve_out)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from lmforge.utils.errors import LmforgeError

    try:
        main()
    except LmforgeError as e:
        sys.exit(f"benchmarks/moe.py: error: {e}")
