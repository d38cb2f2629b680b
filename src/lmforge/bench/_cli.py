"""``lmforge bench kernels|model``: registered here; torch is imported only when a command runs."""

from __future__ import annotations

import argparse

KERNELS_EXAMPLES = """examples:
  lmforge bench kernels                                  # check, then time every kernel (H100/H200)
  lmforge bench kernels --only attention --seqs 4096 --dims 128
  lmforge bench kernels --quick --results benchmarks/RESULTS.md
"""

MODEL_EXAMPLES = """examples:
  lmforge bench model --preset gpt2-small --batch-size 16 --seq 1024
  lmforge bench model --preset gpt2-small --attention flash --norm triton --loss fused
  lmforge bench model --preset tiny --device cpu --steps 2 --no-profile   # smoke test on CPU
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its ``kernels`` and ``model`` subcommands."""
    p = sub.add_parser(
        "bench",
        help="benchmark kernels and model steps against their peers",
        description="Benchmarks on one GPU: Triton kernels against their peers, model step times.",
        epilog="examples:\n  lmforge bench kernels\n  lmforge bench model --preset gpt2-small\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_sub = p.add_subparsers(dest="bench_command", metavar="WHAT")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    k = bench_sub.add_parser(
        "kernels",
        help="check and time lmforge's Triton kernels next to torch SDPA / F.rms_norm / Liger",
        description=(
            "Correctness of each Triton kernel against float64 references, then TFLOP/s or GB/s "
            "next to its peers measured in the same run (warmup, CUDA events, medians)."
        ),
        epilog=KERNELS_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_kernel_args(k)
    k.set_defaults(func=_kernels)

    m = bench_sub.add_parser(
        "model",
        help="forward / backward / step times, top kernels, memory and roofline for a preset",
        description=(
            "Time forward, forward+backward and a full training step of a model preset (the "
            "Trainer that `lmforge train` builds, its own step, on random tokens); print a "
            "torch-profiler table, memory by category and the accounting roofline numbers."
        ),
        epilog=MODEL_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(m)
    m.set_defaults(func=_model)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    # Declared here, not in bench.model, so that --help needs no torch.
    p.add_argument("--preset", required=True, help="model preset name (configs/NAME.toml) or path")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default ≤ 1024)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--attention", choices=["reference", "sdpa", "flash", "auto"], default=None)
    p.add_argument("--norm", choices=["reference", "triton", "auto"], default=None)
    p.add_argument("--rope", choices=["reference", "triton", "auto"], default=None)
    p.add_argument(
        "--swiglu",
        choices=["reference", "triton", "auto"],
        default=None,
        help="model.swiglu (triton: w1/w3 as one GEMM into lmforge's packed gate)",
    )
    p.add_argument(
        "--residual",
        choices=["param", "autocast"],
        default=None,
        help="model.residual_dtype (autocast: the residual stream in bf16 under autocast)",
    )
    p.add_argument("--loss", choices=["reference", "fused"], default="reference")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU")
    p.add_argument("--no-profile", action="store_true")


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    # Same flags as lmforge.bench.kernels.build_parser, declared here to keep --help torch-free.
    p.add_argument(
        "--only", default="attention,rmsnorm,ce,elementwise", help="comma list of suites"
    )
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384", help="attention lengths")
    p.add_argument("--dims", default="64,128", help="attention head dims")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--quick", action="store_true", help="one length and dim per suite")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--results", metavar="FILE", help="append the tables to this markdown file")


def _kernels(args: argparse.Namespace) -> int:
    import sys

    from lmforge.bench import kernels

    return kernels.run(args, "lmforge " + " ".join(sys.argv[1:]))


def _model(args: argparse.Namespace) -> int:
    from lmforge.bench import model

    return model.run(args)
