"""``lmforge demo``: registered here so the demo's heavy imports wait until it runs."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge demo                                   # the CPU recipe: ~10 min on 2 idle cores, offline
  lmforge demo --max-steps 200 --out runs/demo-short
  lmforge demo --from sft --sft.steps=400        # keep data, tokenizer and pretraining; redo the rest
  lmforge demo --data examples/text --until pretrain --out runs/demo-text

The demo is `lmforge recipe run configs/recipes/tiny-cpu.toml`; its flags and any
--section.key=value are overrides of that recipe. It is fixed by step budgets (--max-steps), so
the model is the same on any machine. Rerunning skips finished stages; a killed run continues.
Outputs: OUT/report.md (the report card), OUT/train (the base model), OUT/rl/model (the chat
model: lmforge chat --checkpoint runs/demo/rl/model).
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="the main job: web data → tokenizer → pretraining → SFT → RL → eval → report card",
        description=(
            "Run the CPU tier of the recipe (configs/recipes/tiny-cpu.toml): data pipelines on "
            "the shipped web samples, books and the Python standard library's sources, a BPE "
            "tokenizer, pretraining, SFT on synthetic chats, GRPO with a verifiable reward, "
            "evaluation and a report card, then the command to chat with the model."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", nargs="+", help="your text (files, folders, globs) instead of the "
                   "shipped mixture: its first 12 MB (--data.code_mb=N for more; the mixture "
                   "holds --data.tokens bytes)")  # fmt: skip
    p.add_argument("--out", help="output folder (default: runs/demo)")
    p.add_argument("--preset", help="model preset from configs/ or a TOML path (default: demo)")
    p.add_argument("--vocab-size", type=int, help="tokenizer vocabulary size (default 4096)")
    p.add_argument("--max-steps", type=int, help="pretraining steps (default 800)")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="optional wall-clock cap on pretraining (default 0 = the step budget "
                   "rules)")  # fmt: skip
    p.add_argument("--batch-size", type=int, help="pretraining sequences per step (default 16)")
    p.add_argument("--lr", type=float, help="pretraining peak learning rate (default 2e-3)")
    p.add_argument("--eval-every", type=int, help="validate every N steps (default 200)")
    p.add_argument("--eval-batches", type=int, help="validation batches per evaluation")
    p.add_argument("--tokenizer-mb", type=float, help="train the tokenizer on this many MB")
    p.add_argument(
        "--sample-tokens",
        type=int,
        default=60,
        help="tokens of each sample of the pretrained model printed at the end",
    )
    p.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--seed", type=int)
    p.add_argument("--recipe", help="another recipe file (default configs/recipes/tiny-cpu.toml)")
    p.add_argument("--from", dest="from_stage", metavar="STAGE", help="re-run from this stage")
    p.add_argument("--until", dest="until_stage", metavar="STAGE", help="stop after this stage")
    p.set_defaults(func=_run, accepts_overrides=True)


def _run(args: argparse.Namespace) -> int:
    from lmforge.demo import run_demo

    return run_demo(args)
