"""``lmforge generate``: sample from a model on the serving engine (heavy imports wait inside the
handler)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge generate --checkpoint runs/demo/train --prompt "def main(" --max-new-tokens 100
  lmforge generate --checkpoint runs/demo/train --prompt "import os" --temperature 0.8 --top-p 0.95 \\
      --num-samples 3 --seed 1
  lmforge generate --checkpoint runs/demo/train --prompt "x = " --temperature 0 --stop "\\n"
  lmforge generate --checkpoint runs/demo/train --prompt "class " --prompt "for " --top-k 50
  lmforge generate --checkpoint runs/demo/train --prompt-ids "1 2 3" --stop-id 0  # ids in and out
  lmforge generate --checkpoint runs/demo/train --prompt "def f(x):" --temperature 0 --speculative ngram
  lmforge generate --checkpoint runs/demo/train --prompt "def f(x):" --temperature 0 --speculative draft:2

runs/demo/train is the run ./run demo writes; a run folder loads its latest checkpoint.

other sources (the same flags as lmforge serve and lmforge chat):
  --checkpoint DIR   a folder written by 'lmforge hf import' (tokenizer in hf_tokenizer/)
  --hf DIR           a Hugging Face Llama/Qwen3 folder, e.g. --hf ~/models/Qwen3-0.6B
  --gguf FILE        a llama.cpp file, e.g. --gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    from lmforge.serve.loading import add_engine_args, add_model_source_args

    p = sub.add_parser(
        "generate",
        help="sample text from a checkpoint, HF folder or GGUF file",
        description=(
            "Load a model (an lmforge checkpoint, a Hugging Face folder or a GGUF file), encode "
            "the prompts with its tokenizer, decode them all at once on the serving engine "
            "(lmforge.serve.Engine: paged KV cache, continuous batching) and print the "
            "continuations; one prompt and one sample streams as it is generated. Without a "
            "tokenizer, give token ids with --prompt-ids; ids are printed."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_source_args(p)
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
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, e.g. 0.95 (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p × the top one")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample at this text, not printed (repeatable; \\n and \\t are a newline "
        "and a tab; needs a tokenizer)",
    )
    p.add_argument(
        "--stop-id",
        type=int,
        action="append",
        default=[],
        help="end a sample at this token id (repeatable; the tokenizer's end-of-text always does)",
    )
    add_engine_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from lmforge.generate._command import main

    return main(args)
