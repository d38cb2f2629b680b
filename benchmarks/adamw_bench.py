"""AdamW update over GPT-2-small's parameters: lmforge's Triton multi-tensor kernel, its compiled
update and torch.optim.AdamW (fused and foreach), in one run on one GPU.

Correctness first: 5 steps of each lmforge path against torch.optim.AdamW(foreach=False) from the
same state (max |Δθ|), and one Triton update under ``torch.cuda.set_sync_debug_mode("error")``
(no host sync). Then, per path, two figures:

* GPU ms per update: a queued ``torch.cuda._sleep`` keeps the GPU busy while the host enqueues
  ``--iters`` updates, so the events around them time the device only (medians of 5 repeats);
* host ms per call: the Python and launch time of one update (the training loop's host runs
  ahead of the GPU, so this matters only when it exceeds the GPU time of a step).

Floor: the update reads θ, g, m, v and writes θ, m, v once: 28 bytes a parameter at the device
copy bandwidth (``--bandwidth``, 4.27 TB/s measured on an H200).

    PYTHONPATH=src python benchmarks/adamw_bench.py
    PYTHONPATH=src python benchmarks/adamw_bench.py --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--iters", type=int, default=20, help="updates per timed repeat")
    p.add_argument("--bandwidth", type=float, default=4.27, help="TB/s for the floor")
    p.add_argument(
        "--kinds",
        default="lmforge triton,lmforge compiled,torch fused,torch foreach",
        help="updates to measure, comma-separated (the compiled one compiles for about a minute)",
    )
    p.add_argument(
        "--blocks",
        default="",
        help="elements per program of the Triton kernel to sweep, comma-separated (default: its own)",
    )
    p.add_argument("--results", help="append the table to this markdown file")
    return p.parse_args()


def main() -> int:
    args = _parse()
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/adamw_bench.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from lmforge.model import TransformerLM, load_preset
    from lmforge.train import AdamW
    from lmforge.train.optim import grad_norm_and_clip_coef

    torch.manual_seed(0)
    model = TransformerLM(load_preset(args.preset)).cuda()
    base = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen, device="cuda") * 1e-2 for p in base]
    n = sum(p.numel() for p in base)
    kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def make(kind: str, clip: bool = True):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        if kind.startswith("torch"):  # as the peer does it: clip in place, then the update
            opt = torch.optim.AdamW(
                ps, fused=kind == "torch fused", foreach=kind == "torch foreach", **kw
            )

            def torch_step() -> None:
                if clip:
                    torch.nn.utils.clip_grad_norm_(ps, 1.0)
                opt.step()

            return ps, torch_step
        ours = AdamW(ps, compiled=kind == "lmforge compiled", fused=kind == "lmforge triton", **kw)
        ok = torch.ones((), dtype=torch.bool, device="cuda")

        def step() -> None:  # as the trainer calls it: clip factor folded into the update
            coef = grad_norm_and_clip_coef(ps, 1.0)[1] if clip else None
            ours.step_if(ok, grad_scale=coef)

        return ps, step

    kinds = args.kinds.split(",")
    # Correctness without clipping (torch's in-place clip rescales the stored gradients every
    # step; the folded factor does not, so with it the paths differ by design).
    ref_ps, ref_step = make("torch single-tensor", clip=False)
    for _ in range(5):
        ref_step()
    print("correctness (5 steps vs torch.optim.AdamW single-tensor):", file=sys.stderr)
    for kind in [k for k in kinds if k.startswith("lmforge")]:
        ps, step = make(kind, clip=False)
        for _ in range(5):
            step()
        err = max((p - q).abs().max().item() for p, q in zip(ps, ref_ps))
        print(f"  {kind}: max |Δθ| {err:.2e}", file=sys.stderr)
        if err > 2e-6:  # a few float32 ulps of O(1) weights (fused multiply-adds)
            print(f"FAILED: {kind} differs from torch by {err:.2e}", file=sys.stderr)
            return 1

    # No host sync inside the Triton update (one per step cost 3 ms end to end once).
    for kind in [k for k in kinds if k == "lmforge triton"]:
        ps, step = make(kind)
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as e:
            print(f"FAILED: {kind} synchronises with the device: {e}", file=sys.stderr)
            return 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"  {kind}: no host sync", file=sys.stderr)
    from lmforge.kernels import _adamw_triton

    rows = []
    floor_ms = 28 * n / (args.bandwidth * 1e12) * 1e3
    blocks = [int(b) for b in args.blocks.split(",") if b] or [_adamw_triton.BLOCK]
    runs = [(k, b) for k in kinds for b in (blocks if k == "lmforge triton" else [None])]
    for kind, block in runs:
        if block is not None:
            _adamw_triton.BLOCK = block
            kind = f"{kind} ({block} elements/program)"
        ps, step = make(kind.split(" (")[0])
        for _ in range(3):  # compile, tables, state allocation
            step()
        torch.cuda.synchronize()
        host = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        gpu = []
        for _ in range(5):
            torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU work while the host enqueues
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) / args.iters)
        ms = statistics.median(gpu)
        rows.append((kind, ms, 1e3 * statistics.median(host), 28 * n / ms / 1e6, ms / floor_ms))
        print(f"{kind}: {ms:.3f} ms GPU, {rows[-1][2]:.3f} ms host", file=sys.stderr)
        del ps, step
    fused = {r[0]: r[1] for r in rows}.get("torch fused", math.nan)
    floor_note = "the update alone; the clipping norm adds a read of the gradients"
    lines = [
        f"AdamW update with global-norm clipping (lmforge: the factor folded into the update; "
        f"torch: clip_grad_norm_ in place, then step), {args.preset} "
        f"({n / 1e6:.1f}M fp32 parameters); floor {floor_ms:.3f} ms (28 B/param at "
        f"{args.bandwidth} TB/s, {floor_note}); {torch.cuda.get_device_name(0)}\n",
        "| update | GPU ms | host ms/call | GB/s | × floor | vs torch fused (time) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, ms, h, gbs, xf in rows:
        lines.append(f"| {kind} | {ms:.3f} | {h:.3f} | {gbs:,.0f} | {xf:.2f} | {ms / fused:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(
                f"\n## benchmarks/adamw_bench.py — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}"
                f" UTC\n\nDevice: {torch.cuda.get_device_name(0)}; torch {torch.__version__}\n\n"
                f"Command: `PYTHONPATH=src python {' '.join(sys.argv)}`\n\n{table}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
