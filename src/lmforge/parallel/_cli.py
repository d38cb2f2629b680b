"""``lmforge plan``: the parallelism planner's command line (nothing heavy imported here)."""

from __future__ import annotations

import argparse

EPILOG = """examples:
  lmforge plan --model 70b --gpus 1024 --global-batch 1024 --seq 4096
  lmforge plan --model 405b --gpus 16384 --global-batch 4096 --top 10
  lmforge plan --params 13e9 --layers 40 --d-model 5120 --gpus 256 --domain-size 8
  lmforge plan --model moe-47b-a13b --gpus 512 --crossover      # where FSDP stops scaling
  lmforge plan --model 7b --gpus 64 --peak-tflops 1979 --mfu 0.4 --ib-gbps 100
  lmforge plan --model 7b --gpus 64 --hardware h200-compiled   # MFU fitted to a measured step
  lmforge plan --model 1b --gpus 8 --global-batch 256 --seq 2048   # a configs/ preset

Exits with status 1 when no mix is feasible (out of memory, or a batch the ranks cannot split).
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``lmforge plan``."""
    p = sub.add_parser(
        "plan",
        help="plan parallelism: memory, step time and MFU per strategy mix",
        description=(
            "Enumerate data/tensor/pipeline/ZeRO mixes for a model on a GPU cluster and print "
            "memory per GPU, predicted step time, MFU and the binding constraint; with "
            "--crossover, where pure FSDP's communication overtakes its compute."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="7b",
        help="gpt2-small, 7b, 70b, 405b, moe-47b-a13b, or a configs/ preset (1b, 350m, tiny, …)",
    )
    p.add_argument("--params", type=float, help="total parameters (overrides the preset)")
    p.add_argument("--active-params", type=float, help="active parameters per token (MoE)")
    p.add_argument("--layers", type=int, help="Transformer blocks")
    p.add_argument("--d-model", type=int, help="hidden size")
    p.add_argument("--gpus", type=int, default=64, help="GPU count")
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--domain-size", type=int, default=8, help="GPUs per NVLink domain")
    p.add_argument(
        "--hardware",
        default="h200",
        help="preset: h200 (assumed 45%% MFU), h200-eager, h200-compiled (fitted to measured "
        "steps); the flags below override it",
    )
    p.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s per GPU (preset: 989)")
    p.add_argument("--mfu", type=float, help="achievable fraction of peak (preset's)")
    p.add_argument("--memory-gb", type=float, help="memory per GPU (GB; preset: 141)")
    p.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU (preset: 450)")
    p.add_argument("--ib-gbps", type=float, help="inter-domain GB/s per GPU (preset: 50)")
    p.add_argument("--top", type=int, default=15, help="rows to print")
    p.add_argument("--all", action="store_true", help="also list infeasible mixes")
    p.add_argument("--crossover", action="store_true", help="print FSDP crossover analysis")
    p.set_defaults(func=_handler)


def _handler(args: argparse.Namespace) -> int:
    import dataclasses

    from lmforge.parallel.planner import (
        HARDWARE,
        MODELS,
        ModelSpec,
        format_table,
        fsdp_crossover,
        plan,
        spec_from_config,
    )
    from lmforge.utils.errors import LmforgeError

    base = MODELS.get(args.model)
    if base is None and args.params is None:
        from lmforge.model import load_preset

        try:
            cfg = load_preset(args.model)
        except LmforgeError as e:
            raise LmforgeError(
                f"unknown --model '{args.model}' (choose {', '.join(MODELS)}, a configs/ preset, "
                f"or give --params): {e}"
            ) from None
        base = spec_from_config(args.model, cfg, args.seq)
    base = base or MODELS["7b"]
    model = ModelSpec(
        name=args.model if args.params is None else "custom",
        total_params=args.params or base.total_params,
        n_layers=args.layers or base.n_layers,
        d_model=args.d_model or base.d_model,
        active_params=args.active_params
        if args.active_params is not None
        else (base.active_params if args.params is None else 0.0),
        flops_per_token=base.flops_per_token if args.params is None else 0.0,
        # The memory model's shape: the preset's own unless its size was overridden.
        config=base.config
        if args.params is None and args.layers is None and args.d_model is None
        else None,
    )
    for name in ("gpus", "global_batch", "seq", "micro_batch", "domain_size"):
        if getattr(args, name) <= 0:
            raise LmforgeError(f"--{name.replace('_', '-')} must be positive")
    if args.hardware not in HARDWARE:
        raise LmforgeError(f"unknown --hardware '{args.hardware}' (choose {', '.join(HARDWARE)})")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise LmforgeError(f"--mfu must be in (0, 1], got {args.mfu}")
    overrides = {
        "peak_flops": None if args.peak_tflops is None else args.peak_tflops * 1e12,
        "mfu": args.mfu,
        "memory_bytes": None if args.memory_gb is None else args.memory_gb * 1e9,
        "nvlink_bw": None if args.nvlink_gbps is None else args.nvlink_gbps * 1e9,
        "ib_bw": None if args.ib_gbps is None else args.ib_gbps * 1e9,
        "domain_size": args.domain_size,
    }
    hw = dataclasses.replace(
        HARDWARE[args.hardware], **{k: v for k, v in overrides.items() if v is not None}
    )
    ests = plan(model, hw, args.gpus, args.global_batch, args.seq, args.micro_batch)
    status = 0
    feasible = [e for e in ests if e.feasible]
    print(
        f"# {model.name}: {model.total_params / 1e9:.1f}B params"
        + (f" ({model.active / 1e9:.1f}B active)" if model.active != model.total_params else "")
        + f", {args.gpus} GPUs ({hw.name}-class, domain {hw.domain_size}), "
        f"batch {args.global_batch}×{args.seq} tokens"
    )
    shown = ests if args.all else feasible
    if not shown:
        print("no feasible mix: every candidate runs out of memory or violates the batch floor")
        reasons = sorted({e.binding for e in ests})
        print(f"binding constraints seen: {', '.join(reasons)} (use --all to list them)")
    if not feasible:
        status = 1
    if shown:
        print(format_table(shown, args.top))
        best = shown[0]
        print(f"\nbest: {best.mix.label()}  step {best.step_s:.3f} s  MFU {best.mfu:.1%}")
    if args.crossover:
        print("\n# FSDP crossover: GPU count where ZeRO-3 communication time reaches compute time")
        rows = [
            ("as given", model, hw, args.global_batch),
            ("4× global batch", model, hw, 4 * args.global_batch),
            (
                "sparse (active = total/4)",
                dataclasses.replace(model, active_params=model.active / 4),
                hw,
                args.global_batch,
            ),
            (
                "domain 64 (TPU-like)",
                model,
                dataclasses.replace(hw, domain_size=64),
                args.global_batch,
            ),
        ]
        print("| scenario | crossover GPUs | batch floor (max dp) |")
        print("|---|---|---|")
        for label, m, h, gb in rows:
            x = fsdp_crossover(m, h, gb, args.seq)
            print(f"| {label} | {'never' if x is None else f'{x:.0f}'} | {gb} |")
    return status
