"""The model benchmark's flags, declared once for ``lmforge bench model`` and the script (torch-free,
so ``--help`` stays fast; imported by both ``bench._cli`` and ``bench.model``, which then never
import each other)."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model benchmark's flags (kept here so ``--help`` needs no torch)."""
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
