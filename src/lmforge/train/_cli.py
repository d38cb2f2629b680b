"""``lmforge train``: registered here so torch is imported only when the command runs."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge train --config configs/demo.toml --data.train='["runs/demo/tokens/train.bin"]' --data.val='["runs/demo/tokens/val.bin"]'
  lmforge train --config configs/gpt2-small-train.toml --train.max_steps=2000 --train.device=cuda
  lmforge train --config configs/demo.toml --data.train=runs/demo/tokens/train.bin --train.out_dir=runs/t   # rerun: resumes from runs/t's latest checkpoint
  torchrun --nproc_per_node 2 -m lmforge train --config configs/gpt2-small-train.toml --parallel.dp=2

Every [model], [train], [data] and [parallel] key can be overridden as --section.key=value
(TOML values: numbers, true/false, ["lists"]). Outputs in train.out_dir: config.toml,
metrics.jsonl, loss_curve.png, checkpoints/step_NNNNNNN/.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="pretrain a Transformer LM from a TOML config",
        description=(
            "Pretrain a Transformer LM on token shards (from `lmforge tokenizer encode`): AdamW, "
            "warm-up + cosine/WSD schedule, gradient accumulation, bf16 autocast, periodic "
            "validation (loss, perplexity, bits per byte), atomic checkpoints with exact resume. "
            "The same command runs on CPU, one GPU, or several under torchrun."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --config and the dotted overrides (parsed by lmforge.cli, which sees accepts_overrides);
    # declared here so this stage never imports the CLI above it.
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML run config (see configs/); keys not given take their defaults",
    )
    p.set_defaults(accepts_overrides=True, func=_run)


def _run(args: argparse.Namespace) -> int:
    import json
    import sys

    from lmforge.config import load_run_config
    from lmforge.train.trainer import train
    from lmforge.utils.io import ensure_writable_dir
    from lmforge.utils.runtime import Runtime

    cfg = load_run_config(args.config, args.overrides)
    runtime = Runtime.from_env(device=cfg.train.device, seed=cfg.train.seed)
    if runtime.is_main:  # a read-only or occupied out_dir is one line before any work
        ensure_writable_dir(cfg.train.out_dir, "train.out_dir")
    result = train(cfg, runtime)
    if runtime.is_main:
        print(json.dumps(result), file=sys.stdout)
    return 0
