"""``lmforge generate``: sample from a checkpoint (heavy imports wait inside the handler)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge generate --checkpoint runs/demo/train --prompt "def main(" --max-new-tokens 100
  lmforge generate --checkpoint runs/demo/train --prompt "import os" --temperature 0.8 --top-p 0.95 \\
      --num-samples 3 --seed 1
  lmforge generate --checkpoint runs/demo/train --prompt "x = " --temperature 0   # greedy
  lmforge generate --checkpoint runs/demo/train --prompt-ids "1 2 3" --stop-id 0  # token ids in and out

runs/demo/train is the run ./run demo writes; a run folder loads its latest checkpoint.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description=(
            "Load a checkpoint folder (model.safetensors + config.toml [+ tokenizer/]), encode "
            "the prompts with its tokenizer, sample continuations with a KV cache and print them. "
            "Without a tokenizer, give token ids with --prompt-ids; ids are printed."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint or run folder")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        metavar="IDS",
        help='prompt as space-separated token ids, e.g. "1 2 3" (repeatable)',
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample (128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (e.g. 0.95)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument(
        "--stop-id",
        type=int,
        action="append",
        default=[],
        help="stop at this token id (repeatable; the tokenizer's end-of-text is always a stop)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from lmforge.generate._command import main

    return main(args)
