"""Probe: is cuBLAS's first-ranked kernel the fastest for the GEMMs of a GPT-2-small step?

torch's ``mm`` runs the kernel cuBLAS's heuristic ranks first. cuBLASLt lists several candidates
for the same problem; this script times each (``lmforge.kernels._cublaslt``) against torch's
call, at the exact shapes and operand layouts a GPT-2-small training step (batch 32 × 1024,
``configs/gpt2-small-train.toml``: q‖k, v, o, w1‖w3, w2, and the tied LM head in 8192-row loss
chunks) hands cuBLAS — forward x @ Wᵀ, dX = dy @ W, dW = dyᵀ @ x — correctness first (every
candidate's output against a float64 product, within twice torch's own error), then CUDA-event
medians, a table per problem and the step total weighted by calls per step.

    PYTHONPATH=src python benchmarks/gemm_algos.py
    PYTHONPATH=src python benchmarks/gemm_algos.py --candidates 32 --results runs/RESULTS-algos.md
    PYTHONPATH=src python benchmarks/gemm_algos.py --wide --only "LM head"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch

# (name, M, K, N, kind, calls per step): kind fwd = x (M, K) @ W (N, K)ᵀ; dx = dy (M, K) @ W (K, N);
# dw = dy (K, M)ᵀ @ x (K, N); dw+ accumulates into the output (the LM head's later chunks).
D, T = 768, 32768


def _problems(tokens: int, chunk: int, vocab: int) -> list[tuple[str, int, int, int, str, int]]:
    chunks = tokens // chunk
    rows = []
    for name, d_in, d_out, calls in (("q‖k", D, 2 * D, 12), ("v, o", D, D, 24),
                                     ("w1‖w3", D, 4096, 12), ("w2", 2048, D, 12)):  # fmt: skip
        rows.append((f"{name} fwd", tokens, d_in, d_out, "fwd", calls))
        rows.append((f"{name} dX", tokens, d_out, d_in, "dx", calls))
        rows.append((f"{name} dW", d_out, tokens, d_in, "dw", calls))
    rows.append(("LM head logits", chunk, D, vocab, "fwd", chunks))
    rows.append(("LM head dh", chunk, vocab, D, "dx", chunks))
    rows.append(("LM head dW (first chunk)", vocab, chunk, D, "dw", 1))
    if chunks > 1:
        rows.append(("LM head dW (accumulate)", vocab, chunk, D, "dw+", chunks - 1))
    return rows


def _operands(m: int, k: int, n: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    if kind == "fwd":
        return rnd(m, k), rnd(n, k).t()
    if kind == "dx":
        return rnd(m, k), rnd(k, n)
    return rnd(k, m).t(), rnd(k, n)  # dw, dw+


def _median_us(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in times)


def _kernels(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return " + ".join(n[:48] for n in names) or "?"


def _measure(name: str, m: int, k: int, n: int, kind: str, calls: int,
             args: argparse.Namespace, lt) -> tuple[str, float, float, float]:  # fmt: skip
    """One problem: torch's call and every cuBLASLt candidate, checked, then timed."""
    a, b = _operands(m, k, n, kind)
    acc = kind == "dw+"
    base = (torch.randn(m, n, device="cuda") * 0.1).to(torch.bfloat16)
    want = a.double() @ b.double() + (base.double() if acc else 0.0)
    out = base.clone()

    def torch_call() -> None:
        if acc:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)

    torch_call()
    torch_err = (out.double() - want).abs().max().item()
    flops = 2.0 * m * n * k
    t_torch = _median_us(torch_call, 5, args.iters)
    plan = lt.plan(a, b, candidates=args.candidates, wide=args.wide)
    heuristic = plan.listed  # the heuristic's candidates come first

    def lt_call(i: int) -> None:
        plan.run(a, b, out, i, accumulate=acc)

    subset = list(range(heuristic))
    if args.wide:  # the tuner's staged search, one quick timing each; the heuristic's all stay
        t0 = time.perf_counter()
        ranked = lt.search(plan, lambda i: _median_us(lambda: lt_call(i), 1, 3) / 1e3)
        subset += [i for i in ranked if i >= heuristic][: args.keep]
        print(f"{name}: {heuristic} heuristic + {len(plan.algos) - heuristic} searched "
              f"configurations, {len(ranked)} timed in {time.perf_counter() - t0:.1f} s; "
              f"{lt._caps_text(plan)}", file=sys.stderr)  # fmt: skip
    timed = []
    for i in subset:
        out.copy_(base)
        try:
            lt_call(i)
            torch.cuda.synchronize()
        except lt.LtError as e:
            timed.append((float("inf"), i, f"failed: {e}"))
            continue
        err = (out.double() - want).abs().max().item()
        if not err <= 2 * torch_err + 1e-3:
            timed.append((float("inf"), i, f"wrong: max |error| {err:.2e} vs {torch_err:.2e}"))
            continue
        us = _median_us(lambda i=i: lt_call(i), 3, args.iters)
        timed.append((us, i, plan.describe(i)))
    ok = sorted(t for t in timed if t[0] != float("inf"))
    best = ok[0] if ok else (float("inf"), -1, "none")
    first = next((t for t in timed if t[1] == 0), best)
    best_h = next((t for t in ok if t[1] < heuristic), best)  # the heuristic's own best
    bad = [t for t in timed if t[0] == float("inf")]
    print(f"{name}: torch {t_torch:.1f} µs; {len(ok)} candidates ok, {len(bad)} not"
          + (f" ({bad[0][2]})" if bad else ""), file=sys.stderr)  # fmt: skip
    for us, i, what in ok[:4]:
        print(f"    #{i:2d} {us:8.1f} µs  {what}", file=sys.stderr)
    kern_torch = _kernels(torch_call)
    kern_best = _kernels(lambda: lt_call(best[1])) if ok else "-"
    line = (
        f"| {name} | {m}×{k}×{n} | {calls} | {t_torch:.1f} ({flops / t_torch / 1e6:.0f}) | "
        f"{first[0]:.1f} | {best_h[0]:.1f} | {best[0]:.1f} ({flops / best[0] / 1e6:.0f}) | "
        f"{best[0] / t_torch:.3f} | #{best[1]} {best[2]} | {kern_torch} | {kern_best} |"
    )
    return line, t_torch, first[0], best_h[0], best[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])  # fmt: skip
    p.add_argument("--tokens", type=int, default=T, help="tokens a step (default 32768)")
    p.add_argument("--chunk", type=int, default=8192, help="loss chunk rows (default 8192)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--candidates", type=int, default=24, help="heuristic algorithms to time")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--wide", action="store_true",
                   help="also the configurations the tuner's wide search tries around "
                   "cuBLASLt's heuristic candidates (lmforge.kernels._cublaslt.search)")  # fmt: skip
    p.add_argument(
        "--keep",
        type=int,
        default=12,
        help="with --wide: the fastest screened configurations timed in full",
    )
    p.add_argument("--only", default="", help="substring of the problem names to run")
    p.add_argument("--results", type=Path, help="append the tables to this markdown file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_algos.py: needs a CUDA device", file=sys.stderr)
        return 2
    from lmforge.kernels import _cublaslt as lt

    if not lt.available():
        print("gemm_algos.py: cuBLASLt not found in this process", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    lines = []
    total_torch = total_best = total_first = total_h = 0.0
    for name, m, k, n, kind, calls in _problems(args.tokens, args.chunk, args.vocab):
        if args.only and args.only not in name:
            continue
        line, t_torch, t_first, t_h, t_best = _measure(name, m, k, n, kind, calls, args, lt)
        lines.append(line)
        total_torch += calls * t_torch
        total_first += calls * t_first
        total_h += calls * min(t_h, t_torch)
        total_best += calls * min(t_best, t_torch)
    dev = torch.cuda.get_device_name()
    table = [
        f"## benchmarks/gemm_algos.py — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Device: {dev}; torch {torch.__version__}; command: `python benchmarks/gemm_algos.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
        "| GEMM | M×K×N | calls/step | torch µs (TFLOP/s) | cuBLASLt #0 µs | heuristic's best µs "
        "| best µs (TFLOP/s) | best / torch | best algorithm | torch kernels | best kernels |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        f"Per step: torch {total_torch / 1e3:.3f} ms, cuBLASLt first-ranked "
        f"{total_first / 1e3:.3f} ms, the heuristic's fastest of each (or torch's where faster) "
        f"{total_h / 1e3:.3f} ms, the fastest of all {total_best / 1e3:.3f} ms: "
        f"{(total_torch - total_best) / 1e3:.3f} ms less than torch.",
        "",
    ]
    text = "\n".join(table)
    print(text)
    if args.results:
        with args.results.open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
