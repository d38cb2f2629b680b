"""``lmforge demo``: the CPU tier of the recipe (``configs/recipes/tiny-cpu.toml``).

Web samples → extraction, language ID, quality filters, dedup, mixing with books and the Python
standard library's sources → byte-level BPE tokenizer → a small Transformer pretrained for a step
budget → SFT on synthetic chats → GRPO on additions with a verifiable reward → evaluation (bits
per byte, multiple choice, GSM8K, a CORE-like aggregate) → ``runs/demo/report.md`` and the
command to chat with the result. Every stage resumes (``lmforge recipe --help``); the demo's
flags are overrides of the recipe. Exercise it with ``./run demo`` (or ``lmforge demo --help``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.utils import LmforgeError, expand_inputs


def tiny_cpu_recipe() -> Path:
    """The repository's ``configs/recipes/tiny-cpu.toml``."""
    return Path(__file__).resolve().parents[2] / "configs" / "recipes" / "tiny-cpu.toml"


def demo_overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides the demo's flags stand for (a flag left at None changes nothing)."""
    o: list[str] = []

    def put(key: str, value: object) -> None:
        if value is not None:
            o.append(f"{key}={value}")

    put("recipe.out", args.out)
    put("recipe.device", args.device)
    put("recipe.seed", args.seed)
    put("tokenizer.vocab_size", args.vocab_size)
    put("tokenizer.train_mb", args.tokenizer_mb)
    put("pretrain.steps", args.max_steps)
    put("pretrain.batch_size", args.batch_size)
    put("pretrain.lr", args.lr)
    put("pretrain.eval_every", args.eval_every)
    put("pretrain.eval_batches", args.eval_batches)
    extra = []
    if args.preset is not None:
        from lmforge.model.presets import presets_dir

        preset = Path(args.preset)
        if not (args.preset.endswith(".toml") or preset.is_file()):
            preset = presets_dir() / f"{args.preset}.toml"
        if not preset.is_file():
            raise LmforgeError(f"--preset {args.preset}: no such preset ({preset} not found)")
        put("pretrain.config", f'"{preset}"')
    if args.max_minutes:
        extra.append(f"train.max_minutes={args.max_minutes}")
    if extra:
        o.append("pretrain.overrides=" + "[" + ", ".join(f'"{e}"' for e in extra) + "]")
    if args.data:
        expand_inputs(args.data)  # a missing input is one line now, not minutes later
        files = ", ".join(f'"{d}"' for d in args.data)
        # the user's text replaces the whole mixture
        o += [f"data.files=[{files}]", "data.pipelines=[]", "data.extra_web=[]",
              "data.books=[]", "data.contamination=[]"]  # fmt: skip
    return o


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo (the tiny-cpu recipe with the flags as overrides); returns the exit status."""
    from lmforge.recipe import load_recipe, run_recipe
    from lmforge.recipe._cli import resolve_threads

    recipe = Path(args.recipe) if args.recipe else tiny_cpu_recipe()
    cfg = load_recipe(recipe, [*demo_overrides(args), *getattr(args, "overrides", [])])
    threads = resolve_threads(cfg.recipe.threads)
    print(f"[demo] {recipe}: {threads} CPU thread(s) per stage", file=sys.stderr, flush=True)
    run_recipe(cfg, from_stage=args.from_stage, until_stage=args.until_stage, threads=threads)
    base = Path(cfg.recipe.out) / "train"
    if args.sample_tokens > 0 and base.is_dir():
        from lmforge.cli import main

        print("\nsamples of the pretrained model (lmforge generate):")
        main(["generate", "--checkpoint", str(base), "--prompt", "def ", "--prompt", "import os\n",
              "--max-new-tokens", str(args.sample_tokens), "--temperature", "0.8", "--top-k", "50",
              "--device", cfg.recipe.device, "--seed", str(cfg.recipe.seed)])  # fmt: skip
    return 0
