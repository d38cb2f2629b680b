"""AdamW update over GPT-2-small's parameters: lmforge's Triton multi-tensor kernel, its compiled
update and torch.optim.AdamW (fused and foreach), in one run on one GPU.

Correctness first: 5 steps of each lmforge path (each Triton launch of ``--launches``) against
torch.optim.AdamW(foreach=False) from the same state (max |Δθ|), and one Triton update under
``torch.cuda.set_sync_debug_mode("error")`` (no host sync). Then, per path, three figures:

* GPU ms per update, with global-norm clipping as training runs it and without (the update
  alone, for the floor): a queued ``torch.cuda._sleep`` keeps the GPU busy while the host
  enqueues ``--iters`` updates, so the events around them time the device only (medians of 5);
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
        "--launches",
        default="",
        help="Triton kernel launches to sweep, comma-separated BLOCKxWARPSxSLICES (elements per "
        "slice, warps, slices per program), e.g. 4096x8x1,2048x8x4 (default: its own)",
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

    from lmforge.kernels import _adamw_triton

    default = (_adamw_triton.BLOCK, _adamw_triton.WARPS, _adamw_triton.SLICES)
    launches = [tuple(int(x) for x in a.split("x")) for a in args.launches.split(",") if a]
    if any(len(a) != 3 for a in launches):
        print("--launches: each entry is BLOCKxWARPSxSLICES, e.g. 2048x8x4", file=sys.stderr)
        return 2
    runs = []  # (label, kind, launch or None)
    for k in args.kinds.split(","):
        for launch in (launches or [default]) if k == "lmforge triton" else [None]:
            label = k if launch is None or not launches else f"{k} {'×'.join(map(str, launch))}"
            runs.append((label, k, launch))

    def use(launch) -> None:
        for name, value in zip(("BLOCK", "WARPS", "SLICES"), launch or default):
            setattr(_adamw_triton, name, value)

    # Correctness without clipping (torch's in-place clip rescales the stored gradients every
    # step; the folded factor does not, so with it the paths differ by design).
    ref_ps, ref_step = make("torch single-tensor", clip=False)
    for _ in range(5):
        ref_step()
    print("correctness (5 steps vs torch.optim.AdamW single-tensor):", file=sys.stderr)
    for label, kind, launch in [r for r in runs if r[1].startswith("lmforge")]:
        use(launch)
        ps, step = make(kind, clip=False)
        for _ in range(5):
            step()
        err = max((p - q).abs().max().item() for p, q in zip(ps, ref_ps))
        print(f"  {label}: max |Δθ| {err:.2e}", file=sys.stderr)
        if err > 2e-6:  # a few float32 ulps of O(1) weights (fused multiply-adds)
            print(f"FAILED: {label} differs from torch by {err:.2e}", file=sys.stderr)
            return 1

    # No host sync inside the Triton update (one per step cost 3 ms end to end once).
    for _label, kind, launch in [r for r in runs if r[1] == "lmforge triton"][:1]:
        use(launch)
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

    def gpu_ms(step) -> float:
        for _ in range(3):  # compile, tables, state allocation
            step()
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
        return statistics.median(gpu)

    rows = []
    floor_ms = 28 * n / (args.bandwidth * 1e12) * 1e3
    for label, kind, launch in runs:
        use(launch)
        ps, step = make(kind)
        ms = gpu_ms(step)
        host = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        del ps, step
        ps, step = make(kind, clip=False)
        alone = gpu_ms(step)
        del ps, step
        rows.append((label, ms, alone, 1e3 * statistics.median(host), 28 * n / alone / 1e6,
                     alone / floor_ms))  # fmt: skip
        print(f"{label}: {ms:.3f} ms GPU ({alone:.3f} without clipping), "
              f"{rows[-1][3]:.3f} ms host", file=sys.stderr)  # fmt: skip
    use(None)
    fused = {r[0]: r[1] for r in rows}.get("torch fused", math.nan)
    lines = [
        f"AdamW update with global-norm clipping (lmforge: the factor folded into the update; "
        f"torch: clip_grad_norm_ in place, then step) and without, {args.preset} "
        f"({n / 1e6:.1f}M fp32 parameters); floor of the update alone {floor_ms:.3f} ms (28 "
        f"B/param at {args.bandwidth} TB/s; GB/s and × floor are of the update without "
        f"clipping); {torch.cuda.get_device_name(0)}\n",
        "| update | GPU ms, clipped | GPU ms, update alone | host ms/call | GB/s | × floor "
        "| vs torch fused (time, clipped) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, ms, alone, h, gbs, xf in rows:
        lines.append(
            f"| {kind} | {ms:.3f} | {alone:.3f} | {h:.3f} | {gbs:,.0f} | {xf:.2f} "
            f"| {ms / fused:.2f} |"
        )
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
