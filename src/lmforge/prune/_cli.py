"""``lmforge prune``: registered here so torch is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys

EXAMPLES = """examples:
  lmforge prune --checkpoint runs/demo/train --target-params 6e5 --mode depth --calib examples/text/wikitext2/test.txt --calib-samples 16 --out runs/demo-pruned
  lmforge prune --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --target-params 100e6 --mode width \\
      --calib my_text.txt --out runs/smol-100m-width
  lmforge prune --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --target-params 100e6 --mode depth \\
      --calib my_text.txt --calib-samples 256 --out runs/smol-100m-depth
  # recover by logit distillation from the unpruned model (lmforge.posttrain's distill objective):
  lmforge distill --teacher runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --student runs/smol-100m-width \\
      --data corpus.jsonl --out runs/smol-100m-kd

Importance comes from activations on --calib (default 1024 samples × 128 tokens, Minitron's
~1024): query heads by their output norm, FFN channels by |SwiGLU activation|, residual channels
by |RMSNorm output|, blocks by Block Influence (1 − cos(in, out)). --mode width shrinks d_model
and d_ff by one factor (all heads kept unless --heads-per-group); --mode depth drops the least
influential blocks. The output is an lmforge checkpoint folder (config.toml with the smaller
[model], model.safetensors, tokenizer) that train, eval, generate and distill read.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``prune`` subcommand."""
    p = sub.add_parser(
        "prune",
        help="prune a model to a parameter target (width or depth) from activation importance",
        description="Structured pruning: a smaller valid config and its weights.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="lmforge checkpoint or run folder")
    src.add_argument("--gguf", metavar="FILE", help="llama.cpp GGUF file (Llama / Qwen3)")
    src.add_argument("--hf", metavar="DIR", help="Hugging Face Llama/Qwen3 folder")
    p.add_argument("--target-params", required=True, type=float, help="parameters to keep at most")
    p.add_argument("--mode", default="width", help="width or depth (default width)")
    p.add_argument(
        "--heads-per-group", type=int, default=None, help="width: query heads per kv head"
    )
    p.add_argument("--calib", required=True, metavar="FILE", help="calibration text")
    p.add_argument("--calib-samples", type=int, default=1024, help="samples (1024)")
    p.add_argument("--calib-seq-len", type=int, default=128, help="tokens per sample (128)")
    p.add_argument("--context-length", type=int, default=None, help="context length of imports")
    p.add_argument("--device", default=None, help="where scoring runs (default: cuda if any)")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint folder to write")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from lmforge.prune import (
        activation_importance,
        count_parameters,
        plan_depth,
        plan_width,
        prune_depth,
        prune_width,
    )
    from lmforge.quant.calib import calibration_tokens
    from lmforge.quant.checkpoint import load_source
    from lmforge.utils.errors import LmforgeError

    if args.mode not in ("width", "depth"):
        raise LmforgeError(f"--mode must be width or depth, got {args.mode!r}")
    if args.target_params <= 0:
        raise LmforgeError(f"--target-params must be positive, got {args.target_params:g}")
    if not Path(args.calib).is_file():
        raise LmforgeError(f"calibration file not found: {args.calib}")
    model, tokenizer, template, source = load_source(
        checkpoint=args.checkpoint, gguf=args.gguf, hf=args.hf, context_length=args.context_length
    )
    before = model.num_parameters()
    target = int(args.target_params)
    if target >= before:
        raise LmforgeError(f"--target-params {target:,} is not below the model's {before:,}")
    tokens = calibration_tokens(args.calib, tokenizer, args.calib_samples, args.calib_seq_len)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device).eval()
    imp = activation_importance(model, tokens, progress=True)
    if args.mode == "depth":
        n = plan_depth(model.config, imp, target)
        pruned = prune_depth(model, imp, n)
        shape = f"{n}/{model.config.n_layers} layers"
    else:
        d, f = plan_width(model.config, target)
        pruned = prune_width(model, imp, d_model=d, d_ff=f, heads_per_group=args.heads_per_group)
        shape = f"d_model {d}, d_ff {f}, heads {pruned.config.n_heads}"
    from lmforge.hf import save_as_checkpoint

    out = save_as_checkpoint(pruned.to("cpu"), tokenizer, args.out, source)
    if template:
        from lmforge.utils.io import atomic_write_text

        atomic_write_text(out / "chat_template.jinja", template)
    after = count_parameters(pruned.config)
    print(
        f"pruned {source} ({args.mode}: {shape}) {before / 1e6:.1f}M → {after / 1e6:.1f}M "
        f"parameters → {out}",
        file=sys.stderr,
    )
    teacher = args.checkpoint or args.gguf or args.hf
    print(
        f"recover by distillation: lmforge distill --teacher {teacher} --student {out} "
        "--data CORPUS.jsonl --out OUT_DIR",
        file=sys.stderr,
    )
    return 0
