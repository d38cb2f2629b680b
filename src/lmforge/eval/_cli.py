"""``lmforge eval``: registered here so torch is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXAMPLES = """examples:
  lmforge eval --checkpoint runs/demo/train --tasks ppl,arc --limit 200 --device cpu
  lmforge eval --checkpoint runs/demo/train --tasks ppl,mmlu,arc,gsm8k,math500 --data-dir examples/eval
  lmforge eval --checkpoint runs/demo/train --tasks gsm8k --samples 4 --temperature 0.7 --limit 5
  lmforge eval --checkpoint runs/hf/demo --tasks mmlu --shots 2 --out runs/demo/mmlu.json   # an HF folder
  lmforge eval --pairwise examples/eval/battles.jsonl   # Bradley–Terry/Elo from {"model_a","model_b","winner"}

runs/demo/train is the run ./run demo writes; DATA (--data-dir) defaults to examples/eval.
tasks: ppl (bits per byte on --ppl-text files, default DATA/../text/wikitext2/test.txt),
mmlu, arc, hellaswag (multiple choice: acc and length-normalised acc_norm), mmlu_gen (MMLU by
generating the letter), gsm8k, math500, math (generation; pass@1, and pass@k up to --samples).
DATA is laid out like examples/eval, which holds a few items per task (examples/README.md); give
--data-dir a folder of the same layout with the full sets for real numbers.
lm-evaluation-harness: python -m lmforge.eval.harness --model lmforge --model_args checkpoint=DIR --tasks ...
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint: perplexity, MMLU, ARC, GSM8K, MATH-500",
        description=(
            "Evaluate an lmforge checkpoint (or a Hugging Face Llama/Qwen3 folder) on local "
            "benchmark files; write a JSON report and print a table."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint, run folder or HF model folder")
    p.add_argument(
        "--tasks",
        default="ppl,mmlu,arc,gsm8k,math500",
        help="comma-separated: ppl,mmlu,mmlu_gen,arc,hellaswag,gsm8k,math500,math "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--data-dir",
        default="examples/eval",
        metavar="DIR",
        help="benchmark folder (default: %(default)s)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="at most N examples per task (ppl: N context-length windows of tokens)",
    )
    p.add_argument("--shots", type=int, default=None, help="few-shot examples (default: per task)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="generation budget (default 256)"
    )
    p.add_argument("--samples", type=int, default=1, help="generations per problem, for pass@k")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--ppl-text", nargs="+", default=(), metavar="FILE", help="text for ppl")
    p.add_argument("--ppl-max-tokens", type=int, default=None, help="tokens scored per ppl file")
    p.add_argument("--seed", type=int, default=1234, help="few-shot/subsample/sampling seed")
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="JSON report path (default: eval_report.json in the run folder of --checkpoint; "
        "for --pairwise, runs/ratings/NAME.json)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--pairwise",
        metavar="JSONL",
        help="instead of evaluating: fit Bradley–Terry/Elo ratings to comparison records",
    )
    p.add_argument("--bootstrap", type=int, default=200, help="pairwise: bootstrap resamples")
    p.set_defaults(func=_run)


def default_report_path(checkpoint: str) -> str:
    """Where a report goes without --out: the run folder (not the current directory).

    ``runs/x/checkpoints/step_N`` → ``runs/x/eval_report.json``; any other folder (a run, an HF
    or imported model folder) holds its own report.
    """
    p = Path(checkpoint)
    if p.parent.name == "checkpoints" and p.name.startswith("step_"):
        p = p.parent.parent
    return str(p / "eval_report.json")


def _pairwise(args: argparse.Namespace) -> int:
    import json

    from lmforge.eval.metrics import fit_bradley_terry
    from lmforge.utils.errors import LmforgeError
    from lmforge.utils.io import atomic_write_text, iter_jsonl

    path = Path(args.pairwise)
    records = []
    for lineno, obj in iter_jsonl(path, "pairwise records"):
        try:
            records.append((str(obj["model_a"]), str(obj["model_b"]), obj.get("winner")))
        except KeyError:
            raise LmforgeError(
                f'{path}:{lineno}: expected {{"model_a", "model_b", "winner"}}'
            ) from None
    try:
        ratings = fit_bradley_terry(records, bootstrap=args.bootstrap, seed=args.seed)
    except ValueError as e:
        raise LmforgeError(f"{path}: {e}") from None
    report = {"ratings": ratings.ratings, "ci95": ratings.ci, "n_games": ratings.n_games}
    # Default runs/ratings/<stem>.json: never beside the records (they may be examples/ files).
    out = Path(args.out) if args.out else Path("runs", "ratings", f"{path.stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    print(ratings.table())
    print(f"ratings: {out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.pairwise:
        return _pairwise(args)
    import dataclasses
    import json

    from lmforge.eval.runner import TASKS, EvalOptions, format_table, run_eval
    from lmforge.serve.loading import load_for_serving
    from lmforge.utils.config import config_to_dict
    from lmforge.utils.errors import LmforgeError
    from lmforge.utils.io import atomic_write_text

    if not args.checkpoint:
        raise LmforgeError("--checkpoint DIR is required (or --pairwise FILE)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise LmforgeError(f"unknown task(s) {','.join(unknown)!r}; expected {', '.join(TASKS)}")
    for name in ("limit", "batch_size", "max_new_tokens", "samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise LmforgeError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    if args.samples > 1 and args.temperature <= 0:
        raise LmforgeError("--samples > 1 needs --temperature > 0 (greedy samples are identical)")
    # Every option but two is the flag of the same name.
    same = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EvalOptions) if f.name in args
    }
    options = EvalOptions(**same, ppl_files=tuple(args.ppl_text), progress=not args.no_progress)
    # The one model loader of the inference commands (an HF folder also loads as a checkpoint).
    model, tokenizer, _, _ = load_for_serving(
        checkpoint=args.checkpoint, device=args.device, dtype="float32"
    )
    if tokenizer is None:
        raise LmforgeError(
            f"{args.checkpoint}: no tokenizer in the checkpoint (tokenizer/ missing)"
        )
    report = run_eval(model, tokenizer, tasks, options)
    report = {
        "checkpoint": str(args.checkpoint),
        "model": config_to_dict(model.config),
        "parameters": model.num_parameters(),
        **report,
    }
    out = args.out or default_report_path(args.checkpoint)
    try:
        atomic_write_text(out, json.dumps(report, indent=2, default=str) + "\n")
    except OSError as e:
        raise LmforgeError(
            f"cannot write the report {out}: {e.strerror} (give --out FILE)"
        ) from None
    print(format_table(report))
    print(f"report: {out}", file=sys.stderr)
    return 0
