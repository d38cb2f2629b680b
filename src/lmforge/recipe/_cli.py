"""``lmforge recipe``: registered here so the recipe's imports wait until it runs."""

from __future__ import annotations

import argparse
import os

EXAMPLES = """examples:
  lmforge recipe run configs/recipes/tiny-cpu.toml                 # what ./run demo runs (CPU)
  lmforge recipe run configs/recipes/tiny-cpu.toml --until tokenizer
  lmforge recipe run configs/recipes/tiny-cpu.toml --from sft --sft.steps=400   # SFT onwards again
  lmforge recipe run configs/recipes/h200.toml --recipe.out=runs/h200          # the GPU tier

Stages: data → tokenizer → pretrain → sft → rl → eval → report. Each writes a completion
marker (a hash of its settings, inputs and the stage before it): a rerun skips finished stages,
a changed key re-runs its stage and the ones after it, and a stage killed mid-way continues
(pretraining from its checkpoints) or restarts. Every key of the recipe file can be overridden
as --section.key=value. The report card is OUT/report.md.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``recipe run``."""
    p = sub.add_parser(
        "recipe",
        help="the whole system as one resumable job, ending in a report card",
        description="Run the whole stack as one resumable recipe (lmforge.recipe).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rsub = p.add_subparsers(dest="recipe_command", metavar="SUBCOMMAND", required=True)
    r = rsub.add_parser(
        "run",
        help="run (or resume) a recipe file",
        description=(
            "Run a recipe's stages in order, skipping those already finished under the same "
            "settings, and write OUT/report.md."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("config", metavar="RECIPE.toml", help="recipe file (configs/recipes/)")
    r.add_argument("--from", dest="from_stage", metavar="STAGE", help="re-run from this stage")
    r.add_argument("--until", dest="until_stage", metavar="STAGE", help="stop after this stage")
    r.set_defaults(func=_run, accepts_overrides=True)


def resolve_threads(configured: int) -> int:
    """``recipe.threads`` when set, else ``OMP_NUM_THREADS`` when the user set it, else
    :func:`lmforge.recipe.threads.machine_threads`."""
    from lmforge.recipe.threads import machine_threads

    if configured > 0:
        return configured
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return machine_threads()


def _run(args: argparse.Namespace) -> int:
    import sys

    from lmforge.recipe import load_recipe, run_recipe

    cfg = load_recipe(args.config, args.overrides)
    threads = resolve_threads(cfg.recipe.threads)
    print(f"[recipe] {args.config}: {threads} CPU thread(s) per stage", file=sys.stderr)
    run_recipe(cfg, from_stage=args.from_stage, until_stage=args.until_stage, threads=threads)
    return 0
