"""``lmforge demo``: registered here so the demo's heavy imports wait until it runs."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge demo                                 # 1200 steps, a few minutes on 2 CPU cores, stdlib corpus
  lmforge demo --out runs/demo --max-steps 400 # shorter CPU run
  lmforge demo --preset gpt2-small --vocab-size 32000 --data examples/text --device cuda

The run is fixed by its step budget (--max-steps), so its result does not depend on how busy the
machine is; the progress bar shows the ETA. --max-minutes adds an optional wall-clock cap.
"""


# The step budget: about 6 minutes of training on 2 idle cores at the demo preset's ~0.3 s/step
# (configs/demo.toml); a step budget, unlike a time budget, gives the same model on any machine.
DEMO_STEPS = 1200


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="the main job: tokenizer → model → training → samples on the embedded default corpus",
        description=(
            "Train a byte-level BPE tokenizer, encode train/validation splits, train a small "
            "Transformer LM, report validation loss, perplexity and bits per byte next to a "
            "unigram baseline, save a checkpoint and print samples. With no --data the corpus "
            "is the Python standard library's own sources."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", nargs="+", help="text inputs (files, folders, globs); default: stdlib")
    p.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    p.add_argument("--preset", default="demo", help="model preset from configs/ (default: demo)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary size")
    p.add_argument(
        "--max-steps", type=int, default=DEMO_STEPS, help=f"training steps (default {DEMO_STEPS})"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="optional wall-clock cap on training (minutes; default 0 = none, the step budget rules)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--eval-every", type=int, default=250, help="validate every N steps")
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches per evaluation")
    p.add_argument(
        "--tokenizer-mb", type=float, default=12.0, help="train the tokenizer on this many MB"
    )
    p.add_argument("--sample-tokens", type=int, default=120, help="tokens per printed sample")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from lmforge.demo import run_demo

    return run_demo(args)
