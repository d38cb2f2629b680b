"""The ``lmforge`` command: one subcommand per stage.

This module only parses arguments and dispatches. Each stage registers its own subcommand from
``lmforge/<stage>/_cli.py`` (a ``register(subparsers)`` function that must import nothing heavy at
module level), so ``lmforge --help`` stays fast and stages stay independent. Errors a user can act
on (:class:`~lmforge.utils.errors.LmforgeError`) print as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lmforge.utils.errors import LmforgeError

# (subcommand module, one-line summary); each module defines register(subparsers).
_STAGES: tuple[tuple[str, str], ...] = (
    (
        "lmforge._demo_cli",
        "the main job: data → tokenizer → pretraining → SFT → RL → eval → report card (CPU)",
    ),
    ("lmforge.tokenizer._cli", "train a byte-level BPE tokenizer, encode text into token shards"),
    ("lmforge.data._cli", "download corpora; run WARC → text → filter → dedup → mix pipelines"),
    ("lmforge.train._cli", "pretrain a Transformer LM from a TOML config"),
    ("lmforge.generate._cli", "sample text from a checkpoint"),
    ("lmforge.eval._cli", "evaluate a checkpoint: perplexity, MMLU, ARC, GSM8K, MATH-500"),
    ("lmforge.hf._cli", "export to / import from Hugging Face Llama-style folders"),
    ("lmforge.bench._cli", "benchmark kernels and model steps against their peers"),
    ("lmforge.parallel._cli", "plan parallelism: memory, step time and MFU per strategy mix"),
    ("lmforge.serve._cli", "serve a model over an OpenAI-compatible HTTP API; chat in a terminal"),
    ("lmforge.posttrain._cli", "post-train: SFT, DPO, RL (GRPO family, PPO), distillation"),
    ("lmforge.scaling._cli", "scaling laws: plan and run sweeps, fit and predict, muP coord check"),
    ("lmforge.probe._cli", "probe a model: causality of MoE routing and of KV-cache decoding"),
    ("lmforge.recipe._cli", "the whole system as one resumable recipe with a report card"),
    ("lmforge.recipe._download_cli", "download a pretrained model (SmolLM2-135M-Instruct GGUF)"),
    ("lmforge.vision._cli", "vision: CLIP/SigLIP pretraining, a LLaVA-style VLM, VQ-VAE tokens"),
    ("lmforge.quant._cli", "quantize weights (rtn, awq, gptq, smoothquant; int8/int4/fp8)"),
    ("lmforge.prune._cli", "prune a model (width or depth) to a parameter target"),
)

EPILOG = """examples:
  lmforge demo                                   # the whole recipe on shipped data, CPU: report card
  lmforge recipe run configs/recipes/tiny-cpu.toml --until pretrain
  lmforge tokenizer train --input examples/text/ --vocab-size 32000 --out tok/
  lmforge train --config configs/demo.toml --train.lr=3e-4 --data.train=runs/demo/tokens/train.bin
  lmforge generate --checkpoint runs/demo/train --prompt "def main("
  lmforge <command> --help                       # examples for each command
"""


class OverrideAction(argparse.Action):
    """Collects nothing itself; present so --help documents the dotted override syntax."""


def split_overrides(extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split leftover argv into dotted config overrides (``--a.b=v`` or ``--a.b v``) and the rest."""
    overrides: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(extra):
        tok = extra[i]
        if tok.startswith("--") and "." in tok.split("=", 1)[0]:
            if "=" in tok:
                overrides.append(tok[2:])
            elif i + 1 < len(extra):
                overrides.append(f"{tok[2:]}={extra[i + 1]}")
                i += 1
            else:
                rest.append(tok)
        else:
            rest.append(tok)
        i += 1
    return overrides, rest


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, every stage registered."""
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="lmforge: data → tokenizer → Transformer LM → training → evaluation → inference.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from lmforge import __version__

    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, _summary in _STAGES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("lmforge"):
                continue  # a stage not yet present in this checkout
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    overrides, rest = split_overrides(extra)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if overrides and not getattr(args, "accepts_overrides", False):
        parser.error(f"'{args.command}' takes no config overrides: {' '.join(overrides)}")
    args.overrides = overrides
    try:
        return int(args.func(args) or 0)
    except LmforgeError as e:
        print(f"lmforge {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmforge {args.command}: interrupted", file=sys.stderr)
        return 130


def add_config_arguments(parser: argparse.ArgumentParser, config_help: str = "") -> None:
    """Give a subcommand ``--config FILE`` and dotted ``--section.key=value`` overrides."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=config_help or "TOML run config (see configs/); keys not given take their defaults",
    )
    parser.set_defaults(accepts_overrides=True)
