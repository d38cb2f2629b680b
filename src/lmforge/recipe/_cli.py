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


EVAL_EXAMPLES = """examples:
  lmforge recipe eval configs/recipes/h200.toml --row SmolLM2-135M-Instruct --recipe.device=cpu
  lmforge recipe eval configs/recipes/tiny-cpu.toml --row pretrain
"""

PACK_EXAMPLES = """examples (two machines; benchmarks/h200_session.sh parts recipe-a, recipe-b):
  lmforge recipe run configs/recipes/h200.toml --until tokenizer      # here, on the CPU
  lmforge recipe pack configs/recipes/h200.toml --next pretrain --out .carry/recipe-a
  lmforge recipe unpack .carry/recipe-a --into runs/h200             # there
  lmforge recipe pack configs/recipes/tiny-cpu.toml --next rl --out runs/demo-pack
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

    e = rsub.add_parser(
        "eval",
        help="score eval rows (an anchor, a finished stage's model) into the eval cache",
        description=(
            "Score rows of the recipe's eval table with the eval stage's settings into "
            "OUT/evals/ (the cache the eval stage reads), without running any stage: e.g. the "
            "anchor on a CPU machine that has its GGUF while the GPU machine does the rest. "
            "The device is recipe.device (override it: --recipe.device=cpu); the card says "
            "where each row ran."
        ),
        epilog=EVAL_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("config", metavar="RECIPE.toml", help="recipe file (configs/recipes/)")
    e.add_argument("--row", dest="rows", action="append", required=True, metavar="NAME",
                   help="eval row: pretrain, sft, rl or an anchor's NAME (repeatable)")  # fmt: skip
    e.set_defaults(func=_eval, accepts_overrides=True)

    k = rsub.add_parser(
        "pack",
        help="pack a run folder for the machine that runs the next stages",
        description=(
            "Write what the stages from --next on need (markers, tokenizer, token shards "
            "before pretraining, the models they read with bf16 weights and no optimizer "
            "state) as a gzipped tar in parts of at most --part-mb MB, with a manifest."
        ),
        epilog=PACK_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    k.add_argument("config", metavar="RECIPE.toml", help="recipe file (configs/recipes/)")
    k.add_argument("--next", dest="next_stage", required=True, metavar="STAGE",
                   help="the first stage the other machine runs")  # fmt: skip
    k.add_argument("--out", required=True, metavar="DIR", help="folder of the parts")
    k.add_argument("--part-mb", type=float, default=15.0, help="largest part in MB (15)")
    k.add_argument("--weights-dtype", default="bfloat16",
                   help="bfloat16 (default), float16, float32 or keep")  # fmt: skip
    k.set_defaults(func=_pack, accepts_overrides=True)

    u = rsub.add_parser(
        "unpack",
        help="check and extract a pack into a run folder",
        description="Check a pack's parts against its manifest and extract them.",
        epilog=PACK_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    u.add_argument("src", metavar="DIR", help="folder of recipe-pack.json and its parts")
    u.add_argument("--into", required=True, metavar="OUT", help="the run folder (recipe.out)")
    u.set_defaults(func=_unpack)


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


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmforge.recipe import load_recipe
    from lmforge.recipe.runner import make_context
    from lmforge.recipe.stages import eval_targets, evaluate_row
    from lmforge.utils.errors import LmforgeError

    cfg = load_recipe(args.config, args.overrides)
    targets = dict(eval_targets(cfg, Path(cfg.recipe.out)))
    for name in args.rows:
        if name not in targets:
            raise LmforgeError(
                f"--row {name}: not a row of this recipe's eval ({', '.join(targets)})"
            )
    ctx = make_context(cfg, resolve_threads(cfg.recipe.threads))
    for name in args.rows:
        row = evaluate_row(ctx, name, targets[name])
        shown = ", ".join(f"{k} {v}" for k, v in row.items() if k != "model")
        print(f"{name}: {shown}")
    return 0


def _pack(args: argparse.Namespace) -> int:
    from lmforge.recipe import load_recipe
    from lmforge.recipe.handoff import pack

    cfg = load_recipe(args.config, args.overrides)
    m = pack(cfg, args.out, args.next_stage, part_mb=args.part_mb,
             weights_dtype=args.weights_dtype)  # fmt: skip
    print(f"packed {cfg.recipe.out} for --from {args.next_stage}: {m['bytes'] / 1e6:.1f} MB in "
          f"{len(m['parts'])} part(s) under {args.out}; models: {', '.join(m['models']) or 'none'}")  # fmt: skip
    return 0


def _unpack(args: argparse.Namespace) -> int:
    from lmforge.recipe.handoff import unpack

    m = unpack(args.src, args.into)
    print(f"unpacked {args.src} ({m['bytes'] / 1e6:.1f} MB) into {args.into}; next stage: "
          f"{m['next_stage']}")  # fmt: skip
    return 0
