"""``lmforge quantize``: registered here so torch is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmforge.quant.apply import QuantSpec
    from lmforge.quant.calibrate import CalibOptions

FP8_SCALE_GRID = 50  # --fp8-scale mse: candidate scales absmax / (448 c), c in (1/2, 1]

EXAMPLES = """examples:
  lmforge quantize --checkpoint runs/demo/train --method rtn --bits 8 --group 0 --out runs/q/demo-int8
  lmforge quantize --checkpoint runs/demo/train --method awq --bits 4 --group 32 --calib examples/text/wikitext2/test.txt --calib-samples 16 --calib-seq-len 128 --out runs/q/demo-awq
  lmforge quantize --checkpoint runs/demo/train --method gptq --bits 4 --group 32 --calib examples/text/tinyshakespeare/input.txt --calib-samples 16 --calib-seq-len 128 --out runs/q/demo-gptq
  lmforge quantize --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --method gptq --bits 4 --group 64 --calib my_text.txt --out runs/q/smol-gptq
  lmforge quantize --hf ~/models/SmolLM2-135M --method smoothquant --format fp8 --bits 8 --calib my_text.txt --out runs/q/fp8
  lmforge quantize --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --method gptq --format fp8 --bits 8 --fp8-weight-only --calib my_text.txt --out runs/q/smol-fp8

Methods: rtn (round to nearest, no calibration), awq (activation-aware per-channel scales),
gptq (Hessian-based error correction, act order, diag(H)-weighted clip search of the group
ranges; int4, int8 or fp8),
smoothquant (activation-outlier migration for fp8 W8A8, α searched per group, then round to
nearest). Formats: --format int with --bits 4 (group-wise, asymmetric unless --symmetric) or 8
(symmetric; --group 0 = one scale per output channel); --format fp8 (e4m3, per-channel scales,
searched for the smallest weight MSE unless --fp8-scale absmax; W8A8 with dynamic per-token
activation scales unless --fp8-weight-only). The LM head and the embeddings stay unquantized
(--skip PATTERN... to change). The output folder (model.safetensors with codes and scales,
quantization.json, config.toml, tokenizer) loads with lmforge.quant.load_quantized(DIR); its
layout is in lmforge.quant.checkpoint's docstring.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``quantize`` subcommand."""
    p = sub.add_parser(
        "quantize",
        help="quantize a model's weights (rtn, awq, gptq, smoothquant) into a checkpoint",
        description="Post-training quantization: int8 / int4 / fp8 weights with calibration.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="lmforge checkpoint or run folder")
    src.add_argument("--gguf", metavar="FILE", help="llama.cpp GGUF file (Llama / Qwen3)")
    src.add_argument("--hf", metavar="DIR", help="Hugging Face Llama/Qwen3 folder")
    p.add_argument("--method", default="rtn", help="rtn, awq, gptq or smoothquant (default rtn)")
    p.add_argument("--format", default="int", help="int (int4/int8) or fp8 (default int)")
    p.add_argument("--bits", type=int, default=4, help="4 or 8 (default 4; fp8 needs 8)")
    p.add_argument(
        "--group", type=int, default=128, help="inputs per scale, 0 = per channel (default 128)"
    )
    p.add_argument("--symmetric", action="store_true", help="int4: symmetric codes, no offsets")
    p.add_argument("--fp8-weight-only", action="store_true", help="fp8: weights only (no W8A8)")
    p.add_argument(
        "--fp8-scale",
        default="mse",
        help="fp8 with rtn/awq/smoothquant: per-channel scales by a search minimising the weight "
        "MSE (mse, default) or absmax/448 (absmax); gptq searches its own (--gptq-clip)",
    )
    p.add_argument(
        "--gptq-clip",
        default="hessian",
        help="gptq: group parameters (fp8: channel scales) from a range search minimising the "
        "error weighted by diag(H) (hessian, default), unweighted (mse), or min/max (none)",
    )
    p.add_argument(
        "--gptq-order",
        default="act",
        help="gptq column order: act (decreasing diag(H), static groups; default) or input",
    )
    p.add_argument(
        "--gptq-damp", type=float, default=0.01, help="gptq: damping / mean diag(H) (0.01)"
    )
    p.add_argument(
        "--smooth-alpha",
        default="search",
        help="smoothquant migration strength: a number in [0, 1], or search (default: per group, "
        "the α of 0, 0.1, …, 1 or none with the smallest W8A8 error on calibration rows)",
    )
    p.add_argument("--calib", metavar="FILE", help="calibration text (awq, gptq, smoothquant)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration samples (128)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per sample (512)")
    p.add_argument(
        "--skip", nargs="*", default=["lm_head"], metavar="PATTERN", help="modules left as they are"
    )
    p.add_argument("--context-length", type=int, default=None, help="context length of imports")
    p.add_argument("--device", default=None, help="where calibration runs (default: cuda if any)")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint folder to write")
    p.set_defaults(func=_run)


def _spec(args: argparse.Namespace) -> QuantSpec:
    from lmforge.quant.apply import QuantSpec
    from lmforge.utils.errors import LmforgeError

    if args.bits not in (4, 8):
        raise LmforgeError(f"--bits must be 4 or 8, got {args.bits}")
    if args.format not in ("int", "fp8"):
        raise LmforgeError(f"--format must be int or fp8, got {args.format!r}")
    if args.format == "fp8" and args.bits != 8:
        raise LmforgeError("--format fp8 stores 8-bit weights: use --bits 8")
    if args.group < 0:
        raise LmforgeError(f"--group must be >= 0, got {args.group}")
    if args.fp8_scale not in ("mse", "absmax"):
        raise LmforgeError(f"--fp8-scale must be mse or absmax, got {args.fp8_scale!r}")
    fmt = "fp8" if args.format == "fp8" else f"int{args.bits}"
    return QuantSpec(
        format=fmt,
        group_size=args.group or None,
        symmetric=args.symmetric,
        fp8_activations="none" if args.fp8_weight_only else "dynamic",
        fp8_scale_search=FP8_SCALE_GRID if args.fp8_scale == "mse" else 0,
        skip=tuple(args.skip),
    )


def _options(args: argparse.Namespace) -> CalibOptions:
    from lmforge.quant.calibrate import CalibOptions
    from lmforge.utils.errors import LmforgeError

    clips = {"hessian": (100, True), "mse": (100, False), "none": (0, False)}
    if args.gptq_clip not in clips:
        raise LmforgeError(f"--gptq-clip must be hessian, mse or none, got {args.gptq_clip!r}")
    if args.gptq_order not in ("act", "input"):
        raise LmforgeError(f"--gptq-order must be act or input, got {args.gptq_order!r}")
    if not args.gptq_damp > 0:
        raise LmforgeError(f"--gptq-damp must be > 0, got {args.gptq_damp}")
    alpha, alpha_grid = 0.5, 10
    if args.smooth_alpha != "search":
        try:
            alpha, alpha_grid = float(args.smooth_alpha), 0
        except ValueError:
            alpha = -1.0
        if not 0.0 <= alpha <= 1.0:
            raise LmforgeError(
                f"--smooth-alpha must be a number in [0, 1] or search, got {args.smooth_alpha!r}"
            )
    grid, weighted = clips[args.gptq_clip]
    return CalibOptions(
        gptq_damp=args.gptq_damp,
        gptq_act_order=args.gptq_order == "act",
        gptq_clip_grid=grid,
        gptq_clip_weighted=weighted,
        smooth_alpha=alpha,
        smooth_alpha_grid=alpha_grid,
    )


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from lmforge.quant.apply import check_spec
    from lmforge.quant.calib import calibration_tokens
    from lmforge.quant.calibrate import check_method, quantize_calibrated
    from lmforge.quant.checkpoint import load_source, save_quantized
    from lmforge.utils.errors import LmforgeError

    spec = _spec(args)
    options = _options(args)
    check_method(args.method, spec)
    if args.method != "rtn":
        if args.calib is None:
            raise LmforgeError(f"--method {args.method} needs --calib FILE (calibration text)")
        if not Path(args.calib).is_file():
            raise LmforgeError(f"calibration file not found: {args.calib}")
    model, tokenizer, template, source = load_source(
        checkpoint=args.checkpoint, gguf=args.gguf, hf=args.hf, context_length=args.context_length
    )
    check_spec(model, spec)
    tokens = None
    if args.method != "rtn":
        tokens = calibration_tokens(args.calib, tokenizer, args.calib_samples, args.calib_seq_len)
        if tokens.shape[1] > model.config.context_length:
            raise LmforgeError(
                f"--calib-seq-len {tokens.shape[1]} exceeds the model's context length "
                f"{model.config.context_length}"
            )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    quantize_calibrated(model, spec, args.method, tokens, options, progress=True)
    model = model.to("cpu")
    out = save_quantized(
        model,
        tokenizer,
        args.out,
        method=args.method,
        spec=spec,
        source=source,
        chat_template=template,
    )
    mb = sum(b.numel() * b.element_size() for b in model.state_dict().values()) / 1e6
    print(
        f"quantized {source} ({args.method}, {spec.format}) → {out} ({mb:.1f} MB)", file=sys.stderr
    )
    return 0
